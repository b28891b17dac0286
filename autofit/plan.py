"""Plan: the chosen configuration with what was measured for it, every probe, and the reason.

This module owns the plan: the choice among the fits (`autofit.search.decision.choose`), composing why it won
(`chosen_reason`: the confirmed ratio and its spread, the margin a numerics change cleared, a swapped
optimizer said plainly) or finding why nothing fits (`nothing_fits`: a `Shortfall`, from recorded results and
predictions only: no probe runs while it is found), and the value itself. A plan is a value: `save` writes JSON
(atomically, never over a file that is not a plan: `autofit.files`), `Plan.load` reads it back equal (plans written
by autofit 0.1 too). A plan file is data from anyone: `load` checks it against the schema (`check_plan_data`:
`format_version`, each field's type, the invariants between them) before building anything from it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autofit.config import Config
from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, Source
from autofit.search.decision import (CLEAR_SHARE, CONFIDENCE, NOISE_MARGIN, Comparison, Confirmation, DecidedBy, Finalist,
                                     MarginKind, Ratio, choose)
from autofit.search.shortfall import Basis, Remedy, Shortfall
from autofit.strategies import compute_dtype
from autofit.errors import UsageError
from autofit.files import write_file
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
    def steps_spent(self) -> int:
        """Optimizer steps this search trained to decide: its probes' (`ProbeResult.steps`; a probe process that
        died before reporting counts none) and its confirmation's (`Confirmation.steps`)."""
        probes = sum(p.steps or 0 for p in self.probes if p.source is Source.PROBED)
        return probes + ((self.confirmation.steps or 0) if self.confirmation is not None else 0)

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

    def save(self, path: str | Path, *, force: bool = False) -> Path:
        """Write the plan as JSON to `path` (parent folders are created) and return the path: atomically, never
        through a link, and over an existing file only when it is a plan or autofit wrote it (`force` replaces
        any file: `autofit.files`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_file(path, json.dumps(self.to_dict(), indent=2) + "\n", force=force, ours=is_plan_json,
                          record=False)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan written by `save`: data, validated against the plan's schema (`check_plan_data`: its
        format_version, every field's type, the invariants between them) before anything is built from it.
        `UsageError`, one line naming the file and what is wrong, for anything else."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"Cannot read a plan from {str(path)!r}: {exc}. Pass a plan.json written by autofit "
                             "(plan.save or autofit tune).") from exc
        problem = check_plan_data(data)
        if problem is None:
            try:
                return cls.from_dict(data)
            except (ValueError, KeyError, TypeError) as exc:  # UsageError included: a knob value not known
                problem = f"it has no {exc} field" if isinstance(exc, KeyError) else " ".join(str(exc).split())
        raise UsageError(f"Cannot read a plan from {str(path)!r}: {problem}. Pass a plan.json written by autofit "
                         "(plan.save or autofit tune).")

    def export(self, fmt: str, out_dir: str | Path, *, force: bool = False) -> list[Path]:
        """Write the launcher files of `fmt` ("accelerate", "deepspeed", "trainer", "torchrun") into
        `out_dir`; returns their paths. A plan that does not fit raises `UsageError` saying why, and so does a
        file there autofit did not write (`force` replaces it)."""
        from autofit.export import export

        return export(self, fmt, out_dir, force=force)

    def __repr__(self) -> str:
        """One line a notebook can show: the choice, its figures, the probes counted (the dataclass's
        repr spelled out every probe, thousands of characters for a search). `to_dict` has everything."""
        figures = (f"throughput={self.throughput!r}, tokens_per_second={self.tokens_per_second!r}, "
                   f"peak_memory={self.peak_memory!r} ({format_size(self.peak_memory)})"
                   if self.peak_memory is not None else f"throughput={self.throughput!r}")
        probes = f"{len(self.probes)} ({self.probes_run} run, {self.probes_saved} saved by the estimator)"
        return f"Plan(fits={self.fits!r}, config={self.config!r}, {figures}, reason={self.reason!r}, probes={probes})"

    def summary(self) -> str:
        """At most three short lines for people: the choice and its figures; the rule that decided it; and,
        where they apply, the numerics it changes and a peak near the limit with the next fit that has
        headroom. The whole comparison is in `reason`, `confirmation`, the report and `--json`."""
        if not self.fits:
            return f"Nothing fits. {self.reason}"
        lines = [f"{self.config.describe()}: {self.figures()}", decision_line(self)]
        notes = [note for note in (numerics_note(self), near_limit_note(self)) if note]
        return "\n".join(lines + (["; ".join(notes)] if notes else []))

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
    """Why `best` won, composed from the decision's fields: with a confirmation, its confirmed figures
    against the runner-up, each comparison a reader needs with the test that decided it (margin, share of
    rounds, noise) and the class of what it beat, and a numerics change said plainly; without one, its
    probed throughput against the runner-up's."""
    fits = [r for r in results if r.fits]
    if confirmation is None:
        return _probed_reason(best, fits, len(results))
    said = _worth_saying(confirmation)
    parts = [_confirmed_head(confirmation, len(fits), said)]
    parts += [_comparison_words(c, confirmation) for c in said]
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


