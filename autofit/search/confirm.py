"""Confirmation: the search's finalists re-measured back to back, then the choice between them.

Throughput probed minutes apart on a shared machine (or a GPU whose clocks drift) is noisy: two runs of
one search once chose different optimizers by a few percent. So the plan is not chosen from the walk's
figures alone. This step runs after the walk:

1. **What the walk only implied** (`follow_near_limit`, `follow_numerics`): a fit whose CUDA allocator
   retried during its timed steps runs at the allocator's limit, where a smaller micro-batch is often
   faster (the walk assumes a larger micro-batch is never slower): the next smaller micro-batch of its
   level is probed too. And a numerics change of the fastest fit that the walk decided "cannot be
   faster" (Adafactor where AdamW fits) is probed: it changes the arithmetic, it may do less work.
2. **Finalists** (`finalists`): every fit within the window's margin of the best probed throughput, at
   most its limit of them (`LIVE_WINDOW`: 50%, 5, where a round is one optimizer step of each;
   `PROBE_WINDOW`: 20%, 2, where a round builds each again: one probe on a loaded machine can be off by
   a third), plus the best fits of each safer class (a lower exactness tier, an arithmetic that moves less:
   bf16 autocast where pure bf16 leads; no allocator retries: its fastest however far behind it probed, and
   on live runs up to 3 within the window's margin of that one) so a numerics
   change is chosen over what changes less only on confirmed figures, never on one walk figure; as many of
   each other class within the window's margin of the best (one noisy probe must not keep a class's fastest
   fit out where other fits fill the window's limit), plus the
   largest fitting micro-batch of each finalist's level (the walk holds a larger micro-batch is never
   slower: a smaller one that probed faster must show it). Figures from a resumed trial store are compared
   only with each other, never raw with this session's: each source picks its own finalists, and all of
   them are re-measured here.
3. **Re-measured back to back, interleaved** (`confirm`): live runs when the probes run in this process on
   the CPU (each finalist built once and warmed up, then rounds of one optimizer step each, the order
   rotating, at one torch thread count for all); otherwise rounds of whole probes of the finalists (child
   processes, ranks, CUDA, where one run at a time fits). A comparison takes the ratio within each round
   (paired: both measured within the same seconds, so a load that comes and goes cancels out) and keeps
   the median. `Rounds` says how many: at least `least` (live runs: 4, the fewest whose range holds the
   median at `decision.CONFIDENCE`); then, while a comparison is undecided for noise
   alone (its ratio's interval wider than its margin, or holding the margin's edge), one more at a time, of
   the finalists those comparisons pair alone (`needed`: a finalist whose comparisons are all settled is
   retired, its rounds so far kept, so the cap buys rounds for what is still open), and none once what is
   still open cannot change the choice (`possible_winners`: a third finalist beats either side of an
   undecided pair), up to `most` and within
   a time cap sized from the finalists' own step times (live runs: 30 s, or seven times what the first
   4 rounds took): more rounds narrow the interval of the median, and where the cap ends them first the
   simpler finalist stays.
   The choice between them: `autofit.search.decision`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Collection, Sequence

from autofit.config import Config
from autofit.probe.outcome import ProbeResult, Skip, Source
from autofit.search.decision import (PROBE_WINDOW, Comparison, Confirmation, Finalist, Method, Window, decide,
                                     fewest_rounds, level_of, possible_winners, risk, simplicity, unsettled)

if TYPE_CHECKING:
    from autofit.search.space import Space


@dataclasses.dataclass(frozen=True)
class Rounds:
    """How many confirmation rounds: at least `least`; more, one at a time, while a comparison is undecided
    for noise alone, up to `most` rounds and while the rounds so far took under `seconds`, or under `growth`
    times what the first `least` took (the cap sized from the finalists' own step times: a busy machine's
    slower rounds get their share of extra rounds too). `most` is a backstop, not the usual stop: the time
    cap is, once retired finalists leave each extra round to the comparisons still open."""

    least: int
    most: int
    seconds: float
    growth: float = 0.0

    def cap(self, first: float) -> float:
        """Seconds the rounds may take in all, the first `least` having taken `first`."""
        return max(self.seconds, self.growth * first)


# one optimizer step per finalist a round, live runs: from the fewest rounds whose interval reaches CONFIDENCE
# (4), a finalist whose comparisons are settled is retired; the cap 7x what those took
LIVE_ROUNDS = Rounds(fewest_rounds(), 99, 30.0, 7.0)
PROBE_ROUNDS = Rounds(2, 4, 300.0)  # one whole probe per finalist a round, when runs cannot stay alive side by side
# A lone finalist whose timed steps disagreed by more than this (slowest - fastest over the median) is
# re-measured too: a probe that ran while the machine was busy (or before the process warmed up) would
# otherwise leave its slowest figures in the plan and the exports.
UNSTEADY_SPREAD = 0.30

# measure(configs, rounds, more): samples/s of each config per round (or why it failed); `more(figures so far)`
# says whether a round past `rounds.least` is worth running: False/empty to stop, True for every config, or the
# configs still needed (the others are retired for the rest of the measurement, their rounds so far kept)
More = Callable[["dict[Config, tuple[float, ...] | str]"], "bool | Collection[Config]"]
Measure = Callable[[Sequence[Config], Rounds, More], "dict[Config, tuple[float, ...] | str]"]
Probe = Callable[[Config, str], ProbeResult]


# -- 1. near the limit ------------------------------------------------------------------------------------
def follow_near_limit(space: "Space", results: list[ProbeResult], probe: Probe) -> list[ProbeResult]:
    """`results` with the next smaller micro-batch of every fit whose allocator retried probed too (and
    the next after it, while those retry as well); a decided record of such a config is replaced."""
    results = list(results)
    queue = [r for r in results if r.fits and r.near_limit]
    while queue:
        near = queue.pop(0)
        smaller = [m for m in space.sizes if m < near.config.micro_batch_size]
        if not smaller:
            continue
        config = space.at(near.config, smaller[-1])
        if any(r.config == config and r.measured for r in results):
            continue
        result = probe(config, f"next smaller micro-batch: {near.config.describe()} hit {near.alloc_retries} "
                               "allocator retries while timed")
        results = [r for r in results if r.config != config] + [result]
        if result.fits and result.near_limit:
            queue.append(result)
    return results


def follow_numerics(space: "Space", results: list[ProbeResult], probe: Probe) -> list[ProbeResult]:
    """`results` with the numerics changes of the fastest fit probed where the walk only implied them: the
    walk holds a config that saves memory "only adds work", which is true of checkpointing or a smaller
    micro-batch, but an optimizer or precision of a higher tier changes the arithmetic itself (Adafactor
    keeps no first moment and its step is cheaper than AdamW's). So each option of a higher exactness
    tier than the fastest fit's, applied to it alone, is probed when the walk decided it without running
    it; the confirmation then asks it to clear `exact_margin`."""
    results = list(results)
    fits = [r for r in results if r.fits]
    if not fits:
        return results
    best = max(fits, key=lambda r: r.samples_per_s)
    allowed = set(space.levels())
    for field, options in space.choices.items():
        for option in (o for o in options if o.tier > space.tier(best.config)):
            config = best.config.replace(**option.knobs(field))
            implied = [r for r in results if r.config == config and r.skip is Skip.IMPLIED]
            if implied and level_of(config) in allowed:
                result = probe(config, f"a numerics change of the fastest fit ({best.config.describe()}): "
                                       "it may do less work, not more")
                results = [r for r in results if r.config != config] + [result]
    return results


# -- 2. finalists -----------------------------------------------------------------------------------------
def finalists(space: "Space", results: Sequence[ProbeResult], window: Window = PROBE_WINDOW) -> list[ProbeResult]:
    """The fits to re-measure (see the module doc), from the least to the most change."""
    chosen: list[ProbeResult] = []
    for source in (Source.PROBED, Source.STORED):
        group = sorted((r for r in results if r.fits and r.source is source), key=lambda r: -r.samples_per_s)
        if not group:
            continue
        best = group[0]
        picked = [r for r in group if r.samples_per_s * (1 + window.margin) >= best.samples_per_s][:window.limit]
        for cls in {risk(space, r) for r in group}:
            same = [r for r in group if risk(space, r) == cls]  # by probed throughput, fastest first
            # a safer class's fits within the margin of its own fastest, however far behind that one probed;
            # another class's within the margin of the best: one noisy walk figure must not keep either out
            lead = same[0] if cls < risk(space, best) else best
            near = [r for r in same if r.samples_per_s * (1 + window.margin) >= lead.samples_per_s]
            picked += [r for r in near[:window.safer] if r not in picked]
        for largest in {_largest_oflevel_of(group, r) for r in picked} - set(picked):
            picked.append(largest)
        chosen += picked
    return sorted(chosen, key=lambda r: simplicity(space, r))


def _largest_oflevel_of(group: Sequence[ProbeResult], result: ProbeResult) -> ProbeResult:
    """The fit of `result`'s level with the largest micro-batch: the walk holds a larger micro-batch is
    never slower, so a smaller one that probed faster is confirmed against it."""
    level = result.config.replace(micro_batch_size=1, grad_accum_steps=1)
    same = [r for r in group if r.config.replace(micro_batch_size=1, grad_accum_steps=1) == level]
    return max(same, key=lambda r: r.config.micro_batch_size)


# -- 3. re-measured back to back --------------------------------------------------------------------------
def confirm(space: "Space", results: Sequence[ProbeResult], measure: Measure | None, rounds: Rounds | int,
            exact_margin: float, method: Method, window: Window = PROBE_WINDOW,
            threads: int | None = None) -> Confirmation | None:
    """Re-measure the finalists (`window`: see `finalists`) with `measure(configs, rounds, more)` (samples/s
    per round, or why it failed; `rounds` a count: exactly that many) and decide; `threads` is recorded
    (torch's CPU threads of live runs). None when nothing fits. A lone finalist measured in this session
    needs no rounds, unless its timed steps disagreed by more than `UNSTEADY_SPREAD`."""
    picked = finalists(space, results, window)
    if not picked:
        return None
    rounds = Rounds(rounds, rounds, 0.0) if isinstance(rounds, int) else rounds
    stored = any(r.source is Source.STORED for r in picked)
    unsteady = any((r.step_spread or 0.0) > UNSTEADY_SPREAD for r in picked)
    measured: dict[Config, tuple[float, ...] | str] = {}
    if measure is not None and (len(picked) > 1 or stored or unsteady):
        def more(so_far: dict[Config, tuple[float, ...] | str]) -> frozenset[Config]:
            pool = _pool(space, picked, so_far)
            if len(possible_winners(pool, exact_margin)) == 1:
                return frozenset()  # what is still open cannot change the choice
            return needed(pool, decide(pool, exact_margin)[1])

        measured = measure([r.config for r in picked], rounds, more)
    else:
        method, threads = Method.NONE, None
    dropped = tuple((r.config.describe(), measured[r.config]) for r in picked if isinstance(measured.get(r.config), str))
    pool = _pool(space, picked, measured)
    chosen, comparisons = decide(pool, exact_margin)
    return Confirmation(pool, chosen, tuple(comparisons), method, exact_margin, dropped, window.margin, threads)


def needed(pool: Sequence[Finalist], comparisons: Sequence[Comparison]) -> frozenset[Config]:
    """The finalists more rounds are worth measuring: both sides of every comparison still undecided for
    noise alone (`unsettled`); empty when all are settled. Pairs are positional (round i of one against
    round i of the other), so a finalist retired once stays retired: `interleaved` keeps it so."""
    return frozenset(pool[i].config for c in comparisons if unsettled(c) for i in (c.challenger, c.holder))


def _pool(space: "Space", picked: Sequence[ProbeResult],
          measured: dict[Config, tuple[float, ...] | str]) -> tuple[Finalist, ...]:
    """The finalists with their rounds so far, less those whose re-measurement failed (all of them failing,
    the first stays, as probed)."""
    kept = [r for r in picked if not isinstance(measured.get(r.config), str)] or list(picked[:1])
    return tuple(Finalist(r.config, space.tier(r.config), r.near_limit, r.source, r.samples_per_s,
                          tuple(measured.get(r.config, ()) if not isinstance(measured.get(r.config), str) else ()),
                          space.degree(r.config), space.numerics(r.config))
                 for r in kept)


def interleaved(measure_one: Callable[[Config], float | str]) -> Measure:
    """A `Measure` from one measurement per call: each round measures every config once, the order
    rotating between rounds, for as many rounds as `Rounds` and `more` say (past `rounds.least`, only the
    configs `more` still needs, two or more of them; one it leaves out is retired for good, so round i of
    every config was measured in the same seconds); a config whose measurement fails is dropped with the
    reason."""

    def measure(configs: Sequence[Config], rounds: Rounds,
                more: More = lambda figures: False) -> dict[Config, tuple[float, ...] | str]:
        samples: dict[Config, list[float]] = {c: [] for c in configs}
        failed: dict[Config, str] = {}
        retired: set[Config] = set()

        def figures() -> dict[Config, tuple[float, ...] | str]:
            return {c: failed.get(c) or tuple(samples[c]) for c in configs}

        def go_on() -> bool:
            wanted = more(figures())
            if wanted is True or wanted is False:
                return wanted
            retired.update(c for c in configs if c not in wanted)
            return sum(c not in retired and c not in failed for c in configs) > 1  # a pair or more to compare

        started, index, first = time.perf_counter(), 0, 0.0
        while index < rounds.least or (index < rounds.most and time.perf_counter() - started < rounds.cap(first)
                                       and go_on()):
            live = [c for c in configs if c not in failed and c not in retired]
            shift = index % max(len(live), 1)
            for config in live[shift:] + live[:shift]:
                value = measure_one(config)
                if isinstance(value, str):
                    failed[config] = value
                else:
                    samples[config].append(value)
            index += 1
            if index == rounds.least:
                first = time.perf_counter() - started
        return figures()

    return measure


# -- the two ways of measuring ----------------------------------------------------------------------------
@dataclasses.dataclass
class Spent:
    """Optimizer steps a measurement has started, counted as it runs (`Confirmation.steps`): its live runs'
    warm-up step and rounds, or its probes' (`ProbeResult.steps`)."""

    steps: int = 0


def live_measure(spec: Any, strategies: Sequence[Any], threads: int | None = None,
                 spent: Spent | None = None) -> Measure:
    """A `Measure` on live runs: every finalist built once and warmed up (one step: the process is warm,
    and the median over the rounds shrugs off a slower first round), then each round takes one timed
    optimizer step of each, the order rotating, all at `threads` torch CPU threads (default: the current
    count), held for the whole measurement: a finalist's build must not change what the others run at.
    At one thread a step's figure is samples per second of the measuring thread's own CPU time (`step_seconds`).
    Outside the CPU budget (each already fits it; its bookkeeping is off during timed steps anyway), so
    all runs stay in host memory at once: the caller checks they fit there. `spent` counts the steps taken."""
    import torch

    from autofit.probe.oom import collecting_new_objects, first_line, release_memory
    from autofit.probe.run import fresh_run, timed_step

    @collecting_new_objects()
    def measure(configs: Sequence[Config], rounds: Rounds,
                more: More = lambda figures: False) -> dict[Config, tuple[float, ...] | str]:
        runs: dict[Config, Any] = {}
        failed: dict[Config, str] = {}
        before = torch.get_num_threads()
        try:
            for config in configs:
                torch.set_num_threads(threads or before)
                built: list[Any] = []
                try:
                    run, batches = fresh_run(spec, config, strategies)
                    built.append(run)
                    run.step(batches)
                    runs[config] = (run, batches)
                except Exception as exc:  # noqa: BLE001 - a finalist that cannot run is dropped, with why
                    failed[config] = first_line(exc)
                    if spent is not None and built:
                        spent.steps += built[0].steps_taken
            torch.set_num_threads(threads or before)

            def one(config: Config) -> float | str:
                if config in failed:
                    return failed[config]
                try:
                    return config.global_batch_size / step_seconds(lambda: timed_step(*runs[config], spec.device),
                                                                   threads or before)
                except Exception as exc:  # noqa: BLE001
                    return first_line(exc)

            return interleaved(one)(list(configs), rounds, more)
        finally:
            torch.set_num_threads(before)
            if spent is not None:
                spent.steps += sum(run.steps_taken for run, _ in runs.values())
            runs.clear()
            release_memory()

    return measure


def step_seconds(step: Callable[[], float], threads: int) -> float:
    """Seconds of one timed step (`step()` returns its wall seconds). At one torch thread on the CPU every op
    of the step runs on the calling thread, so its own CPU time is the step's work, without the seconds it
    waited for a core: on a machine other jobs keep busy, the wall figure of two steps a second apart differs
    by how many jobs ran beside each, the CPU figure hardly at all, and on a quiet machine the two agree.
    With more threads the step's work is spread over a pool: the wall figure."""
    started = time.thread_time()
    wall = step()
    return max(time.thread_time() - started, 1e-9) if threads == 1 else wall


def probe_measure(prober: Callable[[Config, float | None], ProbeResult], spent: Spent | None = None) -> Measure:
    """A `Measure` of whole probes (one build, warm-up and timed steps per round): for configs that run in
    a child process or ranks, and on CUDA, where one run at a time is what fits. `spent` counts the steps
    the probes took."""

    def one(config: Config) -> float | str:
        result = prober(config, None)
        if spent is not None:
            spent.steps += result.steps or 0
        return result.samples_per_s if result.fits else f"{result.status.value} when re-measured: {result.reason}"

    return interleaved(one)
