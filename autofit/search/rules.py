"""The rules between knobs: which combinations cannot run, and why. One table (`rules()`: those each strategy
contributes, `Strategy.rules`, for a limit of its own technique, and the joint ones of the one joint module,
`autofit.estimate.states.JOINT_RULES`, for limits that belong to no one technique), applied once where the
space is built (`autofit.search.space`); every combination a rule excludes is recorded with its reason and
never probed. This module names no technique: it orders and checks them.

A rule looks at a candidate's knobs and its `Target` and returns the reason it cannot run, or None.
Most rules read level knobs; a rule that reads the accumulation (the optimizer step in backward) is
applied at every micro-batch size too (`Space.sizes_at`).
`Rule.knobs` names the fields the rule reads, so an excluded combination is recorded once per
distinct value of those fields, not once per level.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from autofit.config import Config
from autofit.estimate.states import JOINT_RULES
from autofit.strategies import completed
from autofit.strategies.base import Rule, plugin_classes

if TYPE_CHECKING:
    from autofit.job.target import Target


# The order the rules are checked in, by name (the first a combination breaks gives its reason): the
# joint ones and the strategies' own; a rule not listed (a plug-in's) after these, in rung order.
ORDER = ("offload needs an engine", "NVMe needs ZeRO-3", "ZeRO-Offload steps with CPU Adam",
         "8-bit states cannot step on the host", "Adafactor cannot step FSDP2 shards", "quantization needs LoRA",
         "quantized weights are not sharded", "flash-attention needs half precision", "one rank shards nothing",
         "pure bf16 trains with torch", "step in backward on one torch rank", "step in backward at accumulation 1",
         "step in backward needs no global view", "activation offload with none or full checkpointing",
         "hierarchical sharding needs several nodes", "ZeRO++'s node partition stays on the GPU",
         "ZeRO++ quantizes 16-bit collectives")


def rules() -> tuple[Rule, ...]:
    """Every rule between knobs, in `ORDER`: the joint ones (`autofit.estimate.states.JOINT_RULES`) and those of
    every built-in and plug-in strategy (`Strategy.rules`)."""
    return _rules(plugin_classes())


@functools.lru_cache(maxsize=8)
def _rules(plugin_classes: tuple[type, ...]) -> tuple[Rule, ...]:
    found = [*JOINT_RULES, *(rule for strategy in completed() for rule in strategy.rules())]
    return tuple(sorted(found, key=lambda r: ORDER.index(r.name) if r.name in ORDER else len(ORDER)))


def violation(config: Config, target: "Target") -> tuple[Rule, str] | None:
    """The first rule `config` breaks on `target`, with its reason; None when it can run."""
    for rule in rules():
        reason = rule.check(config, target)
        if reason:
            return rule, reason
    return None