def _confirmed_head(confirmation: Confirmation, fits: int, said: Sequence[Comparison]) -> str:
    """How the finalists were re-measured and the choice's figure; the runner-up's ratio (or, when faster,
    why it was not taken) unless a comparison said after it covers the runner-up already."""
    winner, runner = confirmation.winner, confirmation.runner_up()
    where = f"{fits} fitting configuration{'s' if fits != 1 else ''}"
    if runner is None:
        return (f"the only finalist of {where} (no other within {confirmation.window:.0%} of it as probed): "
                f"{winner.median:,.2f} {confirmation.unit}" + (", re-measured in this session" if winner.rounds else ""))
    ratio = Ratio.of(winner, runner)
    rounds = len(winner.rounds)
    threads = f" at {confirmation.threads} torch thread{'s' if confirmation.threads != 1 else ''}" \
        if confirmation.threads else ""
    how = f"{rounds} interleaved rounds ({confirmation.method}){threads}" if rounds else "as probed"
    head = (f"chosen of {len(confirmation.finalists)} finalists ({where}) re-measured back to back, {how}: "
            f"{winner.median:,.2f} {confirmation.unit}")
    index = confirmation.finalists.index(runner)
    if any(index in (c.challenger, c.holder) for c in said):
        return head
    if ratio.median >= 1:
        return (f"{head}, {ratio.median:.2f}x the runner-up ({runner.config.describe()}; interval "
                f"{ratio.low:.2f}-{ratio.high:.2f})")
    return f"{head}; {runner.config.describe()} measured {1 / ratio.median:.2f}x as fast, {_not_taken(confirmation, runner)}"


def _not_taken(confirmation: Confirmation, finalist: Finalist) -> str:
    """Why a finalist faster than the choice is not the choice: the test its own comparison failed."""
    index = confirmation.finalists.index(finalist)
    mine = next((c for c in confirmation.comparisons if c.challenger == index), None)
    if mine is None or mine.won:
        return "and was replaced by a finalist that cleared its margin over it (below)"
    holder = confirmation.finalists[mine.holder]
    return f"but was not taken over {holder.config.describe()} ({class_words(holder)}): {rule_words(mine)}"


def _worth_saying(confirmation: Confirmation) -> list[Comparison]:
    """The comparisons a reader needs: a change that won on its exactness or near-limit margin, a faster one
    that was not taken, and a win on the noise margin over a finalist already said to be kept (else the
    text would end on "X is kept" and choose another)."""
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
                 MarginKind.NOISE: "of noise any further change must clear"}


def class_words(finalist: Finalist) -> str:
    """"exact", or the numerics a finalist changes ("numerics: precision=bf16", "tier 2: lora_rank=8")."""
    if not finalist.tier and not finalist.numerics:
        return "exact"
    changes = ", ".join(finalist.numerics) or "a numerics change"
    return f"numerics: {changes}" if finalist.tier <= 1 else f"tier {finalist.tier}: {changes}"


def rule_words(comparison: Comparison) -> str:
    """The test that decided `comparison`, with its figures."""
    ratio, margin = comparison.ratio, comparison.margin
    by = comparison.decided_by
    if by is DecidedBy.CLEARED:
        return f"above the {margin:.0%} margin {_MARGIN_WORDS[comparison.kind]}"
    if by is DecidedBy.MARGIN:
        return f"within the {margin:.0%} margin {_MARGIN_WORDS[comparison.kind]}"
    if by is DecidedBy.SHARE:
        return f"faster in too few rounds ({ratio.wins:.0%} of {ratio.rounds}; a change must win {CLEAR_SHARE:.0%})"
    return (f"too noisy to show a {max(margin, NOISE_MARGIN):.0%} gain: paired ratios {ratio.low:.2f}-{ratio.high:.2f} "
            f"(the median's {CONFIDENCE:.0%} interval) over {ratio.rounds} rounds")


