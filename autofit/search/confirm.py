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
   a third), plus the best fit of each safer class (a lower exactness tier; no allocator retries)
   however far behind it probed, so a numerics change is chosen over an exact fit only on confirmed
   figures, plus the largest fitting micro-batch of each finalist's level (the walk holds a larger
   micro-batch is never slower: a smaller one that probed faster must show it). Figures from a resumed trial store are compared
   only with each other, never raw with this session's: each source picks its own finalists, and all of
   them are re-measured here.
3. **Re-measured back to back, interleaved** (`confirm`): live runs when the probes run in this process on
   the CPU (each finalist built once and warmed up, then LIVE_ROUNDS rounds of one optimizer step each,
   the order rotating); otherwise PROBE_ROUNDS rounds of whole probes of at most PROBE_FINALISTS
   finalists from the window (child processes, ranks, CUDA, where one run at a time fits). A comparison takes the ratio within each round (paired: both measured
   within the same seconds, so a load that comes and goes cancels out) and keeps the median.
4. **The choice** (`decide`): the finalists in order from the least to the most change (exactness tier,
   then allocator retries, then fewer knobs changed, then the larger micro-batch). Starting from the
   first, one that changes more replaces the choice only when clearly faster: a median paired ratio of at
   least 1 + its margin, winning at least CLEAR_SHARE of the rounds. The margin is `exact_margin`
   (default 10%) for a higher exactness tier (bf16/fp16, 8-bit states, Adafactor), NEAR_LIMIT_MARGIN for
   a fit whose allocator retried, and NOISE_MARGIN otherwise: within the noise the simpler one stays.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autofit.config import Config
from autofit.errors import UsageError
from autofit.probe.outcome import ProbeResult, Skip, Source

if TYPE_CHECKING:
    from autofit.search.space import Space

LIVE_ROUNDS = 7  # rounds of one optimizer step per finalist, live runs
PROBE_ROUNDS = 2  # rounds of one whole probe per finalist, when runs cannot stay alive side by side
DEFAULT_EXACT_MARGIN = 0.10  # a numerics change must be this much faster than an exact fit to replace it
NEAR_LIMIT_MARGIN = 0.10  # a fit whose allocator retried must be this much faster than one that did not
NOISE_MARGIN = 0.03  # any other change must be this much faster than a simpler finalist
CLEAR_SHARE = 0.7  # ... and faster in at least this share of the rounds
# A lone finalist whose timed steps disagreed by more than this (slowest - fastest over the median) is
# re-measured too: a probe that ran while the machine was busy (or before the process warmed up) would
# otherwise leave its slowest figures in the plan and the exports.
UNSTEADY_SPREAD = 0.30

Measure = Callable[[Sequence[Config], int], "dict[Config, tuple[float, ...] | str]"]
Probe = Callable[[Config, str], ProbeResult]


@dataclasses.dataclass(frozen=True)
class Window:
    """Which fits are re-measured: those within `margin` of the best as probed, at most `limit` of them
    (the best of each safer class and each finalist's largest micro-batch come on top)."""

    margin: float
    limit: int


LIVE_WINDOW = Window(0.50, 5)  # live runs: a round is one optimizer step of each finalist
PROBE_WINDOW = Window(0.20, 2)  # whole probes: a round builds every finalist again


