"""Search: walk the levels of the decision tree, bisecting micro-batch sizes, probing as little as possible.

The walk, and its stop rule:
1. Levels (every knob but the micro-batch) are visited cheapest first (`Space.levels`).
2. Within a level, the largest fitting micro-batch is found by bisection over the sizes, starting at
   the largest. Known results bound it: a config that saves at least as much memory as a measured fit
   (same precision and attention, at least as much checkpointing, a smaller optimizer state, a
   micro-batch no larger) fits; one that needs at least as much as an OOM fails.
3. A config implied to fit by a measured fit is not probed: it only adds work to that fit (more
   recomputation, compressed optimizer states, smaller micro-batches), so it cannot be faster. It is
   recorded as skipped with that reason; so is the smallest size above a level's largest fit that an
   OOM of another config implies will fail.
4. An error ends its level (errors rarely depend on the micro-batch). The walk stops after `max_probes`
   probes; levels not visited are recorded as skipped with that reason.
Among the fits, the plan takes the highest measured throughput.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

from autofit.candidates import Space
from autofit.config import Config
from autofit.probe import ProbeResult, ProbeStatus, skipped
from autofit.trials import TrialStore

DEFAULT_MAX_PROBES = 40


class Progress(Protocol):
    """Receives the search's events (the CLI shows them)."""

    def starting(self, config: Config, why: str) -> None: ...

    def finished(self, result: ProbeResult) -> None: ...


class _Silent:
    def starting(self, config: Config, why: str) -> None:
        pass

    def finished(self, result: ProbeResult) -> None:
        pass


class Search:
    """One walk over a `Space`; `run()` returns every result in the order it was decided."""

    def __init__(self, space: Space, store: TrialStore, prober: Callable[[Config], ProbeResult],
                 max_probes: int = DEFAULT_MAX_PROBES, progress: Progress | None = None):
        self.space = space
        self.store = store
        self.prober = prober
        self.max_probes = max_probes
        self.progress = progress or _Silent()
        self.results: list[ProbeResult] = []
        self.probes_run = 0

    def run(self) -> list[ProbeResult]:
        """Walk every level; return all results (probed, stored and skipped)."""
        for level in self.space.levels():
            top = self.space.at(level, self.space.sizes[-1])
            if self.probes_run >= self.max_probes:
                self._add(skipped(top, f"probe budget of {self.max_probes} probes spent"))
                continue
            self._walk(level)
        return self.results

    # -- one level -------------------------------------------------------------------------------
    def _walk(self, level: Config) -> None:
        while self.probes_run < self.max_probes:
            status = {m: self._status(self.space.at(level, m)) for m in self.space.sizes}
            if any(r.status is ProbeStatus.ERROR for r in self._measured_at(level)):
                return
            lo = max((m for m, s in status.items() if s is ProbeStatus.FIT), default=0)
            hi = min((m for m, s in status.items() if s is ProbeStatus.OOM), default=math.inf)
            unknown = [m for m in self.space.sizes if lo < m < hi]
            if not unknown:
                self._note_implied(level, lo, hi)
                return
            first = lo == 0 and hi == math.inf
            size = unknown[-1] if first else unknown[len(unknown) // 2]
            self._probe(self.space.at(level, size),
                        "largest micro-batch first" if first else f"bisect between {lo or '-'} and {hi}")

    def _status(self, config: Config) -> ProbeStatus | None:
        """FIT or OOM when measured or implied by a measured result, else None."""
        for status in (ProbeStatus.FIT, ProbeStatus.OOM):
            try:
                self._cause(config, status)
                return status
            except LookupError:
                continue
        return None

    def _measured(self, config: Config) -> bool:
        return any(r.config == config and r.status is not ProbeStatus.SKIPPED for r in self.results)

    def _measured_at(self, level: Config) -> list[ProbeResult]:
        return [r for r in self.results if r.status is not ProbeStatus.SKIPPED
                and r.config.replace(micro_batch_size=level.micro_batch_size,
                                     grad_accum_steps=level.grad_accum_steps) == level]

    def _note_implied(self, level: Config, lo: int, hi: float) -> None:
        """Record the level's largest fit when a measured fit implies it, and its first certain failure."""
        for size, status in ((lo, ProbeStatus.FIT), (hi, ProbeStatus.OOM)):
            if size in (0, math.inf) or self._measured(self.space.at(level, int(size))):
                continue
            config = self.space.at(level, int(size))
            cause = self._cause(config, status)
            self._add(skipped(config, f"fits, but cannot be faster than {cause.describe()}: it only adds work"
                              if status is ProbeStatus.FIT else
                              f"certain to fail: {cause.describe()} already ran out of memory"))

    def _cause(self, config: Config, status: ProbeStatus) -> Config:
        """The measured result that implies `status` for `config`."""
        for result in self.results:
            if result.status is status and (
                    self.space.saves_at_least(config, result.config) if status is ProbeStatus.FIT
                    else self.space.saves_at_least(result.config, config)):
                return result.config
        raise LookupError(config)

    # -- recording -------------------------------------------------------------------------------
    def _probe(self, config: Config, why: str) -> None:
        stored = self.store.lookup(config)
        if stored is not None:
            self._add(stored)
            return
        self.progress.starting(config, why)
        result = self.prober(config)
        self.probes_run += 1
        self.store.record(result)
        self._add(result)

    def _add(self, result: ProbeResult) -> None:
        self.results.append(result)
        self.progress.finished(result)