def _comparison_words(comparison: Comparison, confirmation: Confirmation) -> str:
    challenger = confirmation.finalists[comparison.challenger]
    holder = confirmation.finalists[comparison.holder]
    ratio = comparison.ratio
    rounds = " as probed" if not ratio.rounds else f" over {ratio.rounds} rounds" \
        if comparison.decided_by is DecidedBy.SHARE else f", faster in {ratio.wins:.0%} of {ratio.rounds} rounds"
    figures = (f"{ratio.median:.2f}x as fast as {holder.config.describe()} ({class_words(holder)}; interval "
               f"{ratio.low:.2f}-{ratio.high:.2f}{rounds})")
    if comparison.won:
        return f"{challenger.config.describe()} is {figures}, {rule_words(comparison)}"
    return f"{challenger.config.describe()} was {figures}, {rule_words(comparison)}: {holder.config.describe()} is kept"


def _won_on(confirmation: Confirmation) -> Comparison | None:
    """The comparison in which the winner's numerics replaced another arithmetic (an exactness win), following
    the chain of holders back from the winner's own win; None where it won none."""
    wins = {c.challenger: c for c in confirmation.comparisons if c.won}
    comparison = wins.get(confirmation.chosen)
    while comparison is not None and comparison.kind is not MarginKind.EXACTNESS:
        comparison = wins.get(comparison.holder)
    return comparison


def _exactness_words(space: "Space", confirmation: Confirmation, results: Sequence[ProbeResult]) -> str:
    """Plain words when the choice changes numerics: the user's optimizer swapped, and on what evidence: the
    margin it cleared and the class of what it beat (where the exact configurations probed failed with
    errors, not out of memory, the first of them: a fault of the model's the numerics change only steps
    around)."""
    winner = confirmation.winner
    if winner.tier == 0:
        return ""
    swaps = _swaps(space, winner)
    swap = "; ".join(swaps.values())
    exact = [r for r in results if r.fits and space.tier(r.config) < winner.tier]
    errors = [r for r in results if r.status is ProbeStatus.ERROR and space.tier(r.config) < winner.tier]
    won = _won_on(confirmation)
    if not exact and errors:
        evidence = (f"no exact configuration fits: {len(errors)} of those probed failed with an error, not out of "
                    f"memory ({errors[0].config.describe()}: {errors[0].reason}), which the change may only step "
                    "around: check it with one step of your own loop")
    elif not exact:
        evidence = "no exact configuration fits"
    elif won is not None:
        beaten = confirmation.finalists[won.holder]
        evidence = f"it cleared the {won.margin:.0%} margin over {beaten.config.describe()} ({class_words(beaten)})"
    else:  # the exact finalists could not be re-measured beside it
        fastest = max(exact, key=lambda r: r.samples_per_s)
        why = "; ".join(w for _, w in confirmation.dropped) or "none was a finalist"
        evidence = (f"no exact configuration could be re-measured beside it ({why}); "
                    f"as probed it is {winner.probed / fastest.samples_per_s:.2f}x the fastest exact one "
                    f"({fastest.config.describe()})")
    others = [reason for field, reason in space.changes(winner.config) if field not in swaps]
    change = "; ".join([swap, *others]) if swap else \
        f"a numerics change is taken (tier {winner.tier}: {winner.config.describe()}: {'; '.join(others)})"
    return f"{change}, because {evidence}"


def decision_line(plan: "Plan") -> str:
    """`summary`'s second line: the rule that decided the choice, with its figures."""
    confirmation = plan.confirmation
    fits = [p for p in plan.probes if p.fits]
    if confirmation is None:
        return (f"highest measured throughput of {len(fits)} fits" if len(fits) > 1 else
                "the only configuration that fits")
    winner = confirmation.winner
    wins = [c for c in confirmation.comparisons if c.won and c.challenger == confirmation.chosen]
    if wins:
        won, holder = wins[0], confirmation.finalists[wins[0].holder]
        return (f"{won.ratio.median:.2f}x {holder.config.describe()} ({class_words(holder)}) over "
                f"{won.ratio.rounds} rounds, above the {won.margin:.0%} {won.kind.value} margin")
    challengers = [c for c in confirmation.comparisons if c.holder == confirmation.chosen and c.ratio.median > 1]
    if challengers:
        faster = max(challengers, key=lambda c: c.ratio.median)
        return (f"kept over {confirmation.finalists[faster.challenger].config.describe()} "
                f"({faster.ratio.median:.2f}x): {_short_rule(faster)}")
    if len(confirmation.finalists) == 1:
        return (f"the only finalist of {len(fits)} fit{'s' if len(fits) != 1 else ''} (no other within "
                f"{confirmation.window:.0%} as probed)")
    rounds = len(winner.rounds)
    return f"the fastest of {len(confirmation.finalists)} finalists re-measured over {rounds} rounds, {class_words(winner)}"


