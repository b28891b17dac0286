"""What a launched probe process takes over from its parent, before it touches CUDA.

- **The device.** A probe for `cuda:N` on R ranks sees the cards N .. N+R-1 (of the parent's visible
  ones) as `cuda:0 .. cuda:R-1` through CUDA_VISIBLE_DEVICES, and rank r binds `cuda:r`. Engines bind
  LOCAL_RANK themselves (DeepSpeed `engine._set_distributed_vars` and `zero.Init` call
  `set_device(LOCAL_RANK)`; FSDP2 builds on `current_device()`, `_fsdp_init._get_device_from_mesh`),
  so restricting what is visible is what keeps a `cuda:1` probe off GPU 0.
- **A memory baseline.** The card's device-wide use, read from NVML before this process's CUDA context
  exists, so the probe is charged with its own context and not with its parent's
  (`autofit.probe.memory.note_baseline`).
- **The TF32 / cuDNN flags** in force in the parent, so in-process and launched probes compute alike
  and their throughputs compare. torch >= 2.9 has a new API (`fp32_precision`) beside the legacy one;
  after a setting through the new API the legacy getters raise (aten Context::allowTF32CuBLAS), so the
  new getters are read when they exist and the child sets the same family (torch/backends/__init__.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from autofit.probe import nvml
from autofit.probe.memory import note_baseline

if TYPE_CHECKING:
    from autofit.spec.train import TrainSpec


def parent_state(device: torch.device, world: int) -> dict[str, Any]:
    """Read in the parent: the flags in force, and for CUDA the cards the R ranks will see (their
    CUDA_VISIBLE_DEVICES entries and NVML addresses)."""
    state: dict[str, Any] = {"flags": backend_flags(), "cards": None}
    if device.type == "cuda":
        first = device.index or 0
        visible = _visible_entries()[first:first + world]
        buses = [nvml.bus_id(torch.device("cuda", first + rank)) for rank in range(world)]
        state["cards"] = {"visible": ",".join(visible), "buses": buses}
    return state


def adopt(state: dict[str, Any], spec: "TrainSpec", rank: int) -> "TrainSpec":
    """In the launched process, first thing: apply the parent's flags; for CUDA make the probe's cards
    the visible ones, take the memory baseline, bind `cuda:rank`. Returns the spec on that device."""
    apply_backend_flags(state["flags"])
    cards = state["cards"]
    if cards is None:
        return spec
    os.environ["CUDA_VISIBLE_DEVICES"] = cards["visible"]
    device = torch.device("cuda", rank)
    used = nvml.device_used(cards["buses"][rank])  # NVML makes no CUDA context
    if used is not None:
        note_baseline(device, used)
    torch.cuda.set_device(device)
    return dataclasses.replace(spec, device=device, resident_bytes=0)  # the user's tensors stay in the parent


def _visible_entries() -> list[str]:
    """The parent's visible cards as CUDA_VISIBLE_DEVICES entries (indexes or GPU-/MIG- UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(torch.cuda.device_count())]
    return [entry.strip() for entry in listed.split(",") if entry.strip()]


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
