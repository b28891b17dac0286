"""Memory budgets enforced for real, and the peak a probe reached.

- CPU: every tensor storage created while the budget is active is counted (parameters and optimizer
  states included); going over raises `torch.OutOfMemoryError`, exactly as a card of that size would.
- CUDA: the caching allocator's per-process fraction caps what the allocator may reserve; the peak is
  the allocator's peak reservation plus what the process holds outside it (CUDA context, cuBLAS
  workspaces, bitsandbytes' paged buffers).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autofit.units import format_size


class DeadlinePassed(Exception):
    """A probe ran past its deadline: it is too slow to beat the best configuration found so far."""


class _Deadline:
    """Optional wall-clock deadline (time.perf_counter() seconds) shared by both budgets."""

    deadline: float | None = None

    def check_deadline(self) -> None:
        """Raise `DeadlinePassed` once the deadline has passed."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise DeadlinePassed("deadline passed")


class CpuBudget(_Deadline, TorchDispatchMode):
    """Counts the bytes of every live tensor storage created inside it and enforces `limit` bytes.

    Storages are tracked by weak reference, so the count falls when tensors die. `peak` is the most
    bytes live at once. Views share their base's storage and are counted once. The deadline, when
    set, is checked at every operation, so even one very slow step stops on time.
    """

    def __init__(self, limit: int | None):
        super().__init__()
        self.limit = limit
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}

    # Entered as a context manager: `with CpuBudget(limit) as budget: ...`.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.check_deadline()
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                # A DTensor (FSDP2's sharded parameters) holds only its local shard on this rank.
                self._count(getattr(leaf, "_local_tensor", leaf).untyped_storage())
        return out

    def _count(self, storage: Any) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        known = self._live.get(key)
        if known is not None:
            if known[1] == nbytes:
                return
            self.current -= known[1]  # resized in place (out= ops)
            ref = known[0]
        else:
            ref = weakref.ref(storage, lambda _ref, key=key: self._forget(key))
        self._live[key] = (ref, nbytes)
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        if self.limit is not None and self.current > self.limit:
            raise _budget_oom(self.current, nbytes, self.limit)

    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def reset_peak(self) -> None:
        """Start measuring the peak again from the bytes live now."""
        self.peak = self.current


def _budget_oom(current: int, nbytes: int, limit: int) -> torch.OutOfMemoryError:
    error = torch.OutOfMemoryError(
        f"CPU budget exceeded: allocating {format_size(nbytes)} brought live tensors to "
        f"{format_size(current)}, over the budget of {format_size(limit)}"
    )
    error.autofit_cpu_budget = True  # type: ignore[attr-defined]
    return error


class CudaBudget(_Deadline):
    """Caps the CUDA caching allocator at `limit` bytes for this process and measures the peak.

    The per-process fraction bounds what the allocator reserves; memory outside the allocator (the
    CUDA context, library workspaces, paged buffers) is measured with `torch.cuda.mem_get_info` and
    subtracted from the allocator's share so the whole process stays within `limit`.
    """

    def __init__(self, limit: int | None, device: torch.device):
        self.limit = limit
        self.device = device
        self.peak = 0
        self._previous_fraction = 1.0

    def outside_allocator(self) -> int:
        """Bytes the device holds beyond this process's allocator reservation (context, workspaces)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - torch.cuda.memory_reserved(self.device))

    def __enter__(self) -> "CudaBudget":
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.limit is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            allowed = max(self.limit - self.outside_allocator(), 0)
            torch.cuda.set_per_process_memory_fraction(min(allowed / total, 1.0), self.device)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_reserved(self.device) + self.outside_allocator()
        torch.cuda.set_per_process_memory_fraction(self._previous_fraction, self.device)

    def reset_peak(self) -> None:
        """Start measuring the allocator's peak again."""
        torch.cuda.reset_peak_memory_stats(self.device)


def budget_for(device: torch.device, limit: int | None) -> CpuBudget | CudaBudget:
    """The budget enforcer for `device`: a context manager whose `.peak` is read after it exits."""
    if device.type == "cuda":
        return CudaBudget(limit, device)
    return CpuBudget(limit)
