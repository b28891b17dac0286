"""Host work per op of an eager training step: the figures behind the dry-run's launch floor.

    python bench/measurements/host_ops.py        # ~30 s on 2 cores

A small model's GPU step is bound by the host, not the arithmetic: eager PyTorch issues every op from
Python through autograd and the dispatcher before its kernel is launched, and the GPU waits. The dry-run
(`autofit.pipelines.dry_run`, "a floor for small models") charges `SECONDS_PER_KERNEL` per op counted in
the simulated step, plus what a sharding engine adds (`engine_host_ops`). This measures, on the host at
hand (no GPU needed):

1. seconds per op of a training step of `examples/classifier.py`'s CNN on 2 x 2 pixels, one sample (its
   CPU kernels do next to nothing, so the time is the host's: Python, autograd, the dispatcher), the ops
   counted as the estimator counts kernels (no views, no bare allocations);
2. the ops FSDP2 adds per unit and micro-step on one rank (gloo), reshard after forward or not
   (`FSDP_OPS_PER_UNIT`): the same model with each block and the root wrapped by `fully_shard`;
3. the ops of one optimizer step as CUDA runs it (`foreach=True`), AdamW and Adafactor, over the model at
   two depths: a fixed part and a part per trainable tensor, and a step over one tensor (the step in
   backward runs one per tensor) (`OPTIMIZER_OPS`).

Backs: `SECONDS_PER_KERNEL` in autofit/estimate/cost_model.py, `FSDP_OPS_PER_UNIT` in
autofit/strategies/fsdp.py and `OPTIMIZER_OPS` in autofit/strategies/optimizer.py, and docs/dry-run.md's per-op host time; the results file records the constants beside what was measured.
Results: bench/results/host-ops-<date>.json: host-ops-2026-11-23.json."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autofit.config import Optimizer  # noqa: E402
from autofit.estimate.cost_model import SECONDS_PER_KERNEL  # noqa: E402
from autofit.strategies.fsdp import FSDP_OPS_PER_UNIT  # noqa: E402
from autofit.strategies.optimizer import OPTIMIZER_OPS  # noqa: E402
from autofit.estimate.simulation.step import launches_kernel  # noqa: E402
from examples import classifier  # noqa: E402
from bench import RESULTS  # noqa: E402
from bench.cli import no_options  # noqa: E402

STEPS = 300


class OpCount(TorchDispatchMode):
    """Counts the ops that launch a kernel on a GPU, as `autofit.estimate.simulation.step` counts them;
    `tensors_only`: only those touching a tensor of at least one dimension (an optimizer's step counters
    are 0-dim host tensors under CUDA's default, `capturable=False`: no kernel)."""

    def __init__(self, tensors_only: bool = False) -> None:
        super().__init__()
        self.kernels = 0
        self.tensors_only = tensors_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.kernels += not self.tensors_only or any(t.dim() > 0 for t in tensors)
        return func(*args, **(kwargs or {}))


def step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(images), labels).backward()


def kernels_of(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> int:
    step(model, images, labels)  # the first step makes state (gradients, FSDP2's buffers)
    with OpCount() as count:
        step(model, images, labels)
    return count.kernels


def seconds_per_op() -> dict:
    model = classifier.Net()
    images, labels = torch.randn(1, 3, 2, 2), torch.randint(0, classifier.CLASSES, (1,))
    kernels = kernels_of(model, images, labels)
    for _ in range(20):
        step(model, images, labels)
    started = time.perf_counter()
    for _ in range(STEPS):
        step(model, images, labels)
    seconds = (time.perf_counter() - started) / STEPS
    return {"ops_per_step": kernels, "seconds_per_step": seconds, "seconds_per_op": seconds / kernels}


def fsdp_ops_per_unit() -> dict:
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, classifier.CLASSES, (4,))
        plain = kernels_of(classifier.Net(), images, labels)
        found = {}
        for reshard in (True, False):
            model = classifier.Net()
            for block in model.blocks:
                fully_shard(block, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            units = len(model.blocks) + 1
            found[f"reshard_after_forward={reshard}"] = (kernels_of(model, images, labels) - plain) / units
        return {"plain_ops": plain, "extra_ops_per_unit": found}
    finally:
        dist.destroy_process_group()


def optimizer_ops() -> dict:
    images, labels = torch.randn(2, 3, 4, 4), torch.randint(0, classifier.CLASSES, (2,))

    def step_ops(make, depth: int, tensors: int | None = None) -> tuple[int, int]:
        model = classifier.Net(depth=depth)
        params = list(model.parameters())[:tensors]
        optimizer = make(params)
        for _ in range(2):  # the first step makes the states
            step(model, images, labels)
            with OpCount(tensors_only=True) as count:
                optimizer.step()
        return count.kernels, len(params)

    found = {}
    for name, make in (("adamw", lambda p: torch.optim.AdamW(p, foreach=True)),
                       ("adafactor", lambda p: torch.optim.Adafactor(p, foreach=True))):
        (ops_a, tensors_a), (ops_b, tensors_b) = step_ops(make, 4), step_ops(make, 8)
        per_tensor = (ops_b - ops_a) / (tensors_b - tensors_a)
        found[name] = {"fixed": ops_a - per_tensor * tensors_a, "per_tensor": per_tensor,  # ops on the weights' device
                       "one_tensor_step": step_ops(make, 4, 1)[0]}
    return found


def main() -> None:
    no_options(__doc__)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    result = {
        "what": "host seconds per op of an eager training step (tiny CNN, CPU), FSDP2's ops per unit and the "
                "optimizers' ops per step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_at_start": load,
        "torch": torch.__version__, "step": seconds_per_op(), "fsdp2": fsdp_ops_per_unit(),
        "optimizer_step_ops": optimizer_ops(),
        "constants": {"SECONDS_PER_KERNEL": SECONDS_PER_KERNEL,
                      "FSDP_OPS_PER_UNIT": {k.value: v for k, v in FSDP_OPS_PER_UNIT.items()},
                      "OPTIMIZER_OPS": {k.value: OPTIMIZER_OPS[k] for k in (Optimizer.ADAMW, Optimizer.ADAFACTOR)}}}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"host-ops-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
