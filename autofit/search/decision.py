"""The decision between the finalists the confirmation re-measured (`autofit.search.confirm`), and its records.

The finalists are taken (`decide`) in order from the least to the most change (exactness tier,
then allocator retries, then fewer knobs changed, then the larger micro-batch). Starting from the
first, one that changes more replaces the choice only when clearly faster: a median paired ratio of at
least 1 + its margin, winning at least CLEAR_SHARE of the rounds. The margin is `exact_margin`
(default 10%) for a higher exactness tier (bf16/fp16, 8-bit states, Adafactor), NEAR_LIMIT_MARGIN for
a fit whose allocator retried, and NOISE_MARGIN otherwise: within the noise the simpler one stays.

`choose` picks the plan's result from the search's: the confirmed choice where there is a confirmation,
else the fastest fit (what the walk's deadlines compare against).
"""

from __future__ import annotations

import dataclasses
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


class MarginKind(Knob):
    """Why a challenger had the margin it had to clear (`margin_between`)."""

    EXACTNESS = "exactness"  # it changes numerics (a higher exactness tier): `exact_margin`
    NEAR_LIMIT = "near-limit"  # its allocator retried while timed, the holder's did not: NEAR_LIMIT_MARGIN
    NOISE = "noise"  # any other change: NOISE_MARGIN


class Method(Knob):
    """How the finalists were re-measured (`autofit.search.confirm.confirm`)."""

    LIVE_RUNS = "live runs"  # every finalist built once in this process, one optimizer step each per round
    PROBES = "probes"  # a whole probe of each per round (child processes, ranks, CUDA)
    NONE = "none"  # not re-measured: a single finalist measured in this session


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
    kind: MarginKind  # why that margin
    won: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", MarginKind.parse(self.kind, "kind"))

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {**dataclasses.asdict(self), "kind": self.kind.value}

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method.parse(self.method, "method"))

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


def level_of(config: Config) -> Config:
    return config.replace(micro_batch_size=1, grad_accum_steps=1)


def simplicity(space: "Space", result: ProbeResult) -> tuple:
    """Sort key from the least to the most change: exactness tier, allocator retries, the level's place
    in the space (fewer knobs changed first), the larger micro-batch (fewer accumulation passes)."""
    return change_order(space, result.config, result.near_limit)


def change_order(space: "Space", config: Config, near_limit: bool = False) -> tuple:
    """`simplicity` of a configuration (a prediction has no allocator retries: `near_limit` False)."""
    order = {level: i for i, level in enumerate(space.levels())}
    return (space.tier(config), near_limit, order.get(level_of(config), len(order)), -config.micro_batch_size)


def risk(space: "Space", result: ProbeResult) -> tuple[int, bool]:
    return space.tier(result.config), result.near_limit


def margin_between(safer: tuple[int, bool], riskier: tuple[int, bool],
                   exact_margin: float) -> tuple[float, MarginKind]:
    """What a finalist of class `riskier` must clear against one of class `safer`, and why."""
    if riskier[0] > safer[0]:
        return exact_margin, MarginKind.EXACTNESS
    if riskier[1] and not safer[1]:
        return NEAR_LIMIT_MARGIN, MarginKind.NEAR_LIMIT
    return NOISE_MARGIN, MarginKind.NOISE


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


def choose(results: Sequence[ProbeResult], confirmation: Confirmation | None = None) -> ProbeResult | None:
    """The confirmed choice's result when there is a confirmation, else the fit with the highest
    measured throughput (what the walk's deadlines compare against)."""
    fits = [r for r in results if r.fits]
    if confirmation is not None:
        return next((r for r in fits if r.config == confirmation.winner.config), None)
    return max(fits, key=lambda r: r.samples_per_s, default=None)
