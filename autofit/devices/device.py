"""Which device to tune on, what it supports, and how much memory a plan may use there."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from autofit.errors import Param, UsageError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to probe on: the given one (a name in any case: "CPU", " cuda:1"), validated, or CUDA when
    present, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device.strip().lower() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device={device!r} is not a device name; use 'cpu', 'cuda' or 'cuda:N'.") from exc
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise UsageError(f"device={device!r} is not supported; autofit tunes on 'cpu' or 'cuda[:N]'.")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if resolved.index is None else resolved.index
    if index >= count:
        raise UsageError(f"device={device!r} does not exist: {count} CUDA device(s) visible. "
                         "Use device='cpu' with a memory_budget to tune without a GPU, or dry_run() for a target GPU.")
    return torch.device("cuda", index)


def bf16_support(device: torch.device) -> tuple[bool, str]:
    """Whether bf16 runs natively on `device`, and the reason, e.g. "CUDA SM 7.5: bf16 not native ...".

    Decided by the chosen device's compute capability (>= 8.0, Ampere), not by
    `torch.cuda.is_bf16_supported()`, which checks the current device and counts emulated bf16 as
    supported by default (torch/cuda/__init__.py, `including_emulation=True`).
    """
    if device.type == "cpu":
        return True, "CPU autocast supports bf16"
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return True, f"CUDA SM {major}.{minor} supports bf16"
    return False, f"CUDA SM {major}.{minor}: bf16 not native, fp16 with GradScaler instead"


def device_memory(device: torch.device) -> int:
    """Bytes a plan may use on `device` when no budget is given: the card's memory, or free host RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().available


def describe(device: torch.device) -> str:
    """The device in words, e.g. "NVIDIA H100 80GB HBM3" or "cpu (2 cores)"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({psutil.cpu_count() or 1} cores)"


def memory_report(device: torch.device) -> dict[str, Any]:
    """For the spec summary: bytes other processes hold on a CUDA `device` (None where NVML cannot tell),
    and how this process's memory outside the allocator is measured there."""
    if device.type != "cuda":
        return {"foreign_memory": None, "memory_accounting": ""}
    from autofit.devices.memory import accounting, foreign_memory

    return {"foreign_memory": foreign_memory(device), "memory_accounting": accounting(device)}


def check_nvme_path(path: str | os.PathLike) -> Path:
    """`path` as an existing, writable folder (created when missing); `UsageError` naming it otherwise."""
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UsageError("{given} is not a writable folder ({why}); give a folder on a fast local disk that this "
                         "user can write, e.g. /local_nvme/autofit.", given=Param("nvme_path", str(path)),
                         why=str(exc.strerror or exc)) from exc
    return folder.resolve()


def spare_threads(requested: int, idle: int | None = None) -> int:
    """Torch CPU threads for the probes of a search: `requested`, fewer where other processes keep the cores
    busy (`idle`: the CPUs idle now, `idle_cpus` by default). OpenMP's threads wait for each other at every
    parallel operation, so a thread that another process holds off its core stalls the rest (docs/search.md:
    "A busy machine's cores"). One thread asked for is one thread: the CPUs are not sampled."""
    if requested <= 1:
        return 1
    return max(1, min(requested, idle_cpus() if idle is None else idle))


def idle_cpus(window: float = 0.2) -> int:
    """CPUs this process may run on (its affinity, where the platform says) that were idle over the last `window`
    seconds (under half busy). Sampled, not read from the load average: that one lags by a minute, so right after
    a run that kept the cores busy (a search, an install) it still counts it, on a machine quiet by now."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        busy = psutil.cpu_percent(interval=window, percpu=True)
    except (OSError, psutil.Error):  # counters this system does not let be read: taken as idle, as torch does
        return len(allowed) if allowed is not None else os.cpu_count() or 1
    return sum(1 for cpu, percent in enumerate(busy) if percent < 50 and (allowed is None or cpu in allowed))


@contextlib.contextmanager
def search_threads(device: torch.device) -> Iterator[int | None]:
    """On the CPU, torch's thread count held at `spare_threads` for a search (probes and their re-measurement),
    the caller's restored after; elsewhere nothing (None)."""
    if device.type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(spare_threads(before))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
