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

if TYPE_CHECKING:
    from autofit.devices.gpus import GpuProfile

# Optional packages a strategy may need, by the name a Target lists them under.
EXTRAS = ("deepspeed", "bitsandbytes", "peft", "flash_attn")


@dataclasses.dataclass(frozen=True)
class Target:
    """What a plan is for. Memory in bytes per device, bandwidth in GB/s (10^9 B/s)."""

    device_type: str  # "cuda" or "cpu"
    name: str  # "NVIDIA H100 80GB HBM3", "a100-80gb" (a profile) or "cpu (2 cores)"
    count: int  # data-parallel ranks (devices)
    memory_bytes: int  # per device: the budget a plan may use there
    bf16: bool  # whether bf16 runs natively
    bf16_reason: str  # one line, e.g. "CUDA SM 7.5: bf16 not native, fp16 with GradScaler instead"
    extras: frozenset[str]  # optional packages installed (live) or assumed installable (profile)
    interconnect_gbps: float | None = None  # GPU <-> GPU per GPU; None where unknown
    live: bool = True  # built from a device here (probes run) rather than from a profile

    @property
    def cuda(self) -> bool:
        """Whether the target is a CUDA GPU."""
        return self.device_type == "cuda"

    def has(self, extra: str) -> bool:
        """Whether optional package `extra` (one of `EXTRAS`) is there."""
        return extra in self.extras

    @classmethod
    def from_device(cls, device: torch.device, count: int, memory_bytes: int) -> "Target":
        """The target of a live device: what this machine has and has installed."""
        from autofit.devices.device import bf16_support, describe

        bf16, why = bf16_support(device)
        return cls(device.type, describe(device), count, memory_bytes, bf16, why, installed_extras(), None, True)

    @classmethod
    def from_profile(cls, profile: "GpuProfile", count: int) -> "Target":
        """The target of a GPU profile (dry-run): every extra is assumed installable there."""
        why = f"{profile.display} supports bf16" if profile.bf16 else \
            f"{profile.display} has no native bf16: fp16 with GradScaler instead"
        return cls("cuda", profile.name, count, profile.memory_bytes, profile.bf16, why, frozenset(EXTRAS),
                   profile.interconnect_gbps, False)


def installed_extras() -> frozenset[str]:
    """The optional packages of `EXTRAS` importable here."""
    return frozenset(name for name in EXTRAS if importlib.util.find_spec(name) is not None)
