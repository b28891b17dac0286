"""The activation formula's error bound (autofit/estimate/tolerance.py) is the committed measurement's
(bench/calibration/formula_bound.py), per target, and a formula-based estimate carries its target's."""

import json

from autofit.estimate.tolerance import FORMULA_UNDER_PREDICTION
from bench.calibration import formula_bound


def test_each_targets_bound_covers_its_measured_worst_and_no_more_than_rounding():
    summaries = json.loads(formula_bound.RESULT.read_text())["summary"]
    assert set(summaries) == set(formula_bound.TARGETS) == set(FORMULA_UNDER_PREDICTION)
    for target, numbers in summaries.items():
        assert numbers["worst_under"] <= FORMULA_UNDER_PREDICTION[target] < numbers["worst_under"] + 0.1


def test_a_formula_based_estimate_carries_its_targets_bound_where_the_formula_covers_the_model(monkeypatch):
    import torch
    from torch import nn

    from autofit.config import Config
    from autofit.estimate import estimator as estimator_module
    from autofit.estimate.estimator import Estimator
    from autofit.job.train_spec import make_spec

    def failing(*_args, **_kwargs):
        raise RuntimeError("no fake kernel")

    monkeypatch.setattr(estimator_module, "simulate_step", failing)
    from transformers import GPT2Config

    covered = make_spec(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100), seq_len=16, device="cpu",
                        memory_budget="1TiB")
    for target in ("cpu", "cuda"):
        estimate = Estimator(covered, target=target).predict(Config(micro_batch_size=2))
        assert not estimate.simulated and estimate.error_bound > 0
        assert f"up to {FORMULA_UNDER_PREDICTION[target]:.1f}x under" in estimate.reason
    # a model of one's own has no transformer width or positions to count: the formula has no bound there
    own = make_spec(lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)),
                    lambda n: torch.zeros(n, 64), device="cpu", memory_budget="1TiB",
                    loss_fn=lambda output, _batch: output.sum())
    estimate = Estimator(own, target="cuda").predict(Config(micro_batch_size=2))
    assert estimate.error_bound is None and estimate.upper_bytes is None and "no bound" in estimate.reason