@dataclasses.dataclass(frozen=True)
class Finalist:
    """One finalist: what the search measured for it, and its samples/s in each confirmation round."""

    config: Config
    tier: int  # exactness tier: 0 same math, 1 numerics change, 2 trains adapters
    near_limit: bool  # its allocator retried during the timed steps (CUDA)
    source: Source  # PROBED in this search, or STORED (an earlier session's figure)
    probed: float  # samples/s the search measured
    rounds: tuple[float, ...] = ()  # samples/s in each confirmation round, this session

    @property
    def median(self) -> float:
        """Confirmed samples/s: the median over the rounds (the probed figure when there were none)."""
        return statistics.median(self.rounds) if self.rounds else self.probed

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {**dataclasses.asdict(self), "config": self.config.to_dict(), "source": self.source.value,
                "rounds": list(self.rounds)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Finalist":
        """Inverse of `to_dict`."""
        return cls(**{**data, "config": Config.from_dict(data["config"]), "source": Source(data["source"]),
                      "rounds": tuple(data["rounds"])})


@dataclasses.dataclass(frozen=True)
class Ratio:
    """Paired comparison of two finalists over the same rounds: samples/s of `a` over `b` in each round."""

    median: float
    low: float  # lower quartile of the per-round ratios
    high: float  # upper quartile
    wins: float  # share of the rounds in which `a` was faster
    rounds: int

    @classmethod
    def of(cls, a: Finalist, b: Finalist) -> "Ratio":
        """`a` against `b`; from the medians alone (one pseudo-round) when either was not re-measured."""
        pairs = [x / y for x, y in zip(a.rounds, b.rounds)] or [a.median / b.median]
        low, high = (min(pairs), max(pairs)) if len(pairs) < 4 else _quartiles(pairs)
        return cls(statistics.median(pairs), low, high, sum(p > 1 for p in pairs) / len(pairs),
                   len(a.rounds) if a.rounds and b.rounds else 0)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One step of the decision: a finalist that changes more (`challenger`) against the choice so far."""

    challenger: int  # index into `Confirmation.finalists`
    holder: int
    ratio: Ratio  # challenger over holder
    margin: float  # what the challenger had to clear
    kind: str  # "exactness" | "near-limit" | "noise": why that margin
    won: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Comparison":
        """Inverse of `to_dict`."""
        return cls(**{**data, "ratio": Ratio(**data["ratio"])})


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """The confirmation step's record: finalists from the least to the most change, the decision's
    comparisons, and the finalists dropped because a re-measurement did not fit."""

    finalists: tuple[Finalist, ...]
    chosen: int  # index into `finalists`
    comparisons: tuple[Comparison, ...]
    method: str  # "live runs" | "probes" | "none" (a single finalist measured in this session)
    exact_margin: float
    dropped: tuple[tuple[str, str], ...] = ()  # (config described, why) of finalists a re-measurement lost
    window: float = PROBE_WINDOW.margin  # the window's margin the finalists were taken within

    @property
    def winner(self) -> Finalist:
        """The chosen finalist."""
        return self.finalists[self.chosen]

    def runner_up(self) -> Finalist | None:
        """The fastest confirmed finalist other than the chosen one."""
        others = [f for i, f in enumerate(self.finalists) if i != self.chosen]
        return max(others, key=lambda f: f.median, default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (stored in the plan)."""
        return {"finalists": [f.to_dict() for f in self.finalists], "chosen": self.chosen,
                "comparisons": [c.to_dict() for c in self.comparisons], "method": self.method,
                "exact_margin": self.exact_margin, "dropped": [list(d) for d in self.dropped], "window": self.window}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Confirmation":
        """Inverse of `to_dict`."""
        return cls(tuple(Finalist.from_dict(f) for f in data["finalists"]), data["chosen"],
                   tuple(Comparison.from_dict(c) for c in data["comparisons"]), data["method"],
                   data["exact_margin"], tuple(tuple(d) for d in data.get("dropped", ())),
                   data.get("window", PROBE_WINDOW.margin))


def check_margin(exact_margin: Any) -> float:
    """`exact_margin` as a float, or `UsageError` naming the bad value."""
    if isinstance(exact_margin, bool) or not isinstance(exact_margin, (int, float)) or not 0 <= exact_margin < 10:
        raise UsageError(f"exact_margin must be a fraction >= 0 (0.10 = a numerics change must be 10% faster "
                         f"than an exact fit), but got {exact_margin!r}.")
    return float(exact_margin)


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
            if implied and _level(config) in allowed:
                result = probe(config, f"a numerics change of the fastest fit ({best.config.describe()}): "
                                       "it may do less work, not more")
                results = [r for r in results if r.config != config] + [result]
    return results


def _level(config: Config) -> Config:
    return config.replace(micro_batch_size=1, grad_accum_steps=1)


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
        for safer in {_risk(space, r) for r in group if _risk(space, r) < _risk(space, best)}:
            top = next(r for r in group if _risk(space, r) == safer)
            if top not in picked:
                picked.append(top)
        for largest in {_largest_of_level(group, r) for r in picked} - set(picked):
            picked.append(largest)
        chosen += picked
    return sorted(chosen, key=lambda r: simplicity(space, r))


def _largest_of_level(group: Sequence[ProbeResult], result: ProbeResult) -> ProbeResult:
    """The fit of `result`'s level with the largest micro-batch: the walk holds a larger micro-batch is
    never slower, so a smaller one that probed faster is confirmed against it."""
    level = result.config.replace(micro_batch_size=1, grad_accum_steps=1)
    same = [r for r in group if r.config.replace(micro_batch_size=1, grad_accum_steps=1) == level]
    return max(same, key=lambda r: r.config.micro_batch_size)


def simplicity(space: "Space", result: ProbeResult) -> tuple:
    """Sort key from the least to the most change: exactness tier, allocator retries, the level's place
    in the space (fewer knobs changed first), the larger micro-batch (fewer accumulation passes)."""
    return change_order(space, result.config, result.near_limit)


def change_order(space: "Space", config: Config, near_limit: bool = False) -> tuple:
    """`simplicity` of a configuration (a prediction has no allocator retries: `near_limit` False)."""
    order = {level: i for i, level in enumerate(space.levels())}
    return (space.tier(config), near_limit, order.get(_level(config), len(order)), -config.micro_batch_size)


def _risk(space: "Space", result: ProbeResult) -> tuple[int, bool]:
    return space.tier(result.config), result.near_limit


def margin_between(safer: tuple[int, bool], riskier: tuple[int, bool], exact_margin: float) -> tuple[float, str]:
    """What a finalist of class `riskier` must clear against one of class `safer`, and why."""
    if riskier[0] > safer[0]:
        return exact_margin, "exactness"
    if riskier[1] and not safer[1]:
        return NEAR_LIMIT_MARGIN, "near-limit"
    return NOISE_MARGIN, "noise"


# -- 3. re-measured back to back --------------------------------------------------------------------------
def confirm(space: "Space", results: Sequence[ProbeResult], measure: Measure | None, rounds: int,
            exact_margin: float, method: str, window: Window = PROBE_WINDOW) -> Confirmation | None:
    """Re-measure the finalists (`window`: see `finalists`) with `measure(configs, rounds)` (samples/s per
    round, or why it failed) and decide. None when nothing fits. A lone finalist measured in this session
    needs no rounds, unless its timed steps disagreed by more than `UNSTEADY_SPREAD`."""
    picked = finalists(space, results, window)
    if not picked:
        return None
    stored = any(r.source is Source.STORED for r in picked)
    unsteady = any((r.step_spread or 0.0) > UNSTEADY_SPREAD for r in picked)
    measured: dict[Config, tuple[float, ...] | str] = {}
    if measure is not None and (len(picked) > 1 or stored or unsteady):
        measured = measure([r.config for r in picked], rounds)
    else:
        method = "none"
    dropped = tuple((r.config.describe(), measured[r.config]) for r in picked if isinstance(measured.get(r.config), str))
    kept = [r for r in picked if not isinstance(measured.get(r.config), str)] or picked[:1]
    pool = tuple(Finalist(r.config, space.tier(r.config), r.near_limit, r.source, r.samples_per_s,
                          tuple(measured.get(r.config, ()) if not isinstance(measured.get(r.config), str) else ()))
                 for r in kept)
    chosen, comparisons = decide(pool, exact_margin)
    return Confirmation(pool, chosen, tuple(comparisons), method, exact_margin, dropped, window.margin)


def interleaved(measure_one: Callable[[Config], float | str]) -> Measure:
    """A `Measure` from one measurement per call: each round measures every config once, the order
    rotating between rounds; a config whose measurement fails is dropped with the reason."""

    def measure(configs: Sequence[Config], rounds: int) -> dict[Config, tuple[float, ...] | str]:
        samples: dict[Config, list[float]] = {c: [] for c in configs}
        failed: dict[Config, str] = {}
        for index in range(rounds):
            live = [c for c in configs if c not in failed]
            shift = index % max(len(live), 1)
            for config in live[shift:] + live[:shift]:
                value = measure_one(config)
                if isinstance(value, str):
                    failed[config] = value
                else:
                    samples[config].append(value)
        return {c: failed.get(c) or tuple(samples[c]) for c in configs}

    return measure


# -- 4. the choice ----------------------------------------------------------------------------------------
def decide(pool: Sequence[Finalist], exact_margin: float) -> tuple[int, list[Comparison]]:
    """Index of the chosen finalist in `pool` (ordered from the least to the most change) and the
    comparisons that decided it (see the module doc)."""
    holder, comparisons = 0, []
    for index in range(1, len(pool)):
        challenger, current = pool[index], pool[holder]
        margin, kind = margin_between((current.tier, current.near_limit), (challenger.tier, challenger.near_limit),
                               exact_margin)
        ratio = Ratio.of(challenger, current)
        won = ratio.median >= 1 + margin and ratio.wins >= CLEAR_SHARE
        comparisons.append(Comparison(index, holder, ratio, margin, kind, won))
        if won:
            holder = index
    return holder, comparisons


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


# -- the two ways of measuring ----------------------------------------------------------------------------
def live_measure(spec: Any, strategies: Sequence[Any]) -> Measure:
    """A `Measure` on live runs: every finalist built once and warmed up (one step: the process is warm,
    and the median over the rounds shrugs off a slower first round), then each round takes one timed optimizer step of each, the order rotating. Outside the CPU
    budget (each already fits it; its bookkeeping is off during timed steps anyway), so all runs stay in
    host memory at once: the caller checks they fit there."""
    from autofit.probe.oom import collecting_new_objects, first_line, release_memory
    from autofit.probe.run import fresh_run, timed_step

    @collecting_new_objects()
    def measure(configs: Sequence[Config], rounds: int) -> dict[Config, tuple[float, ...] | str]:
        runs: dict[Config, Any] = {}
        failed: dict[Config, str] = {}
        try:
            for config in configs:
                try:
                    run, batches = fresh_run(spec, config, strategies)
                    run.step(batches)
                    runs[config] = (run, batches)
                except Exception as exc:  # noqa: BLE001 - a finalist that cannot run is dropped, with why
                    failed[config] = first_line(exc)

            def one(config: Config) -> float | str:
                if config in failed:
                    return failed[config]
                try:
                    return config.global_batch_size / timed_step(*runs[config], spec.device)
                except Exception as exc:  # noqa: BLE001
                    return first_line(exc)

            return interleaved(one)(list(configs), rounds)
        finally:
            runs.clear()
            release_memory()

    return measure


def probe_measure(prober: Callable[[Config, float | None], ProbeResult]) -> Measure:
    """A `Measure` of whole probes (one build, warm-up and timed steps per round): for configs that run in
    a child process or ranks, and on CUDA, where one run at a time is what fits."""

    def one(config: Config) -> float | str:
        result = prober(config, None)
        return result.samples_per_s if result.fits else f"{result.status.value} when re-measured: {result.reason}"

    return interleaved(one)
