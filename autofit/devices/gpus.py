"""GPU profiles for planning without the card: memory, bf16 support, peak TFLOP/s, link bandwidths.

The figures are data (`autofit/data/gpus.json`, sources in its `_comment`); `autofit gpus` lists them and
`autofit dry-run --gpu NAME` plans against one. `--gpu-memory` overrides the memory of any profile.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from importlib import resources

from autofit.errors import UsageError

MIB = 1024**2


@dataclasses.dataclass(frozen=True)
class GpuProfile:
    """One GPU model. Memory in bytes, compute in TFLOP/s (10^12 FLOP/s), bandwidths in GB/s (10^9 B/s)."""

    name: str  # the profile's key, e.g. "a100-80gb"
    display: str  # what the driver calls it
    memory_bytes: int  # total device memory
    bf16: bool  # whether bf16 autocast runs (Ampere and later)
    bf16_tflops: float | None  # peak dense tensor-core bf16, None where unsupported
    fp16_tflops: float  # peak dense tensor-core fp16
    fp32_tflops: float  # peak fp32 without TF32
    pcie_gbps: float  # host <-> device, per direction: what CPU offload moves states over
    interconnect_gbps: float  # GPU <-> GPU per GPU (NVLink, else PCIe): what ZeRO communicates over
    aliases: tuple[str, ...] = ()

    def tflops(self, precision: str) -> float:
        """Peak TFLOP/s for compute in `precision` ("fp32", "bf16", "fp16")."""
        if precision == "bf16" and self.bf16_tflops:
            return self.bf16_tflops
        if precision in ("bf16", "fp16"):
            return self.fp16_tflops
        return self.fp32_tflops

    def with_memory(self, memory_bytes: int) -> "GpuProfile":
        """This profile with another memory size (`--gpu-memory`)."""
        return dataclasses.replace(self, memory_bytes=memory_bytes)


@functools.lru_cache(maxsize=1)
def _profiles() -> dict[str, GpuProfile]:
    text = resources.files("autofit").joinpath("data/gpus.json").read_text(encoding="utf-8")
    profiles = {}
    for name, e in json.loads(text).items():
        if name.startswith("_"):
            continue
        profiles[name] = GpuProfile(name, e["display"], e["memory_mib"] * MIB, e["bf16"], e["bf16_tflops"],
                                    e["fp16_tflops"], e["fp32_tflops"], e["pcie_gbps"], e["interconnect_gbps"],
                                    tuple(e.get("aliases", ())))
    return profiles


def list_gpus() -> list[GpuProfile]:
    """Every profile, largest memory first."""
    return sorted(_profiles().values(), key=lambda g: (-g.memory_bytes, g.name))


def _key(name: str) -> str:
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


_COUNTED = re.compile(r"^\s*(\d+)\s*[x×*]\s*(\S.*)$", re.IGNORECASE)
_COUNT_AFTER = re.compile(r"^\s*(\S.*?)\s*[x×*]\s*(\d+)\s*$", re.IGNORECASE)


def split_count(name: str) -> tuple[int | None, str]:
    """A GPU written with its count, as people write a machine ("8xa100-40gb", "8×A100-40GB", "2 x h100",
    or after it, "h100x8"): (8, "a100-40gb"); the count is read on the side where the rest names a GPU
    ("4090x2" is two RTX 4090s; "rtx4090" no count). A plain name: (None, name)."""
    before, after = _COUNTED.match(str(name)), _COUNT_AFTER.match(str(name))
    if before and _find(before.group(2)) is not None:
        return int(before.group(1)), before.group(2)
    if after and _find(after.group(1)) is not None:
        return int(after.group(2)), after.group(1)
    return (int(before.group(1)), before.group(2)) if before else (None, name)


def other_sizes(name: str) -> list[str]:
    """The other profiles of the family an alias such as "a100" names (["a100-80gb"] when it reads as
    a100-40gb): empty for a profile's own name and for an alias of one card."""
    name = split_count(name)[1]
    key, chosen = _key(name), get_gpu(name)
    if key == chosen.name:
        return []
    return [p.name for p in list_gpus() if p is not chosen and p.name.startswith(key + "-")]


def get_gpu(name: str) -> GpuProfile:
    """The profile called `name` or one of its aliases (any case, hyphens optional: "h100sxm" reads as
    h100-sxm where one profile answers to it; the memory's unit left out, "a100-80" for a100-80gb);
    `UsageError` listing the profiles otherwise."""
    found = _find(name)
    if found is not None:
        return found
    key = _key(name)
    spellings = [n for p in _profiles().values() for n in (p.name, *p.aliases)]
    close = [n for n in difflib.get_close_matches(key, spellings, n=3, cutoff=0.6) if n[0] == key[:1]]  # a family
    hint = f"Did you mean {', '.join(close)}? " if close else ""
    raise UsageError(f"Unknown GPU {name!r}. {hint}Known GPUs: {', '.join(sorted(_profiles()))} "
                     "(autofit gpus lists them); for any other card pass --gpu-memory, e.g. --gpu-memory 20GiB.")


def _find(name: str) -> GpuProfile | None:
    """The one profile `name` spells: a name or alias, its hyphens optional, its memory's unit too."""
    key = _key(name)
    for profile in _profiles().values():
        if key == profile.name or key in profile.aliases:
            return profile
    bare = key.replace("-", "")
    for unit in ("", "g", "gb"):
        found = {p.name: p for p in _profiles().values()
                 if any(n.replace("-", "") == bare + unit for n in (p.name, *p.aliases))}
        if len(found) == 1:
            return found.popitem()[1]
    return None
