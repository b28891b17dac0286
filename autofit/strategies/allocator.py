"""Rung 0, the caching allocator's expandable segments: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.

PyTorch's caching allocator takes a `cudaMalloc` segment per size class (a 20 MiB one for requests of
1-10 MiB, the request rounded to 2 MiB above) and keeps every freed block cached in its segment; a later
request that no cached block fits takes a new segment, so a training step reserves more than it ever
allocates, and at the limit only whole free segments can be given back. With expandable segments each pool
has one segment that grows by mapping pages, freed blocks merge across it, and before an OOM every free
page is unmapped (c10/cuda/CUDACachingAllocator.cpp, Note [Expandable Segments];
`autofit.estimate.cuda.expandable` replays it). PyTorch's own out-of-memory message proposes it first
("If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
to avoid fragmentation"), and no tuner searches it.

Buys the allocator's reserve beyond the allocated bytes; costs nothing in the math (tier 0), a mapping of
milliseconds when the segment grows, and sharing CUDA tensors with another process (IPC). A process-wide
setting, read when a segment is made: a probe with it runs in a child process (`Placement.CHILD`), the
exports set the variable before the job starts, and `autofit.prepare` switches it on in the running process
(PyTorch allows it at any time: segments made from then on are expandable; what the allocator already holds
stays in its fixed segments until `torch.cuda.empty_cache()`, which prepare calls). A CUDA setting only: CPU
targets are not offered it.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import Allocator as A
from autofit.config import Config
from autofit.strategies.base import Option, Placement, Strategy
from autofit.strategies.memory import SEGMENTS_FACT

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.run import TrainRun

ENVIRONMENT = "PYTORCH_CUDA_ALLOC_CONF"  # read by torch 2.1 and later (2.9 reads PYTORCH_ALLOC_CONF first)
SETTING = "expandable_segments:True"
logger = logging.getLogger("autofit.prepare")


class ExpandableSegments(Strategy):
    """PyTorch's default fixed segments, or expandable segments (CUDA on Linux)."""

    field = "allocator"
    rung = 0
    order = 0

    def options(self, spec: "TrainSpec") -> list[Option]:
        target = spec.target
        default = Option(A.DEFAULT, 0, "the caching allocator's default fixed segments")
        if not target.cuda:
            return [default, Option(A.EXPANDABLE, 0, f"expandable segments are a setting of the CUDA caching "
                                    f"allocator; {target.name} is not a CUDA device", available=False)]
        why = unsupported() if target.live else None
        return [default, Option(A.EXPANDABLE, 0, why or f"{ENVIRONMENT}={SETTING}: one segment per pool, grown "
                                "page by page, its free pages unmapped before an out-of-memory error",
                                available=why is None)]

    def placement(self, config: Config) -> Placement:
        # a process-wide allocator setting: the caller's allocator keeps its own
        return Placement.CHILD if config.allocator is A.EXPANDABLE else Placement.IN_PROCESS

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        # the simulated step's events are the same; the estimator replays them through expandable segments
        return {SEGMENTS_FACT: "expandable"} if config.allocator is A.EXPANDABLE else {}

    def relieves(self, config: Config) -> Config | None:
        # the same step and cost model; only the reserve differs
        return config.replace(allocator=A.DEFAULT) if config.allocator is A.EXPANDABLE else None

    def apply(self, run: "TrainRun") -> None:
        if run.simulated or run.config.allocator is not A.EXPANDABLE or run.device.type != "cuda":
            return
        held = torch.cuda.memory_reserved(run.device)
        enable()
        if held:  # a process whose allocator started: its fixed segments stay where tensors live in them
            torch.cuda.empty_cache()
            logger.warning("autofit.prepare: expandable segments are on from now; %.0f MiB this process had "
                           "reserved before stay in fixed segments while its tensors live (the unused ones were "
                           "given back). Set %s=%s before the process starts to have every segment expandable, "
                           "as the probe did.", held / 2**20, ENVIRONMENT, SETTING)

    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        # torchrun.sh and accelerate_launch.sh export it before the job's first CUDA call
        return {ENVIRONMENT: SETTING} if config.allocator is A.EXPANDABLE and fmt == "torchrun" else {}

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if config.allocator is not A.EXPANDABLE or fmt in ("torchrun", "accelerate"):  # their launch scripts export it
            return []
        return ["from autofit.strategies.allocator import enable as expandable_segments",
                f"expandable_segments()  # {ENVIRONMENT}={SETTING}: before the model's first CUDA allocation"]


def enable() -> None:
    """Switch the CUDA caching allocator of this process to expandable segments (segments made from now on)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch 2.9 and later
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings  # torch 2.1 .. 2.8
    setter(SETTING)


def unsupported() -> str | None:
    """Why this process's CUDA allocator cannot have expandable segments, or None where it can: they need the
    CUDA driver's virtual memory API, which torch's Linux CUDA builds use from 2.1 on."""
    if not sys.platform.startswith("linux"):
        return f"expandable segments need Linux (the CUDA virtual memory API as torch uses it); this is {sys.platform}"
    if getattr(torch.version, "hip", None):
        return "expandable segments are not offered on ROCm builds of torch (their reserve is not modelled)"
    return None
