"""One scenario, side by side: autofit, the exhaustive oracle, the tools people use, the back-to-back
re-measurement, the robustness run and the dry-run error. Returns plain JSON-ready dicts."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

import autofit
from autofit.probe.outcome import Source
from autofit.strategies import Strategy, default_strategies

from bench.dryrun import peak_rows
from bench.measure import remeasure, robustness
from bench.oracle import exhaustive
from bench.scenarios import Scenario, baseline_config, budget_for
from bench.tools import run_tools


@dataclasses.dataclass(frozen=True)
class Options:
    """How much of the suite to run, and how hard."""

    device: str = "cpu"
    tools: bool = True
    robustness_steps: int = 200
    repetitions: int = 5  # interleaved re-measurement rounds
    remeasure_steps: int = 3  # timed steps per round
    oracle_top: int = 2  # the oracle's k fastest fits (as probed) are re-measured; the best of them is the oracle
    dry_run: bool = True
    strategies: Callable[[], list[Strategy]] = default_strategies  # the techniques searched (all rungs by default)


def log(message: str) -> None:
    """Progress on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_scenario(scenario: Scenario, options: Options) -> dict[str, Any]:
    """Everything the suite measures for `scenario` (see the module doc)."""
    phases: dict[str, float] = {}
    with _phase(phases, "budget"):
        budget, baseline = budget_for(scenario, options.device)
    strategies = options.strategies()
    spec = scenario.spec(options.device, budget)
    log(f"{scenario.name}: budget {autofit.format_size(budget)}"
        + (f" ({scenario.budget_fraction:.0%} of the baseline peak {autofit.format_size(baseline)})" if baseline else ""))
    with _phase(phases, "autofit"):
        plan = autofit.autofit(scenario.model_factory, scenario.batch_factory, strategies=options.strategies(),
                               **scenario.autofit_kwargs(options.device, budget))
    log(f"  autofit: {plan.config.describe() if plan.fits else 'nothing fits'}, {plan.probes_run} probes, {phases['autofit']:.1f} s")
    with _phase(phases, "exhaustive"):
        oracle = exhaustive(spec, strategies)
    log(f"  exhaustive: {len(oracle.results)} candidates {oracle.counts()}, {oracle.wall_s:.1f} s")
    tools = []
    if options.tools:
        with _phase(phases, "tools"):
            tools = run_tools(spec)
        log("  tools: " + "; ".join(f"{t.tool}: {t.status} mb={t.micro_batch_size} {t.note[:200]}" for t in tools))
    out: dict[str, Any] = dict(
        name=scenario.name, family=scenario.family, intent=scenario.intent, model=spec.model.name,
        num_params=spec.model.num_params, batch=spec.batch_description, global_batch_size=scenario.global_batch_size,
        baseline_peak_bytes=baseline, budget_fraction=scenario.budget_fraction, budget_bytes=budget,
        fit_limit_bytes=spec.fit_limit, allow=sorted(scenario.allow) if scenario.allow else None,
        autofit=_autofit_part(plan, phases["autofit"]), exhaustive=_oracle_part(oracle, options.oracle_top),
        tools=[t.to_dict(scenario.global_batch_size) for t in tools])
    if plan.fits and oracle.best is not None:
        with _phase(phases, "remeasure"):
            out["remeasured"] = _compare(spec, plan, oracle, tools, strategies, options)
        log("  decision quality " + ", ".join(f"{k} {v['decision_quality']:.3f}" for k, v in out["remeasured"].items())
            + f"; cost {phases['autofit'] / oracle.wall_s:.3f}")
    out["cost_ratio"] = phases["autofit"] / oracle.wall_s if oracle.wall_s else None
    if plan.fits and options.robustness_steps:
        with _phase(phases, "robustness"):
            out["robustness"] = dataclasses.asdict(robustness(spec, plan.config, strategies, options.robustness_steps))
        log(f"  robustness: {out['robustness']['steps_done']}/{options.robustness_steps} steps, ok={out['robustness']['ok']}")
    if options.dry_run and plan.fits:
        with _phase(phases, "dry_run"):
            probed = {p.config for p in plan.probes if p.source is Source.PROBED}
            out["dry_run"] = [r.to_dict() for r in peak_rows(spec, oracle.results, plan.config, probed, strategies)]
    out["phase_seconds"] = phases
    return out


