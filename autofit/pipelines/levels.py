"""Which levels a dry-run predicts: every level of the space at its best micro-batch, but for those that could be
neither chosen nor the closest to fitting (`best_levels`): knobs that only relieve memory where the level they
relieve fits or is faster (`Strategy.relieves`, `_may_win`), and levels whose states alone are over the limit
and over the least need predicted (`_closest_over`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autofit.config import Config
from autofit.pipelines.candidate import Candidate
from autofit.search.space import Space

if TYPE_CHECKING:
    from autofit.pipelines.dry_run import _Planner
    from autofit.strategies.base import Strategy

Relieves = Callable[["Strategy", Config], "Config | None"]  # `Strategy.relieves`, asked of a strategy and a level


def _asked(strategy: "Strategy", level: Config) -> Config | None:
    return strategy.relieves(level)


def best_levels(space: Space, planner: "_Planner", strategies: Sequence["Strategy"],
                listener: Callable[[int, int], Any] | None) -> list[Candidate]:
    """Each level at its best micro-batch (`_Planner.best_at`). A level whose knobs only relieve memory, never
    faster at the same micro-batch (`Strategy.relieves`: checkpointing, a chunked loss, offloading, expandable
    segments), is predicted only where it could be chosen over the level they relieve (`_may_win`); one whose
    model states alone are over the limit, only where it could be the closest to fitting (`_closest_over`)."""
    levels = list(space.levels())
    planned = set(levels)
    relieves = functools.cache(_asked)  # asked of each level again and again
    reliefs = {level: _reliefs(level, strategies, planned, relieves) for level in levels}
    knobs = {level: sum(relieves(strategy, level) is not None for strategy in strategies) for level in levels}
    best: dict[Config, Candidate] = {}
    over: list[Config] = []
    left_out: set[Config] = set()
    for count in sorted(set(knobs.values())):  # a level after every level it relieves: those have fewer knobs
        wave = [level for level in levels if knobs[level] == count]
        left_out.update(level for level in wave if not all(_may_win(planner, level, relieved, whole, best, left_out)
                                                           for relieved, whole in reliefs[level]))
        wave = [level for level in wave if level not in left_out]
        states_over = {level for level in wave if planner.states_over(planner.smallest(level))}
        over += [level for level in wave if level in states_over]
        wave = [level for level in wave if level not in states_over]
        planner.estimator.prefetch((config for level in wave for config in planner.asks(level)), listener)
        best.update(zip(wave, planner.best_of(wave)))
    best.update(_closest_over(planner, over, best, listener))
    return [best[level] for level in levels if level in best]


def _closest_over(planner: "_Planner", over: list[Config], best: dict[Config, Candidate],
                  listener: Callable[[int, int], Any] | None) -> dict[Config, Candidate]:
    """The levels of `over` (model states alone over the limit: no size fits) at their smallest micro-batch, each
    predicted only where its states (`Estimator.states_floor`, a lower bound of its need) are under the least
    need of those predicted (`best`'s, and theirs as they come, least states first): the rest could be neither
    chosen nor the closest to fitting."""
    floors = {level: planner.estimator.states_floor(planner.smallest(level)) for level in over}
    found: dict[Config, Candidate] = {}
    least = min((c.estimate.need_bytes for c in best.values()), default=float("inf"))
    ordered = sorted(over, key=floors.__getitem__)
    for batch in (ordered[:1], ordered[1:]):  # the first one's need bounds which others are simulated
        batch = [level for level in batch if floors[level] < least]
        planner.estimator.prefetch((planner.smallest(level) for level in batch), listener)
        for level in batch:
            if floors[level] >= least:
                break
            found[level] = planner.best_at(level)
            least = min(least, found[level].estimate.need_bytes)
    return found


def _reliefs(level: Config, strategies: Sequence["Strategy"], planned: set[Config],
             relieves: Relieves = _asked) -> list[tuple[Config, bool]]:
    """The planned levels `level` relieves (`Strategy.relieves`, asked through `relieves`), each with whether it is
    the whole relief (every knob that relieves at its default, else, that one not planned, every one but one:
    `_relieved`) or one knob's."""
    whole = _relieved(level, strategies, planned, relieves)
    ones = {one for strategy in strategies if (one := relieves(strategy, level)) is not None and one in planned}
    return [(whole, True)] * (whole is not None) + [(one, False) for one in ones - {whole}]


def _relieved(level: Config, strategies: Sequence["Strategy"], planned: set[Config],
              relieves: Relieves = _asked) -> Config | None:
    """The planned level `level` relieves as a whole: every knob that does (`Strategy.relieves`) at its default,
    else (that one not planned: state offloading on one GPU, its engine's reason to be there) every one but one,
    kept as `level` has it (its cost does not change with the others'); None where there is none."""
    reliefs = [strategy for strategy in strategies if relieves(strategy, level) is not None]
    for kept in (None, *reliefs):
        relieved = level
        for strategy in reliefs:
            relieved = relieved if strategy is kept else relieves(strategy, relieved) or relieved
        if relieved != level and relieved in planned:
            return relieved
    return None


def _may_win(planner: "_Planner", level: Config, relieved: Config, whole: bool, best: dict[Config, Candidate],
             left_out: set[Config]) -> bool:
    """Whether `level`, whose knobs only relieve memory, could be chosen over a level it relieves (`relieved`;
    `whole`: every such knob of `level` reset; `best`: the levels predicted so far, `left_out` those this left
    out). Not where that one fits cleanly at its largest micro-batch and, reset whole or running the same step
    at the same cost (`_Planner.alike`: expandable segments), is as fast at every size, or is alike and left
    out; nor where it is faster than `level` could be at any size (`_Planner.fastest`, with as many kernels a
    micro-step: the knobs add kernels, never remove them). Elsewhere that one changes less, and the tuner's
    rule keeps it."""
    found = best.get(relieved)
    if found is None or not found.fits:
        return not (relieved in left_out and planner.alike(level, relieved))
    largest = found.config.micro_batch_size >= planner.largest(relieved).micro_batch_size
    if largest and (whole or planner.alike(level, relieved)):
        return False
    return planner.fastest(level, found.estimate.kernels) < found.step_seconds
