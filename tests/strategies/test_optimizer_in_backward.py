"""The optimizer step in backward: the same update as a step after backward, no whole-model gradients,
kept by the rules at accumulation 1 on one torch rank; chosen where only it fits; predicted."""

import pytest
import torch
from forcing import budget_between, peak, tune
from models import WideBlocks, thin_batch

from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.estimate.tolerance import PREDICTION_TOLERANCE
from autofit.devices.gpus import get_gpu
from autofit.probe.run import run_probe
from autofit.strategies.run import build_run
from autofit.search.rules import violation
from autofit.search.space import build_space
from autofit.job.target import Target
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch, OptimizerInBackward, OptimizerStates, default_strategies


def _spec(**kwargs):
    return make_spec(WideBlocks, thin_batch, global_batch_size=4, device="cpu", memory_budget="1GiB", **kwargs)


def test_same_weights_as_a_step_after_backward_and_no_gradients_left():
    spec = _spec()
    runs = []
    for step in ("after_backward", "in_backward"):
        torch.manual_seed(0)  # the same initial weights
        runs.append(build_run(spec, Config(micro_batch_size=4, optimizer_step=step), default_strategies()))
    for _ in range(3):
        losses = [run.step([thin_batch(4)]) for run in runs]
        assert torch.equal(*losses)
    for after, inside in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(after, inside) and inside.grad is None


def test_rules_keep_it_exact():
    target = Target.from_profile(get_gpu("a100-80gb"), 2)
    inside = Config(optimizer_step="in_backward")
    assert "accumulation 1" in violation(inside.replace(grad_accum_steps=2), target)[1]
    assert "GradScaler" in violation(inside.replace(precision="fp16"), target)[1]
    assert "several ranks" in violation(inside.replace(num_gpus=2), target)[1]
    assert "engine" in violation(inside.replace(sharding="zero2", offload="cpu"), target)[1]
    assert violation(inside.replace(precision="pure_bf16", optimizer="adafactor"), target) is None


def test_the_space_runs_it_at_accumulation_1_only_and_says_why():
    space = build_space(_spec(), [OptimizerInBackward(), MicroBatch()])
    inside = [level for level in space.levels() if level.steps_in_backward]
    assert inside and space.sizes_at(inside[0]) == (4,) and space.sizes == (1, 2, 4)
    reasons = [e.reason for e in space.excluded if e.config.steps_in_backward]
    assert reasons and all("exact only at accumulation 1" in r for r in reasons)


@pytest.mark.parametrize("strategies", [[OptimizerInBackward, MicroBatch],
                                        [OptimizerInBackward, OptimizerStates, MicroBatch]])
def test_forced_by_a_budget_only_the_step_in_backward_meets(strategies):
    """Whatever order the strategies come in (the optimizer rung left out, or given after this one), the
    optimizer's strategy applies first and this one runs its optimizer per parameter. Exact math only
    (allow=0): Adafactor's factored states fit this budget at micro-batch 4 too, and whether it clears the
    numerics margin is a matter of this machine's speed, not of the rung being forced."""
    after = peak(WideBlocks, thin_batch, Config(micro_batch_size=1, grad_accum_steps=4))
    inside = peak(WideBlocks, thin_batch, Config(micro_batch_size=4, optimizer_step="in_backward"))
    plan = tune(WideBlocks, thin_batch, [s() for s in strategies], budget_between(inside, after), 4, allow=0)
    assert plan.fits and plan.config.steps_in_backward and plan.config.grad_accum_steps == 1, plan.reason


def test_estimator_predicts_the_peak_within_its_tolerance():
    spec = _spec()
    for precision in ("fp32", "pure_bf16"):
        config = Config(precision=precision, micro_batch_size=4, optimizer_step="in_backward")
        measured = run_probe(spec, config, default_strategies()).peak_bytes
        predicted = Estimator(spec).predict(config).peak_bytes
        assert abs(predicted / measured - 1) <= PREDICTION_TOLERANCE["cpu"], (precision, predicted, measured)
