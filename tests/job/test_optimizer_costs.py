"""A user's own optimizer is measured on stand-in parameters (`autofit.job.optimizer_costs`): its states
and step temporaries, which the estimator scales by the trained weights instead of counting AdamW."""

import pytest
import torch
from torch import nn

import autofit
from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.probe.run import run_probe
from autofit.job.optimizer_costs import measure, stand_ins
from autofit.job.train_spec import make_spec, parse_optimizer
from autofit.strategies import default_strategies


def costs(build):
    params = stand_ins()
    return measure(build(params), params)


@pytest.mark.parametrize("build, states, foreach, single", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0, 0, 0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1, 0, 0),  # the momentum buffer, updated in place
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1), 1, 1, 1),  # grad + decay: a new list
    (lambda ps: torch.optim.Adam(ps), 2, 1, 2),  # AdamW's formula: one foreach list, two single temporaries
    (lambda ps: torch.optim.RMSprop(ps), 1, 1, 1),
], ids=["sgd", "momentum", "momentum+decay", "adam", "rmsprop"])
def test_states_and_temporaries_per_byte_of_weight(build, states, foreach, single):
    measured = costs(build)
    assert measured.states == pytest.approx(states, abs=0.01)
    assert measured.foreach_temporaries == pytest.approx(foreach, abs=0.01)
    assert measured.single_temporaries == pytest.approx(single, abs=0.01)


def test_an_optimizer_the_stand_ins_cannot_step_is_not_measured():
    assert costs(lambda ps: torch.optim.LBFGS(ps)) is None  # its step needs a closure
    assert parse_optimizer(torch.optim.LBFGS([nn.Parameter(torch.zeros(2))])).costs is None


def make_mlp():
    return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(4)], nn.Linear(1024, 10))


BATCH = (torch.randn(64, 1024), torch.randint(0, 10, (64,)))


def mlp_loss(output, batch):
    return nn.functional.cross_entropy(output, batch[1])


@pytest.mark.parametrize("optimizer", [
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.RMSprop(ps),
], ids=["sgd", "momentum", "rmsprop"])
def test_the_estimator_predicts_your_optimizer_as_measured(optimizer):
    """16 MiB of weights: AdamW's states would have added 32 MiB to every one (+100% for plain SGD)."""
    spec = make_spec(make_mlp, BATCH, loss_fn=mlp_loss, global_batch_size=64, device="cpu", memory_budget="1GiB",
                     optimizer=optimizer, warmup_steps=1, timed_steps=1)
    config = Config(micro_batch_size=64, optimizer="user")
    predicted = Estimator(spec).predict(config)
    measured = run_probe(spec, config, default_strategies())
    assert predicted.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.02)
    assert "your optimizer's states" in predicted.reason and "measured on stand-ins" in predicted.reason


def test_an_optimizer_that_could_not_be_measured_is_counted_as_adamw_and_said_so():
    spec = make_spec(make_mlp, BATCH, loss_fn=mlp_loss, global_batch_size=64, device="cpu", memory_budget="1GiB",
                     optimizer=lambda ps: torch.optim.LBFGS(ps))
    predicted = Estimator(spec).predict(Config(micro_batch_size=64, optimizer="user"))
    weights = 4 * sum(p.numel() for p in make_mlp().parameters())
    largest = 4 * 1024 * 1024
    assert predicted.breakdown.optimizer == 2 * weights + 2 * largest  # AdamW's states and CPU temporaries
    assert "counted as AdamW's" in predicted.reason and "a fallback" in predicted.reason


def test_plain_sgd_fits_where_adamw_would_not():
    """The tuner skips a configuration predicted over the budget: with SGD counted as AdamW (72 MiB), this
    run had ended "nothing fits" under a 45 MiB budget it trains in at 33 MiB."""
    plan = autofit.autofit(make_mlp, BATCH, loss_fn=mlp_loss, global_batch_size=64, device="cpu",
                           memory_budget="45MiB", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), allow=0,
                           max_probes=4)
    assert plan.fits and plan.config.micro_batch_size == 64, plan.reason
