"""Rung 8, offload: model states leave the GPU for host memory, or for an NVMe folder.

"cpu": with ZeRO the optimizer states go to the host and DeepSpeed's CPU Adam steps there (ZeRO-Offload);
at ZeRO-3 the parameters go too (ZeRO-Infinity on the host); with FSDP2 `CPUOffloadPolicy` keeps
parameters, gradients and the optimizer step on the host. "nvme": as "cpu" with ZeRO, but to a folder
on a fast local disk (DeepSpeed only). Buys: the states' GPU memory. Costs: PCIe (or disk) traffic,
2-10x slower steps; same math (tier 0). Applies on one GPU too. The engine strategy (ZeRO or FSDP2)
reads the choice when it builds the engine; the DeepSpeed keys come from `autofit.export.deepspeed`.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import TYPE_CHECKING, Any, Callable

from autofit.devices.device import check_nvme_path
from autofit.config import Config, Engine
from autofit.config import Offload as O
from autofit.errors import UsageError
from autofit.strategies.base import EngineInputs, Ladder, Option, Placement, Rule
from autofit.units import format_size

CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed CPU Adam, parameters updated per second per rank (the cost model)

if TYPE_CHECKING:
    from autofit.job.target import Target
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.costs import StepFacts
    from autofit.strategies.run import TrainRun


class StateOffloading(Ladder):
    """none, cpu, nvme (when a writable `nvme_path` is given)."""

    field = "offload"
    rung = 8
    order = 0
    values = (O.NONE, O.CPU, O.NVME)  # least GPU memory saved first

    def __init__(self, nvme_path: str | os.PathLike | None = None):
        """`nvme_path`: folder on a fast local disk for NVMe offload; checked writable now. The spec's
        `nvme_path` (`autofit.autofit(nvme_path=...)`, `autofit tune --nvme-path`) comes first: it is the
        one the plan keeps and the exports write."""
        self.nvme_path = str(check_nvme_path(nvme_path)) if nvme_path is not None else None

    def relieves(self, config: Config) -> Config | None:
        # the states' copies and the host's optimizer step only add time at the same micro-batch
        return config.replace(offload=O.NONE) if config.offload is not O.NONE else None

    def writing_to(self, nvme_path: str) -> "StateOffloading":
        return StateOffloading(nvme_path)

    def host_room(self, config: Config, need: Callable[[], int | None], nvme_path: str | None) -> str | None:
        """Its predicted host RAM (`need()`) over what is free now, or its NVMe folder missing or with less
        free space than that."""
        import psutil

        if not config.offloads:
            return None
        need_bytes = need()
        if not need_bytes:
            return None
        if config.offload is O.NVME:
            if nvme_path is None or not os.path.isdir(nvme_path):
                return f"its NVMe folder {str(nvme_path)!r} does not exist (nvme_path)"
            free = shutil.disk_usage(nvme_path).free
            if need_bytes > free:
                return (f"it would write ~{format_size(need_bytes)} to {str(nvme_path)!r}, which has "
                        f"{format_size(free)} free")
            return None
        free = psutil.virtual_memory().available
        if need_bytes > free:
            return (f"it needs ~{format_size(need_bytes)} of host RAM for what it offloads, and this machine has "
                    f"{format_size(free)} free")
        return None

    def folder(self, spec: "TrainSpec") -> str | None:
        """The NVMe folder for `spec`: the spec's, else this strategy's own."""
        return getattr(spec, "nvme_path", None) or self.nvme_path

    def options(self, spec: "TrainSpec") -> list[Option]:
        why_not = None if spec.target.cuda else \
            f"offload moves states from a GPU to the host; the target {spec.target.name} is already the host"
        folder = self.folder(spec)
        nvme_not = why_not or _nvme_reason(folder, probed_here=_probed_here(spec))
        return [
            Option(O.NONE, 0, "model states stay on the device"),
            Option(O.CPU, 0, why_not or "optimizer states (ZeRO-3/FSDP2: parameters too) to host memory",
                   available=why_not is None),
            Option(O.NVME, 0, nvme_not or f"optimizer states and parameters (ZeRO-3) to NVMe at {folder}",
                   available=nvme_not is None),
        ]

    def placement(self, config: Config) -> Placement:
        """Offload runs through an engine, in launched ranks."""
        return Placement.RANKS if config.offloads else Placement.IN_PROCESS

    def apply(self, run: "TrainRun") -> None:
        if not run.config.offloads or run.simulated:  # simulated: the states' formulas say where they live
            return
        if run.live:
            raise UsageError(f"The plan offloads model states ({run.config.describe()}); the OOM guard runs plain "
                             "torch or DDP steps. Train that plan with autofit.prepare (bash launch/torchrun.sh), "
                             "or tune again without offload for the guard.")
        run.nvme_path = self.folder(run.spec)  # the engine strategy reads it when it builds the engine

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        return {}

    def offload_seconds(self, config: Config, step: "StepFacts") -> float:
        """Gradients down and parameters up over PCIe once per step, the trained parameters stepped by CPU
        Adam at `CPU_ADAM_PARAMS_PER_S`; with the parameters sharded (ZeRO-3's `offload_param`, FSDP2's
        policy) the whole model's 16-bit weights up and down in every micro-step too. Per rank."""
        if not config.offloads:
            return 0.0
        n = config.num_gpus
        seconds = 2 * step.half * step.trained / n / step.pcie + step.trained / n / CPU_ADAM_PARAMS_PER_S
        if config.shards_parameters:
            seconds += config.grad_accum_steps * 2 * step.half * step.facts.num_params / n / step.pcie
        return seconds

    def replays_training(self, config: Config) -> bool:
        return not config.offloads

    def rules(self) -> tuple[Rule, ...]:
        """Offload moves states through an engine, and only ZeRO-3 writes them to NVMe."""
        return (Rule("offload needs an engine", ("offload", "sharding"), _offload_needs_engine),
                Rule("NVMe needs ZeRO-3", ("offload", "sharding"), _nvme_needs_zero3))

    def deepspeed_keys(self, config: Config, inputs: EngineInputs) -> dict[str, Any]:
        """ZeRO-Offload's targets: the optimizer states to the host or NVMe (`inputs.nvme_path`), the
        parameters too at ZeRO-3 (the only stage whose parameters can leave the GPU)."""
        if not config.offloads:
            return {}
        if config.zero_stage == 0:
            raise UsageError(f"offload={config.offload.value!r} needs ZeRO (zero_stage 1-3) but zero_stage is 0; "
                             "set zero_stage, e.g. 2 for optimizer offload or 3 to offload parameters too.")
        target: dict[str, Any] = {"device": config.offload.value, "pin_memory": True}
        if config.offload is O.NVME:
            if not inputs.nvme_path:
                raise UsageError("offload='nvme' needs a folder on a fast local disk: pass nvme_path=... "
                                 "(autofit.autofit(nvme_path=...), autofit tune --nvme-path DIR).")
            target["nvme_path"] = str(inputs.nvme_path)
        keys = {"zero_optimization.offload_optimizer": dict(target)}
        if config.zero_stage == 3:
            keys["zero_optimization.offload_param"] = dict(target)
        return keys


