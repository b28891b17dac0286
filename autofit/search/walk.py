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
   micro-batch, checkpointing and attention, so the search does not learn the same fixed cost again.
3. A config implied to fit by a measured fit is not probed: it only adds work to that fit (more
   recomputation, compressed optimizer states, smaller micro-batches), so it cannot be faster. It is
   recorded as skipped with that reason; so is the smallest size above a level's largest fit that an
   OOM of another config implies will fail.
4. Once something fits, every probe gets a deadline: at less than half the best throughput so far it
   cannot win, so it is stopped and recorded as pruned. Whatever only adds work to a too-slow config
   is not probed either (bf16 on a CPU without bf16 units, offload, ...).
5. With a predictor (the dry-run estimator), a level starts at the largest micro-batch predicted to
   fit, and a config predicted over the fit limit by more than the estimator's measured error is not
   probed: it is recorded as skipped with its prediction, and bounds the bisection like an OOM.
6. An error or a too-slow probe ends its level. The walk stops after `max_probes` probes; levels not
   visited are recorded as skipped with that reason. When the first probes fail with one and the same
   error on two levels, before anything fitted or ran out of memory, the fault is the user's model, batch
   or loss, not a knob: the walk stops with a `UsageError` quoting it. After a fit, an error two levels
   met alike is laid to a knob value they share that no level which ran without error had (pure bf16
   meeting an fp32 tensor the model makes); a level with that value, and otherwise only values the failed
   levels had, is certain to fail the same way and is recorded as skipped, not probed.
