"""Smoke tests of the benchmark harness (bench/): tiny models, real probes, real tools, real budgets."""

import functools
import json

import pytest
import torch

from autofit.config import Config
from autofit.probe.run import ProbeStatus
from autofit.strategies import ActivationCheckpointing, MicroBatch, default_strategies
from bench.suite.measure import Remeasured, paired, paired_ratio, remeasure, robustness
from bench.suite.oracle import exhaustive
from bench.suite.report import END, START, update_readme
from bench.suite.scenarios import Scenario, TokenFeatures, baseline_config, budget_for, make_mlp, token_loss
from autofit.search.space import build_space
from bench.suite.load import CompetingLoad
from bench.suite.side_by_side import Options, _policy_oracle, run_scenario
from bench.suite.tools import AllocatorWordedBudget, run_accelerate, run_lightning, run_trainer

TINY = Scenario("tiny-mlp@60%", "mlp", functools.partial(make_mlp, 16, 3), TokenFeatures(256, 16), 2, 0.6,
                loss_fn=token_loss, intent="smoke test")


@pytest.fixture(scope="module")
def budget():
    return budget_for(TINY)[0]


def test_budget_is_the_fraction_of_a_measured_baseline():
    budget, peak = budget_for(TINY)
    assert peak > 0 and budget == int(peak * 0.6)


def test_exhaustive_probes_every_level_at_every_size(budget):
    spec = TINY.spec("cpu", budget)
    oracle = exhaustive(spec, [ActivationCheckpointing(), MicroBatch()])
    described = sorted((r.config.checkpointing.value, r.config.checkpoint_every, r.config.micro_batch_size)
                       for r in oracle.results)
    assert described == [("every_k", 2, 1), ("every_k", 2, 2), ("full", 1, 1), ("full", 1, 2), ("none", 1, 1),
                         ("none", 1, 2), ("ops", 1, 1), ("ops", 1, 2)]  # op-level selective checkpointing too
    assert oracle.counts().get("oom", 0) >= 1  # the baseline (no checkpointing, micro-batch 2) cannot fit 60% of its peak
    assert oracle.best is not None and oracle.best.fits and oracle.wall_s > 0
    assert oracle.ranked(2)[0] is oracle.best


def test_remeasure_gives_one_median_per_distinct_config(budget):
    spec = TINY.spec("cpu", budget)
    a = baseline_config(spec).replace(micro_batch_size=1, grad_accum_steps=2)
    b = a.replace(checkpointing="full")
    for accounting in (False, True):
        measured = remeasure(spec, [a, b, a], default_strategies(), repetitions=2, steps=1, accounting=accounting)
        assert [m.config for m in measured] == [a, b]
        assert all(len(m.samples_per_s) == 2 and m.median > 0 for m in measured)


def test_paired_measures_every_config_in_every_round_and_the_ratio_is_taken_round_by_round(budget):
    spec = TINY.spec("cpu", budget)
    a = baseline_config(spec).replace(micro_batch_size=1, grad_accum_steps=2)
    b = a.replace(checkpointing="full")
    measured = paired(spec, [a, b, a], default_strategies(), rounds=3, warmup=1)
    assert [m.config for m in measured] == [a, b] and all(len(m.samples_per_s) == 3 for m in measured)
    # a load that halves both in the second round cancels: the ratio is 2 in every round
    loaded = Remeasured(a, (200.0, 100.0, 200.0)), Remeasured(b, (100.0, 50.0, 100.0))
    assert paired_ratio(*loaded) == 2.0


def test_robustness_holds_for_a_fit_and_reports_an_oom(budget):
    spec = TINY.spec("cpu", budget)
    fits = robustness(spec, Config(micro_batch_size=1, grad_accum_steps=2, checkpointing="full"), default_strategies(), 3)
    assert fits.ok and fits.steps_done == 3 and 0 < fits.peak_bytes <= budget
    fails = robustness(spec, Config(micro_batch_size=2, grad_accum_steps=1), default_strategies(), 3)
    assert not fails.ok and fails.error.startswith("OOM after 0 steps")


def test_worded_budget_is_recognised_by_accelerate():
    from accelerate.utils.memory import should_reduce_batch_size

    with pytest.raises(torch.OutOfMemoryError) as caught, AllocatorWordedBudget(1024):
        torch.zeros(1024)
    assert should_reduce_batch_size(caught.value)


