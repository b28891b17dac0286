"""Recognising out-of-memory errors of every kind, so that an OOM becomes a result, not a crash."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

from autofit.probe.outcome import OomKind

# (kind, substring of the message) for OOMs that arrive as plain RuntimeErrors (first match wins).
_MESSAGES = (
    # torch/utils/data/_utils/pin_memory.py wraps the error: "Caught RuntimeError in pin memory thread ..."
    (OomKind.HOST_PINNED, "in pin memory thread"),
    # c10_cuda_check_implementation: "CUDA error: " + cudaGetErrorString; also cudaHostAlloc of pinned
    # host memory (aten/src/ATen/cuda/CachingHostAllocator.cpp), which cannot be told apart by its text.
    (OomKind.CUDA_RUNTIME, "CUDA error: out of memory"),
    (OomKind.CUDA_DRIVER, "CUDA driver error: out of memory"),  # c10/cuda/driver_api.h: cuMemCreate, cuMemHostAlloc
    (OomKind.CUBLAS, "CUBLAS_STATUS_ALLOC_FAILED"),
    (OomKind.CUDNN, "CUDNN_STATUS_ALLOC_FAILED"),
    (OomKind.CUDNN, "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),  # cuDNN 9 (code 4004)
    (OomKind.CUDNN_HOST, "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"),  # cuDNN 9 (code 4003)
    (OomKind.CUDNN, "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"),
    (OomKind.CUDA_ALLOCATOR, "CUDA out of memory"),
    (OomKind.CPU_ALLOCATOR, "DefaultCPUAllocator: can't allocate memory"),
    (OomKind.CPU_ALLOCATOR, "DefaultCPUAllocator: not enough memory"),
)
# cublasCreate fails with NOT_INITIALIZED when there is no memory for the handle, and also after an
# earlier asynchronous error: an OOM only while the context still works (CublasHandlePool.cpp).
_CUBLAS_CREATE = "CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate"
# NCCL's DistBackendError (NCCLUtils.hpp C10D_NCCL_CHECK) carries NCCL's last error: an OOM only when it names one.
_NCCL_OOM = ("'out of memory'", "Failed to CUDA calloc")
# Errors that poison the CUDA context: every later CUDA call in the process fails the same way
# (c10/cuda/CUDAMiscFunctions.cpp lists them for the "asynchronously reported" suffix). Never an OOM.
STICKY = ("device-side assert triggered", "an illegal memory access was encountered", "unspecified launch failure",
          "an illegal instruction was encountered", "misaligned address")


def classify_oom(exc: BaseException) -> OomKind | None:
    """The kind of OOM `exc` is (CUDA_ALLOCATOR, CPU_BUDGET, CUBLAS, NCCL, ...), or None if it is not one."""
    if isinstance(exc, torch.OutOfMemoryError):
        return OomKind.CPU_BUDGET if getattr(exc, "autofit_cpu_budget", False) else OomKind.CUDA_ALLOCATOR
    if isinstance(exc, MemoryError):
        return OomKind.HOST
    if isinstance(exc, RuntimeError):
        kind = _runtime_kind(exc, str(exc))
        if kind is not None:
            return kind
    cause = exc.__cause__ or exc.__context__
    return classify_oom(cause) if cause is not None and cause is not exc else None


def _runtime_kind(exc: RuntimeError, message: str) -> OomKind | None:
    if sticky_error(exc) is not None:
        return None
    for kind, needle in _MESSAGES:
        if needle in message:
            return kind
    if _CUBLAS_CREATE in message:
        return OomKind.CUBLAS if _context_works() else None
    if _is_nccl_error(exc) and any(needle in message for needle in _NCCL_OOM):
        return OomKind.NCCL
    return None


def _is_nccl_error(exc: BaseException) -> bool:
    backend_error = getattr(torch.distributed, "DistBackendError", None) if torch.distributed.is_available() else None
    return backend_error is not None and isinstance(exc, backend_error)


def _context_works() -> bool:
    """Whether the CUDA context still answers (a sticky error makes every call fail)."""
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        return False
    return True


def sticky_error(exc: BaseException) -> str | None:
    """The first line of `exc` (or of its cause) when it is a sticky CUDA error, else None."""
    seen = 0
    while exc is not None and seen < 8:
        message = str(exc)
        if isinstance(exc, RuntimeError) and any(needle in message for needle in STICKY):
            return first_line(exc)
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and the first line of its message, for a one-line probe reason."""
    text = str(exc).strip().splitlines()
    message = text[0] if text else ""
    return f"{type(exc).__name__}: {message}"[:limit]


def error_site(exc: BaseException) -> str | None:
    """Where `exc` was raised in code that is neither torch's, autofit's nor Python's own (the user's model or
    loss, or a library such as transformers), as "file:line in function"; None when there is no such frame."""
    import sysconfig
    import traceback
    from pathlib import Path

    from autofit.version import PACKAGE

    paths = sysconfig.get_paths()
    libraries = (paths["purelib"], paths["platlib"])
    ours = (str(Path(torch.__file__).parent), str(PACKAGE))

    def foreign(name: str) -> bool:
        python_own = name.startswith(paths["stdlib"]) and not name.startswith(libraries)
        return not (python_own or name.startswith(ours))

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if foreign(f.filename)]
    if not frames:
        return None
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


@contextlib.contextmanager
def collecting_new_objects() -> Iterator[None]:
    """Within it, the garbage collector looks only at the objects made since it began: those alive before
    (the libraries', a notebook's) are frozen (`gc.freeze`, undone on leaving), so the full collection
    that returns a probe's memory (`release_memory`) costs what the probe made, not what the process
    holds (bench/measurements/probe_release.py: a small MLP's probe 0.03 s against 0.40 s in a process that built a
    transformers model; more in a long-lived one). A cycle the probe made is new whatever it references,
    so it is collected as before. Left as it is where the caller froze objects of its own (`gc.unfreeze`
    would thaw theirs too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def release_memory() -> None:
    """Return freed memory: collect reference cycles (tracebacks hold frames), free this thread's cuBLAS
    workspaces (allocated through the caching allocator, aten/src/ATen/cuda/CublasHandlePool.cpp
    getNewWorkspace; torch's own leak check clears them the same way) and empty CUDA's cache."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
