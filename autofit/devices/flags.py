"""The process-wide TF32 and cuDNN settings, read in one process and set in another (a probe's child or
rank takes its parent's, so in-process and launched probes compute alike and their throughputs compare).

torch >= 2.9 has a new API (`fp32_precision`) beside the legacy one; after a setting through the new API
the legacy getters raise (aten Context::allowTF32CuBLAS), so the new getters are read when they exist and
the other process sets the same family (torch/backends/__init__.py).
"""

from __future__ import annotations

from typing import Any

import torch

_NEW_API = {  # name -> (module, attribute) of the torch >= 2.9 precision settings, generic first
    "generic": ("backends", "fp32_precision"),
    "matmul": ("backends.cuda.matmul", "fp32_precision"),
    "conv": ("backends.cudnn.conv", "fp32_precision"),
    "rnn": ("backends.cudnn.rnn", "fp32_precision"),
}


def _owner(path: str) -> Any:
    owner: Any = torch
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner


def backend_flags() -> dict[str, Any]:
    """TF32 and cuDNN settings in force here, in a form `apply_backend_flags` sets elsewhere."""
    flags: dict[str, Any] = {"cudnn.benchmark": torch.backends.cudnn.benchmark,
                             "cudnn.deterministic": torch.backends.cudnn.deterministic,
                             "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                             "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled()}
    if all(hasattr(_owner(path), name) for path, name in _NEW_API.values()):
        flags["fp32_precision"] = {key: getattr(_owner(path), name) for key, (path, name) in _NEW_API.items()}
    else:  # torch < 2.9: the legacy flags are the only ones
        flags["matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        flags["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
    return flags


def without_tf32(flags: dict[str, Any]) -> dict[str, Any]:
    """`flags` (from `backend_flags`) with fp32 matmuls, convolutions and RNNs at full precision (no TF32), in
    the API family they were read with, for `apply_backend_flags`."""
    if "fp32_precision" in flags:
        return {**flags, "fp32_precision": {**flags["fp32_precision"], "matmul": "ieee", "conv": "ieee", "rnn": "ieee"}}
    return {**flags, "matmul.allow_tf32": False, "cudnn.allow_tf32": False}


def apply_backend_flags(flags: dict[str, Any]) -> None:
    """Set `flags` (from `backend_flags`) in this process, through the API family they were read with."""
    torch.backends.cudnn.benchmark = flags["cudnn.benchmark"]
    torch.backends.cudnn.deterministic = flags["cudnn.deterministic"]
    torch.use_deterministic_algorithms(flags["deterministic_algorithms"], warn_only=flags["deterministic_warn_only"])
    if "fp32_precision" in flags:
        _apply_precisions(flags["fp32_precision"])
    else:
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul.allow_tf32"]
        torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]


def _apply_precisions(wanted: dict[str, str]) -> None:
    """Set the new-API precisions that differ from this process's. A set through the new API makes the
    legacy getters raise here (the trap above), so matmul goes through the legacy setter when that maps
    exactly: `allow_tf32=True` is "tf32", False is "ieee" (torch/backends/cuda/__init__.py)."""
    for key, (path, name) in _NEW_API.items():
        value = wanted[key]
        if getattr(_owner(path), name) == value:
            continue
        if key == "matmul" and value in ("tf32", "ieee"):
            torch.backends.cuda.matmul.allow_tf32 = value == "tf32"
        else:
            setattr(_owner(path), name, value)
