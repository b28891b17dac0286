"""The Target: the hardware a plan is for, as one value the strategies read.

Built from a live device when tuning (`Target.from_device`: the probe device, its memory budget, what
is installed here) or from a GPU profile when planning without the card (`Target.from_profile`: every
extra assumed installable there). Strategies offer their options for a Target, so the tuner and the
dry-run build the same space.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

import torch

from autofit.errors import Param, UsageError

if TYPE_CHECKING:
    from autofit.devices.gpus import GpuProfile

# Optional packages a strategy may need, by the name a Target lists them under.
EXTRAS = ("deepspeed", "bitsandbytes", "peft", "flash_attn")


@dataclasses.dataclass(frozen=True)
class Target:
    """What a plan is for. Memory in bytes per device, bandwidth in GB/s (10^9 B/s)."""

    device_type: str  # "cuda" or "cpu"
    name: str  # "NVIDIA H100 80GB HBM3", "a100-80gb" (a profile) or "cpu (2 cores)"
    count: int  # data-parallel ranks (devices), over every node
    memory_bytes: int  # per device: the budget a plan may use there
    bf16: bool  # whether bf16 runs natively
    bf16_reason: str  # one line, e.g. "CUDA SM 7.5: bf16 not native, fp16 with GradScaler instead"
    extras: frozenset[str]  # optional packages installed (live) or assumed installable (profile)
    interconnect_gbps: float | None = None  # GPU <-> GPU per GPU within a node; None where unknown
    live: bool = True  # built from a device here (probes run) rather than from a profile
    nodes: int = 1  # machines the `count` devices span, count // nodes each
    inter_node_gbps: float | None = None  # what each GPU sends across nodes (its share of the network)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.count % self.nodes:
            raise UsageError("{count} over {nodes}: every node has as many GPUs, so the count must be a multiple of "
                             "the nodes (nodes x GPUs per node).", count=Param("num_gpus", self.count),
                             nodes=Param("nodes", self.nodes))

    @property
    def per_node(self) -> int:
        """Devices on each node."""
        return self.count // self.nodes

    def describe_layout(self) -> str:
        """"4 nodes x 8" over several nodes, else the device count."""
        return f"{self.nodes} nodes x {self.per_node}" if self.nodes > 1 else str(self.count)

    @property
    def cuda(self) -> bool:
        """Whether the target is a CUDA GPU."""
        return self.device_type == "cuda"

    def has(self, extra: str) -> bool:
        """Whether optional package `extra` (one of `EXTRAS`) is there."""
        return extra in self.extras

    @classmethod
    def from_device(cls, device: torch.device, count: int, memory_bytes: int, nodes: int = 1) -> "Target":
        """The target of a live device: what this machine has and has installed; over `nodes` machines like
        it, of which the probes run one (or, where this machine has them all, every rank)."""
        from autofit.devices.device import bf16_support, describe

        bf16, why = bf16_support(device)
        return cls(device.type, describe(device), count, memory_bytes, bf16, why, installed_extras(), None, True,
                   nodes)

    @classmethod
    def from_profile(cls, profile: "GpuProfile", count: int, nodes: int = 1,
                     inter_node_gbps: float | None = None) -> "Target":
        """The target of a GPU profile (dry-run): every extra is assumed installable there; `count` GPUs over
        `nodes` nodes whose network gives each GPU `inter_node_gbps` GB/s."""
        why = f"{profile.display} supports bf16" if profile.bf16 else \
            f"{profile.display} has no native bf16: fp16 with GradScaler instead"
        return cls("cuda", profile.name, count, profile.memory_bytes, profile.bf16, why, frozenset(EXTRAS),
                   profile.interconnect_gbps, False, nodes, inter_node_gbps)


def installed_extras() -> frozenset[str]:
    """The optional packages of `EXTRAS` importable here."""
    return frozenset(name for name in EXTRAS if importlib.util.find_spec(name) is not None)