Among the fits, the plan takes the highest measured throughput.
"""

from __future__ import annotations

import collections
import enum
import math
import re
import sys
from typing import Callable, Protocol, Sequence, TextIO

import torch

from autofit.config import Config
from autofit.errors import UsageError
from autofit.search.decision import choose
from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, Source, decided
from autofit.search.space import Space
from autofit.search.trials import TrialStore
from autofit.strategies.base import Strategy
from autofit.units import format_size

DEFAULT_MAX_PROBES = 40
USER_ERROR_PROBES = 2  # the first probes failing alike on this many levels: the user's code is at fault
WIN_FRACTION = 0.5  # a probe slower than this fraction of the best throughput so far is stopped
# The knobs that change only activation memory: an OOM where no activation was live bounds every value of them.
ACTIVATION_KNOBS = ("micro_batch_size", "grad_accum_steps", "checkpointing", "checkpoint_every", "attention")
# The knobs that leave the dtypes a forward computes in as they are: an op failing on the dtype a precision
# computes in (torch.fft on bf16: "Unsupported dtype BFloat16") fails so whatever their values
DTYPE_NEUTRAL_KNOBS = ("checkpointing", "checkpoint_every", "optimizer", "optimizer_step", "activation_offload",
                       "offload")
# 16-bit dtypes as torch names them in its errors (`"addmm" not implemented for 'Half'`)
DTYPE_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Half"}


class Verdict(enum.Enum):
    """What the measured results imply for a config not run (the walk's own bookkeeping)."""

    FIT = "fit"  # a measured fit saves no more memory than it: it fits
    FAIL = "fail"  # it needs at least what an OOM (measured or predicted) needed: it fails
    SLOW = "slow"  # it only adds work to a pruned (too slow) config: it cannot win


class Progress(Protocol):
    """Receives the search's events (the CLI shows them). A listener may also have `flush()`, called once
    the search has decided everything (what it held back, it says then)."""

    def starting(self, config: Config, why: str) -> None: ...

    def finished(self, result: ProbeResult) -> None: ...


# Why a candidate was not run, as progress counts them; each skip is in plan.probes with its reason.
SKIP_WORDS = {Skip.PREDICTED: "predicted not to fit", Skip.IMPLIED: "implied by a measured result",
              Skip.EXCLUDED: "excluded", Skip.BUDGET: "past the probe budget"}
# Skips progress counts instead of listing: decided by a measured result, the rules or the spent probe
# budget, dozens at a time (a predicted one is shown as it is decided, with the need it was predicted).
QUIET_SKIPS = (Skip.IMPLIED, Skip.EXCLUDED, Skip.BUDGET)


def skip_counts(counts: "collections.Counter[Skip]") -> str:
    """'32 implied by a measured result, 24 excluded'."""
    return ", ".join(f"{counts[skip]} {words}" for skip, words in SKIP_WORDS.items() if counts[skip])


class SkipTally:
    """The quiet skips (`QUIET_SKIPS`) decided since progress last printed a line."""

    def __init__(self) -> None:
        self.counts: collections.Counter[Skip] = collections.Counter()

    def held(self, result: ProbeResult) -> bool:
        """Count `result` when it is a quiet skip (and say so)."""
        if result.skip in QUIET_SKIPS:
            self.counts[result.skip] += 1
            return True
        return False

    def take(self) -> str:
        """The counts held ('' when none), emptied."""
        text = skip_counts(self.counts)
        self.counts.clear()
        return text


class _Silent:
    def starting(self, config: Config, why: str) -> None:
        pass

    def finished(self, result: ProbeResult) -> None:
        pass


class Heartbeat:
    """Predictions between probes, timed: simulating a step takes seconds to minutes (a recurrent model's
    scan, token by token), so where predicting has gone on `EVERY_S` since the last line, `heard` returns
    one saying so (the search is simulating, not stuck); else None. A probe's line is one too (`probed`)."""

    EVERY_S = 10.0

    def __init__(self) -> None:
        self.count, self.seconds, self.quiet = 0, 0.0, 0.0

    def heard(self, seconds: float) -> str | None:
        self.count, self.seconds, self.quiet = self.count + 1, self.seconds + seconds, self.quiet + seconds
        if self.quiet < self.EVERY_S:
            return None
        self.quiet = 0.0
        return (f"predicting peaks ({self.count} predicted in {self.seconds:.0f} s: training steps simulated under "
                "fake tensors, nothing trained)")

    def probed(self) -> None:
        """A probe's line was printed: the quiet time starts again."""
        self.quiet = 0.0


class PrintedProgress:
    """`progress=True`: a line on stderr as each probe starts (the candidate and why) and one as it lands
    (its status, peak and speed, and the reason), for a script or a notebook cell. The skips a measured
    result implies, the rules exclude or the spent probe budget leaves are counted in one line (`SkipTally`;
    `plan.probes` lists them all)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self.count = 0
        self.tally = SkipTally()
        self.heartbeat = Heartbeat()

    def predicted(self, seconds: float) -> None:
        """A peak was predicted in `seconds` (`Heartbeat`)."""
        line = self.heartbeat.heard(seconds)
        if line:
            self._print(f"autofit: {line}")

    def starting(self, config: Config, why: str) -> None:
        self.flush()
        self.heartbeat.probed()
        self.count += 1
        self._print(f"autofit probe {self.count}: {config.describe()} ({why})")

    def finished(self, result: ProbeResult) -> None:
        if self.tally.held(result):
            return
        self.flush()
        peak = f", peak {format_size(result.peak_bytes)}" if result.peak_bytes else ""
        speed = f", {result.samples_per_s:,.2f} samples/s" if result.samples_per_s else ""
        self._print(f"  {result.status.value} {result.config.describe()}{peak}{speed} - {result.reason}")

    def flush(self) -> None:
        """Print the skips counted since the last line, if any."""
        held = self.tally.take()
        if held:
            self._print(f"  skipped {held} (plan.probes has each with its reason)")

    def _print(self, line: str) -> None:
        print(line, file=self.stream or sys.stderr, flush=True)


def make_progress(progress: "Progress | bool | None") -> "Progress":
    """The search's listener for `progress`: None or False (silent), True (`PrintedProgress`), or an
    object with `starting(config, why)` and `finished(result)`."""
    if progress is None or progress is False:
        return _Silent()
    if progress is True:
        return PrintedProgress()
    if not (callable(getattr(progress, "starting", None)) and callable(getattr(progress, "finished", None))):
        raise UsageError(f"progress={progress!r}: pass True (a line per probe on stderr), False, or an object "
                         "with starting(config, why) and finished(result) methods.")
    return progress


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

    def run(self) -> list[ProbeResult]:
        """Walk every level; return all results (probed, stored and decided)."""
        for level in self.space.levels():
            top = self.space.at(level, self.space.sizes_at(level)[-1])
            if self.probes_run >= self.max_probes:
                self._add(decided(top, Skip.BUDGET, f"probe budget of {self.max_probes} probes spent"))
                continue
            same_error = self._same_error(level)
            if same_error:
                self._add(decided(top, Skip.IMPLIED, same_error))
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
        if self.predictor is not None:
            fitting = [m for m in unknown if not self._over(self.space.at(level, m))]
            if not fitting:
                return unknown[0], "smallest micro-batch: none is predicted to fit"
            if self.predictor(self.space.at(level, fitting[-1])) is None:
                return fitting[-1], "largest micro-batch first: the estimator could not simulate this step"
            return fitting[-1], "largest micro-batch predicted to fit"
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
                self._add(decided(config, Skip.IMPLIED, template.format(cause.describe())))

    def _cause(self, config: Config, verdict: Verdict) -> Config | None:
        """The result's config that implies `verdict` for `config`, or None."""
        for result in self.results:
            if verdict is Verdict.FAIL:
                failed = (result.measured and result.status is ProbeStatus.OOM) or result.skip is Skip.PREDICTED
                if failed and self.space.saves_at_least(result.config, config):
                    return result.config
                if result.measured and result.fixed_cost and self._holds_no_less(config, result.config):
                    return result.config
            elif result.measured and result.status is _IMPLIES[verdict] \
                    and self.space.saves_at_least(config, result.config):
                return result.config
        return None

    def _same_error(self, level: Config) -> str | None:
        """Why `level` is certain to fail as earlier levels did, or None: at least `USER_ERROR_PROBES` levels
        failed with one error (type and place), sharing a knob value that no level which ran without error
        had and that `level` has; each of `level`'s other knob values is one a failed level had (but for
        `DTYPE_NEUTRAL_KNOBS` where the error names the dtype of the precision they share: `_dtype_error`),
        and their one micro-batch, if they shared one, is not the likelier cause (`_one_size`; no size is,
        of such an error)."""
        knobs = [name for name in self.space.values() if name not in ("micro_batch_size", "grad_accum_steps")]
        ran = [r.config for r in self.results if r.measured and r.status is not ProbeStatus.ERROR]
        failures = collections.defaultdict(list)
        for result in self.results:
            if result.measured and result.status is ProbeStatus.ERROR:
                failures[failure(result)].append(result)
        for failed in failures.values():
            if len(failed) < USER_ERROR_PROBES:
                continue
            seen = {name: {r.config.knob(name) for r in failed} for name in knobs}
            dtype = _dtype_error(failed, self.space.strategies)  # then neither those knobs nor the micro-batch is the likelier cause
            free = DTYPE_NEUTRAL_KNOBS if dtype else ()
            if any(level.knob(name) not in values for name, values in seen.items() if name not in free) \
                    or (_one_size(failed, ran) and not dtype):
                continue
            for name, values in seen.items():
                value = level.knob(name)
                if len(values) == 1 and all(c.knob(name) != value for c in ran):
                    return (f"certain to fail the same way: {failed[0].config.describe()} and "
                            f"{failed[1].config.describe()} failed alike ({failed[0].reason}), and no level with "
                            f"{name}={getattr(value, 'value', value)} ran without error")
        return None

    def _holds_no_less(self, config: Config, failed: Config) -> bool:
        """Whether `config` holds at least what `failed` held where no activation is live (model states,
        engine buffers): the same engine and stage, and state knobs that save no more. Micro-batch,
        checkpointing and attention only change activations, so they are set to `failed`'s to compare."""
        if config.sharding is not failed.sharding or config.num_gpus != failed.num_gpus:
            return False
        aligned = config.replace(**{name: getattr(failed, name) for name in ACTIVATION_KNOBS})
        return self.space.saves_at_least(failed, aligned)

    def _step_limit(self, config: Config) -> float | None:
        """Seconds per step below which `config` could still beat the best fit so far; None before any fit."""
        best = choose(self.results)
        if best is None:
            return None
        return config.global_batch_size / (best.samples_per_s * WIN_FRACTION)

    # -- recording -------------------------------------------------------------------------------
    def _over(self, config: Config) -> str | None:
        """Why `config` is predicted not to fit, beyond the predictor's error; None when it may fit."""
        if self.predictor is None:
            return None
        predicted = self.predictor(config)
        limit = self.space.spec.fit_limit
        tolerance = self.tolerance(config) if callable(self.tolerance) else self.tolerance
        if predicted is None or predicted <= limit * (1 + tolerance):
            return None
        return (f"predicted to need {format_size(predicted)}, over the fit limit {format_size(limit)} by "
                f"{predicted / limit - 1:.0%}, more than the estimator's error ({tolerance:.0%})")

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
