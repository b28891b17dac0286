"""Rung 6, DeepSpeed ZeRO stage 1, 2, 3 through `deepspeed.initialize` with the generated config.

Stage 1 shards the optimizer states over the ranks, stage 2 the gradients too, stage 3 the parameters
too. Buys: each rank holds 1/num_gpus of those states. Costs: communication (stage 3 gathers every
layer's parameters in forward and backward); same math (tier 0). The probe trains with exactly the dict
that `autofit.export.deepspeed.deepspeed_config` writes for the launcher, with bf16/fp16 as DeepSpeed
configures them, so what was measured is what runs. On one GPU ZeRO is the base of the offload rung.
Needs DeepSpeed (`pip install 'autofit[deepspeed]'`); probes run in the ranks `autofit.probe.distributed`
launches, never in the caller's process.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from autofit.strategies.base import Option, Strategy

STAGES = (0, 1, 2, 3)
MIN_VERSION = "0.14"  # the `deepspeed` extra's floor (pyproject); the probes were run with 0.19.8 only
WHAT = {1: "optimizer states", 2: "optimizer states and gradients", 3: "optimizer states, gradients and parameters"}


class Zero(Strategy):
    """ZeRO stage 0 (off), 1, 2, 3."""

    field = "zero_stage"
    rung = 6

    def options(self, spec) -> list[Option]:
        why_not = unavailable_reason(spec)
        return [Option(0, 0, "no ZeRO")] + [
            Option(stage, 0, why_not or f"ZeRO-{stage}: {WHAT[stage]} sharded over {spec.num_gpus} ranks",
                   available=why_not is None) for stage in STAGES[1:]]

    def saves_at_least(self, a: Any, b: Any) -> bool:
        return a >= b

    def isolates(self, value: Any) -> bool:
        return value > 0

    def apply(self, run, value: Any) -> None:
        if value:
            run.scaler = None  # DeepSpeed scales fp16 losses itself (the config's fp16 section)
            run.engine_factory = build_engine


def unavailable_reason(spec, feature: str = "ZeRO") -> str | None:
    """Why DeepSpeed ZeRO cannot be probed for `spec`, or None."""
    problem = version_problem(installed_version(), feature)
    if problem:
        return problem
    if spec.num_gpus < 2 and spec.device.type != "cuda":
        return f"sharding needs several ranks; num_gpus={spec.num_gpus} (on one GPU ZeRO only serves offload)"
    return None


def installed_version() -> str | None:
    """DeepSpeed's installed version, or None."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problem(version: str | None, feature: str, minimum: str = MIN_VERSION) -> str | None:
    """Why DeepSpeed `version` cannot serve `feature`: not installed, or older than `minimum`; else None."""
    from packaging.version import Version

    if version is None:
        return f"{feature} needs DeepSpeed, which is not installed: pip install 'autofit[deepspeed]'"
    if Version(version) < Version(minimum):
        return (f"DeepSpeed {version} is too old for {feature} (autofit needs >= {minimum}); "
                f"pip install -U 'deepspeed>={minimum}'")
    return None


class DeepSpeedEngine:
    """`TrainRun`'s engine over a DeepSpeed engine: the run weights each micro-batch's loss itself, so
    DeepSpeed must not divide by the accumulation steps again; DeepSpeed counts micro-steps in `step()`
    and applies the optimizer at the accumulation boundary, so it is stepped after every backward."""

    def __init__(self, engine: Any):
        self.engine = engine

    def backward(self, loss: Any) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()  # a micro-step; the optimizer steps on the last one of the accumulation

    def step(self) -> None:
        """Nothing left to do: the last micro-batch's `engine.step()` was the accumulation boundary."""


def build_engine(run) -> DeepSpeedEngine:
    """`deepspeed.initialize` over the run's model with `deepspeed_config(run.config)`; the run's model
    becomes the engine. Only inside a rank that `autofit.probe.distributed` launched (a process group exists)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("ZeRO probes run in the ranks autofit launches (autofit.probe.distributed.run_ranks); "
                           "no process group here")
    import deepspeed

    from autofit.export.deepspeed import deepspeed_config

    config = deepspeed_config(run.config, nvme_path=run.nvme_path)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    params = [p for p in run.model.parameters() if p.requires_grad]
    optimizer = None if "optimizer" in config else _factory(run)(params)
    engine, optimizer, _, _ = deepspeed.initialize(model=run.model, model_parameters=params, optimizer=optimizer,
                                                   config=config)
    run.model, run.optimizer = engine, optimizer
    return DeepSpeedEngine(engine)


def _factory(run) -> Any:
    import torch

    return run.optimizer_factory or (lambda ps: torch.optim.AdamW(ps))
