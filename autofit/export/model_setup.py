"""The lines a training script runs on its model to apply what no launcher file can say (pure bf16, the
chunked loss, checkpointing op by op or every k-th block, activation offloading, the optimizer step in
backward, and for the Trainer the attention implementation and the adapters): each strategy's
`setup_lines`, which call the strategy's own code, in the order the probe applied them (rung order), so the
launched job runs what was measured.

The Trainer script runs them itself; the DeepSpeed file lists them in its "autofit" section, and the
accelerate and torchrun files as comments, for your train.py.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from autofit.config import Config
from autofit.errors import AutofitError
from autofit.strategies import for_plan
from autofit.strategies.base import Strategy

if TYPE_CHECKING:
    from autofit.plan import Plan


def strategies_of(plan: "Plan") -> list[Strategy]:
    """The strategies `plan` runs with, each as the plan recorded it (`autofit.strategies.for_plan`)."""
    return for_plan(plan.settings, plan.spec)


def setup_lines(plan: "Plan", fmt: str) -> list[str]:
    """Python lines applying `plan`'s model-side knobs to a variable `model` in a script of format `fmt`
    (none when it has none)."""
    return [line for strategy in strategies_of(plan) for line in strategy.setup_lines(plan.config, fmt)]


def setup_comments(plan: "Plan", fmt: str) -> list[str]:
    """`setup_lines` as shell/YAML comments for train.py (none when there are none)."""
    lines = setup_lines(plan, fmt)
    return ["# In train.py, after building the model (as probed):", *(f"#   {line}" for line in lines)] if lines else []


def refusal(plan: "Plan", fmt: str) -> str | None:
    """Why format `fmt` cannot run `plan` (the first strategy that refuses it), or None."""
    return next((why for strategy in strategies_of(plan) if (why := strategy.refuses(plan.config, fmt))), None)


def launcher_keys(plan: "Plan", fmt: str) -> dict[str, object]:
    """Every strategy's keys for format `fmt`, in rung order (a later key wins; dotted names as given)."""
    keys: dict[str, object] = {}
    for strategy in strategies_of(plan):
        keys.update(strategy.launcher_keys(plan.config, fmt))
    return keys


def left_out(plan: "Plan", launched: Callable[["Plan"], Any] | None) -> list[str]:
    """The plan's knobs (as "knob=value") that what a format runs without your code (`launched(plan)`: the
    launcher's document, the lines its own script runs; None: everything, as train_with_prepare.py does) does
    not depend on: set to its default, the knob changes nothing there, so your training script must apply it.
    One entry per knob, in rung order."""
    if launched is None:
        return []
    base = launched(plan)
    fields = {s.field for s in strategies_of(plan)}
    left: list[str] = []
    for strategy in strategies_of(plan):
        value = strategy.value(plan.config)
        word = f"{strategy.field}={value}"
        if value == Config().knob(strategy.field) or word in left:
            continue
        variant = _at_default(plan.config, strategy.field, fields)
        if variant is None or _same(launched, dataclasses.replace(plan, config=variant), base):
            left.append(word)
    return left


def _at_default(config: Config, field: str, fields: set[str]) -> Config | None:
    """`config` with knob `field` at its default (and, where that alone is no valid config, with the fields no
    strategy owns at theirs too: a frequency that belongs to a mode), or None where no such config exists."""
    default = Config()
    try:
        return config.replace(**{field: default.knob(field)})
    except AutofitError:
        pass
    free = {f.name for f in dataclasses.fields(Config)} - fields - {"grad_accum_steps", "extras"}
    try:
        return config.replace(**{field: default.knob(field), **{name: getattr(default, name) for name in free}})
    except AutofitError:
        return None


def _same(launched: Callable[["Plan"], Any], variant: "Plan", base: Any) -> bool:
    """Whether `variant` launches as `base` does; a variant the format cannot even build depends on the knob."""
    try:
        return launched(variant) == base
    except (AutofitError, ValueError):
        return False
