"""An experiment on the estimator's allocator model: does replaying whole training steps explain the
1.1B Llama peaks measured on an H100 that the estimator under-predicts?

    python bench/allocator_steps.py        # ~1 min on 2 cores; writes results/allocator-steps-<date>.json

The estimator replays one forward + backward through its model of the CUDA caching allocator
(`autofit.estimate.allocator`) and counts what it reserves beyond what it allocates there. Training runs
many steps: the first optimizer step creates AdamW's states, every step's foreach update allocates a
temporary per parameter (`_foreach_sqrt` of the second moments) and `zero_grad` frees the gradients, all
in segments of one parameter's size. The next step's activations fit those segments only where they are
no larger, and take new segments otherwise. Here the simulated step of each configuration (the whole
depth, 22 blocks, on CPU kernels standing in for CUDA) is recorded allocation by allocation and replayed
for three steps with the weights placed first, the gradients kept until the step, the states made on the
first step and the temporaries on every step, then compared with the measured peaks less the CUDA
context and cuBLAS workspace the estimator counts (bench/results/estimate-cuda-2026-11-22.json). Not
part of the estimator (yet): the replay is of the full depth, which the estimator does not simulate.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofit.config import Config  # noqa: E402
from autofit.estimate import simulate  # noqa: E402
from autofit.estimate.allocator import CachingAllocator  # noqa: E402
from autofit.estimate.estimator import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES  # noqa: E402
from bench.estimate_accuracy import models  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MEASURED = RESULTS / "estimate-cuda-2026-11-22.json"
STEPS = 3


class Recording(CachingAllocator):
    """The simulation's allocator, recording every request and release; a weight gradient is marked as such."""

    events: list[tuple[str, int, int]] = []

    def malloc(self, key: int, nbytes: int) -> None:
        self.events.append(("malloc", key, nbytes))
        super().malloc(key, nbytes)

    def free(self, key: int) -> None:
        self.events.append(("free", key, 0))
        super().free(key)


def record(config: Config) -> tuple[list[int], list[tuple[str, int, int]]]:
    """The weights' sizes and the allocation events of one simulated forward + backward of the 1.1B Llama."""
    model_config, _, seq_len = models(large=True)["llama-1.1b"]
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(model_config)
    weights = [p.numel() * 4 for p in model.parameters()]  # fp32 weights: autocast keeps them so
    ids = torch.zeros(config.micro_batch_size, seq_len, dtype=torch.long)
    Recording.events = []
    take_grad = simulate._Tracker.take_grad

    def marked(tracker, param):
        Recording.events.append(("grad", id(param.grad.untyped_storage()), 0))
        take_grad(tracker, param)

    simulate.CachingAllocator, simulate._Tracker.take_grad = Recording, marked
    try:
        simulate.simulate_step(model, {"input_ids": ids, "labels": ids}, lambda out, batch: out.loss, config,
                               device="cpu", cuda_ampere=True)
    finally:
        simulate.CachingAllocator, simulate._Tracker.take_grad = CachingAllocator, take_grad
    return weights, Recording.events


def replay(weights: list[int], events: list[tuple[str, int, int]], steps: int = STEPS) -> tuple[CachingAllocator, list]:
    """`steps` training steps through the allocator model: weights first; each step the recorded forward +
    backward (its gradients kept), AdamW's two states per weight on the first step, one foreach
    temporary per weight freed after the update, then the gradients freed (`zero_grad`)."""
    allocator, serial = CachingAllocator(), iter(range(1, 1 << 62))
    for i, size in enumerate(weights):
        allocator.malloc(-1 - i, size)
    phases, states = [], False
    for step in range(1, steps + 1):
        live: dict[int, int] = {}
        grads: list[int] = []
        kept: set[int] = set()
        for kind, key, size in events:
            if kind == "malloc":
                live[key] = next(serial)
                allocator.malloc(live[key], size)
            elif kind == "grad":
                kept.add(key)
                grads.append(live[key])
            elif key in kept:  # the simulation drops each gradient once counted; a training step keeps it
                kept.discard(key)
                live.pop(key, None)
            elif key in live:
                allocator.free(live.pop(key))
        phases.append({"step": step, "phase": "forward + backward", "allocated": allocator.peak_allocated,
                       "reserved": allocator.peak_reserved})
        if not states:
            for size in weights:
                for _ in range(2):
                    allocator.malloc(next(serial), size)
            states = True
        temporaries = [next(serial) for _ in weights]
        for key, size in zip(temporaries, weights):
            allocator.malloc(key, size)
        for key in temporaries + grads:
            allocator.free(key)
        phases.append({"step": step, "phase": "optimizer step", "allocated": allocator.peak_allocated,
                       "reserved": allocator.peak_reserved})
    return allocator, phases


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    measured = [r for r in json.loads(MEASURED.read_text())["rows"] if r["model"] == "llama-1.1b"]
    rows = []
    for row in measured:
        config = Config.from_dict(row["config"])
        allocator, phases = replay(*record(config))
        target = row["measured_bytes"] - CUDA_CONTEXT_BYTES - CUBLAS_WORKSPACE_BYTES
        one_step = next(p for p in phases if p["step"] == 1 and p["phase"] == "optimizer step")["reserved"]
        rows.append({"describe": row["describe"], "measured_less_overheads": target,
                     "replayed_reserved": allocator.peak_reserved, "error": round(allocator.peak_reserved / target - 1, 4),
                     "first_step_reserved": one_step, "error_first_step": round(one_step / target - 1, 4),
                     "phases": phases})
        print(f"{row['describe']:45s} measured less overheads {target / 2**30:6.2f} GiB, replayed {STEPS} steps "
              f"{allocator.peak_reserved / 2**30:6.2f} GiB {rows[-1]['error']:+.1%} (first step only "
              f"{rows[-1]['error_first_step']:+.1%})", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"allocator-steps-{now.date().isoformat()}.json"
    out.write_text(json.dumps({"what": __doc__.splitlines()[0], "measured": MEASURED.name, "date": now.isoformat(
        timespec="seconds"), "machine": platform.machine(), "torch": torch.__version__, "steps": STEPS,
        "seconds": round(time.perf_counter() - started, 1), "rows": rows}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
