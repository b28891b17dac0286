"""One of two CPU ranks (gloo) for test_deferred_sync.py: FSDP2 through `autofit.prepare`, then the bytes
of tensors left live by one micro-batch's backward, with the reduce-scatter done (FSDP2's default, as
autofit's loop runs) and deferred (`set_requires_gradient_sync(False)`, as accelerate's `accumulate()`
and the Trainer run every micro-batch but the last); then the peak of whole optimizer steps both ways,
model states included. Rank 0 prints one JSON line per case."""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import autofit
from autofit.config import Config
from autofit.devices.memory import CpuBudget, StorageCounter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_deferred_sync import CASES, PEAK_CONFIG, make_model  # noqa: E402


def live_after_backward(prepared, deferred: bool) -> int:
    ids = torch.randint(0, 1000, (1, 64))
    prepared.model.set_requires_gradient_sync(not deferred)
    with StorageCounter() as counter:
        prepared.forward_backward({"input_ids": ids, "labels": ids}, 0.5)
        # what is referenced, not a cycle the collector has yet to reach: once in about seven loaded full-suite
        # runs the deferred case read 320 KiB more (cause not found; four looped runs under load did not repeat it)
        gc.collect()
        live = counter.current
    prepared.model.set_requires_gradient_sync(True)
    prepared.forward_backward({"input_ids": ids, "labels": ids}, 0.5)  # the last micro-batch reduces what was held
    prepared.optimizer.zero_grad(set_to_none=True)
    return live


def step_peak(deferred: bool) -> int:
    """The most bytes live over two optimizer steps of PEAK_CONFIG's micro-batches, from the model's build."""
    ids = torch.randint(0, 1000, (1, 64))
    with CpuBudget(None) as budget:
        prepared = autofit.prepare(PEAK_CONFIG, make_model("float32"), device="cpu")
        for _ in range(2):
            for i in range(PEAK_CONFIG.grad_accum_steps):
                prepared.model.set_requires_gradient_sync(not deferred or i == PEAK_CONFIG.grad_accum_steps - 1)
                prepared.forward_backward({"input_ids": ids, "labels": ids}, 1 / PEAK_CONFIG.grad_accum_steps)
            prepared.optimizer_step()
    return budget.peak


for precision, dtype in CASES:
    config = Config(precision=precision, sharding="fsdp_full", num_gpus=2, micro_batch_size=1, grad_accum_steps=2)
    prepared = autofit.prepare(config, make_model(dtype), device="cpu")
    live = {"synced": live_after_backward(prepared, False), "deferred": live_after_backward(prepared, True)}
    if dist.get_rank() == 0:
        print(json.dumps({"precision": precision, "dtype": dtype, **live}), flush=True)

peaks = {"synced": step_peak(False), "deferred": step_peak(True)}
if dist.get_rank() == 0:
    print(json.dumps({"precision": "peak", "dtype": "float32", **peaks}), flush=True)
