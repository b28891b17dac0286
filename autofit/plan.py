"""Plan: the chosen configuration with what was measured for it, every probe, and the reason.

This module owns the plan: the choice among the fits (`autofit.search.decision.choose`), composing why it won
(`chosen_reason`: the confirmed ratio and its spread, the margin a numerics change cleared, a swapped
optimizer said plainly) or finding why nothing fits (`nothing_fits`: a `Shortfall`, from recorded results and
predictions only: no probe runs while it is found), and the value itself. A plan is a value: `save` writes JSON, `Plan.load` reads it back equal (plans written by
autofit 0.1 too).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autofit.config import Config, Optimizer
from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, Source
from autofit.search.decision import Comparison, Confirmation, Finalist, MarginKind, Ratio, choose
from autofit.search.shortfall import Basis, Remedy, Shortfall
from autofit.units import format_size
from autofit.version import __version__

if TYPE_CHECKING:
    from autofit.search.space import Space

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Plan:
    """The outcome of a search. Memory in bytes, throughput in samples/s, tokens/s and images/s."""

    fits: bool  # a configuration fits within the budget and its safety margin
    config: Config | None  # the chosen configuration (None when nothing fits)
    # measured samples/s of the chosen configuration; None when nothing fits, or for a configuration the OOM
    # guard wrote back (`figures` says so)
    throughput: float | None
    tokens_per_second: float | None  # measured tokens/s, where the batch has a sequence axis
    peak_memory: int | None  # measured peak bytes of the chosen configuration on the device
    reason: str  # why this configuration was chosen, or why nothing fits and what to allow next
    probes: tuple[ProbeResult, ...]  # every candidate decided, in order: fit / oom / error / skipped
    spec: dict[str, Any]  # the spec summary: model, device, budget, global batch, ...
    created: str = dataclasses.field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    autofit_version: str = ""
    confirmation: Confirmation | None = None  # the finalists re-measured back to back, and the decision
    # What reproducing the chosen knobs takes beyond their values, by knob (`Strategy.settings`: LoRA's
    # target modules, alpha and dropout), for the exports and `autofit.prepare`.
    settings: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Why nothing fits, as fields (`reason` is its Python words; the CLI says it in its own): None when a
    # configuration fits, and in plans written before plans kept it
    shortfall: Shortfall | None = None
    images_per_second: float | None = None  # measured images/s, where the batch holds images (video: frames/s)

    @property
    def probes_run(self) -> int:
        """How many candidates were actually run in this search (not stored, not skipped)."""
        return sum(1 for p in self.probes if p.source is Source.PROBED)

    @property
    def probes_saved(self) -> int:
        """How many candidates were not run because the estimator predicted they would not fit."""
        return sum(1 for p in self.probes if p.skip is Skip.PREDICTED)

    @property
    def peak_rank(self) -> int | None:
        """The rank whose peak is `peak_memory` when the chosen configuration ran on several ranks, else None."""
        chosen = next((p for p in self.probes if p.fits and p.config == self.config), None)
        return chosen.peak_rank if chosen is not None else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (what `save` writes)."""
        data = dataclasses.asdict(self)
        data["config"] = self.config.to_dict() if self.config else None
        data["probes"] = [p.to_dict() for p in self.probes]
        data["confirmation"] = self.confirmation.to_dict() if self.confirmation else None
        data["shortfall"] = self.shortfall.to_dict() if self.shortfall else None
        data["format_version"] = FORMAT_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Inverse of `to_dict`."""
        fields = {k: v for k, v in data.items() if k != "format_version"}
        fields["config"] = Config.from_dict(fields["config"]) if fields["config"] else None
        fields["probes"] = tuple(ProbeResult.from_dict(p) for p in fields["probes"])
        confirmed = fields.get("confirmation")
        fields["confirmation"] = Confirmation.from_dict(confirmed) if confirmed else None
        fields["shortfall"] = Shortfall.from_dict(fields["shortfall"]) if fields.get("shortfall") else None
        return cls(**fields)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON to `path` (parent folders are created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by `save`."""
        from autofit.errors import UsageError

        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = f"it has no {exc} field" if isinstance(exc, KeyError) else str(exc)
            raise UsageError(f"Cannot read a plan from {str(path)!r}: {why}. Pass a plan.json written by "
                             "autofit (plan.save or autofit tune).") from exc

    def export(self, fmt: str, out_dir: str | Path) -> list[Path]:
        """Write the launcher files of `fmt` ("accelerate", "deepspeed", "trainer", "torchrun") into
        `out_dir`; returns their paths. A plan that does not fit raises `UsageError` saying why."""
        from autofit.export import export

        return export(self, fmt, out_dir)

    def __repr__(self) -> str:
        """One line a notebook can show: the choice, its figures, the probes counted (the dataclass's
        repr spelled out every probe, thousands of characters for a search). `to_dict` has everything."""
        figures = (f"throughput={self.throughput!r}, tokens_per_second={self.tokens_per_second!r}, "
                   f"peak_memory={self.peak_memory!r} ({format_size(self.peak_memory)})"
                   if self.peak_memory is not None else f"throughput={self.throughput!r}")
        probes = f"{len(self.probes)} ({self.probes_run} run, {self.probes_saved} saved by the estimator)"
        return f"Plan(fits={self.fits!r}, config={self.config!r}, {figures}, reason={self.reason!r}, probes={probes})"

    def summary(self) -> str:
        """A few lines for people: the choice, its figures and the reason."""
        if not self.fits:
            return f"Nothing fits. {self.reason}"
        return f"{self.config.describe()}: {self.figures()}\n{self.reason}"

    def figures(self) -> str:
        """The chosen configuration's measured throughput and peak, or why it has none (the OOM guard
        changed the configuration in a run and wrote it back: no probe measured it)."""
        if self.throughput is None:
            return "not measured (the OOM guard changed the configuration in a run; tune again to measure it)"
        tokens = f", {self.tokens_per_second:,.0f} tokens/s" if self.tokens_per_second else ""
        images = f", {self.images_per_second:,.2f} images/s" if self.images_per_second else ""
        return f"{self.throughput:,.2f} samples/s{tokens}{images}, peak {format_size(self.peak_memory)}"


