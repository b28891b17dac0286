"""A dry-run's per-candidate work done once: each configuration predicted once per plan (a bisection's fit is
its row), each configuration's simulated facts found once per prediction (`Estimator.steady`, a dry-run's planning throughout) and read anew
by the next one, the change order's level index made once per decision."""

import collections

import pytest
import torch

from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.estimate.simulation import disk_cache as kept
from autofit.estimate.simulation import memo as simulations
from autofit.job.train_spec import make_spec
from autofit.pipelines.dry_run import dry_run
from autofit.search.decision import change_order, level_order
from autofit.search.space import build_space
from autofit.strategies import FusedAttention, MicroBatch, MixedPrecision
from tests.pipelines.test_dry_run import above_overhead
from tests.pipelines.test_dry_run_floors import tiny_llama

PLAN = dict(seq_len=256, global_batch_size=64, gpu="a100-80gb", gpu_memory=above_overhead(48))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """One thread, and nothing simulated or replayed before (in the process or on disk)."""
    torch.set_num_threads(1)
    monkeypatch.setattr(simulations, "SIMULATIONS", simulations.Simulations(folder=None))
    monkeypatch.setattr(kept, "RESERVES", kept.Reserves(folder=None))


def test_each_configuration_is_predicted_once_per_plan(monkeypatch):
    predicted = collections.Counter()
    real = Estimator.predict
    monkeypatch.setattr(Estimator, "predict", lambda self, config: predicted.update([config]) or real(self, config))
    report = dry_run(tiny_llama(), **PLAN, strategies=[MixedPrecision(), FusedAttention(), MicroBatch()])
    assert report.chosen is not None and predicted
    assert max(predicted.values()) == 1, [c.describe() for c, n in predicted.items() if n > 1][:3]
    assert {c.config for c in report.candidates} <= set(predicted)  # every row was predicted, once
    document = report.to_dict()  # its rows and choice by index, as `index` finds them
    assert document["rows"] == [[report.candidates.index(c) for c in row] for row in report.rows]
    assert document["chosen_index"] == report.candidates.index(report.chosen)


def test_a_prediction_finds_each_configurations_facts_once_and_the_next_finds_them_anew(monkeypatch):
    spec = make_spec(tiny_llama(), None, seq_len=128, device="cpu", global_batch_size=32, memory_budget="4GiB")
    estimator = Estimator(spec, target="cuda", extrapolate_batch=True)
    found = collections.Counter()
    real = simulations.merged_facts
    monkeypatch.setattr(simulations, "merged_facts", lambda config, shaping: found.update([config]) or real(config, shaping))
    config = Config(precision="bf16", micro_batch_size=8, grad_accum_steps=4)
    first = estimator.predict(config)
    assert found[config] == 1 and max(found.values()) == 1  # one line through 1 and 2, each found once
    found.clear()
    assert estimator.predict(config) == first
    assert found[config] == 1  # read anew: the calibration may change what a strategy simulates between calls
    found.clear()
    estimator._key(config, 1), estimator._key(config, 1)
    assert found[config] == 2  # outside a prediction, every time
    found.clear()
    with estimator.steady():  # as a dry-run plans: once for all its predictions
        estimator.predict(config), estimator.floor(config), estimator.predict(config)
    assert found[config] == 1


def test_the_change_order_is_the_same_with_the_level_index_made_once():
    spec = make_spec(tiny_llama(), None, seq_len=128, device="cpu", global_batch_size=32, memory_budget="4GiB")
    space = build_space(spec, [MixedPrecision(), FusedAttention(), MicroBatch()])
    order = level_order(space)
    configs = [space.at(level, size) for level in space.levels() for size in space.sizes_at(level)]
    assert len(configs) > 4
    assert [change_order(space, c, order=order) for c in configs] == [change_order(space, c) for c in configs]
    assert [order[level] for level in space.levels()] == list(range(len(order)))

