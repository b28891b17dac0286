"""Exhaustive search: every level x every micro-batch size of the space autofit searches, each probed.

The oracle is what a patient person would get by trying everything: the best fitting throughput, and
how long that took. It probes exactly as autofit does (same `run_probe`, same child-process isolation
for the configs that need it), with no deadline and no skipping.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from autofit.plan import choose
from autofit.probe.launch import probe_placed
from autofit.probe.outcome import ProbeResult
from autofit.search.space import build_space
from autofit.job.train_spec import TrainSpec
from autofit.strategies import Strategy


@dataclasses.dataclass(frozen=True)
class Exhaustive:
    """Every candidate's probe result, and the wall time of the whole search (seconds)."""

    results: tuple[ProbeResult, ...]
    wall_s: float

    @property
    def best(self) -> ProbeResult | None:
        """The fit with the highest measured throughput (samples/s), or None when nothing fits."""
        return choose(self.results)

    def ranked(self, k: int) -> list[ProbeResult]:
        """The `k` fastest fits, fastest first."""
        fits = sorted((r for r in self.results if r.fits), key=lambda r: r.samples_per_s, reverse=True)
        return fits[:k]

    def counts(self) -> dict[str, int]:
        """How many candidates ended in each status."""
        out: dict[str, int] = {}
        for result in self.results:
            out[result.status.value] = out.get(result.status.value, 0) + 1
        return out


def exhaustive(spec: TrainSpec, strategies: Sequence[Strategy], timeout: float = 600.0) -> Exhaustive:
    """Probe every candidate of `build_space(spec, strategies)`, cheapest level first, smallest size first."""
    space = build_space(spec, strategies)
    start = time.perf_counter()
    results = []
    for level in space.levels():
        for size in space.sizes:
            config = space.at(level, size)
            results.append(probe_placed(spec, config, space.strategies, space.placement(config), timeout))
    return Exhaustive(tuple(results), time.perf_counter() - start)
