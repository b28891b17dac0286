"""The decision between the finalists the confirmation re-measured (`autofit.search.confirm`), and its records.

The finalists are taken (`decide`) in order from the least to the most change: exactness tier, then how
far the arithmetic moves (`Space.degree`: exact < bf16 autocast < pure bf16 / 8-bit states / Adafactor,
a combination adding up), then allocator retries, then fewer knobs changed, then the larger micro-batch.
Starting from the first, one that changes more replaces the choice only when clearly faster, and each
comparison records the test that decided it (`DecidedBy`):

1. its median paired ratio is at least 1 + its margin (else MARGIN): `exact_margin` (default 10%) where
   its arithmetic changes more than the holder's (`steps_up`: a higher tier, or another numerics change:
   pure bf16 against bf16 autocast must clear it too; a larger micro-batch where batch norm couples the
   samples changes less, not more), NEAR_LIMIT_MARGIN for a fit whose allocator retried, NOISE_MARGIN
   otherwise;
2. it was faster in at least CLEAR_SHARE of the rounds (else SHARE);
3. the ratio's interval (where its median lies, at CONFIDENCE, from the rounds' order statistics) is no
   wider than the margin, or lies above the margin by at least its own width (else NOISE): on a machine
   whose paired ratios spread 0.6-2.6 no 10% gain can be shown, whatever the median says, and the simpler
   finalist stays; an interval of 1.07-1.12 shows a 3% gain, though it is wider than 3%.

`choose` picks the plan's result from the search's: the confirmed choice where there is a confirmation,
else the fastest fit (what the walk's deadlines compare against).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
from typing import TYPE_CHECKING, Any, Sequence

from autofit.config import Config, Knob
from autofit.errors import UsageError
from autofit.probe.outcome import ProbeResult, Source

if TYPE_CHECKING:
    from autofit.search.space import Space

DEFAULT_EXACT_MARGIN = 0.10  # a numerics change must be this much faster than an exact fit to replace it
NEAR_LIMIT_MARGIN = 0.10  # a fit whose allocator retried must be this much faster than one that did not
NOISE_MARGIN = 0.03  # any other change must be this much faster than a simpler finalist
CLEAR_SHARE = 0.7  # ... and faster in at least this share of the rounds
# ... on an interval of the median ratio no wider than the margin (and than NOISE_MARGIN, the finest gain
# any measurement here resolves), taken at this confidence from the order statistics of the rounds' ratios
CONFIDENCE = 0.85


class MarginKind(Knob):
    """Why a challenger had the margin it had to clear (`margin_between`)."""

    EXACTNESS = "exactness"  # it changes numerics (a higher exactness tier): `exact_margin`
    NEAR_LIMIT = "near-limit"  # its allocator retried while timed, the holder's did not: NEAR_LIMIT_MARGIN
    NOISE = "noise"  # any other change: NOISE_MARGIN


class DecidedBy(Knob):
    """The test that decided a comparison (`judge`), in the order they are applied."""

    MARGIN = "margin"  # its median ratio is under 1 + its margin: the holder stays
    SHARE = "share of rounds"  # faster in fewer than CLEAR_SHARE of the rounds: the holder stays
    NOISE = "noise"  # the ratio's interval is wider than the margin: the machine cannot rank them at it
    CLEARED = "cleared"  # faster by its margin, in enough rounds, on a narrow enough interval: it replaces


class Method(Knob):
    """How the finalists were re-measured (`autofit.search.confirm.confirm`)."""

    LIVE_RUNS = "live runs"  # every finalist built once in this process, one optimizer step each per round
    PROBES = "probes"  # a whole probe of each per round (child processes, ranks, CUDA)
    NONE = "none"  # not re-measured: a single finalist measured in this session


@dataclasses.dataclass(frozen=True)
class Window:
    """Which fits are re-measured: those within `margin` of the best as probed, at most `limit` of them; on
    top, each safer class's fits within `margin` of its best as probed and each other class's within `margin`
    of the best, at most `safer` of each (one walk figure must not keep a class's fastest fit out), and each
    finalist's largest micro-batch."""

    margin: float
    limit: int
    safer: int = 1


LIVE_WINDOW = Window(0.50, 5, 3)  # live runs: a round is one optimizer step of each finalist
PROBE_WINDOW = Window(0.20, 2, 1)  # whole probes: a round builds every finalist again


@dataclasses.dataclass(frozen=True)
class Finalist:
    """One finalist: what the search measured for it, and its samples/s in each confirmation round."""

    config: Config
    tier: int  # exactness tier: 0 same math, 1 numerics change, 2 trains adapters
    near_limit: bool  # its allocator retried during the timed steps (CUDA)
    source: Source  # PROBED in this search, or STORED (an earlier session's figure)
    probed: float  # samples/s the search measured
    rounds: tuple[float, ...] = ()  # samples/s in each confirmation round, this session
    degree: int = 0  # how far its arithmetic moves from the exact baseline (`Space.degree`)
    numerics: tuple[str, ...] = ()  # its numerics changes, "knob=value" (`Space.numerics`); () exact

    @property
    def standing(self) -> "Standing":
        """What sets the margins it must clear, or others must clear against it."""
        return Standing(self.tier, self.numerics, self.near_limit, self.config.micro_batch_size)

    @property
    def median(self) -> float:
        """Confirmed samples/s: the median over the rounds (the probed figure when there were none)."""
        return statistics.median(self.rounds) if self.rounds else self.probed

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {**dataclasses.asdict(self), "config": self.config.to_dict(), "source": self.source.value,
                "rounds": list(self.rounds), "numerics": list(self.numerics)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Finalist":
        """Inverse of `to_dict`."""
        return cls(**{**data, "config": Config.from_dict(data["config"]), "source": Source(data["source"]),
                      "rounds": tuple(data["rounds"]), "numerics": tuple(data.get("numerics", ()))})


@dataclasses.dataclass(frozen=True)
class Standing:
    """What sets the margin between two finalists (`margin_between`)."""

    tier: int  # exactness tier
    numerics: tuple[str, ...] = ()  # the numerics changes, "knob=value" (`Space.numerics`)
    near_limit: bool = False  # its allocator retried while timed
    micro_batch: int = 0  # samples a rank's statistics are taken over where the micro-batch is a numerics change


@dataclasses.dataclass(frozen=True)
class Ratio:
    """Paired comparison of two finalists over the same rounds: samples/s of `a` over `b` in each round."""

    median: float
    low: float  # the interval the median ratio lies in at CONFIDENCE (order statistics of the rounds'
    high: float  # ratios: 7 rounds give the 2nd lowest and the 2nd highest; 6 or fewer, their range)
    wins: float  # share of the rounds in which `a` was faster
    rounds: int

    @property
    def spread(self) -> float:
        """How wide the interval is, relative: high / low - 1 (0 without rounds)."""
        return self.high / self.low - 1 if self.rounds and self.low > 0 else 0.0

    @classmethod
    def of(cls, a: Finalist, b: Finalist) -> "Ratio":
        """`a` against `b`; from the medians alone (one pseudo-round) when either was not re-measured."""
        pairs = [x / y for x, y in zip(a.rounds, b.rounds)] or [a.median / b.median]
        low, high = median_interval(pairs)
        return cls(statistics.median(pairs), low, high, sum(p > 1 for p in pairs) / len(pairs),
                   len(pairs) if a.rounds and b.rounds else 0)


def fewest_rounds(confidence: float = CONFIDENCE) -> int:
    """The fewest rounds whose interval of the median (`median_interval`: their range, at that count) holds it
    with at least `confidence`: the range of n values misses the median only where all of them lie on one side
    of it, with probability 2 / 2**n (4 at 85%: 87.5%, as 7 rounds' 2nd lowest to 2nd highest hold it)."""
    return next(n for n in itertools.count(2) if 1 - 2 / 2 ** n >= confidence)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The narrowest order-statistics interval (the k-th lowest to the k-th highest) that holds the median
    of the distribution `values` were drawn from with at least `confidence` (distribution-free: the count
    of values below the median is binomial(n, 1/2)); their range where no narrower one reaches it."""
    ordered = sorted(values)
    n, k = len(ordered), 1
    while k < (n + 1) // 2 and 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One step of the decision: a finalist that changes more (`challenger`) against the choice so far."""

    challenger: int  # index into `Confirmation.finalists`
    holder: int
    ratio: Ratio  # challenger over holder
    margin: float  # what the challenger had to clear
    kind: MarginKind  # why that margin
    won: bool
    decided_by: DecidedBy | None = None  # the test that decided it (None: derived, as plans written before kept it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", MarginKind.parse(self.kind, "kind"))
        decided = judge(self.ratio, self.margin, noise=False) if self.decided_by is None else self.decided_by
        object.__setattr__(self, "decided_by", DecidedBy.parse(decided, "decided_by"))
        if self.won != (self.decided_by is DecidedBy.CLEARED):
            raise ValueError(f"inconsistent comparison: won={self.won} but decided by {self.decided_by.value}")

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {**dataclasses.asdict(self), "kind": self.kind.value, "decided_by": self.decided_by.value}

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
    method: Method  # how the finalists were re-measured
    exact_margin: float
    dropped: tuple[tuple[str, str], ...] = ()  # (config described, why) of finalists a re-measurement lost
    window: float = PROBE_WINDOW.margin  # the window's margin the finalists were taken within
    threads: int | None = None  # torch's CPU threads every finalist was re-measured at (live runs)
    steps: int | None = None  # optimizer steps the re-measurement started (None: not counted, as in older plans)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method.parse(self.method, "method"))
        if self.steps is not None and (type(self.steps) is not int or self.steps < 0):
            raise ValueError(f"steps={self.steps!r}: the steps a re-measurement started are a count (>= 0)")

    @property
    def on_cpu_clock(self) -> bool:
        """Whether the rounds' figures are samples per second of the measuring thread's own CPU time (live runs
        at one torch thread, `autofit.search.confirm.step_seconds`) rather than of the wall clock: they rank
        the finalists, but a busy machine's wall throughput is lower."""
        return self.method is Method.LIVE_RUNS and self.threads == 1

    @property
    def unit(self) -> str:
        """What the rounds' figures count, for a sentence."""
        return "samples per CPU second" if self.on_cpu_clock else "samples/s"

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
                "comparisons": [c.to_dict() for c in self.comparisons], "method": self.method.value,
                "exact_margin": self.exact_margin, "dropped": [list(d) for d in self.dropped], "window": self.window,
                "threads": self.threads, "steps": self.steps}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Confirmation":
        """Inverse of `to_dict`."""
        return cls(tuple(Finalist.from_dict(f) for f in data["finalists"]), data["chosen"],
                   tuple(Comparison.from_dict(c) for c in data["comparisons"]), data["method"],
                   data["exact_margin"], tuple(tuple(d) for d in data.get("dropped", ())),
                   data.get("window", PROBE_WINDOW.margin), data.get("threads"), data.get("steps"))


def check_margin(exact_margin: Any) -> float:
    """`exact_margin` as a float, or `UsageError` naming the bad value."""
    if isinstance(exact_margin, bool) or not isinstance(exact_margin, (int, float)) or not 0 <= exact_margin < 10:
        raise UsageError(f"exact_margin must be a fraction >= 0 (0.10 = a numerics change must be 10% faster "
                         f"than an exact fit), but got {exact_margin!r}.")
    return float(exact_margin)


def level_of(config: Config) -> Config:
    return config.replace(micro_batch_size=1, grad_accum_steps=1)


def simplicity(space: "Space", result: ProbeResult) -> tuple:
    """Sort key from the least to the most change: exactness tier, how far the arithmetic moves, allocator
    retries, the level's place in the space (fewer knobs changed first), the larger micro-batch (fewer
    accumulation passes)."""
    return change_order(space, result.config, result.near_limit)


def change_order(space: "Space", config: Config, near_limit: bool = False,
                 order: dict[Config, int] | None = None) -> tuple:
    """`simplicity` of a configuration (a prediction has no allocator retries: `near_limit` False). `order`:
    `level_order(space)` made once, where many configurations of one space are ordered."""
    order = level_order(space) if order is None else order
    return (space.tier(config), space.degree(config), near_limit, order.get(level_of(config), len(order)),
            -config.micro_batch_size)


def level_order(space: "Space") -> dict[Config, int]:
    """Each level of `space` by its place among `space.levels()` (fewer knobs changed first)."""
    return {level: i for i, level in enumerate(space.levels())}


def risk(space: "Space", result: ProbeResult) -> tuple[int, int, bool]:
    """The class a fit belongs to for the finalists: the best of each safer class is re-measured."""
    return space.tier(result.config), space.degree(result.config), result.near_limit


def standing(space: "Space", config: Config, near_limit: bool = False) -> Standing:
    """`config`'s `Standing` in `space`."""
    return Standing(space.tier(config), space.numerics(config), near_limit, config.micro_batch_size)


def margin_between(holder: Standing, challenger: Standing, exact_margin: float) -> tuple[float, MarginKind]:
    """What `challenger` must clear against `holder`, and why: a change of the arithmetic beyond the holder's
    (`steps_up`) `exact_margin`; allocator retries the holder had not NEAR_LIMIT_MARGIN; anything else
    NOISE_MARGIN."""
    if steps_up(holder, challenger):
        return exact_margin, MarginKind.EXACTNESS
    if challenger.near_limit and not holder.near_limit:
        return NEAR_LIMIT_MARGIN, MarginKind.NEAR_LIMIT
    return NOISE_MARGIN, MarginKind.NOISE


_COUPLED = "micro_batch_size="  # `Space.numerics`' entry of a micro-batch that batch norm or the loss couples


def steps_up(holder: Standing, challenger: Standing) -> bool:
    """Whether `challenger` changes the arithmetic more than `holder`: a higher tier, or numerics changes other
    than the holder's (pure bf16 against bf16 autocast, Adafactor against 8-bit states), or statistics over
    fewer samples where the micro-batch is a numerics change (batch norm over 2 samples moves further from the
    rank's batch than over 4: the larger micro-batch changes less, not more)."""
    if challenger.tier > holder.tier:
        return True
    others = [[n for n in s.numerics if not n.startswith(_COUPLED)] for s in (holder, challenger)]
    if others[0] != others[1]:
        return True
    coupled = [any(n.startswith(_COUPLED) for n in s.numerics) for s in (holder, challenger)]
    return coupled[1] and (not coupled[0] or challenger.micro_batch < holder.micro_batch)


def unsettled(comparison: Comparison) -> bool:
    """Whether more rounds could turn `comparison`: its interval is wider than the margin allows (NOISE), or
    holds the margin's edge, so the median may yet land on either side of it."""
    ratio, edge = comparison.ratio, 1 + comparison.margin
    return comparison.decided_by is DecidedBy.NOISE or (ratio.rounds > 1 and ratio.low < edge <= ratio.high)


def judge(ratio: Ratio, margin: float, noise: bool = True) -> DecidedBy:
    """The test that decides a challenger at `ratio` over the holder that had to clear `margin` (see the
    module doc); `noise=False` leaves the interval out (records written before it was applied)."""
    if ratio.median < 1 + margin:
        return DecidedBy.MARGIN
    if ratio.wins < CLEAR_SHARE:
        return DecidedBy.SHARE
    if noise and ratio.rounds > 1 and ratio.spread > max(margin, NOISE_MARGIN) and not _clear_of_noise(ratio, margin):
        return DecidedBy.NOISE
    return DecidedBy.CLEARED


def _clear_of_noise(ratio: Ratio, margin: float) -> bool:
    """Whether the interval lies above the margin by at least its own width: the gain its low end shows is
    larger than the disagreement between the rounds (1.07-1.12 shows a 3% gain; 1.30-2.00 shows no 10% one)."""
    return ratio.low >= 1 + margin and ratio.low - 1 >= ratio.spread


def decide(pool: Sequence[Finalist], exact_margin: float) -> tuple[int, list[Comparison]]:
    """Index of the chosen finalist in `pool` (ordered from the least to the most change) and the
    comparisons that decided it (see the module doc)."""
    holder, comparisons = 0, []
    for index in range(1, len(pool)):
        comparisons.append(_compare(pool, index, holder, exact_margin))
        if comparisons[-1].won:
            holder = index
    return holder, comparisons


def possible_winners(pool: Sequence[Finalist], exact_margin: float) -> frozenset[int]:
    """Every finalist that more rounds could still make the choice: `decide`'s walk, taking both turns at
    each comparison still undecided for noise alone (`unsettled`). One index when no comparison left open
    can change the choice (an undecided pair that a third finalist beats either way): the rounds stop there."""

    @functools.lru_cache(maxsize=None)
    def walk(index: int, holder: int) -> frozenset[int]:
        if index == len(pool):
            return frozenset({holder})
        comparison = _compare(pool, index, holder, exact_margin)
        if unsettled(comparison):
            return walk(index + 1, holder) | walk(index + 1, index)
        return walk(index + 1, index if comparison.won else holder)

    return walk(1, 0)


def _compare(pool: Sequence[Finalist], index: int, holder: int, exact_margin: float) -> Comparison:
    """`pool[index]` judged against `pool[holder]`, the choice so far."""
    challenger, current = pool[index], pool[holder]
    margin, kind = margin_between(current.standing, challenger.standing, exact_margin)
    ratio = Ratio.of(challenger, current)
    decided = judge(ratio, margin)
    return Comparison(index, holder, ratio, margin, kind, decided is DecidedBy.CLEARED, decided)


def choose(results: Sequence[ProbeResult], confirmation: Confirmation | None = None) -> ProbeResult | None:
    """The confirmed choice's result when there is a confirmation, else the fit with the highest
    measured throughput (what the walk's deadlines compare against)."""
    fits = [r for r in results if r.fits]
    if confirmation is not None:
        return next((r for r in fits if r.config == confirmation.winner.config), None)
    return max(fits, key=lambda r: r.samples_per_s, default=None)
