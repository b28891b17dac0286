"""The strategy contract: one technique of the decision tree, one small class.

A strategy owns one field of `Config`. It says which values it offers for a spec (cheapest first), why a
value is unavailable, how its values compare in memory saved (so the search can skip candidates that
are certain to fail), and how a value is applied to the training run a probe builds.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from autofit.spec.train import TrainSpec
    from autofit.probe.step import TrainRun


@dataclasses.dataclass(frozen=True)
class Option:
    """One value a strategy offers: its exactness tier, and a one-line reason (why offered, or why not)."""

    value: Any
    tier: int  # 0 same math, 1 standard numerics change, 2 trains something different (opt-in)
    reason: str
    available: bool = True


class Strategy(abc.ABC):
    """One technique. Subclasses set `field` and `rung` and implement `options` and `apply`."""

    field: ClassVar[str]  # the Config field this strategy sets
    rung: ClassVar[int]  # position in DESIGN.md's decision tree (cheapest first)

    @abc.abstractmethod
    def options(self, spec: "TrainSpec") -> list[Option]:
        """Every value for `spec`, cheapest (least cost) first; unavailable ones carry the reason."""

    @abc.abstractmethod
    def apply(self, run: "TrainRun", value: Any) -> None:
        """Make the probe's training run use `value` (called in rung order, before the optimizer exists)."""

    def saves_at_least(self, a: Any, b: Any) -> bool:
        """Whether value `a` needs no more memory than value `b`, everything else equal."""
        return a == b

    def isolates(self, value: Any) -> bool:
        """Whether a probe using `value` touches process-global state and must run in a child process."""
        return False

    def default(self, spec: "TrainSpec") -> Any:
        """The value used when the search does not vary this field: the first available option."""
        return next(option.value for option in self.options(spec) if option.available)


class Ladder(Strategy):
    """A strategy whose values each save at least as much memory as the ones before them in `values`
    ("none" first); any value but the first runs through an engine in launched ranks (a child process)."""

    values: ClassVar[tuple[Any, ...]]

    def saves_at_least(self, a: Any, b: Any) -> bool:
        return self.values.index(a) >= self.values.index(b)

    def isolates(self, value: Any) -> bool:
        return value != self.values[0]
