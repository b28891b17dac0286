"""The lines a training script runs on its model to apply what no launcher file can say (pure bf16, the
chunked loss, checkpointing op by op or every k-th block, activation offloading, the optimizer step in
backward, and for the Trainer the attention implementation and the adapters): each strategy's
`setup_lines`, which call the strategy's own code, in the order the probe applied them (rung order), so the
launched job runs what was measured.

The Trainer script runs them itself; the DeepSpeed file lists them in its "autofit" section, and the
accelerate and torchrun files as comments, for your train.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