def chosen_reason(best: ProbeResult, results: Sequence[ProbeResult], confirmation: Confirmation | None = None,
                  space: "Space | None" = None) -> str:
    """Why `best` won: with a confirmation, its confirmed ratio to the runner-up and the spread over the
    rounds, the margin a numerics change had to clear, and a swapped optimizer said plainly; without one,
    its probed throughput against the runner-up's."""
    fits = [r for r in results if r.fits]
    if confirmation is None:
        return _probed_reason(best, fits, len(results))
    parts = [_confirmed_head(confirmation, len(fits))]
    parts += [_comparison_words(c, confirmation) for c in _worth_saying(confirmation)]
    if space is not None:
        parts.append(_exactness_words(space, confirmation, results))
    parts.append(best.reason)
    return "; ".join(p for p in parts if p)


def _probed_reason(best: ProbeResult, fits: Sequence[ProbeResult], candidates: int) -> str:
    others = sorted((r for r in fits if r.config != best.config), key=lambda r: r.samples_per_s, reverse=True)
    if not others:
        return f"the only configuration of {candidates} candidates that fits ({best.reason})"
    runner = others[0]
    return (f"highest measured throughput of {len(others) + 1} fitting configurations: {best.samples_per_s:,.2f} "
            f"samples/s, {best.samples_per_s / runner.samples_per_s:.2f}x as fast as the runner-up "
            f"({runner.config.describe()}); {best.reason}")