def test_tools_shrink_the_batch_under_the_budget(budget):
    spec = TINY.spec("cpu", budget)
    for outcome in (run_accelerate(spec), run_trainer(spec)):
        assert outcome.status == "ok", outcome.note
        assert outcome.tried[0] == 2 and outcome.micro_batch_size == 1
        assert outcome.keeps(2) is False and outcome.wall_s > 0


def test_lightning_finder_ends_with_a_size_or_a_reason(budget):
    pytest.importorskip("lightning")
    outcome = run_lightning(TINY.spec("cpu", budget))
    assert outcome.tried[:1] == (2,)
    assert (outcome.status == "ok" and outcome.micro_batch_size >= 1) or (outcome.status == "failed" and outcome.note)


def test_one_scenario_end_to_end_fills_the_readme(tmp_path):
    options = Options(tools=False, robustness_steps=2, repetitions=1, remeasure_steps=1,
                      strategies=lambda: [ActivationCheckpointing(), MicroBatch()])
    result = run_scenario(TINY, options)
    assert result["autofit"]["fits"] and result["exhaustive"]["candidates"] >= result["autofit"]["probes_run"]
    plain = result["remeasured"]["plain"]
    quality = plain["decision_quality"]
    assert 0 < quality <= 1 and 0 < plain["decision_quality_policy"] <= 1
    assert result["cost_ratio"] > 0 and result["robustness"]["ok"]
    assert result["repeat"]["fits"] and plain["repeat"]["agrees"] in (True, False)  # tuned twice, compared
    rows = result["dry_run"]
    assert len(rows) == result["exhaustive"]["candidates"] and sum(r["role"] == "chosen" for r in rows) == 1
    assert any(r["role"] == "oom" and r["measured_bytes"] > result["fit_limit_bytes"] for r in rows)
    doc = dict(device="cpu (test)", date="2026-01-01", started_utc="x", command="pytest", wall_s=1.0, torch_threads=1,
               load_before=(0.0, 0.0, 0.0), versions=dict(torch="t", autofit="a", transformers="tr", accelerate="ac",
                                                         lightning=None), scenarios=[json.loads(json.dumps(result))])
    readme = tmp_path / "README.md"
    readme.write_text(f"# Bench\n\nintro\n\n{START}\nold\n{END}\n\ntail\n")
    update_readme(readme, doc, "results/x.json")
    text = readme.read_text()
    assert text.startswith("# Bench\n\nintro") and text.rstrip().endswith("tail") and "old" not in text
    assert "| tiny-mlp@60% |" in text and f"{quality:.2f}" in text and "Dry-run error" in text
    assert "Tuned twice: the same configuration in" in text


def test_policy_oracle_keeps_exact_unless_the_change_clears_the_margin():
    space = build_space(TINY.spec("cpu", 2**30), default_strategies())
    exact, changed = Config(micro_batch_size=2), Config(micro_batch_size=2, optimizer="adafactor")
    assert _policy_oracle([exact, changed], {exact: 100, changed: 105}, space, 0.10) == exact
    assert _policy_oracle([exact, changed], {exact: 100, changed: 115}, space, 0.10) == changed
    assert _policy_oracle([changed], {changed: 1}, space, 0.10) == changed


def test_competing_load_runs_and_stops():
    import time

    with CompetingLoad(1, every_s=0.2) as load:
        (worker,) = load._workers
        time.sleep(1.0)
        assert worker.is_alive()
    assert not worker.is_alive() and not load._workers
    assert load.loads and all(x >= 0 for x in load.loads)  # the load average, sampled while it ran


def test_busy_starts_two_competing_processes_per_core(monkeypatch, tmp_path):
    import os

    import bench.run

    class Started(Exception):
        pass

    def load(processes):
        raise Started(processes)

    monkeypatch.setattr(bench.run, "CompetingLoad", load)
    monkeypatch.setattr(bench.run, "cpu_scenarios", lambda: [TINY])
    with pytest.raises(Started) as started:
        bench.run.main(["--busy", "--no-readme", "--only", TINY.name, "--out", str(tmp_path)])
    assert started.value.args == (2 * (os.cpu_count() or 1),)


def test_probe_status_values_used_by_the_report_exist():
    assert {s.value for s in ProbeStatus} >= {"fit", "oom"}
