"""What NVML says about one card: this process's memory on it, and everything used on it.

`torch.cuda.mem_get_info` counts every process on the card (cudaMemGetInfo, torch/cuda/memory.py), so
it charges a probe with the parent's CUDA context and with other people's jobs. NVML reports memory per
process: `nvmlDeviceGetComputeRunningProcesses` (nvidia-ml-py, pynvml.py), matched on this pid, with
the card found by its PCI bus id as torch's own OOM report does (c10/cuda/CUDACachingAllocator.cpp,
reportProcessMemoryInfo) — never by index, whose order differs from CUDA's.

nvidia-ml-py is optional (`autofit[gpu]`) and imported lazily. Every reading returns None when it
cannot be had: no nvidia-ml-py, no driver, or a container whose PIDs NVML does not translate
(NVIDIA/nvidia-docker#1483: "you will always get the host pids"); callers then fall back to a baseline.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch


@functools.lru_cache(maxsize=1)
def _nvml() -> Any:
    """The initialised pynvml module, or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError (no driver): no NVML here
        return None
    return pynvml


def forget() -> None:
    """Look for NVML again at the next reading (after installing nvidia-ml-py; tests)."""
    _nvml.cache_clear()


def bus_id(device: torch.device) -> str | None:
    """The card's PCI bus id in NVML's format ("%08X:%02X:%02X.0", NVML_DEVICE_PCI_BUS_ID_FMT), or None
    where torch does not expose the address (`pci_*_id` properties: torch 2.13, torch/numa/binding.py)."""
    props = torch.cuda.get_device_properties(device)
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(part is None for part in parts):
        return None
    return "%08X:%02X:%02X.0" % tuple(parts)


def _handle(nvml: Any, bus: str | None) -> Any:
    if nvml is None or bus is None:
        return None
    try:
        return nvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:  # noqa: BLE001 - NVMLError: not found
        return None


def process_used(bus: str | None, pid: int | None = None) -> int | None:
    """Bytes process `pid` (this one by default) holds on the card at PCI address `bus`, or None when NVML
    cannot say (no NVML, pid not listed, or `usedGpuMemory` None: NVML_VALUE_NOT_AVAILABLE, pynvml.py)."""
    nvml = _nvml()
    handle = _handle(nvml, bus)
    if handle is None:
        return None
    pid = os.getpid() if pid is None else pid
    try:
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # noqa: BLE001
        return None
    used = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory]
    return sum(used) if used else None


def device_used(bus: str | None) -> int | None:
    """Bytes used on the card at `bus` by every process (`nvmlDeviceGetMemoryInfo(...).used`), or None.
    Reading it makes no CUDA context, so a child can take it before its own exists."""
    nvml = _nvml()
    handle = _handle(nvml, bus)
    if handle is None:
        return None
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # noqa: BLE001
        return None
