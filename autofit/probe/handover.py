"""What a launched probe process takes over from its parent, before it touches CUDA.

- **The device.** A probe for `cuda:N` on R ranks sees the cards N .. N+R-1 (of the parent's visible
  ones) as `cuda:0 .. cuda:R-1` through CUDA_VISIBLE_DEVICES, and rank r binds `cuda:r`. Engines bind
  LOCAL_RANK themselves (DeepSpeed `engine._set_distributed_vars` and `zero.Init` call
  `set_device(LOCAL_RANK)`; FSDP2 builds on `current_device()`, `_fsdp_init._get_device_from_mesh`),
  so restricting what is visible is what keeps a `cuda:1` probe off GPU 0.
- **A memory baseline.** The card's device-wide use, read from NVML before this process's CUDA context
  exists, so the probe is charged with its own context and not with its parent's
  (`autofit.devices.memory.note_baseline`).
- **The TF32 / cuDNN flags** in force in the parent (`autofit.devices.flags`), so in-process and launched
  probes compute alike and their throughputs compare.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from autofit.devices import nvml
from autofit.devices.flags import apply_backend_flags, backend_flags
from autofit.devices.memory import note_baseline

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec


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


def check_state(state: Any) -> None:
    """`ValueError` unless `state` is what `parent_state` makes: {"flags": booleans and, on torch >= 2.9, the
    precisions by name; "cards": None, or the visible entries and one NVML address per rank}."""
    flags = state.get("flags") if isinstance(state, dict) else None
    cards = state.get("cards") if isinstance(state, dict) else None
    precisions = flags.get("fp32_precision", {}) if isinstance(flags, dict) else None
    if not (isinstance(flags, dict) and isinstance(precisions, dict)
            and all(type(v) is bool for k, v in flags.items() if k != "fp32_precision")
            and all(isinstance(v, str) for v in precisions.values())):
        raise ValueError("the parent's flags are not booleans and precision names")
    if cards is not None and not (isinstance(cards, dict) and isinstance(cards.get("visible"), str)
                                  and isinstance(cards.get("buses"), list)
                                  and all(b is None or isinstance(b, str) for b in cards["buses"])):
        raise ValueError("the parent's cards are not visible entries and NVML addresses")


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