def _short_rule(comparison: Comparison) -> str:
    by, ratio = comparison.decided_by, comparison.ratio
    if by is DecidedBy.SHARE:
        return f"faster in only {ratio.wins:.0%} of {ratio.rounds} rounds"
    if by is DecidedBy.NOISE:
        return f"too noisy to show a {max(comparison.margin, NOISE_MARGIN):.0%} gain ({ratio.low:.2f}-{ratio.high:.2f})"
    return f"under the {comparison.margin:.0%} {comparison.kind.value} margin"


def numerics_note(plan: "Plan") -> str:
    """"numerics: ..." where the choice changes them (from the confirmation's record), else ""."""
    winner = plan.confirmation.winner if plan.confirmation is not None else None
    if winner is None or not winner.numerics:
        return ""
    return f"numerics: {', '.join(winner.numerics)} (tier {winner.tier})"


def near_limit_note(plan: "Plan") -> str:
    """Where the chosen fit's allocator retried while timed (its peak at the limit, run to run), that, and the
    fastest fit whose allocator did not; else ""."""
    chosen = next((p for p in plan.probes if p.fits and p.config == plan.config), None)
    if chosen is None or not chosen.near_limit:
        return ""
    confirmed = {f.config: f.median for f in plan.confirmation.finalists} \
        if plan.confirmation and not plan.confirmation.on_cpu_clock else {}  # the probes' wall figures otherwise
    calm = [p for p in plan.probes if p.fits and not p.near_limit and p.config != plan.config]
    note = f"near the limit ({chosen.alloc_retries} allocator retries while timed)"
    if not calm:
        return f"{note}; no fit with headroom"
    roomy = max(calm, key=lambda p: confirmed.get(p.config, p.samples_per_s))
    return (f"{note}; with headroom: {roomy.config.describe()}, {confirmed.get(roomy.config, roomy.samples_per_s):,.2f} "
            f"samples/s, peak {format_size(roomy.peak_bytes)}")


def _swaps(space: "Space", winner: Finalist) -> dict[str, str]:
    """Knob field -> what the winner's value replaces of the job as given (`Strategy.replaces`), where it does."""
    said = {s.field: s.replaces(winner.config, space.spec) for s in space.strategies}
    return {field: words for field, words in said.items() if words}


