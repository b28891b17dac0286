"""Memory budgets enforced for real, and the peak a probe reached.

- CPU: every tensor storage created while the budget is active is counted (parameters and optimizer
  states included); going over raises `torch.OutOfMemoryError`, exactly as a card of that size would.
- CUDA: the caching allocator's per-process fraction caps what the allocator may reserve; the peak is
  the allocator's peak reservation plus what this process holds outside it (CUDA context, library
  workspaces), read per process from NVML (`autofit.devices.nvml`): other processes on the card are not
  charged.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from autofit.devices import nvml
from autofit.units import format_size


class DeadlinePassed(Exception):
    """A probe ran past its deadline: it is too slow to beat the best configuration found so far."""


class _Deadline:
    """Optional wall-clock deadline (time.perf_counter() seconds) shared by both budgets. A probe sets
    `allowance` (seconds) and the clock starts after its first step (`start_clock`): one-time setup
    (`deepspeed.initialize`, NCCL communicators, CPU-Adam builds) is not what makes it slow."""

    deadline: float | None = None
    allowance: float | None = None

    def start_clock(self) -> None:
        """Set the deadline `allowance` seconds from now, once (later calls leave it)."""
        if self.allowance is not None and self.deadline is None:
            self.deadline = time.perf_counter() + self.allowance

    def check_deadline(self) -> None:
        """Raise `DeadlinePassed` once the deadline has passed."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise DeadlinePassed("deadline passed")

    def timing(self) -> contextlib.AbstractContextManager:
        """Context for a probe's timed steps, once warm-up steps have reached the steady-state peak."""
        return contextlib.nullcontext()

    def after_step(self) -> None:
        """Called after each training step of a probe (the CUDA budget re-reads its context here)."""


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of every live tensor storage that operations create while it is active.

    Storages are tracked by weak reference, so the count falls when tensors die. An output that aliases
    an input (a view, an in-place or out= op) is no new memory: it is counted only when its storage is
    already tracked (picking up an in-place resize) — so views of tensors made outside, such as the
    `detach` of a user's parameter that `deepcopy` takes, cost nothing. `rounding` rounds every storage
    up as an allocator would. Subclasses react to growth in `_grew`.
    """

    rounding = 1

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._ignored: set[int] = set()

    def __enter__(self) -> "StorageCounter":
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        return super().__exit__(*exc_info)

    def resized(self, storage: Any) -> None:
        """A tracked storage changed size outside any op (`UntypedStorage.resize_`): count its new size."""
        if id(storage) in self._live:
            self._count(storage)

    def ignore(self, tensors: Any) -> None:
        """Never count the storages of `tensors`."""
        self._ignored.update(id(storage) for t in tensors for storage in storages_of(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:  # creates nothing; the autograd engine asks it of every tensor it sees
            return func(*args, **(kwargs or {}))
        self._before_op(func)
        # read before the op: an in-place op on a sparse tensor (autograd accumulating a sparse gradient,
        # `add_`) gives it new parts, which are new memory
        inputs = _input_storages(func, args, kwargs)
        out = self._run(func, args, kwargs)
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and self._counts(leaf):
                for storage in storages_of(leaf):
                    if id(storage) in self._live or id(storage) not in inputs:
                        self._count(storage)
        return out

    def _counts(self, tensor: torch.Tensor) -> bool:
        """Whether storages of `tensor`'s kind are counted (all, unless a subclass says otherwise)."""
        return True

    def _before_op(self, func: Any) -> None:
        """Called before every operation (`func`, an aten `OpOverload`)."""

    def _run(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """Run the operation (a subclass may give a kernel's outputs the size the real kernel's have)."""
        return func(*args, **(kwargs or {}))

    def _count(self, storage: Any) -> None:
        key = id(storage)
        if key in self._ignored:
            return
        nbytes = -(-storage.nbytes() // self.rounding) * self.rounding
        known = self._live.get(key)
        if known is not None and known[1] == nbytes:
            return
        if known is not None:
            self.current -= known[1]  # resized in place (out= ops)
        ref = known[0] if known else weakref.ref(storage, lambda _ref, key=key: self._forget(key))
        self._live[key] = (ref, nbytes)
        self.current += nbytes
        self._grew(nbytes)

    def _grew(self, nbytes: int) -> None:
        """Called after a storage of `nbytes` was counted."""

    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]


# `tensor.device` of a tensor subclass (fake tensors, DTensor) as a dispatched op: two dispatches in three
# of a simulated step, answered without the bookkeeping.
_DEVICE_QUERY = torch.ops.prim.device.default
_ALIASING: dict[Any, bool] = {}
_ACTIVE: list[StorageCounter] = []  # counters entered and not left, innermost last


def _resize_seen(original: Any) -> Any:
    """`UntypedStorage.resize_` that tells the active counters. FSDP2 frees a block's gathered parameters
    by resizing their storage to 0 bytes and re-allocates them the same way (torch/distributed/fsdp/
    _fully_shard/_fsdp_param.py, `free_storage`/`alloc_storage`), which no dispatched op shows: without
    this, every block's full parameters would stay counted after their reshard."""
    def resize_(storage: Any, size: int) -> Any:
        out = original(storage, size)
        for counter in tuple(_ACTIVE):
            counter.resized(storage)
        return out

    resize_.__wrapped__ = original  # type: ignore[attr-defined]
    return resize_


if not hasattr(torch.UntypedStorage.resize_, "__wrapped__"):
    torch.UntypedStorage.resize_ = _resize_seen(torch.UntypedStorage.resize_)  # type: ignore[method-assign]


def _input_storages(func: Any, args: Any, kwargs: Any) -> dict[int, Any]:
    """The input storages an op's outputs may alias, by id (empty for ops whose schema aliases nothing); held,
    so that no storage made by the op takes the id of one that died meanwhile (a sparse tensor's parts are
    read afresh each time)."""
    aliasing = _ALIASING.get(func)
    if aliasing is None:
        aliasing = _ALIASING[func] = any(r.alias_info is not None for r in func._schema.returns)
    if not aliasing:
        return {}
    return {id(storage): storage for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)
            for storage in storages_of(leaf)}


