"""Recognising out-of-memory errors of every kind, so that an OOM becomes a result, not a crash."""

from __future__ import annotations

import gc

import torch

# (kind, substring of the message) for OOMs that arrive as plain RuntimeErrors.
_MESSAGES = (
    ("cuda-runtime", "CUDA error: out of memory"),
    ("cublas", "CUBLAS_STATUS_ALLOC_FAILED"),
    ("cudnn", "CUDNN_STATUS_ALLOC_FAILED"),
    ("cudnn", "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"),
    ("cuda-allocator", "CUDA out of memory"),
    ("cpu-allocator", "DefaultCPUAllocator: can't allocate memory"),
    ("cpu-allocator", "DefaultCPUAllocator: not enough memory"),
)


def classify_oom(exc: BaseException) -> str | None:
    """The kind of OOM `exc` is ("cuda-allocator", "cpu-budget", "cublas", ...), or None if it is not one."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "cpu-budget" if getattr(exc, "autofit_cpu_budget", False) else "cuda-allocator"
    if isinstance(exc, MemoryError):
        return "host"
    if isinstance(exc, RuntimeError):
        message = str(exc)
        for kind, needle in _MESSAGES:
            if needle in message:
                return kind
    cause = exc.__cause__ or exc.__context__
    return classify_oom(cause) if cause is not None and cause is not exc else None


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and the first line of its message, for a one-line probe reason."""
    text = str(exc).strip().splitlines()
    message = text[0] if text else ""
    return f"{type(exc).__name__}: {message}"[:limit]


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
