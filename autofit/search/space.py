"""The space: the strategies' options for a spec and its Target, filtered by availability and allowed
tier, laid out as levels (every knob but the micro-batch) in the decision tree's order, with the rules
between knobs (`autofit.search.rules`) applied once, plus the micro-batch sizes.

The tuner walks this space and the dry-run predicts it: one code for both. Everything left out is
recorded once with its reason (`Space.excluded`): an unavailable option, a tier not allowed, or a
combination a rule forbids.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Sequence

from autofit.config import Config
from autofit.errors import UsageError
from autofit.probe.outcome import ProbeResult, Skip, decided
from autofit.search.rules import Rule, rules
from autofit.search.shortfall import TIERS, tier_words
from autofit.strategies.base import Option, Placement, Strategy

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec

TIER_NAMES = {tier: tier_words(tier) for tier in TIERS}  # what to pass to open each tier, in Python's words


@dataclasses.dataclass(frozen=True)
class Excluded:
    """A candidate the search will not try, and why: `config` stands for every level that has its knobs."""

    config: Config
    reason: str
    tier: int | None = None  # the tier an allow= would open, when the tier alone excluded it
    rule: str | None = None  # the rule between knobs that excluded it (`autofit.search.rules.rules`)
    micro_batch: int | None = None  # the size excluded, where the micro-batch option itself was

    def result(self) -> ProbeResult:
        """The record shown in `plan.probes`."""
        return decided(self.config, Skip.EXCLUDED, self.reason)


@dataclasses.dataclass(frozen=True)
class Space:
    """What the search walks: ordered levels (configs without their micro-batch) and micro-batch sizes."""

    spec: "TrainSpec"
    strategies: tuple[Strategy, ...]
    choices: dict[str, tuple[Option, ...]]  # knob -> allowed options, cheapest first
    sizes: tuple[int, ...]  # micro-batch sizes, ascending
    level_list: tuple[Config, ...]  # every allowed combination, cheapest first
    excluded: tuple[Excluded, ...]
    level_sizes: dict[Config, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # see sizes_at
    size_options: tuple[Option, ...] = ()  # the micro-batch's options, whose tiers count as the others' do
    # what `at` and `_used` found, per argument: a plan asks the same ones thousands of times (a copy made
    # by `dataclasses.replace` starts empty: `init=False`)
    _found: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def levels(self) -> list[Config]:
        """Every allowed combination of the level knobs, cheapest first: fewer and earlier changes first."""
        return list(self.level_list)

    def at(self, level: Config, micro_batch: int) -> Config:
        """`level` at `micro_batch`, with the accumulation that keeps the global batch."""
        found = self._found.get(("at", level, micro_batch))
        if found is None:
            per_rank = (self.spec.global_batch_size or micro_batch * self.spec.num_gpus) // self.spec.num_gpus
            found = level.replace(micro_batch_size=micro_batch, grad_accum_steps=per_rank // micro_batch)
            self._found["at", level, micro_batch] = found
        return found

    def sizes_at(self, level: Config) -> tuple[int, ...]:
        """The micro-batch sizes `level` may run at, ascending: those at whose accumulation no rule
        forbids it (the optimizer step in backward runs at accumulation 1 only)."""
        known = self.level_sizes.get(level)
        if known is not None:
            return known
        return tuple(m for m in self.sizes if _size_violation(self.at(level, m), self.spec.target) is None)

    def values(self) -> dict[str, tuple[Any, ...]]:
        """Every value each knob takes in the levels, and the sizes (the trial store's distributions)."""
        names = dict.fromkeys(name for field, options in self.choices.items() for o in options for name in o.knobs(field))
        out = {name: tuple(dict.fromkeys(level.knob(name) for level in self.level_list)) for name in names}
        return {**out, "micro_batch_size": self.sizes}

    def tier(self, config: Config) -> int:
        """The exactness tier of `config`: the highest tier among the options it uses, its micro-batch's too
        (fewer samples than the rank's batch where batch norm or the loss couples them)."""
        return max((o.tier for _, o in self._used(config)), default=0)

    def degree(self, config: Config) -> int:
        """How far `config` moves the arithmetic from the exact baseline: the sum of its options' degrees
        (`Option.change`: bf16 autocast 1; pure bf16, 8-bit states, Adafactor 2; both 3). Orders numerics
        changes within a tier."""
        return sum(o.change for _, o in self._used(config) if o.tier)

    def numerics(self, config: Config) -> tuple[str, ...]:
        """`config`'s numerics changes as "knob=value" (its options of tier 1 and up), sorted: two configs
        with the same tuple compute the same arithmetic, whatever their memory knobs."""
        return tuple(sorted(f"{field}={getattr(o.value, 'value', o.value)}" for field, o in self._used(config)
                            if o.tier))

    def changes(self, config: Config) -> list[tuple[str, str]]:
        """The numerics changes `config` makes, as (knob, the option's reason): its options of tier 1 and up."""
        return [(field, o.reason) for field, o in self._used(config) if o.tier]

    def _used(self, config: Config) -> tuple[tuple[str, Option], ...]:
        found = self._found.get(("used", config))
        if found is None:
            options = [*self.choices.items(), ("micro_batch_size", self.size_options)]
            found = self._found["used", config] = tuple(
                (field, o) for field, kept in options for o in kept
                if all(config.knob(k) == v for k, v in o.knobs(field).items()))
        return found

    def saves_at_least(self, a: Config, b: Config) -> bool:
        """Whether config `a` needs no more memory than `b`: every knob of `a` saves at least as much."""
        return all(s.saves_at_least(a, b) for s in self.strategies)

    def placement(self, config: Config) -> Placement:
        """Where a probe of `config` runs: the most demanding of its knobs' placements."""
        return max(s.placement(config) for s in self.strategies)

    def excluded_results(self) -> list[ProbeResult]:
        """One SKIPPED/EXCLUDED record per excluded option or combination."""
        return [e.result() for e in self.excluded]

    def next_tier(self) -> tuple[int, bool] | None:
        """The tier to allow to go further, when options were excluded by their tier, and whether it opens
        micro-batches too (where they were: batch norm's or a coupled loss's); None when none was."""
        tiers = sorted({e.tier for e in self.excluded if e.tier is not None})
        if not tiers or tiers[0] not in TIERS:
            return None
        return tiers[0], any(e.micro_batch and e.tier == tiers[0] for e in self.excluded)


def build_space(spec: "TrainSpec", strategies: Sequence[Strategy]) -> Space:
    """The search space for `spec`; raises `UsageError` when a knob has no usable option at all. The
    micro-batch, the rank count and the optimizer are knobs of every space (`with_required`)."""
    from autofit.strategies import with_required

    ordered = tuple(with_required(strategies))
    base = Config(num_gpus=spec.num_gpus)
    choices: dict[str, list[Option]] = {}
    excluded: list[Excluded] = []
    for strategy in ordered:
        kept = choices.setdefault(strategy.field, [])
        for option in strategy.options(spec):
            reason, tier = _exclusion(option, spec.max_tier)
            if reason:
                size = option.value if strategy.field == "micro_batch_size" else None
                excluded.append(Excluded(base.replace(**option.knobs(strategy.field)), reason, tier, micro_batch=size))
            elif all(o.knobs(strategy.field) != option.knobs(strategy.field) for o in kept):  # engines share
                # the no-sharding value; every_k options differ in their frequency only
                kept.append(option)
    empty = [field for field, kept in choices.items() if not kept]
    if empty:
        reasons = "; ".join(e.reason for e in excluded if any(e.config.knob(f) != base.knob(f) for f in empty))
        raise UsageError(f"No usable {', '.join(empty)}: {reasons}")
    size_options = tuple(choices.pop("micro_batch_size"))
    sizes = tuple(sorted(o.value for o in size_options))
    frozen = {field: tuple(kept) for field, kept in choices.items()}
    levels, ruled_out = _levels(spec, base, frozen)
    space = Space(spec, ordered, frozen, sizes, tuple(levels), (), size_options=size_options)
    shown = tuple(dataclasses.replace(e, config=space.at(e.config, e.micro_batch or sizes[-1]))
                  for e in excluded + ruled_out)
    by_size, level_sizes = _sizes_ruled_out(space)
    return dataclasses.replace(space, excluded=shown + by_size, level_sizes=level_sizes)


SIZE_FIELDS = ("micro_batch_size", "grad_accum_steps")


def _size_violation(config: Config, target: Any) -> tuple[Rule, str] | None:
    """The first rule reading the micro-batch or the accumulation that `config` breaks (a level passed the
    others already), with its reason."""
    for rule in _size_rules(rules()):
        reason = rule.check(config, target)
        if reason:
            return rule, reason
    return None


@functools.lru_cache(maxsize=8)
def _size_rules(table: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """The rules of `table` that read the micro-batch or the accumulation, in its order."""
    return tuple(rule for rule in table if any(k in SIZE_FIELDS for k in rule.knobs))


def _sizes_ruled_out(space: Space) -> tuple[tuple[Excluded, ...], dict[Config, tuple[int, ...]]]:
    """The sizes each level may run at, and one `Excluded` per rule and distinct value of its knobs among
    the micro-batch sizes a rule forbids at an allowed level (the accumulation they need)."""
    excluded, seen, level_sizes = [], set(), {}
    for level in space.level_list:
        fine = []
        for size in space.sizes:
            config = space.at(level, size)
            broken = _size_violation(config, space.spec.target)
            if broken is None:
                fine.append(size)
                continue
            rule, reason = broken
            key = (rule.name, *(config.knob(k) for k in rule.knobs))
            if key not in seen:
                seen.add(key)
                excluded.append(Excluded(config, f"{reason} ({rule.name})", rule=rule.name))
        level_sizes[level] = tuple(fine)
    return tuple(excluded), level_sizes


def _levels(spec: "TrainSpec", base: Config, choices: dict[str, tuple[Option, ...]]) -> tuple[list[Config], list[Excluded]]:
    """Every combination cheapest first, split into the allowed levels and one `Excluded` per rule and
    distinct value of the knobs that rule reads (shown at the cheapest combination it excludes).

    Combinations are built knob by knob; a rule is checked as soon as every knob it reads is set, so a
    forbidden prefix is never extended (the product of all knobs is large; the allowed levels are few)."""
    fields = list(choices)
    # Knobs that rules read most are set first, so forbidden prefixes are cut early; the levels are
    # ordered afterwards by their indices in `fields` (the decision tree's order).
    table = rules()
    reads = {f: sum(any(k in o.knobs(f) for o in choices[f] for k in r.knobs) for r in table) for f in fields}
    order = sorted(fields, key=lambda f: -reads[f])
    setter = {name: depth for depth, field in enumerate(order) for o in choices[field] for name in o.knobs(field)}
    checks: list[list[Rule]] = [[] for _ in order]
    for rule in table:
        checks[max((setter.get(k, 0) for k in rule.knobs), default=0)].append(rule)
    allowed: list[tuple[tuple[int, ...], Config]] = []
    pruned: list[tuple[tuple[int, ...], Rule, str, Config]] = []

    def visit(depth: int, idx: dict[str, int], knobs: dict[str, Any]) -> None:
        field = order[depth]
        for i, option in enumerate(choices[field]):
            here, at = {**knobs, **option.knobs(field)}, {**idx, field: i}
            config = base.replace(**here)
            broken = next(((r, why) for r in checks[depth] if (why := r.check(config, spec.target))), None)
            if broken is not None:
                pruned.append((tuple(at.get(f, 0) for f in fields), *broken, config))
            elif depth + 1 == len(order):
                allowed.append((tuple(at[f] for f in fields), config))
            else:
                visit(depth + 1, at, here)

    def cheapest(idx: tuple[int, ...]) -> tuple:
        return sum(idx), tuple(reversed(idx))

    if fields:
        visit(0, {}, {})
    levels = [config for _, config in sorted(allowed, key=lambda item: cheapest(item[0]))]
    excluded, seen = [], set()
    for _, rule, reason, config in sorted(pruned, key=lambda item: cheapest(item[0])):
        key = (rule.name, *(config.knob(k) for k in rule.knobs))
        if key not in seen:
            seen.add(key)
            excluded.append(Excluded(config, f"{reason} ({rule.name})", rule=rule.name))
    return levels, excluded


def _exclusion(option: Option, max_tier: int) -> tuple[str | None, int | None]:
    if not option.available:
        return option.reason, None
    if option.tier > max_tier:
        return f"{option.reason}: tier {option.tier}, not allowed: {TIER_NAMES.get(option.tier, '')}", option.tier
    return None, None
