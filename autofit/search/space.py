"""Candidates: the strategies' options for a spec, filtered by availability and allowed tier, laid out
as levels (every knob but the micro-batch) in the decision tree's order, plus the micro-batch sizes.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from autofit.config import Config
from autofit.spec.train import TrainSpec
from autofit.strategies.base import Option, Strategy

TIER_NAMES = {1: "allow={'numerics'} (mixed precision, 8-bit optimizers)",
              2: "allow={'lora'} (LoRA adapters, quantized base weights)"}


@dataclasses.dataclass(frozen=True)
class Excluded:
    """An option the search will not try, and why."""

    field: str
    option: Option
    reason: str


@dataclasses.dataclass(frozen=True)
class Space:
    """What the search walks: ordered levels (configs without their micro-batch) and micro-batch sizes."""

    spec: TrainSpec
    strategies: tuple[Strategy, ...]
    choices: dict[str, tuple[Any, ...]]  # field -> allowed values, cheapest first
    sizes: tuple[int, ...]  # micro-batch sizes, ascending
    excluded: tuple[Excluded, ...]

    @property
    def level_strategies(self) -> tuple[Strategy, ...]:
        """Every strategy but the micro-batch one, in rung order."""
        return tuple(s for s in self.strategies if s.field != "micro_batch_size")

    def levels(self) -> list[Config]:
        """Every combination of the level knobs, cheapest first: fewer and earlier changes first."""
        fields = [s.field for s in self.level_strategies]
        combos = itertools.product(*(range(len(self.choices[f])) for f in fields))
        ordered = sorted(combos, key=lambda idx: (sum(idx), tuple(reversed(idx))))
        base = Config(num_gpus=self.spec.num_gpus)
        return [base.replace(**{f: self.choices[f][i] for f, i in zip(fields, idx)}) for idx in ordered]

    def at(self, level: Config, micro_batch: int) -> Config:
        """`level` at `micro_batch`, with the accumulation that keeps the global batch."""
        per_rank = (self.spec.global_batch_size or micro_batch * self.spec.num_gpus) // self.spec.num_gpus
        return level.replace(micro_batch_size=micro_batch, grad_accum_steps=per_rank // micro_batch)

    def saves_at_least(self, a: Config, b: Config) -> bool:
        """Whether config `a` needs no more memory than `b`: every knob of `a` saves at least as much."""
        return all(s.saves_at_least(getattr(a, s.field), getattr(b, s.field)) for s in self.strategies)

    def isolates(self, config: Config) -> bool:
        """Whether probing `config` touches process-global state (run it in a child process)."""
        return any(s.isolates(getattr(config, s.field)) for s in self.strategies)

    def next_tier_hint(self) -> str | None:
        """What to allow to go further, when options were excluded by their tier."""
        tiers = sorted({e.option.tier for e in self.excluded if e.option.available and e.option.tier > self.spec.max_tier})
        return TIER_NAMES.get(tiers[0]) if tiers else None


def build_space(spec: TrainSpec, strategies: Sequence[Strategy]) -> Space:
    """The search space for `spec`; raises when a strategy has no usable option at all."""
    from autofit.errors import UsageError

    ordered = tuple(sorted(strategies, key=lambda s: s.rung))
    choices: dict[str, tuple[Any, ...]] = {}
    excluded: list[Excluded] = []
    for strategy in ordered:
        kept = []
        for option in strategy.options(spec):
            reason = _exclusion(option, spec.max_tier)
            if reason:
                excluded.append(Excluded(strategy.field, option, reason))
            else:
                kept.append(option.value)
        if not kept:
            reasons = "; ".join(e.reason for e in excluded if e.field == strategy.field)
            raise UsageError(f"No usable {strategy.field}: {reasons}")
        choices[strategy.field] = tuple(kept)
    sizes = tuple(sorted(choices.pop("micro_batch_size")))
    return Space(spec, ordered, choices, sizes, tuple(excluded))


def _exclusion(option: Option, max_tier: int) -> str | None:
    if not option.available:
        return option.reason
    if option.tier > max_tier:
        return f"tier {option.tier} not allowed: {TIER_NAMES.get(option.tier, '')}"
    return None

