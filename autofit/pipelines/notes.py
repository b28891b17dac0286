"""The sentences a dry-run's chosen reason adds about its choice: gradients under FSDP2 accumulation
(`sync_note`), a near-limit candidate that would have won (`edge_note`), what crossing nodes costs
(`nodes_note`). Composed from the candidates' fields."""

from __future__ import annotations

from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.estimate.states import unsharded_grads
from autofit.pipelines.candidate import Candidate
from autofit.strategies import completed
from autofit.units import format_size


def sync_note(chosen: Candidate, estimator: Estimator) -> str:
    """For FSDP2 with accumulation: the prediction reduces gradients after every micro-batch, and what a
    loop that defers the reduce would add."""
    config = chosen.config
    synced = any(s.accumulation_kwargs(config).get("sync_each_batch") for s in completed())
    if not synced or estimator.deferred_sync:
        return ""
    more = unsharded_grads(estimator.facts, config) - chosen.estimate.breakdown.grads
    return (f". Its peak has the gradients reduced after every micro-batch, as autofit's loop and exports do "
            f"(sync_each_batch); a loop that waits for the last one (accelerate's accumulate(), the Trainer's "
            f"default) holds every gradient unsharded: {format_size(more)} more per GPU")


def edge_note(near_choice: Candidate | None) -> str:
    """Where a candidate near the limit would have been chosen: its speed, its need against the limit, and the
    error bound that reaches past it (`autofit tune` on the card decides it)."""
    if near_choice is None:
        return ""
    estimate, limit = near_choice.estimate, near_choice.limit
    return (f". Near the limit: {near_choice.config.describe()} would be ~{near_choice.samples_per_s:,.1f} "
            f"samples/s, but needs {format_size(estimate.need_bytes)} of {format_size(limit)} "
            f"({estimate.need_bytes / limit:.0%}), up to {format_size(estimate.upper_bytes)} at its "
            f"+{estimate.error_bound:.0%} error bound; autofit tune on the card decides it")


def nodes_note(chosen: Candidate, allowed: list[Candidate]) -> str:
    """Over several nodes: what crossing them costs the chosen candidate, against the fastest fit of the
    other way to shard (within a node or over every GPU), or the closest of it where none fits."""
    config = chosen.config
    if config.nodes < 2 or chosen.cost is None:
        return ""
    strategies = completed()

    def spread(c: Config) -> tuple[str, bool] | None:  # `Strategy.spread`: (its name, within a node), or None
        return next(filter(None, (s.spread(c) for s in strategies)), None)

    layout = spread(config)
    hierarchical = layout is not None and layout[1]
    others = [c for c in allowed if (way := spread(c.config)) is not None and way[1] != hierarchical
              and c.cost is not None]
    ways = ("sharding within a node", "sharding over every GPU")
    own, other_way = ways if hierarchical else ways[::-1]
    said = (f". Across nodes: {chosen.cost.across_nodes:.3g} s of its {chosen.step_seconds:.3g} s step "
            f"({layout[0]}, {own})" if layout is not None else
            f". Across nodes: {chosen.cost.across_nodes:.3g} s of its {chosen.step_seconds:.3g} s step")
    fits = [c for c in others if c.fits]
    if fits:
        best = min(fits, key=lambda c: c.step_seconds)
        saves = chosen.peak_bytes - best.peak_bytes
        held = f"holds {format_size(saves)} less per GPU" if saves > 0 else f"holds {format_size(-saves)} more per GPU"
        return (f"{said}; {other_way} ({best.config.describe()}) {held} and spends {best.cost.across_nodes:.3g} s of "
                f"{best.step_seconds:.3g} s across nodes")
    if others:
        closest = min(others, key=lambda c: c.estimate.need_bytes)
        return (f"{said}; {other_way} fits in none of its candidates (the smallest, {closest.config.describe()}, "
                f"needs {format_size(closest.estimate.need_bytes)} per GPU)")
    return said
