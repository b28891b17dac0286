"""The search's own knobs, as one value: how many probes, how long each runs, the margins a fit and a
numerics change must clear, and whether the estimator prunes. `autofit.autofit(options=SearchOptions(...))`
takes it; its keywords of the same names (`max_probes=`, `warmup_steps=`, ...) are shortcuts that set these
fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from autofit.errors import Param, UsageError
from autofit.job.train_spec import DEFAULT_SAFETY_MARGIN
from autofit.probe.launch import DEFAULT_TIMEOUT
from autofit.search.decision import DEFAULT_EXACT_MARGIN
from autofit.search.walk import DEFAULT_MAX_PROBES


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How `autofit.autofit` searches, checked when built (`UsageError` naming the bad value)."""

    max_probes: int = DEFAULT_MAX_PROBES
    """At most this many probes run (each builds the model and trains `warmup_steps + timed_steps` steps);
    the levels left are recorded as skipped, with that reason."""

    warmup_steps: int = 2
    """Untimed optimizer steps per probe before the timed ones (two reach the steady-state peak: the first
    makes the optimizer states, the second holds them through its backward)."""

    timed_steps: int = 3
    """Timed optimizer steps per probe: their median seconds give its throughput (more steps, steadier
    figures, longer probes)."""

    max_micro_batch: int = 1024
    """Largest micro-batch tried (samples) when no global batch size is given."""

    probe_timeout: float = DEFAULT_TIMEOUT
    """Wall seconds a probe may take (setup included) before it is stopped and recorded as an error: a child
    process (or its ranks) is killed, an in-process probe interrupted (on the main thread); a probe is a few
    steps, so this only stops a hang."""

    safety_margin: float = DEFAULT_SAFETY_MARGIN
    """Fraction of the memory budget a fit must leave free (0.10: a fit peaks under 90% of it)."""

    exact_margin: float = DEFAULT_EXACT_MARGIN
    """How much faster (0.10 = 10%) a numerics change (bf16/fp16, 8-bit optimizer states, Adafactor in place
    of your AdamW) must be than the best exact fit, re-measured back to back, to be chosen over it."""

    predict: bool = True
    """Whether the dry-run estimator starts each level at the largest micro-batch predicted to fit and skips
    configurations predicted over the budget by more than its measured error (fewer probes)."""

    def __post_init__(self) -> None:
        _integer("max_probes", self.max_probes, 1, "probes the search may run")
        _integer("warmup_steps", self.warmup_steps, 0, "untimed steps per probe")
        _integer("timed_steps", self.timed_steps, 1, "timed steps per probe")
        _integer("max_micro_batch", self.max_micro_batch, 1, "the largest micro-batch tried, in samples")
        _number("probe_timeout", self.probe_timeout, "wall seconds a probe may take",
                lambda value: value > 0, "> 0")
        _number("safety_margin", self.safety_margin, "the share of the budget a fit leaves free",
                lambda value: 0 <= value < 1, "in [0, 1)")
        _number("exact_margin", self.exact_margin, "0.10 = a numerics change must be 10% faster than an exact fit",
                lambda value: 0 <= value < 10, ">= 0")
        if not isinstance(self.predict, bool):
            raise UsageError("{name} must be True or False (whether the estimator prunes), but got {value}.",
                             name=Param("predict"), value=repr(self.predict))
        object.__setattr__(self, "probe_timeout", float(self.probe_timeout))
        object.__setattr__(self, "safety_margin", float(self.safety_margin))
        object.__setattr__(self, "exact_margin", float(self.exact_margin))

    def replace(self, **fields: Any) -> "SearchOptions":
        """A copy with `fields` changed (checked again); a field given as None keeps its value."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise UsageError(f"SearchOptions has no field {unknown[0]!r}; its fields are "
                             f"{', '.join(f.name for f in dataclasses.fields(self))}.")
        return dataclasses.replace(self, **{name: value for name, value in fields.items() if value is not None})


def _integer(name: str, value: Any, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError("{name} must be an integer >= {minimum} ({what}), but got {value}.", name=Param(name),
                         minimum=str(minimum), what=what, value=repr(value))


def _number(name: str, value: Any, what: str, valid: Callable[[float], bool], bound: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
        raise UsageError("{name} must be a number {bound} ({what}), but got {value}.", name=Param(name),
                         bound=bound, what=what, value=repr(value))