def _autofit_part(plan: Any, wall: float) -> dict[str, Any]:
    return dict(fits=plan.fits, config=plan.config.to_dict() if plan.config else None,
                describe=plan.config.describe() if plan.config else None, probes_run=plan.probes_run,
                probes_decided=len(plan.probes), wall_s=wall, probe_samples_per_s=plan.throughput,
                peak_bytes=plan.peak_memory, reason=plan.reason)


def _oracle_part(oracle: Any, top: int) -> dict[str, Any]:
    best = oracle.best
    return dict(candidates=len(oracle.results), counts=oracle.counts(), wall_s=oracle.wall_s,
                best=best.config.to_dict() if best else None, best_describe=best.config.describe() if best else None,
                best_probe_samples_per_s=best.samples_per_s if best else None,
                top=[dict(describe=r.config.describe(), probe_samples_per_s=r.samples_per_s, peak_bytes=r.peak_bytes)
                     for r in oracle.ranked(top)])


def _compare(spec: Any, plan: Any, oracle: Any, tools: list[Any], strategies: Any, options: Options) -> dict[str, Any]:
    """Re-measure autofit's choice against the oracle's best and each tool's end configuration, back to back.

    "as probed": under the probes' conditions (on the CPU, the budget's per-storage bookkeeping on), the
    oracle's candidates being the exhaustive search's fastest fits: this judges the search's decision.
    "plain" (CPU only): plain training, the speed a user gets; every fit of the exhaustive search is
    screened once in plain training and the two fastest are the oracle's candidates.
    In both, the oracle is the fastest re-measured fit, autofit's choice included (so quality <= 1).
    """
    level = baseline_config(spec)
    tool_configs = {t.tool: t.config(level) for t in tools if t.config(level) is not None}
    tops = [r.config for r in oracle.ranked(options.oracle_top)]
    out = {"as_probed": _side_by_side(spec, plan.config, tops, tool_configs, strategies, options, accounting=True)}
    if spec.device.type == "cpu":
        fits = [r.config for r in oracle.results if r.fits]
        screen = remeasure(spec, fits, strategies, repetitions=1, steps=2)
        plain_tops = [m.config for m in sorted(screen, key=lambda m: m.median, reverse=True)[:2]]
        out["plain"] = _side_by_side(spec, plan.config, plain_tops, tool_configs, strategies, options, accounting=False)
    return out


def _side_by_side(spec: Any, chosen: Any, tops: list[Any], tool_configs: dict[str, Any], strategies: Any,
                  options: Options, accounting: bool) -> dict[str, Any]:
    configs = [chosen, *tops, *tool_configs.values()]
    measured = {m.config: m for m in remeasure(spec, configs, strategies, options.repetitions,
                                               options.remeasure_steps, accounting=accounting)}
    # The chosen config is a fit too: the oracle is the fastest of all of them, so quality <= 1.
    oracle_best = max([chosen, *tops], key=lambda c: measured[c].median)
    ours = measured[chosen].median
    return dict(
        repetitions=options.repetitions, steps=options.remeasure_steps, accounting=accounting,
        autofit_samples_per_s=ours, oracle=oracle_best.describe(), oracle_samples_per_s=measured[oracle_best].median,
        same_config=oracle_best == chosen, decision_quality=ours / measured[oracle_best].median,
        tools={name: dict(describe=c.describe(), samples_per_s=measured[c].median,
                          vs_autofit=measured[c].median / ours) for name, c in tool_configs.items()},
        all=[dict(describe=m.config.describe(), median=m.median, samples=list(m.samples_per_s)) for m in measured.values()])


class _phase:
    """Context manager adding the seconds of a block to `phases[name]`."""

    def __init__(self, phases: dict[str, float], name: str):
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.phases[self.name] = self.phases.get(self.name, 0.0) + time.perf_counter() - self.start
