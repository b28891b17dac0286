"""GPU profiles for planning without the card: memory, bf16 support, peak TFLOP/s, link bandwidths, the
common node type; and the networks between nodes.

The figures are data (`autofit/data/gpus.json`, `autofit/data/networks.json`, sources in their `_comment`);
`autofit gpus` lists them and `autofit dry-run --gpu NAME [--nodes N --node-network NAME]` plans against
them. `--gpu-memory` overrides the memory of any profile, `--inter-node-gbps` any network's bandwidth.
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


# A torch dtype's name -> the rate `GpuProfile.tflops` reads for compute in it (fp32: the rest).
DTYPE_RATES = {"bfloat16": "bf16", "float16": "fp16"}


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
    interconnect_gbps: float  # GPU <-> GPU per GPU within a node (NVLink, else PCIe): what ZeRO communicates over
    aliases: tuple[str, ...] = ()
    node_gpus: int | None = None  # GPUs on the common node type (an HGX board: 8); None where there is none
    node_network: str | None = None  # the network such nodes ship with (a `NetworkProfile` name)

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
        node = e.get("node") or {}
        profiles[name] = GpuProfile(name, e["display"], e["memory_mib"] * MIB, e["bf16"], e["bf16_tflops"],
                                    e["fp16_tflops"], e["fp32_tflops"], e["pcie_gbps"], e["interconnect_gbps"],
                                    tuple(e.get("aliases", ())), node.get("gpus"), node.get("network"))
    return profiles


@dataclasses.dataclass(frozen=True)
class NetworkProfile:
    """A network between nodes, as vendors state it: Gb/s (10^9 bit/s) per direction, either a NIC per GPU
    (`per_gpu`: rail-optimised fabrics, each GPU sends over its own) or one link the node's GPUs share."""

    name: str
    display: str
    gbit: float  # Gb/s of one NIC (per GPU) or of the node's link (shared)
    per_gpu: bool
    aliases: tuple[str, ...] = ()

    def gbps_per_gpu(self, gpus_per_node: int) -> float:
        """GB/s (10^9 B/s) each GPU can send across nodes when `gpus_per_node` GPUs share the node."""
        return self.gbit / 8 / (1 if self.per_gpu else max(gpus_per_node, 1))


@functools.lru_cache(maxsize=1)
def _networks() -> dict[str, NetworkProfile]:
    text = resources.files("autofit").joinpath("data/networks.json").read_text(encoding="utf-8")
    networks = {}
    for name, e in json.loads(text).items():
        if name.startswith("_"):
            continue
        speeds = [(key, e[key]) for key in ("gbit_per_gpu", "gbit_per_node") if key in e]
        if len(speeds) != 1 or not isinstance(speeds[0][1], (int, float)) or speeds[0][1] <= 0:
            raise ValueError(f"networks.json: {name!r} needs one positive gbit_per_gpu or gbit_per_node, got {e!r}")
        key, gbit = speeds[0]
        networks[name] = NetworkProfile(name, e["display"], float(gbit), key == "gbit_per_gpu",
                                        tuple(e.get("aliases", ())))
    return networks


def list_networks() -> list[NetworkProfile]:
    """Every network profile, fastest per GPU first (on 8-GPU nodes)."""
    return sorted(_networks().values(), key=lambda n: (-n.gbps_per_gpu(8), n.name))


def get_network(name: str) -> NetworkProfile:
    """The network called `name` or one of its aliases (any case); `UsageError` listing them otherwise."""
    key = _key(name)
    for network in _networks().values():
        if key == network.name or key in network.aliases:
            return network
    close = difflib.get_close_matches(key, [n for p in _networks().values() for n in (p.name, *p.aliases)], n=3)
    hint = f"Did you mean {', '.join(close)}? " if close else ""
    raise UsageError(f"Unknown node network {name!r}. {hint}Known networks: {', '.join(sorted(_networks()))} "
                     "(autofit gpus lists them); for any other pass --inter-node-gbps, the GB/s each GPU sends "
                     "across nodes (a 400 Gb/s NIC per GPU: 50).")


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a plan's GPUs are: `nodes` machines of `per_node` GPUs, each GPU sending `inter_node_gbps` GB/s
    across nodes (None on one node) over `network` (its description)."""

    nodes: int
    per_node: int
    inter_node_gbps: float | None = None
    network: str = ""

    @property
    def count(self) -> int:
        """GPUs over every node."""
        return self.nodes * self.per_node


def layout(profile: GpuProfile, count: int | None, nodes: int | None = None, gpus_per_node: int | None = None,
           node_network: str | None = None, inter_node_gbps: float | None = None) -> Layout:
    """The nodes, GPUs per node and network that `count` GPUs (None: not given) and the node options say
    together; what is left out comes from the others, then from the profile's common node type (`node_gpus`,
    `node_network`). `UsageError` naming the options where they disagree or leave the node size unknown."""
    from autofit.errors import Param

    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("inter_node_gbps", inter_node_gbps)):
        if value is not None and (isinstance(value, bool) or not value > 0):
            raise UsageError("{given} must be positive.", given=Param(name, value))
    if nodes is None and gpus_per_node is None:
        if node_network is not None or inter_node_gbps is not None:
            raise UsageError("{network} describes the links between nodes, but the plan has one node: pass {nodes} "
                             "(and {per_node}) for several.", network=Param("node_network" if node_network else
                             "inter_node_gbps", node_network or inter_node_gbps), nodes=Param("nodes"),
                             per_node=Param("gpus_per_node"))
        return Layout(1, count or 1)
    if nodes is None:
        nodes = max((count or gpus_per_node) // gpus_per_node, 1)
    if gpus_per_node is None and count is not None and count % nodes:
        raise UsageError("{count} over {nodes}: every node has as many GPUs, so the count must be a multiple of the "
                         "nodes; give a multiple, or {per_node} instead of the count.", count=Param("num_gpus", count),
                         nodes=Param("nodes", nodes), per_node=Param("gpus_per_node"))
    per_node = gpus_per_node or (count // nodes if count else profile.node_gpus)
    if per_node is None:
        raise UsageError("{nodes} of {gpu}, which has no common node type: pass {per_node} (or {count}).",
                         nodes=Param("nodes", nodes), gpu=profile.name, per_node=Param("gpus_per_node"),
                         count=Param("num_gpus"))
    if count is not None and count != nodes * per_node:
        raise UsageError("{count} is not {nodes} x {per_node} GPUs ({total}): give two of the three.",
                         count=Param("num_gpus", count), nodes=Param("nodes", nodes),
                         per_node=Param("gpus_per_node", per_node), total=str(nodes * per_node))
    if nodes == 1:
        return Layout(1, per_node)
    if inter_node_gbps is not None:
        return Layout(nodes, per_node, float(inter_node_gbps), f"{inter_node_gbps:g} GB/s per GPU across nodes")
    name = node_network or profile.node_network
    if name is None:
        raise UsageError("{nodes} of {gpu}: name the network between them, {network} (autofit gpus lists them) or "
                         "{gbps}, the GB/s each GPU sends across nodes.", nodes=Param("nodes", nodes), gpu=profile.name,
                         network=Param("node_network"), gbps=Param("inter_node_gbps"))
    network = get_network(name)
    return Layout(nodes, per_node, network.gbps_per_gpu(per_node), network.display)
