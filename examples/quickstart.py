"""Quickstart: tune a small GPT-2 (random weights, built from a config) for a global batch of 16.

On a GPU machine it tunes against the card (or --memory-budget); on a CPU-only machine against a CPU
memory budget (default 160MiB here, small enough that several rungs are needed).

    python examples/quickstart.py [--memory-budget 160MiB] [--out runs/quickstart]
"""

from __future__ import annotations

import argparse
import collections

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import autofit

CONFIG = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=2048, n_positions=256,
                    bos_token_id=0, eos_token_id=0)
SEQ_LEN = 128


def make_model() -> GPT2LMHeadModel:
    """A ~1M-parameter GPT-2 with random weights: nothing is downloaded."""
    return GPT2LMHeadModel(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    """Token ids and labels at the longest sequence the job will see."""
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN))
    return {"input_ids": ids, "labels": ids}


def make_dataset(n: int = 64) -> list[dict[str, torch.Tensor]]:
    """`n` samples of token ids and labels, as a Trainer takes them (for the exported scripts' --dataset)."""
    return [{key: value[0] for key, value in make_batch(1).items()} for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-budget", default=None, help="e.g. 160MiB (default: the GPU, or 160MiB on CPU)")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--out", default="runs/quickstart", help="where plan.json is written")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    budget = args.memory_budget or (None if on_gpu else "160MiB")
    plan = autofit.autofit(make_model, make_batch, global_batch_size=args.global_batch_size,
                           device="cuda" if on_gpu else "cpu", memory_budget=budget)
    for probe in plan.probes:
        if probe.skip is None:  # run: fit, oom, error or stopped as too slow
            peak = autofit.format_size(probe.peak_bytes)
            speed = f"{probe.samples_per_s:8.2f} samples/s" if probe.samples_per_s else " " * 18
            print(f"{probe.status.value:8} {peak:>11} {speed}  {probe.config.describe()}  -- {probe.reason}")
    skips = collections.Counter(probe.skip.value for probe in plan.probes if probe.skip is not None)
    print(f"and {sum(skips.values())} decided without running ({', '.join(f'{n} {why}' for why, n in skips.items())}; "
          "plan.probes holds each with its reason)")
    print(f"\n{plan.probes_run} probes. Chosen: {plan.summary()}")
    print(f"plan written to {plan.save(f'{args.out}/plan.json')}")


if __name__ == "__main__":
    main()
