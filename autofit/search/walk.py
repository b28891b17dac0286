"""Search: walk the levels of the decision tree, bisecting micro-batch sizes, probing as little as possible.

The walk, and its stop rule:
1. Levels (every knob but the micro-batch) are visited cheapest first (`Space.levels`).
2. Within a level, the largest fitting micro-batch is found by bisection over the sizes, starting at
   the largest (or at the smallest, when a config it only saves more than already failed there). Known
   results bound it: a config that saves at least as much memory as a measured fit
   (same precision and attention, at least as much checkpointing, a smaller optimizer state, a
   micro-batch no larger) fits; one that needs at least as much as an OOM fails.
   An OOM where no activation was live (building the model and engine, or the optimizer step) is a
   fixed cost: it bounds every config of that engine and stage whose model states hold no less, at any
   micro-batch, checkpointing and attention, so the search does not learn the same fixed cost again. So is
   a complete peak over the limit that does not shrink with the micro-batch (`fixed_peak`: two of one
   level whose line still reaches micro-batch 0 over the limit).
3. A config implied to fit by a measured fit is not probed: it only adds work to that fit (more
   recomputation, compressed optimizer states, smaller micro-batches), so it cannot be faster. It is
   recorded as skipped with that reason; so is the smallest size above a level's largest fit that an
   OOM of another config implies will fail.
4. Once something fits, every probe gets a deadline: at less than half the best throughput so far of the
   fits that change the arithmetic no more than it does, it cannot win, so it is stopped (at its deadline,
   or as soon as its pace shows it cannot meet it) and recorded as pruned (a numerics change's figure
   never stops an exact probe: they are compared re-measured).
   Whatever only adds work to a too-slow config is not probed either (bf16 on a CPU without bf16 units,
   offload, ...), at up to twice its micro-batch too: a micro-step of more samples takes no less time, so
   doubling the micro-batch at most doubles samples/s, which leaves it under the best.
5. With a predictor (the dry-run estimator), a level starts at the largest micro-batch predicted to
   fit, and a config predicted over the fit limit by more than the estimator's measured error is not
   probed: it is recorded as skipped with its prediction, and bounds the bisection like an OOM.
6. An error or a too-slow probe ends its level. The walk stops after `max_probes` probes; levels not
   visited are recorded as skipped with that reason. When the first probes fail with one and the same
   error on two levels, before anything fitted or ran out of memory, the fault is the user's model, batch
   or loss, not a knob: the walk stops with a `UsageError` quoting it. After a fit, an error two levels
   met alike is laid to the knob values they share that no level which ran without error had (`Lesson`:
   pure bf16 meeting an fp32 tensor the model makes, op-level checkpointing a model it cannot replay): every
   later level with those values is certain to fail the same way and is recorded as skipped, not probed,
   the lesson told to the listener once.
Among the fits, the plan takes the highest measured throughput.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import re
from typing import Callable, Sequence

import torch

from autofit.config import Config
from autofit.errors import UsageError
from autofit.search.decision import choose
from autofit.probe.outcome import OomKind, ProbeResult, ProbeStatus, Skip, Source, decided
# the listeners moved to their own module; these names are imported from here too (autofit.cli.tune)
from autofit.search.progress import (QUIET_SKIPS, SKIP_WORDS, Heartbeat, PrintedProgress, Progress,  # noqa: F401
                                     SkipTally, make_progress, skip_counts)
from autofit.search.space import Space
from autofit.search.trials import TrialStore
from autofit.strategies import completed
from autofit.strategies.base import Strategy
from autofit.units import format_size

DEFAULT_MAX_PROBES = 40
USER_ERROR_PROBES = 2  # the first probes failing alike on this many levels: the user's code is at fault
WIN_FRACTION = 0.5  # a probe slower than this fraction of the best throughput so far is stopped
# Allowed beyond the most the predictor over-predicted this search's complete peaks (`Search._tolerance`):
# what one configuration's error may differ from its neighbours' (the estimator's errors on one model go
# together: -2.0% .. +4.2% over the 2-rank scenario's 14 probed peaks, bench/results/sharded-cpu-*.json)
LEARNED_SLACK = 0.03


def activation_knobs() -> tuple[str, ...]:
    """The knobs that change only activation memory (`Strategy.activation_knobs` of every strategy): an OOM
    where no activation was live bounds every value of them."""
    return tuple(name for strategy in completed() for name in strategy.activation_knobs)


# 16-bit dtypes as torch names them in its errors (`"addmm" not implemented for 'Half'`)
DTYPE_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Half"}


class Verdict(enum.Enum):
    """What the measured results imply for a config not run (the walk's own bookkeeping)."""

    FIT = "fit"  # a measured fit saves no more memory than it: it fits
    FAIL = "fail"  # it needs at least what an OOM (measured or predicted) needed: it fails
    SLOW = "slow"  # it only adds work to a pruned (too slow) config: it cannot win


class Search:
    """One walk over a `Space`; `run()` returns every result in the order it was decided."""

    def __init__(self, space: Space, store: TrialStore, prober: Callable[[Config, float | None], ProbeResult],
                 max_probes: int = DEFAULT_MAX_PROBES, progress: Progress | bool | None = None,
                 predictor: Callable[[Config], int | None] | None = None,
                 tolerance: float | Callable[[Config], float] = 0.0):
        """`predictor(config)` returns a predicted peak in bytes (or None); a config predicted over the
        fit limit by more than `tolerance` (the predictor's measured relative error, or a function of
        the config giving it) is not probed."""
        self.space = space
        self.store = store
        self.prober = prober
        self.max_probes = max_probes
        self.progress = make_progress(progress)
        self.predictor = predictor
        self.tolerance = tolerance
        self.results: list[ProbeResult] = []
        self.probes_run = 0
        self._fixed: tuple[int, list[ProbeResult]] = (-1, [])  # `_fixed_peaks`, as of a result count
        self._predicted: dict[Config, int | None] = {}  # the predictor's bytes per config asked
        self._said: set[tuple[tuple[str, object], ...]] = set()  # the lessons told to the listener

    def run(self) -> list[ProbeResult]:
        """Walk every level; return all results (probed, stored and decided)."""
        for level in self.space.levels():
            top = self.space.at(level, self.space.sizes_at(level)[-1])
            if self.probes_run >= self.max_probes:
                self._add(decided(top, Skip.BUDGET, f"probe budget of {self.max_probes} probes spent"))
                continue
            lesson = self._same_error(level)
            if lesson is not None:
                self._learned(lesson)
                self._add(decided(top, Skip.IMPLIED, lesson.words))
                continue
            self._walk(level)
        return self.results

    # -- one level -------------------------------------------------------------------------------
    def _walk(self, level: Config) -> None:
        sizes = self.space.sizes_at(level)
        while self.probes_run < self.max_probes:
            verdicts = {m: self._verdict(self.space.at(level, m)) for m in sizes}
            if any(r.status in (ProbeStatus.ERROR, ProbeStatus.PRUNED) for r in self._measured_at(level)):
                return
            lo = max((m for m, v in verdicts.items() if v is Verdict.FIT), default=0)
            hi = min((m for m, v in verdicts.items() if v is Verdict.FAIL), default=math.inf)
            unknown = [m for m in sizes if lo < m < hi and verdicts[m] is None]
            if not unknown:
                self._note_implied(level, lo, hi)
                return
            if lo or hi != math.inf:
                size, why = unknown[len(unknown) // 2], f"bisect between {lo or '-'} and {hi}"
            else:
                size, why = self._start(level, unknown)
            self._probe(self.space.at(level, size), why)

    def _start(self, level: Config, unknown: list[int]) -> tuple[int, str]:
        """Where a level with no known bound starts: the largest micro-batch predicted to fit; without a
        predictor, the largest, or the smallest when a config it saves more than already ran out of
        memory there (its frontier is likely low too)."""
        if self.predictor is not None:  # from the largest down: a size under the first that may fit is not predicted
            largest = next((m for m in reversed(unknown) if not self._over(self.space.at(level, m))), None)
            if largest is None:
                return unknown[0], "smallest micro-batch: none is predicted to fit"
            if self._predict(self.space.at(level, largest)) is None:
                return largest, "largest micro-batch first: the estimator could not simulate this step"
            return largest, "largest micro-batch predicted to fit"
        smallest = self.space.at(level, unknown[0])
        for result in self.results:
            if result.status is ProbeStatus.OOM and result.config.micro_batch_size == unknown[0] \
                    and self.space.saves_at_least(smallest, result.config):
                return unknown[0], f"smallest micro-batch first: {result.config.describe()} ran out of memory there"
        return unknown[-1], "largest micro-batch first"

    def _verdict(self, config: Config) -> Verdict | None:
        """What measured (or predicted) results imply for `config`, or None."""
        return next((v for v in Verdict if self._cause(config, v) is not None), None)

    def _measured_at(self, level: Config) -> list[ProbeResult]:
        return [r for r in self.results if r.measured
                and r.config.replace(micro_batch_size=level.micro_batch_size,
                                     grad_accum_steps=level.grad_accum_steps) == level]

    def _note_implied(self, level: Config, lo: int, hi: float) -> None:
        """Record what the level was decided by without probing: its largest fit or, failing that, its
        largest size implied too slow; and its first certain failure."""
        slow = max((m for m in self.space.sizes_at(level)
                    if m < hi and self._verdict(self.space.at(level, m)) is Verdict.SLOW), default=0)
        notes = ((lo, Verdict.FIT, "fits, but cannot be faster than {}: it only adds work"),
                 (0 if lo else slow, Verdict.SLOW, "cannot win: it only adds work to {}, which was too slow"),
                 (hi, Verdict.FAIL, "certain to fail: {} already ran out of memory"))
        for size, verdict, template in notes:
            config = self.space.at(level, int(size)) if size not in (0, math.inf) else None
            if config is not None and not any(r.config == config for r in self.results):
                cause = self._cause(config, verdict)
                if verdict is Verdict.SLOW and cause.micro_batch_size < config.micro_batch_size:
                    template = ("cannot win: {} was too slow, and this adds work to it at no more than "
                                f"{1 / WIN_FRACTION:g}x its micro-batch (at most {1 / WIN_FRACTION:g}x its samples/s)")
                self._add(decided(config, Skip.IMPLIED, template.format(cause.describe())))

    def _cause(self, config: Config, verdict: Verdict) -> Config | None:
        """The result's config that implies `verdict` for `config`, or None."""
        for result in self.results:
            if verdict is Verdict.FAIL:
                failed = (result.measured and result.status is ProbeStatus.OOM) or result.skip is Skip.PREDICTED
                if failed and self.space.saves_at_least(result.config, config):
                    return result.config
                fixed = result.fixed_cost or result in self._fixed_peaks()
                if result.measured and fixed and self._holds_no_less(config, result.config):
                    return result.config
            elif result.measured and result.status is _IMPLIES[verdict] \
                    and self.space.saves_at_least(config, result.config):
                return result.config
            elif verdict is Verdict.SLOW and result.measured and result.status is ProbeStatus.PRUNED \
                    and self._outrun(config, result.config):
                return result.config
        return None

    def _outrun(self, config: Config, pruned: Config) -> bool:
        """Whether `config` cannot win because `pruned` (stopped at under WIN_FRACTION of the best throughput)
        was too slow: at `pruned`'s micro-batch it only adds work, and its own micro-batch is at most
        1 / WIN_FRACTION times larger. A micro-step of more samples takes no less time, so samples/s grow at
        most as the micro-batch does: under WIN_FRACTION of the best, times at most 1 / WIN_FRACTION."""
        size = config.micro_batch_size
        aligned = config.replace(micro_batch_size=pruned.micro_batch_size, grad_accum_steps=pruned.grad_accum_steps)
        return size > pruned.micro_batch_size and size * WIN_FRACTION <= pruned.micro_batch_size \
            and self.space.saves_at_least(aligned, pruned)

    def _same_error(self, level: Config) -> "Lesson | None":
        """The lesson that `level` is certain to fail as earlier levels did (`lessons`): `level` has every
        knob value it lays the error to. None when no lesson covers it."""
        knobs = [n for n in self.space.values() if n not in ("micro_batch_size", "grad_accum_steps")]
        for lesson in lessons(self.results, knobs, self.space.strategies):
            if all(level.knob(name) == value for name, value in lesson.values):
                return lesson
        return None

    def _fixed_peaks(self) -> list[ProbeResult]:
        """Complete peaks (finished, inside the safety margin) that do not shrink with the micro-batch, so that
        what holds no less is over the limit at any micro-batch (`fixed_peak`); cached per result count."""
        if self._fixed[0] != len(self.results):
            limit = self.space.spec.fit_limit
            complete = [r for r in self.results if r.measured and r.oom_kind is OomKind.MARGIN and r.peak_bytes]
            self._fixed = (len(self.results), [r for r in complete if fixed_peak(r, complete, limit)])
        return self._fixed[1]

    def _learned(self, lesson: "Lesson") -> None:
        """Tell the listener a lesson once, where it hears lessons (`learned`): the levels it skips are
        counted with the other quiet skips."""
        heard = getattr(self.progress, "learned", None)
        if lesson.values not in self._said and callable(heard):
            heard(lesson.announcement)
        self._said.add(lesson.values)

    def _holds_no_less(self, config: Config, failed: Config) -> bool:
        """Whether `config` holds at least what `failed` held where no activation is live (model states,
        engine buffers): the same engine and stage, and state knobs that save no more. Micro-batch,
        checkpointing and attention only change activations (`activation_knobs`), so they are set to `failed`'s
        to compare."""
        if config.num_gpus != failed.num_gpus or not all(s.holds_alike(config, failed) for s in self.space.strategies):
            return False
        aligned = config.replace(**{name: getattr(failed, name) for name in activation_knobs()})
        return self.space.saves_at_least(failed, aligned)

    def _step_limit(self, config: Config) -> float | None:
        """Seconds per step below which `config` could still beat the best fit so far that changes the
        arithmetic no more than it does (a numerics change's figure never stops an exact probe: it is compared
        on its margin, re-measured); None before any such fit."""
        mine = (self.space.tier(config), self.space.degree(config))
        best = choose([r for r in self.results if (self.space.tier(r.config), self.space.degree(r.config)) <= mine])
        if best is None:
            return None
        return config.global_batch_size / (best.samples_per_s * WIN_FRACTION)

    # -- recording -------------------------------------------------------------------------------
    def _over(self, config: Config) -> str | None:
        """Why `config` is predicted not to fit, beyond the predictor's error; None when it may fit."""
        if self.predictor is None:
            return None
        predicted = self._predict(config)
        limit = self.space.spec.fit_limit
        tolerance, measured = self._tolerance(config)
        if predicted is None or predicted <= limit * (1 + tolerance):
            return None
        return (f"predicted to need {format_size(predicted)}, over the fit limit {format_size(limit)} by "
                f"{predicted / limit - 1:.{1 if measured else 0}%}, more than the estimator's error "
                f"({tolerance:.{1 if measured else 0}%}{measured})")

    def _predict(self, config: Config) -> int | None:
        if config not in self._predicted:
            self._predicted[config] = self.predictor(config) if self.predictor is not None else None
        return self._predicted[config]

    def _tolerance(self, config: Config) -> tuple[float, str]:
        """The predictor's error to allow `config` (and where it was learnt, in words): its general measured
        error, or, once this search has measured complete peaks (fits, and runs inside the safety margin) of
        `config`'s sharding on as many ranks, the most it over-predicted them plus `LEARNED_SLACK`, where that
        is less: a lesson about this model learnt once (a 2-rank search whose predictions were within 2.5%
        probed eight configurations predicted 2-9% over the limit, each inside the margin, under a general
        10%)."""
        general = self.tolerance(config) if callable(self.tolerance) else self.tolerance
        over = [self._predicted.get(r.config) / r.peak_bytes - 1 for r in self.results
                if r.measured and r.peak_bytes and (r.fits or r.oom_kind is OomKind.MARGIN)
                and r.config.num_gpus == config.num_gpus and self._predicted.get(r.config)
                and all(s.holds_alike(r.config, config) for s in self.space.strategies)]
        learned = max([*over, 0.0]) + LEARNED_SLACK
        if not over or learned >= general:
            return general, ""
        return learned, (f", as it over-predicted {len(over)} complete peak{'s' if len(over) > 1 else ''} of "
                         f"this sharding here; {general:.0%} in general")

    def _probe(self, config: Config, why: str) -> None:
        stored = self.store.lookup(config)
        if stored is not None:
            self._add(stored)
            return
        over = self._over(config)
        if over:
            self._add(decided(config, Skip.PREDICTED, over))
            return
        self.progress.starting(config, why)
        result = self.prober(config, self._step_limit(config))
        self.probes_run += 1
        self.store.record(result)
        self._add(result)
        self._stop_on_user_error()

    def _stop_on_user_error(self) -> None:
        """Raise a `UsageError` once the first probes all failed with one and the same error on different
        levels before anything fitted or ran out of memory: no knob is the cause, the model, the batch or
        loss_fn is, and every other level would fail the same way."""
        probed = [r for r in self.results if r.source is Source.PROBED]
        if len(probed) < USER_ERROR_PROBES or any(r.status is not ProbeStatus.ERROR for r in probed):
            return
        levels = {r.config.replace(micro_batch_size=1, grad_accum_steps=1) for r in probed}
        if len({failure(r) for r in probed}) == 1 and len(levels) > 1:
            first = probed[0]
            raise UsageError(f"Every configuration probed ({'; '.join(r.config.describe() for r in probed)}) failed "
                             f"the same way in the {first.phase or 'step'}, so the cause is the model, the batch or "
                             f"loss_fn, not a memory knob: {first.reason}. Fix it and run again (one step of your "
                             "own loop shows the whole traceback).")

    def _add(self, result: ProbeResult) -> None:
        self.results.append(result)
        self.progress.finished(result)


# What a knob changes in an error's text without changing the error: sizes (the micro-batch) and dtypes
# (precision: "Long and Float" at fp32 is "Long and BFloat16" under bf16 autocast).
_VARIES_BY_KNOB = re.compile(r"\d+|\b(?:B?Float\d*|Half|Double|bfloat16|float\d*|half)\b")


@dataclasses.dataclass(frozen=True)
class Lesson:
    """An error two levels met alike (`failure`), laid to the knob values they shared that no level which ran
    without error had: a level with all of them is certain to fail the same way."""

    values: tuple[tuple[str, object], ...]  # (knob, value) the error is laid to
    failed: tuple[ProbeResult, ...]  # the levels' results that met it

    @property
    def named(self) -> str:
        """"checkpointing=ops" (and the others, where it is laid to several values)."""
        return " and ".join(f"{name}={getattr(value, 'value', value)}" for name, value in self.values)

    @property
    def words(self) -> str:
        """The reason each level it skips records."""
        first, second = self.failed[:2]
        return (f"certain to fail the same way: {first.config.describe()} and {second.config.describe()} failed "
                f"alike ({first.reason}), and no level with {self.named} ran without error")

    @property
    def announcement(self) -> str:
        """What the listener is told once."""
        return (f"{self.named} fails every level alike ({len(self.failed)} met {failure(self.failed[0])}): the "
                "other levels with it are skipped, not probed")


def lessons(results: list[ProbeResult], knobs: list[str], strategies: Sequence[Strategy]) -> list[Lesson]:
    """Every lesson the measured `results` teach (`Lesson`): an error (type and site) at least
    `USER_ERROR_PROBES` levels met, laid to the values of `knobs` they all shared that no level which ran
    without error had; none where they all ran at one micro-batch nothing else ran at, which may be the
    cause instead (`_one_size`; no size is, of an error naming the dtype of the precision they share)."""
    ran = [r.config for r in results if r.measured and r.status is not ProbeStatus.ERROR]
    failures = collections.defaultdict(list)
    for result in results:
        if result.measured and result.status is ProbeStatus.ERROR:
            failures[failure(result)].append(result)
    found = []
    for failed in failures.values():
        if len({r.config.replace(micro_batch_size=1, grad_accum_steps=1) for r in failed}) < USER_ERROR_PROBES:
            continue
        if _one_size(failed, ran) and not _dtype_error(failed, strategies):
            continue
        shared = [(name, failed[0].config.knob(name)) for name in knobs
                  if len({r.config.knob(name) for r in failed}) == 1]
        values = tuple((name, value) for name, value in shared if all(c.knob(name) != value for c in ran))
        if values:
            found.append(Lesson(values, tuple(failed)))
    return found


def fixed_peak(result: ProbeResult, complete: list[ProbeResult], limit: int) -> bool:
    """Whether `result`'s complete peak is a fixed cost over `limit`: another complete peak of its level, at
    another micro-batch, barely differs, so that the line through the two reaches micro-batch 0 still over
    the limit (nine ZeRO-3 probes, three checkpointing levels at micro-batch 8, 4 and 2, all peaked at the
    same 22.60 MiB: the model states, not the activations, set it)."""
    level = result.config.replace(micro_batch_size=1, grad_accum_steps=1)
    for other in complete:
        if other.config.replace(micro_batch_size=1, grad_accum_steps=1) != level:
            continue
        small, large = sorted((result, other), key=lambda r: r.config.micro_batch_size)
        if small.config.micro_batch_size == large.config.micro_batch_size:
            continue
        sizes = large.config.micro_batch_size - small.config.micro_batch_size
        slope = abs(large.peak_bytes - small.peak_bytes) / sizes
        if min(small.peak_bytes, large.peak_bytes) - slope * small.config.micro_batch_size > limit:
            return True
    return False


def _one_size(failed: list[ProbeResult], ran: list[Config]) -> bool:
    """Whether the failed probes all ran at one micro-batch that nothing which ran without error ran at: the
    error may be that size's (a squeeze that drops the sample axis at 1), not a knob value's."""
    sizes = {r.config.micro_batch_size for r in failed}
    return len(sizes) == 1 and all(c.micro_batch_size not in sizes for c in ran)


def _dtype_error(failed: list[ProbeResult], strategies: Sequence[Strategy]) -> bool:
    """Whether `failed` (one error) share a 16-bit dtype their error names (the one a strategy makes the forward
    compute in: `Strategy.compute_dtype`): an op that does not take it, which no checkpointing, optimizer or
    offload changes."""
    dtypes = {next((d for s in strategies if (d := s.compute_dtype(r.config)) is not None), None) for r in failed}
    name = DTYPE_NAMES.get(next(iter(dtypes))) if len(dtypes) == 1 else None
    return name is not None and name in failed[0].reason


def failure(result: ProbeResult) -> str:
    """What identifies an error across configurations: its type and the site it was raised at where the probe
    found one (`ProbeResult.error_type`, `error_site`), else its text with sizes and dtypes blanked. A record
    from an older trial store or plan, which lacks those fields, has them read back from its reason."""
    if result.error_type is not None:
        return f"{result.error_type} at {result.error_site}" if result.error_site else \
            _VARIES_BY_KNOB.sub("#", result.reason)
    kind, _, rest = result.reason.partition(":")  # older records: "Type: message (at file:line in function)"
    site = rest.rpartition(" (at ")[2].partition(")")[0]
    return f"{kind} at {site}" if " (at " in rest else _VARIES_BY_KNOB.sub("#", result.reason)


_IMPLIES = {Verdict.FIT: ProbeStatus.FIT, Verdict.SLOW: ProbeStatus.PRUNED}
