"""Plan: the chosen configuration with what was measured for it, every probe, and the reason.

This module owns the plan: choosing among the fits (`choose`), composing why it won or why nothing
fits (from recorded results and predictions only: no probe runs while a message is composed), and the
value itself. A plan is a value: `save` writes JSON, `Plan.load` reads it back equal (plans written by
autofit 0.1 too).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autofit.config import Config
from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, Source
from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.search.space import Space

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Plan:
    """The outcome of a search. Memory in bytes, throughput in samples/s and tokens/s."""

    fits: bool  # a configuration fits within the budget and its safety margin
    config: Config | None  # the chosen configuration (None when nothing fits)
    throughput: float | None  # measured samples/s of the chosen configuration
    tokens_per_second: float | None  # measured tokens/s, where the batch has a sequence axis
    peak_memory: int | None  # measured peak bytes of the chosen configuration on the device
    reason: str  # why this configuration was chosen, or why nothing fits and what to allow next
    probes: tuple[ProbeResult, ...]  # every candidate decided, in order: fit / oom / error / skipped
    spec: dict[str, Any]  # the spec summary: model, device, budget, global batch, ...
    created: str = dataclasses.field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    autofit_version: str = ""

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
        data["format_version"] = FORMAT_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Inverse of `to_dict`."""
        fields = {k: v for k, v in data.items() if k != "format_version"}
        fields["config"] = Config.from_dict(fields["config"]) if fields["config"] else None
        fields["probes"] = tuple(ProbeResult.from_dict(p) for p in fields["probes"])
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
            raise UsageError(f"Cannot read a plan from {str(path)!r}: {exc}. Pass a plan.json written by "
                             "autofit (plan.save or autofit tune).") from exc

    def export(self, fmt: str, out_dir: str | Path) -> list[Path]:
        """Write the launcher files of `fmt` ("accelerate", "deepspeed", "trainer", "torchrun") into
        `out_dir`; returns their paths. A plan that does not fit raises `UsageError` saying why."""
        from autofit.export import export

        return export(self, fmt, out_dir)

    def summary(self) -> str:
        """A few lines for people: the choice, its figures and the reason."""
        if not self.fits:
            return f"Nothing fits. {self.reason}"
        tokens = f", {self.tokens_per_second:,.0f} tokens/s" if self.tokens_per_second else ""
        return (f"{self.config.describe()}: {self.throughput:,.2f} samples/s{tokens}, "
                f"peak {format_size(self.peak_memory)}\n{self.reason}")


def choose(results: Sequence[ProbeResult]) -> ProbeResult | None:
    """The fit with the highest measured throughput."""
    fits = [r for r in results if r.fits]
    return max(fits, key=lambda r: r.samples_per_s, default=None)


def chosen_reason(best: ProbeResult, results: Sequence[ProbeResult]) -> str:
    """Why `best` won: its throughput against the runner-up's."""
    others = sorted((r for r in results if r.fits and r.config != best.config),
                    key=lambda r: r.samples_per_s, reverse=True)
    fits = len(others) + 1
    if not others:
        return f"the only configuration of {len(results)} candidates that fits ({best.reason})"
    runner = others[0]
    return (f"highest measured throughput of {fits} fitting configurations: {best.samples_per_s:,.2f} samples/s, "
            f"{best.samples_per_s / runner.samples_per_s:.2f}x the runner-up ({runner.config.describe()}); "
            f"{best.reason}")


def make_plan(space: "Space", results: Sequence[ProbeResult],
              predict: Callable[[Config], int | None] | None = None) -> Plan:
    """The plan for a finished search: the fastest fit, or why nothing fits and what to allow next.
    `plan.probes` holds the search's results, then every option and combination the space excluded.
    `predict(config)` (predicted peak bytes) names what the smallest candidate needs when nothing fits."""
    from autofit import __version__

    common = dict(probes=tuple(results) + tuple(space.excluded_results()), spec=space.spec.summary(),
                  autofit_version=__version__)
    best = choose(results)
    if best is not None:
        return Plan(True, best.config, best.samples_per_s, best.tokens_per_s, best.peak_bytes,
                    chosen_reason(best, results), **common)
    return Plan(False, None, None, None, None, nothing_fits_reason(space, results, predict), **common)


def nothing_fits_reason(space: "Space", results: Sequence[ProbeResult],
                        predict: Callable[[Config], int | None] | None = None) -> str:
    """"No candidate fits X; the smallest needs Y (config). Allow ... to go further." """
    spec = space.spec
    head = (f"No candidate fits {format_size(spec.fit_limit)} ({format_size(spec.memory_budget)} budget less "
            f"the {spec.safety_margin:.0%} margin)")
    errors = [r for r in results if r.status is ProbeStatus.ERROR]
    ooms = [r for r in results if r.status is ProbeStatus.OOM or r.skip is Skip.PREDICTED]
    if not ooms:
        return f"{head}: every probe failed with an error, the first: {errors[0].reason}" if errors else head
    # the OOM that saves at least as much memory as the most others: the closest to fitting
    smallest = max(ooms, key=lambda r: sum(space.saves_at_least(r.config, o.config) for o in ooms))
    hint = space.next_tier_hint()
    further = f"Pass {hint} to go further." if hint else \
        "Raise the budget, use more GPUs (num_gpus) or offload to go further."
    return f"{head}; the smallest needs {_need(smallest, predict)} ({smallest.config.describe()}). {further}"


def _need(result: ProbeResult, predict: Callable[[Config], int | None] | None) -> str:
    """What `result`'s config needs: the estimator's prediction where there is one (said so), else the
    bytes it held when it ran out (a lower bound)."""
    predicted = predict(result.config) if predict is not None else None
    if predicted:
        return f"{format_size(predicted)} by the estimator's prediction"
    if result.peak_bytes:
        return f"more than {format_size(result.peak_bytes)}"
    return "more than the budget"
