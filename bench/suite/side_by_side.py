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

from bench.suite.dryrun import peak_rows
from bench.suite.measure import paired, paired_ratio, remeasure, robustness
from bench.suite.oracle import exhaustive
from bench.suite.scenarios import Scenario, baseline_config, budget_for
from bench.suite.tools import run_tools


@dataclasses.dataclass(frozen=True)
class Options:
    """How much of the suite to run, and how hard."""

    device: str = "cpu"
    tools: bool = True
    robustness_steps: int = 200
    repetitions: int = 5  # interleaved re-measurement rounds of the tools' configurations (whole builds)
    paired_rounds: int = 21  # rounds of one step each of autofit's choice and the oracle's candidates, side by side
    remeasure_steps: int = 3  # timed steps per round
    oracle_top: int = 2  # the oracle's k fastest fits (as probed) are re-measured; the best of them is the oracle
    dry_run: bool = True
    strategies: Callable[[], list[Strategy]] = default_strategies  # the techniques searched (all rungs by default)
    repeat: bool = True  # tune a second time, identically, to see whether the choice holds
    large: bool = True  # run the >= 50M-parameter CPU scenarios too


def log(message: str) -> None:
    """Progress on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_scenario(scenario: Scenario, options: Options) -> dict[str, Any]:
    """Everything the suite measures for `scenario` (see the module doc)."""
    phases: dict[str, float] = {}
    with _phase(phases, "budget"):
        budget, baseline = budget_for(scenario, options.device)
    rungs = scenario.strategies or options.strategies
    strategies = rungs()
    spec = scenario.spec(options.device, budget)
    log(f"{scenario.name}: budget {autofit.format_size(budget)}"
        + (f" ({scenario.budget_fraction:.0%} of the baseline peak {autofit.format_size(baseline)})" if baseline else ""))
    with _phase(phases, "autofit"):
        plan = autofit.autofit(scenario.model_factory, scenario.batch_factory, strategies=rungs(),
                               **scenario.autofit_kwargs(options.device, budget))
    log(f"  autofit: {plan.config.describe() if plan.fits else 'nothing fits'}, {plan.probes_run} probes, {phases['autofit']:.1f} s")
    again = None
    if options.repeat:
        with _phase(phases, "autofit_repeat"):
            again = autofit.autofit(scenario.model_factory, scenario.batch_factory, strategies=rungs(),
                                    **scenario.autofit_kwargs(options.device, budget))
        log(f"  autofit again: {again.config.describe() if again.fits else 'nothing fits'}, {phases['autofit_repeat']:.1f} s")
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
        tools=[t.to_dict(scenario.global_batch_size) for t in tools], large=scenario.large,
        repeat=_autofit_part(again, phases["autofit_repeat"]) if again is not None else None)
    if plan.fits and oracle.best is not None:
        with _phase(phases, "remeasure"):
            out["remeasured"] = _compare(spec, plan, again, oracle, tools, strategies, options)
        plain = out["remeasured"]["plain"]
        log(f"  decision quality {plain['decision_quality']:.3f} (exactness rule {plain['decision_quality_policy']:.3f})"
            + (f", repeat agrees: {plain['repeat']['agrees']}" if "repeat" in plain else "")
            + f"; cost {phases['autofit'] / oracle.wall_s:.3f}")
    out["cost_ratio"] = phases["autofit"] / oracle.wall_s if oracle.wall_s else None
    steps = min(options.robustness_steps, scenario.robustness_steps or options.robustness_steps)
    if plan.fits and steps:
        with _phase(phases, "robustness"):
            out["robustness"] = dataclasses.asdict(robustness(spec, plan.config, strategies, steps))
        log(f"  robustness: {out['robustness']['steps_done']}/{steps} steps, ok={out['robustness']['ok']}")
    if options.dry_run and plan.fits:
        with _phase(phases, "dry_run"):
            probed = {p.config for p in plan.probes if p.source is Source.PROBED}
            out["dry_run"] = [r.to_dict() for r in peak_rows(spec, oracle.results, plan.config, probed, strategies)]
    out["phase_seconds"] = phases
    return out


def _autofit_part(plan: Any, wall: float) -> dict[str, Any]:
    confirmed = plan.confirmation
    return dict(fits=plan.fits, config=plan.config.to_dict() if plan.config else None,
                describe=plan.config.describe() if plan.config else None, probes_run=plan.probes_run,
                probes_decided=len(plan.probes), steps_spent=plan.steps_spent,
                confirmation_steps=confirmed.steps if confirmed is not None else 0,
                wall_s=wall, probe_samples_per_s=plan.throughput,
                peak_bytes=plan.peak_memory, reason=plan.reason,
                confirmation=confirmed.to_dict() if confirmed is not None else None,
                noise=_confirmed_noise(confirmed))


def _confirmed_noise(confirmed: Any) -> float:
    """The noise the search itself saw between its top two finalists: the width of the interval of their
    median paired ratio (`autofit.search.decision.Ratio`), at least the noise margin."""
    from autofit.search.decision import NOISE_MARGIN, Ratio

    runner = confirmed.runner_up() if confirmed is not None else None
    if runner is None or not runner.rounds:
        return NOISE_MARGIN
    ratio = Ratio.of(confirmed.winner, runner)
    return max(NOISE_MARGIN, ratio.high / ratio.low - 1)


def _oracle_part(oracle: Any, top: int) -> dict[str, Any]:
    best = oracle.best
    return dict(candidates=len(oracle.results), counts=oracle.counts(), wall_s=oracle.wall_s,
                best=best.config.to_dict() if best else None, best_describe=best.config.describe() if best else None,
                best_probe_samples_per_s=best.samples_per_s if best else None,
                top=[dict(describe=r.config.describe(), probe_samples_per_s=r.samples_per_s, peak_bytes=r.peak_bytes)
                     for r in oracle.ranked(top)])


def _compare(spec: Any, plan: Any, again: Any, oracle: Any, tools: list[Any], strategies: Any,
             options: Options) -> dict[str, Any]:
    """Re-measure autofit's choice against the oracle's candidates and the repeat run's choice side by side
    (`paired`: each built once, one step of each per round, the order rotating; plain training, the speed
    a user gets), and each tool's end configuration back to back (whole builds: it may change the batch).
    Every fit of the exhaustive search is screened twice; the three fastest, and the two fastest exact
    (tier 0) ones, are the oracle's candidates. Two oracles: the fastest of them all (autofit's choice
    included, so quality <= 1), and the choice the same exactness rule makes (a numerics change only when
    `exact_margin` faster than the best exact fit, re-measured). Quality is the median of the per-round
    ratios of autofit's choice over the oracle's."""
    from autofit.search.space import build_space

    space = build_space(spec, strategies)
    level = baseline_config(spec)
    tool_configs = {t.tool: t.config(level) for t in tools if t.config(level) is not None}
    fits = [r.config for r in oracle.results if r.fits]
    screen = sorted(remeasure(spec, fits, strategies, repetitions=2, steps=2), key=lambda m: m.median, reverse=True)
    tops = [m.config for m in screen[:options.oracle_top + 1]]
    exact = [m.config for m in screen if space.tier(m.config) == 0][:options.oracle_top]
    repeat = again.config if again is not None and again.fits else None
    candidates = list(dict.fromkeys([plan.config, *tops, *exact]))
    side = {m.config: m for m in paired(spec, [*candidates, *([repeat] if repeat else [])], strategies,
                                        options.paired_rounds)}
    tooled = {m.config: m for m in remeasure(spec, [plan.config, *tool_configs.values()], strategies,
                                             options.repetitions, options.remeasure_steps, accounting=False)}
    ours = side[plan.config]
    ratio = {c: paired_ratio(ours, side[c]) for c in side}  # ours over each, round by round
    fastest = min(candidates, key=ratio.get)
    speed = {c: side[c].median for c in side}
    policy = _policy_oracle(candidates, {c: 1 / ratio[c] for c in candidates}, space,
                            plan.confirmation.exact_margin if plan.confirmation else 0.1)
    part = dict(
        rounds=options.paired_rounds, paired=True, accounting=False,
        autofit_samples_per_s=ours.median, oracle=fastest.describe(), oracle_samples_per_s=speed[fastest],
        same_config=fastest == plan.config, decision_quality=min(1.0, ratio[fastest]),
        policy_oracle=policy.describe(), policy_same_config=policy == plan.config,
        decision_quality_policy=min(1.0, ratio[policy]),
        tools={name: dict(describe=c.describe(), samples_per_s=tooled[c].median,
                          vs_autofit=tooled[c].median / tooled[plan.config].median)
               for name, c in tool_configs.items()},
        screen=[dict(describe=m.config.describe(), samples_per_s=m.median) for m in screen],
        all=[dict(describe=m.config.describe(), median=m.median, over_autofit=1 / ratio[m.config],
                  samples=list(m.samples_per_s)) for m in side.values()])
    part["numerics"] = _numerics_check(plan, candidates, {c: 1 / ratio[c] for c in candidates}, space)
    if repeat is not None:
        noise = _confirmed_noise(plan.confirmation)
        part["repeat"] = dict(describe=repeat.describe(), same_config=repeat == plan.config, ratio=1 / ratio[repeat],
                              noise=noise, agrees=repeat == plan.config or abs(1 / ratio[repeat] - 1) <= noise)
    return {"plain": part}


def _numerics_check(plan: Any, candidates: list[Any], speed: dict[Any, float], space: Any) -> dict[str, Any]:
    """Whether autofit took a numerics change, and if so whether the oracle's re-measured figures confirm its
    margin: its samples/s over the fastest exact candidate's, against `exact_margin`."""
    margin = plan.confirmation.exact_margin if plan.confirmation else 0.1
    exact = [speed[c] for c in candidates if space.tier(c) == 0]
    changed = space.tier(plan.config) > 0
    over = speed[plan.config] / max(exact) if exact else None  # `speed`: relative to autofit's choice
    return dict(changed=changed, margin=margin, over_best_exact=over,
                confirmed=(over is None or over >= 1 + margin) if changed else None)


def _policy_oracle(candidates: list[Any], speed: dict[Any, float], space: Any, margin: float) -> Any:
    """What the exactness rule chooses from re-measured figures: the fastest exact candidate, unless the
    fastest of all is a numerics change faster than it by `margin` (or nothing exact is among them)."""
    fastest = max(candidates, key=speed.get)
    exact = [c for c in candidates if space.tier(c) == 0]
    if not exact:
        return fastest
    best_exact = max(exact, key=speed.get)
    return fastest if speed[fastest] >= speed[best_exact] * (1 + margin) else best_exact


class _phase:
    """Context manager adding the seconds of a block to `phases[name]`."""

    def __init__(self, phases: dict[str, float], name: str):
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.phases[self.name] = self.phases.get(self.name, 0.0) + time.perf_counter() - self.start