def _confirmed_head(confirmation: Confirmation, fits: int) -> str:
    winner, runner = confirmation.winner, confirmation.runner_up()
    where = f"{fits} fitting configuration{'s' if fits != 1 else ''}"
    if runner is None:
        return (f"the only finalist of {where} (no other within {confirmation.window:.0%} of it as probed): "
                f"{winner.median:,.2f} samples/s" + (", re-measured in this session" if winner.rounds else ""))
    ratio = Ratio.of(winner, runner)
    rounds = len(winner.rounds)
    how = f"{rounds} interleaved rounds ({confirmation.method})" if rounds else "as probed"
    return (f"chosen of {len(confirmation.finalists)} finalists ({where}) re-measured back to back, {how}: "
            f"{winner.median:,.2f} samples/s, {ratio.median:.2f}x as fast as the runner-up "
            f"({runner.config.describe()}; per-round ratio {ratio.low:.2f}-{ratio.high:.2f})")


def _worth_saying(confirmation: Confirmation) -> list[Comparison]:
    """The comparisons a reader needs: a change that won on its exactness or near-limit margin, a faster one
    that did not clear its margin, and a win on the noise margin over a finalist already said to be kept
    (else the text would end on "X is kept" and choose another)."""
    said, kept = [], set()
    for comparison in confirmation.comparisons:
        if comparison.won:
            worth = comparison.kind is not MarginKind.NOISE or comparison.holder in kept
        else:
            worth = comparison.ratio.median > 1 and comparison.challenger != confirmation.chosen
            if worth:
                kept.add(comparison.holder)
        if worth:
            said.append(comparison)
    return said


_MARGIN_WORDS = {MarginKind.EXACTNESS: "a numerics change must clear (exact_margin)",
                 MarginKind.NEAR_LIMIT: "a fit whose allocator retried must clear",
                 MarginKind.NOISE: "of noise (or faster in too few rounds) any further change must clear"}


def _comparison_words(comparison: Comparison, confirmation: Confirmation) -> str:
    challenger = confirmation.finalists[comparison.challenger]
    holder = confirmation.finalists[comparison.holder]
    ratio = comparison.ratio
    figures = (f"{ratio.median:.2f}x as fast as {holder.config.describe()} ({ratio.low:.2f}-{ratio.high:.2f}, "
               f"faster in {ratio.wins:.0%} of rounds)")
    margin = f"the {comparison.margin:.0%} margin {_MARGIN_WORDS[comparison.kind]}"
    if comparison.won:
        return f"{challenger.config.describe()} is {figures}, above {margin}"
    return f"{challenger.config.describe()} was {figures}, within {margin}: {holder.config.describe()} is kept"


def _exactness_words(space: "Space", confirmation: Confirmation, results: Sequence[ProbeResult]) -> str:
    """Plain words when the choice changes numerics: the user's optimizer swapped, and on what evidence
    (where the exact configurations probed failed with errors, not out of memory, the first of them: a
    fault of the model's the numerics change only steps around)."""
    winner = confirmation.winner
    if winner.tier == 0:
        return ""
    swap = _optimizer_swap(space, winner)
    exact = [r for r in results if r.fits and space.tier(r.config) < winner.tier]
    errors = [r for r in results if r.status is ProbeStatus.ERROR and space.tier(r.config) < winner.tier]
    if not exact and errors:
        evidence = (f"no exact configuration fits: {len(errors)} of those probed failed with an error, not out of "
                    f"memory ({errors[0].config.describe()}: {errors[0].reason}), which the change may only step "
                    "around: check it with one step of your own loop")
    elif not exact:
        evidence = "no exact configuration fits"
    elif any(c.won and c.kind is MarginKind.EXACTNESS for c in confirmation.comparisons):
        evidence = f"it cleared the {confirmation.exact_margin:.0%} margin over an exact configuration (above)"
    else:  # the exact finalists could not be re-measured beside it
        fastest = max(exact, key=lambda r: r.samples_per_s)
        why = "; ".join(w for _, w in confirmation.dropped) or "none was a finalist"
        evidence = (f"no exact configuration could be re-measured beside it ({why}); "
                    f"as probed it is {winner.probed / fastest.samples_per_s:.2f}x the fastest exact one "
                    f"({fastest.config.describe()})")
    others = [reason for field, reason in space.changes(winner.config) if not (swap and field == "optimizer")]
    change = "; ".join([swap, *others]) if swap else \
        f"a numerics change is taken (tier {winner.tier}: {winner.config.describe()}: {'; '.join(others)})"
    return f"{change}, because {evidence}"