def _probed_here(spec: "TrainSpec") -> bool:
    """Whether `spec` probes on a card of this machine (not a dry-run's plan for another one)."""
    device = getattr(spec, "device", None)
    return device is not None and device.type == "cuda"


def _nvme_reason(nvme_path: str | None, probed_here: bool) -> str | None:
    if nvme_path is None:
        return ("NVMe offload needs a folder on a fast local disk: autofit.autofit(nvme_path=...) or "
                "autofit tune --nvme-path DIR")
    from autofit.strategies.deepspeed_install import installed_version, version_problem

    return version_problem(installed_version(), "NVMe offload") or (aio_problem() if probed_here else None)


@functools.cache
def aio_problem() -> str | None:
    """Why DeepSpeed's async I/O op, which reads and writes NVMe offload's files, cannot build on this
    machine, or None. `AsyncIOBuilder.is_compatible` compiles a test against libaio
    (deepspeed/ops/op_builder/async_io.py); without it every NVMe probe failed at the engine's build with
    "Unable to JIT load the async_io op" (seen on an H100 machine without libaio-dev)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return ("NVMe offload needs DeepSpeed's async_io op, which cannot build here (libaio is missing): "
            "apt install libaio-dev (or yum install libaio-devel), then check with ds_report")


def _offload_needs_engine(c: Config, t: "Target") -> str | None:
    if c.offloads and c.engine is Engine.TORCH:
        return (f"offload={c.offload.value} moves states through an engine: it needs ZeRO or FSDP2 sharding "
                "(on one GPU too)")
    return None


def _nvme_needs_zero3(c: Config, t: "Target") -> str | None:
    if c.offload is O.NVME and c.zero_stage != 3:
        return (f"NVMe offload needs DeepSpeed ZeRO-3; with {c.sharding.value} DeepSpeed offloads to the CPU "
                "instead and FSDP2 offloads to the CPU only")
    return None