# A sparse tensor has no storage of its own: its parts do (torch/sparse: `_indices`/`_values` of COO,
# the compressed and plain indices and the values of CSR/CSC/BSR/BSC). An `nn.Embedding(sparse=True)`'s
# gradient is one: a recommendation model's tables trained with SGD or SparseAdam.
SPARSE_PARTS = {torch.sparse_coo: ("_indices", "_values"),
                **{layout: ("crow_indices", "col_indices", "values") for layout in (torch.sparse_csr, torch.sparse_bsr)},
                **{layout: ("ccol_indices", "row_indices", "values") for layout in (torch.sparse_csc, torch.sparse_bsc)}}


def storages_of(tensor: torch.Tensor) -> list[Any]:
    """The storages holding `tensor`'s data: its own; a DTensor's (FSDP2's sharded parameters) local shard's
    on this rank; a sparse tensor's parts'."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    parts = SPARSE_PARTS.get(tensor.layout)
    if parts is None:
        return [tensor.untyped_storage()]
    return [getattr(tensor, part)().untyped_storage() for part in parts]


class CpuBudget(_Deadline, StorageCounter):
    """Counts every CPU tensor storage created inside it (see `StorageCounter`) and enforces `limit`
    bytes: going over raises `torch.OutOfMemoryError`. `peak` is the most bytes live at once. The
    deadline, when set, is checked at every operation, so even one very slow step stops on time.

    Entered as a context manager: `with CpuBudget(limit) as budget: ...`.
    """

    def __init__(self, limit: int | None):
        super().__init__()
        self.limit = limit
        self.peak = 0

    def _counts(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def _before_op(self, func: Any) -> None:
        self.check_deadline()

    def timing(self) -> contextlib.AbstractContextManager:
        """Per-operation bookkeeping off: on the CPU it is a Python call per op, which for small models
        costs more than the arithmetic and would skew throughput. Storages freed meanwhile still
        leave the count; nothing new is counted."""
        return _disable_current_modes()

    def _grew(self, nbytes: int) -> None:
        if self.current > self.peak:
            self.peak = self.current
        if self.limit is not None and self.current > self.limit:
            raise _budget_oom(self.current, nbytes, self.limit)

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

    The per-process fraction bounds what the allocator reserves; what this process holds outside the
    allocator (its CUDA context, library workspaces, NCCL buffers) is measured (`outside_allocator`)
    and subtracted from the allocator's share, so the whole process stays within `limit`. Other
    processes on the card are not charged, nor `resident` bytes of the user's own tensors that were on
    the card before (a module given on the GPU). The fraction in force before is restored on exit.
    """

    def __init__(self, limit: int | None, device: torch.device, resident: int = 0):
        self.limit = limit
        # with its index: torch's `get_per_process_memory_fraction` refuses a bare "cuda"
        # (torch/cuda/_utils.py `_get_device_index(device)`, not optional)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.resident = resident
        self.peak = 0
        self._previous_fraction: float | None = None
        self._allowed = 0  # the allocator's share in force (bytes)
        self._floor = 0  # the allocated peak before the share last came down with the peak reset (bytes)

    def outside_allocator(self) -> int:
        """Bytes this process holds on the card beyond its allocator's reservation (context, workspaces)."""
        return outside_allocator(self.device)

    def __enter__(self) -> "CudaBudget":
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.limit is not None:
            self._previous_fraction = _fraction(self.device)
            self._share(self._allowed_now())
        return self

    def after_step(self) -> None:
        """Bring the allocator's share down to what the limit leaves now, where this process holds more
        outside the allocator than on entry. A fresh process's CUDA context grows through its first steps:
        cuBLAS makes its handle at the first matmul (aten/src/ATen/cuda/CublasHandlePool.cpp), and CUDA loads
        each kernel's module at its first launch (lazy loading, CUDA's default from 12.2; CUDA C++
        Programming Guide, "Lazy Loading"). On an H200 by 130 MiB or more, inferred from
        bench/README.md#fit-threshold: the share set on entry let
        allocator and context together pass the limit, and the probe failed where a card of that size
        would have made the allocator free its cache and retry. Where the allocator reserved more
        than the new share, its cache is emptied and its peak counts again from here, the allocated peak
        so far kept as a floor."""
        if self.limit is None:
            return
        allowed = self._allowed_now()
        if allowed >= self._allowed:
            return
        self._share(allowed)
        if torch.cuda.max_memory_reserved(self.device) > allowed:
            self._floor = max(self._floor, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def _allowed_now(self) -> int:
        """The allocator's bytes under the limit (set): what this process holds outside it is not theirs."""
        return max(self.limit - self.outside_allocator() + self.resident, 0)  # type: ignore[operator]

    def _share(self, allowed: int) -> None:
        """Cap the allocator at `allowed` bytes (the per-process fraction of the card's memory)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(allowed / total, 1.0), self.device)
        self._allowed = allowed

    def __exit__(self, *exc_info: Any) -> None:
        try:
            torch.cuda.synchronize(self.device)
            allocator = max(torch.cuda.max_memory_reserved(self.device), self._floor)
            self.peak = max(allocator + self.outside_allocator() - self.resident, 0)
        finally:
            if self._previous_fraction is not None:
                torch.cuda.set_per_process_memory_fraction(self._previous_fraction, self.device)
                self._previous_fraction = None

    def reset_peak(self) -> None:
        """Start measuring the allocator's peak again."""
        torch.cuda.reset_peak_memory_stats(self.device)


def _fraction(device: torch.device) -> float:
    """The per-process fraction in force on `device` (1.0 when unset); torch < 2.6 has no getter
    (`get_per_process_memory_fraction`, pytorch/pytorch#140620), and there it is taken as 1.0."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return float(getter(device)) if getter is not None else 1.0


# device index -> device-wide bytes used that are not charged to this process: taken before its CUDA
# context existed (a launched child, `note_baseline`), or else at its first reading (context included).
_BASELINES: dict[int, int] = {}
_BEFORE_CONTEXT: set[int] = set()  # device indexes whose baseline was taken before the context


def note_baseline(device: torch.device, used: int) -> None:
    """Record `used`, the card's device-wide bytes in use before this process made its CUDA context, so
    that what it adds later (context included) is charged to it and nothing else is."""
    _BASELINES[device.index or 0] = used
    _BEFORE_CONTEXT.add(device.index or 0)


_LEFT_BEHIND: dict[int, int] = {}  # device index -> bytes probes in this process left allocated there


def note_left_behind(device: torch.device, left: int) -> None:
    """Record `left` bytes a probe left allocated on `device` after releasing everything it held."""
    _LEFT_BEHIND[device.index or 0] = memory_left_behind(device) + left


def memory_left_behind(device: torch.device) -> int:
    """Bytes earlier probes in this process left allocated on `device` (0: it measures as a fresh one)."""
    return _LEFT_BEHIND.get(device.index or 0, 0) if device.type == "cuda" else 0


def forget_baselines() -> None:
    """Forget every baseline and what probes left behind, and look for NVML afresh (a test double swapping
    the runtime; a new process)."""
    _BASELINES.clear()
    _BEFORE_CONTEXT.clear()
    _LEFT_BEHIND.clear()
    nvml.forget()


def _device_used(device: torch.device, bus: str | None) -> int:
    used = nvml.device_used(bus)
    if used is None:
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    return used


def outside_allocator(device: torch.device) -> int:
    """Bytes this process holds on `device` beyond its caching allocator's reservation.

    NVML's reading for this pid when it has one (exact). Otherwise the growth of the device-wide use over
    the baseline (`note_baseline`, or this process's first reading, whose CUDA context is then not
    counted): other processes are assumed steady meanwhile. `accounting(device)` says which applies.
    """
    reserved = torch.cuda.memory_reserved(device)
    bus = nvml.bus_id(device)
    own = nvml.process_used(bus)
    if own is not None:
        return max(0, own - reserved)
    used = _device_used(device, bus)
    baseline = _BASELINES.setdefault(device.index or 0, used - reserved)
    return max(0, used - baseline - reserved)


def accounting(device: torch.device) -> str:
    """How `outside_allocator(device)` measures this process: one line for the plan's spec summary."""
    bus = nvml.bus_id(device)
    if nvml.process_used(bus) is not None:
        return "this process's own memory (NVML)"
    if (device.index or 0) in _BEFORE_CONTEXT:
        return "device-wide growth since before this process's CUDA context (NVML does not list this pid)"
    why = "NVML does not list this pid" if nvml.device_used(bus) is not None else \
        "install nvidia-ml-py to measure it: pip install 'autofit[gpu]'"
    return f"device-wide growth since this process first looked; its CUDA context is not counted ({why})"


def foreign_memory(device: torch.device) -> int | None:
    """Bytes other processes hold on `device` (NVML), or None when NVML cannot tell them from this one."""
    bus = nvml.bus_id(device)
    own, used = nvml.process_used(bus), nvml.device_used(bus)
    if own is None or used is None:
        return None
    return max(0, used - own)


Budget = CpuBudget | CudaBudget


def budget_for(device: torch.device, limit: int | None, resident: int = 0) -> Budget:
    """The budget enforcer for `device`: a context manager whose `.peak` is read after it exits.
    `resident`: bytes of the user's tensors already on a CUDA `device`, not charged (`CudaBudget`)."""
    if device.type == "cuda":
        return CudaBudget(limit, device, resident)
    return CpuBudget(limit)