def _optimizer_swap(space: "Space", winner: Finalist) -> str:
    asked = space.spec.optimizer
    if asked.explore and winner.config.optimizer is not Optimizer(asked.name):
        return (f"your optimizer {asked.name} is replaced by {winner.config.optimizer.value} "
                "(different numerics, same hyperparameters where they apply)")
    return ""


def make_plan(space: "Space", results: Sequence[ProbeResult],
              predict: Callable[[Config], int | None] | None = None,
              confirmation: Confirmation | None = None) -> Plan:
    """The plan for a finished search: the confirmed choice (or the fastest fit), or why nothing fits and
    what to allow next. `plan.probes` holds the search's results, then every option and combination the
    space excluded. `predict(config)` (predicted peak bytes) names what the smallest candidate needs when
    nothing fits. The plan's throughput is the confirmed median where the finalists were re-measured."""
    common = dict(probes=tuple(results) + tuple(space.excluded_results()), spec=space.spec.summary(),
                  autofit_version=__version__, confirmation=confirmation)
    best = choose(results, confirmation)
    if best is not None:
        throughput = confirmation.winner.median if confirmation is not None else best.samples_per_s
        tokens = best.tokens_per_s * throughput / best.samples_per_s if best.tokens_per_s else None
        images = best.images_per_s * throughput / best.samples_per_s if best.images_per_s else None
        settings = {s.field: s.settings(best.config, space.spec) for s in space.strategies}
        return Plan(True, best.config, throughput, tokens, best.peak_bytes,
                    space.spec.model.noting_weights(chosen_reason(best, results, confirmation, space),
                                                    best.config.precision), **common,
                    settings={field: value for field, value in settings.items() if value}, images_per_second=images)
    shortfall = nothing_fits(space, results, predict)
    return Plan(False, None, None, None, None, shortfall.words(), **common, shortfall=shortfall)


def nothing_fits(space: "Space", results: Sequence[ProbeResult],
                 predict: Callable[[Config], int | None] | None = None) -> Shortfall:
    """Why nothing fits: the limit, the candidate closest to fitting and what it needs, and what to allow
    next (or more memory); its words read "No candidate fits X; the smallest needs Y (config). Pass ... to
    go further." """
    spec = space.spec
    head = dict(limit=spec.fit_limit, capacity=spec.memory_budget, margin=spec.safety_margin)
    errors = [r for r in results if r.status is ProbeStatus.ERROR]
    ooms = [r for r in results if r.status is ProbeStatus.OOM or r.skip is Skip.PREDICTED]
    if not ooms:
        return Shortfall(**head, first_error=errors[0].reason if errors else None)
    # the OOM that saves at least as much memory as the most others: the closest to fitting
    smallest = max(ooms, key=lambda r: sum(space.saves_at_least(r.config, o.config) for o in ooms))
    need, basis = _need(smallest, predict)
    tier = space.next_tier()
    if tier is None:
        return Shortfall(**head, smallest=smallest.config, need=need, basis=basis, remedy=Remedy.MORE_MEMORY)
    return Shortfall(**head, smallest=smallest.config, need=need, basis=basis, remedy=Remedy.ALLOW, tier=tier[0],
                     micro_batches=tier[1])


def _need(result: ProbeResult, predict: Callable[[Config], int | None] | None) -> tuple[int | None, Basis]:
    """What `result`'s config needs (bytes) and how that is known: the estimator's prediction where there is
    one, else the bytes it held when it ran out (a lower bound), else only that it is more than the budget."""
    predicted = predict(result.config) if predict is not None else None
    if predicted:
        return predicted, Basis.PREDICTED
    if result.peak_bytes:
        return result.peak_bytes, Basis.HELD
    return None, Basis.OVER_BUDGET
