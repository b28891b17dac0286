"""How far a split step's gradient moves from the whole batch's when micro-batches are weighted by their
share of the samples instead of their share of the targets (`autofit.batches.shares`), for a Hugging Face
model's own token-level loss over rows padded with -100 labels.

    python bench/diag/token_shares.py

A tiny GPT-2 (random weights), 8 rows of 64 tokens holding 8 to 64 targets, split in two and in four;
prints the relative error of each weighting against the unsplit batch's gradient. On 2026-11-29 (2-core
CPU): sample shares 1.8% (halves) and 27.6% (quarters); target shares 1e-7, floating-point order alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.batches.shares import target_counts  # noqa: E402
from bench.cli import no_options  # noqa: E402

LENGTHS = [8, 64, 12, 60, 5, 40, 30, 64]


def gradient(model, ids, labels, pieces, weights) -> torch.Tensor:
    model.zero_grad()
    for (start, end), weight in zip(pieces, weights):
        (model(input_ids=ids[start:end], labels=labels[start:end]).loss * weight).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def main() -> None:
    no_options(__doc__)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 100, (len(LENGTHS), 64))
    labels = ids.clone()
    for row, length in enumerate(LENGTHS):
        labels[row, length:] = -100
    whole = gradient(model, ids, labels, [(0, len(LENGTHS))], [1.0])
    counts = target_counts(model, {"input_ids": ids, "labels": labels})
    for parts in (2, 4):
        size = len(LENGTHS) // parts
        pieces = [(start, start + size) for start in range(0, len(LENGTHS), size)]
        by_samples = [size / len(LENGTHS)] * parts
        by_targets = [float(counts[start:end].sum() / counts.sum()) for start, end in pieces]
        for name, weights in (("sample shares", by_samples), ("target shares", by_targets)):
            error = (gradient(model, ids, labels, pieces, weights) - whole).norm() / whole.norm()
            print(f"{parts} pieces, {name}: gradient {float(error):.2e} from the whole batch's")


if __name__ == "__main__":
    main()