def make_plan(space: "Space", results: Sequence[ProbeResult],
              predict: Callable[[Config], int | None] | None = None,
              confirmation: Confirmation | None = None) -> Plan:
    """The plan for a finished search: the confirmed choice (or the fastest fit), or why nothing fits and
    what to allow next. `plan.probes` holds the search's results, then every option and combination the
    space excluded. `predict(config)` (predicted peak bytes) names what the smallest candidate needs when
    nothing fits. The plan's throughput is the confirmed median where the finalists were re-measured on the wall
    clock; where the rounds counted CPU time (one torch thread), the chosen probe's measured figure."""
    common = dict(probes=tuple(results) + tuple(space.excluded_results()), spec=space.spec.summary(),
                  autofit_version=__version__, confirmation=confirmation)
    best = choose(results, confirmation)
    if best is not None:
        wall = confirmation is not None and not confirmation.on_cpu_clock
        throughput = confirmation.winner.median if wall else best.samples_per_s
        tokens = best.tokens_per_s * throughput / best.samples_per_s if best.tokens_per_s else None
        images = best.images_per_s * throughput / best.samples_per_s if best.images_per_s else None
        settings = {s.field: s.settings(best.config, space.spec) for s in space.strategies}
        return Plan(True, best.config, throughput, tokens, best.peak_bytes,
                    space.spec.model.noting_weights(chosen_reason(best, results, confirmation, space),
                                                    compute_dtype(best.config) is not None), **common,
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


# -- a plan file is data: its schema ----------------------------------------------------------------------------
# field -> (the JSON types it may hold, whether it may be missing); `None` in a tuple: null allowed
_NUMBER = (int, float)
PLAN_FIELDS: dict[str, tuple[tuple[type | None, ...], bool]] = {
    "fits": ((bool,), False), "config": ((dict, None), False), "throughput": ((*_NUMBER, None), False),
    "tokens_per_second": ((*_NUMBER, None), False), "peak_memory": ((int, None), False), "reason": ((str,), False),
    "probes": ((list,), False), "spec": ((dict,), False), "created": ((str,), True),
    "autofit_version": ((str,), True), "confirmation": ((dict, None), True), "settings": ((dict,), True),
    "shortfall": ((dict, None), True), "format_version": ((int,), False),
    "images_per_second": ((*_NUMBER, None), True)}
SPEC_FIELDS = {"model": (str,), "model_fingerprint": (str,), "device": (str,), "memory_budget": (int, None),
               "global_batch_size": (int, None), "num_gpus": (int,), "nvme_path": (str, None)}


def is_plan_json(data: bytes) -> bool:
    """Whether `data` is a plan autofit wrote (a JSON object with a format_version and a fits field): a file
    `Plan.save` may replace."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(document, dict) and "format_version" in document and "fits" in document


def check_plan_data(data: Any) -> str | None:
    """What is wrong with `data` as a plan (one phrase), or None: a JSON object of `PLAN_FIELDS` of their types,
    a `format_version` this autofit reads, sizes and speeds that are not negative, and a configuration exactly
    when it fits whose micro-batch x accumulation x GPUs is the global batch it was measured for."""
    if not isinstance(data, dict):
        return f"it holds a JSON {_json_type(data)}, not a plan (a JSON object)"
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            return (f"it has format_version {version}, written by a newer autofit (this one, {__version__}, reads "
                    f"{FORMAT_VERSION}); upgrade autofit to read it")
        return f"its format_version is {version!r}, not one autofit writes ({FORMAT_VERSION})"
    unknown = sorted(set(data) - set(PLAN_FIELDS))
    if unknown:
        return f"it has fields no plan has: {', '.join(unknown)}"
    for name, (kinds, optional) in PLAN_FIELDS.items():
        if name not in data:
            if not optional:
                return f"it has no {name!r} field"
        elif not _is(data[name], kinds):
            return f"its {name!r} is {data[name]!r}, not {_kinds_words(kinds)}"
    for name, kinds in SPEC_FIELDS.items():
        if name in data["spec"] and not _is(data["spec"][name], kinds):
            return f"its spec's {name!r} is {data['spec'][name]!r}, not {_kinds_words(kinds)}"
    return _invariant_problem(data)


def _invariant_problem(data: dict[str, Any]) -> str | None:
    for name in ("throughput", "tokens_per_second", "images_per_second", "peak_memory"):
        value = data.get(name)
        if value is not None and (not math.isfinite(value) or value < 0):
            return f"its {name} is {value!r}; a measured figure is a finite number >= 0"
    if data["fits"] != (data["config"] is not None):
        return ("it says fits=true but has no configuration" if data["fits"] else
                "it says fits=false but has a configuration")
    if data["fits"] and data["throughput"] is not None and data["peak_memory"] is None:
        return "it fits with a measured throughput but no peak_memory"
    if any(not isinstance(p, dict) for p in data["probes"]):
        return "its probes are not all JSON objects"
    if any(not isinstance(v, dict) for v in data.get("settings", {}).values()):
        return "its settings are not all JSON objects (one per knob)"
    config, spec = data["config"], data["spec"]
    if config is None or data["throughput"] is None:  # nothing fits; or the OOM guard wrote it back, unmeasured
        return None
    sizes = [config.get(k, 1) for k in ("micro_batch_size", "grad_accum_steps", "num_gpus")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        return f"its configuration's micro_batch_size, grad_accum_steps and num_gpus are {sizes}, not integers >= 1"
    wanted = spec.get("global_batch_size")
    if wanted is not None and math.prod(sizes) != wanted:
        return (f"its configuration trains {sizes[0]} x {sizes[1]} x {sizes[2]} = {math.prod(sizes)} samples a step "
                f"(micro-batch x accumulation x GPUs), but it was measured for a global batch of {wanted}")
    return None


def _is(value: Any, kinds: tuple[type | None, ...]) -> bool:
    if value is None:
        return None in kinds
    if isinstance(value, bool):
        return bool in kinds
    return any(kind is not None and kind is not bool and isinstance(value, kind) for kind in kinds)


def _kinds_words(kinds: tuple[type | None, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "a JSON object",
             list: "a JSON list", None: "null"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", type(None): "null", bool: "boolean", int: "number",
            float: "number"}.get(type(value), type(value).__name__)
