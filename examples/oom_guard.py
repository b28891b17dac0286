"""A training job whose batches grow past the memory budget mid-run, kept alive by autofit's OOM guard.

The sequences get longer every few steps (as in curriculum training or a long-document tail). Without
the guard the step that no longer fits kills the job; with it, the guard halves the micro-batch,
doubles accumulation, replays the samples that had not yet gone in, and the run carries on with the
same global batch. On CPU the budget is autofit's CPU budget (every tensor counted); on CUDA it is
the caching allocator's per-process fraction, so the OOM is a real CUDA OOM.

    python examples/oom_guard.py                                # CPU, 48 MiB budget
    python examples/oom_guard.py --device cuda --budget 2GiB --width 1024
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch import nn

from autofit.guard.core import OomGuard
from autofit.devices.memory import budget_for
from autofit.units import format_size, parse_size


class TinyLM(nn.Module):
    """A small residual MLP language model: activations grow with batch x sequence length."""

    def __init__(self, vocab: int, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def next_token_loss(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", default="48MiB", help="memory budget, e.g. 48MiB (CPU) or 2GiB (CUDA)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="samples per optimizer step (never changes)")
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    device, vocab = torch.device(args.device), 256
    limit = parse_size(args.budget, "--budget")
    torch.manual_seed(0)

    with budget_for(device, limit) as budget:
        model = TinyLM(vocab, args.width, depth=4).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = OomGuard(model, optimizer, micro_batch_size=args.batch, loss_fn=next_token_loss)
        print(f"budget {format_size(limit)} on {device}; {args.batch} samples per step, always")
        for step in range(args.steps):
            length = 32 * 2 ** (step // 2)  # 32, 32, 64, 64, 128, ...: the batch grows past the budget
            ids = torch.randint(0, vocab, (args.batch, length + 1), device=device)
            report = guard.step((ids[:, :-1], ids[:, 1:]))
            print(f"step {step}: seq {length:4d}, {guard.config.describe():32s} loss {report.loss.item():.3f}, "
                  f"samples {report.samples}, micro-batches {list(report.micro_batches)}")
    print(f"{guard.samples_seen} samples in {guard.steps} steps, {len(guard.recoveries)} recoveries; "
          f"peak {format_size(budget.peak)}")


if __name__ == "__main__":
    main()
