"""What `autofit.estimate.simulation.sized_kernels` costs a simulation of a model that has none of its kernels: a
GPT-2 step (6 layers, 1,024 tokens, CPU kernels standing in for CUDA) simulated with `sized_kernels.run`
and with a pass-through in its place, alternated, medians of 10.

    AUTOFIT_CACHE=off python bench/diag/sized_kernels_cost.py

On 2026-11-29 (x86_64, 2 cores, torch 2.13.0+cpu): 0.115 s both idle, 0.122 s both beside a test run. As a
dispatch mode of its own over every op (its first form, 2420efb) it was 0.130 s against 0.119 s.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.config import Config  # noqa: E402
from autofit.estimate.simulation import sized_kernels  # noqa: E402
from autofit.estimate.simulation.step import simulate_step  # noqa: E402
from autofit.batches.batch import default_loss  # noqa: E402
from bench.cli import no_options  # noqa: E402


def _pass_through(func, args, kwargs, cuda):
    return func(*args, **(kwargs or {}))


def _seconds(batch: dict) -> float:
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=768, n_head=12))
    start = time.perf_counter()
    simulate_step(model, batch, default_loss, Config(micro_batch_size=2), device="cpu", cuda_ampere=True)
    return time.perf_counter() - start


def main() -> None:
    no_options(__doc__)
    ids = torch.randint(0, 50000, (2, 1024))
    batch = {"input_ids": ids, "labels": ids}
    sized, times = sized_kernels.run, {"sized_kernels.run": [], "pass-through": []}
    try:
        for _ in range(10):
            sized_kernels.run = sized
            times["sized_kernels.run"].append(_seconds(batch))
            sized_kernels.run = _pass_through
            times["pass-through"].append(_seconds(batch))
    finally:
        sized_kernels.run = sized
    for name, values in times.items():
        print(f"{name:18} median {statistics.median(values):.3f} s over {len(values)}")


if __name__ == "__main__":
    main()
