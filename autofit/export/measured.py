"""What every launcher file carries besides its knobs: what was measured, where, and by which autofit.

Also the gate every format goes through: a plan that does not fit has nothing worth launching. A plan's text
(its reason can quote a probe's error; its model name is whatever the model was called) is data: it reaches a
comment as one line of printable characters (`one_line`), and a generated Python script only as a literal
(`python_literal`), never pasted into its source.
"""

from __future__ import annotations

import pprint
from typing import TYPE_CHECKING, Any

from autofit.errors import UsageError
from autofit.strategies.base import set_nested
from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.plan import Plan


def require_fit(plan: "Plan") -> None:
    """Raise `UsageError` when `plan` has no fitting configuration, saying why and what to do."""
    if not plan.fits or plan.config is None:
        raise UsageError("This plan does not fit, so there is nothing to export: {why} Re-run autofit tune with "
                         "what the message allows, then export the new plan.", why=plan.shortfall or plan.reason)


def measured(plan: "Plan") -> dict[str, Any]:
    """JSON-serialisable record of the measurement behind `plan`: throughput (samples/s, tokens/s, images/s),
    peak memory (bytes), device, budget (bytes), date and autofit version."""
    spec = plan.spec
    return {
        "configuration": plan.config.describe(),
        "throughput_samples_per_s": _round(plan.throughput),
        "throughput_tokens_per_s": _round(plan.tokens_per_second),
        "throughput_images_per_s": _round(plan.images_per_second),
        "peak_memory_bytes": plan.peak_memory,
        "peak_memory": format_size(plan.peak_memory),
        "device": spec.get("device"),
        "memory_budget_bytes": spec.get("memory_budget"),
        "memory_budget": format_size(spec.get("memory_budget")),
        "model": spec.get("model"),
        "global_batch_size": plan.config.global_batch_size,
        "date": plan.created,
        "autofit_version": plan.autofit_version,
        "reason": plan.reason,
    }


def with_launcher_keys(document: dict[str, Any], plan: "Plan", fmt: str) -> dict[str, Any]:
    """`document` with the keys every strategy writes into format `fmt` (`Strategy.launcher_keys`; dotted names
    nest), over those the exporter wrote."""
    from autofit.export.model_setup import launcher_keys

    for dotted, value in launcher_keys(plan, fmt).items():
        set_nested(document, dotted, value)
    return document


def comment_lines(plan: "Plan", prefix: str = "# ") -> list[str]:
    """The measurement as comment lines for formats that have comments (YAML, shell, Python)."""
    info = measured(plan)
    measurement = f"Measured on {info['device']}: {plan.figures()} of a {info['memory_budget']} budget." \
        if plan.throughput is not None else f"Configuration {plan.figures()}."
    lines = [
        f"Written by autofit {info['autofit_version']} on {info['date']} for {info['model']}.",
        f"Configuration: {info['configuration']} (global batch {info['global_batch_size']}).",
        measurement,
        f"Why: {info['reason']}",
    ]
    return [prefix + one_line(line) for line in lines]


def one_line(text: object) -> str:
    """`text` as one line of printable characters: every line break (a shell's, YAML's, Python's: \\n, \\r,
    \\x85, \\u2028, ...) and control character becomes a space, so a comment holding it cannot end early."""
    printable = "".join(ch if ch.isprintable() else " " for ch in str(text))
    return " ".join(printable.split())


def python_literal(value: Any) -> str:
    """`value` (JSON values: what a plan holds) as a Python literal for a generated script (`repr`, wrapped):
    quotes, backslashes and line breaks in its strings are escaped, so no plan text becomes code."""
    return pprint.pformat(value, width=110, sort_dicts=False)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
