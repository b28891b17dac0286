"""Host memory is part of fitting: what offloaded states and activations hold in a node's RAM.

A dry-run given the node's RAM (`host_memory`, per node) rules out the candidates that need more
(`over_host`); without it, a chosen plan needing more than a typical node of that GPU has is said in the
summary line (`host_note`), not only in the table's host RAM column. `autofit tune` checks this machine
before an offload probe (`offload_skip`, which the tuner's prober asks first).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.config import Config
    from autofit.job.train_spec import TrainSpec
    from autofit.probe.outcome import ProbeResult
    from autofit.strategies.base import Strategy
    from autofit.devices.gpus import GpuProfile
    from autofit.pipelines.dry_run import Candidate

# A node's RAM is about three times the memory of the GPUs it holds (a DGX H100: 2 TiB beside 8 x 80 GB), and
# a workstation's at least 64 GiB: a yardstick for saying a plan needs an unusual node, never a limit.
HOST_PER_GPU_MEMORY = 3
MIN_TYPICAL_HOST = 64 * 2**30
GPUS_PER_NODE = 8


def typical_host_bytes(gpu: "GpuProfile", num_gpus: int) -> int:
    """Bytes of RAM a typical node holding `num_gpus` (at most `GPUS_PER_NODE`) of `gpu` has."""
    return max(MIN_TYPICAL_HOST, HOST_PER_GPU_MEMORY * gpu.memory_bytes * min(num_gpus, GPUS_PER_NODE))


def over_host(candidates: list["Candidate"], host_memory: int | None) -> tuple[list["Candidate"], list["Candidate"]]:
    """`candidates` with each fit needing more host RAM per node than `host_memory` marked as not fitting
    (its verdict naming host memory), and those so marked; unchanged where `host_memory` is None."""
    if host_memory is None:
        return candidates, []
    out, excluded = [], []
    for candidate in candidates:
        need = candidate.estimate.cpu_bytes
        if candidate.fits and need > host_memory:
            candidate = dataclasses.replace(candidate, fits=False, verdict=(
                f"needs {format_size(need)} of host RAM per node for what it offloads, over the "
                f"{format_size(host_memory)} given (host_memory)"))
            excluded.append(candidate)
        out.append(candidate)
    return out, excluded


def host_shortfall(excluded: list["Candidate"], host_memory: int) -> str:
    """Why nothing fits where the GPU-fitting candidates were ruled out by host memory: the least they need."""
    least = min(excluded, key=lambda c: c.estimate.cpu_bytes)
    return (f"No candidate fits in {format_size(host_memory)} of host memory per node (host_memory): the ones that "
            f"fit the GPU offload states to host RAM, and the least of them needs {format_size(least.estimate.cpu_bytes)} "
            f"({least.config.describe()}). Give a node with more RAM (host_memory / --host-memory), more GPUs, or "
            "GPUs with more memory.")


def host_note(chosen: "Candidate", gpu: "GpuProfile", num_gpus: int) -> str:
    """A clause for the summary line where `chosen` needs more host RAM than a typical node of `gpu` has."""
    need, typical = chosen.estimate.cpu_bytes, typical_host_bytes(gpu, num_gpus)
    if need <= typical:
        return ""
    return (f"; note: it needs {format_size(need)} of host RAM per node for what it offloads, more than a typical "
            f"node with {min(num_gpus, GPUS_PER_NODE)} x {gpu.name} has (~{format_size(typical)}): give your node's "
            "RAM (host_memory / --host-memory) to plan within it")


def offload_skip(spec: "TrainSpec", config: "Config",
                 strategies: Sequence["Strategy"] = ()) -> "ProbeResult | None":
    """A SKIPPED result where this machine cannot hold an offload probe of `config` (`Strategy.host_room` of
    `strategies` and every other, on the estimator's predicted host RAM), else None; None too where the
    estimator cannot predict it (the probe then decides)."""
    from autofit.estimate.estimator import predict_peak
    from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip
    from autofit.strategies import completed

    @functools.cache
    def need() -> int | None:
        try:
            return predict_peak(spec, config).cpu_bytes
        except Exception:  # noqa: BLE001 - a prediction only spares a probe that cannot run
            return None

    room = next(filter(None, (s.host_room(config, need, spec.nvme_path) for s in completed(strategies))), None)
    if room is None:
        return None
    return ProbeResult(config, ProbeStatus.SKIPPED, f"not probed: {room}; free room, or plan for a larger machine "
                       "with autofit dry-run --host-memory", skip=Skip.EXCLUDED)
