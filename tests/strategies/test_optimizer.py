import torch
from forcing import budget_between, peak, tune
from models import make_mlp, make_mlp_batch, mlp_loss

from autofit.config import Config
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.strategies import MicroBatch, OptimizerStates, Placement, default_strategies


def spec(**kwargs):
    return make_spec(make_mlp, make_mlp_batch, global_batch_size=1, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss, **kwargs)


def test_bitsandbytes_options_say_why_they_are_unavailable():
    options = {o.value: o for o in OptimizerStates().options(spec())}
    assert options["adamw"].available and options["adafactor"].available and options["adafactor"].tier == 1
    assert not options["adamw8bit"].available
    assert "autofit[bnb]" in options["adamw8bit"].reason or "need CUDA" in options["adamw8bit"].reason
    strategy = OptimizerStates()
    assert strategy.placement(Config(optimizer="paged_adamw8bit")) is Placement.CHILD
    assert strategy.placement(Config()) is Placement.IN_PROCESS


class Spectral(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.modes = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.cfloat))

    def forward(self, x):
        return (x.to(torch.cfloat) @ self.modes).abs().mean()


def test_adafactor_is_not_offered_for_complex_weights():
    """torch's Adafactor raises on a complex weight: each level with it had been probed to an error."""
    options = {o.value: o for o in OptimizerStates().options(
        make_spec(Spectral, lambda n: torch.randn(n, 4), device="cpu", memory_budget="1GiB"))}
    assert options["adamw"].available and not options["adafactor"].available
    assert "Adafactor does not step complex weights" in options["adafactor"].reason


def test_the_users_hyperparameters_are_kept():
    chosen = spec(optimizer=torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.123, weight_decay=0.5))
    run = build_run(chosen, Config(), default_strategies())
    assert isinstance(run.optimizer, torch.optim.AdamW) and run.optimizer.defaults["lr"] == 0.123


def test_a_user_optimizer_is_kept_as_is():
    chosen = spec(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9))
    options = OptimizerStates().options(chosen)
    assert [o.value for o in options] == ["user"]
    run = build_run(chosen, Config(optimizer="user"), default_strategies())
    assert isinstance(run.optimizer, torch.optim.SGD) and run.optimizer.defaults["momentum"] == 0.9


def test_forced_by_a_budget_only_adafactor_meets():
    adamw = peak(make_mlp, make_mlp_batch, Config(), loss_fn=mlp_loss)
    adafactor = peak(make_mlp, make_mlp_batch, Config(optimizer="adafactor"), loss_fn=mlp_loss)
    plan = tune(make_mlp, make_mlp_batch, [OptimizerStates(), MicroBatch()], budget_between(adafactor, adamw), 1,
                loss_fn=mlp_loss)
    assert plan.fits and plan.config.optimizer == "adafactor"


def test_a_swapped_optimizer_says_what_it_replaces_and_a_kept_one_nothing():
    strategy, chosen = OptimizerStates(), spec(optimizer="adamw")
    assert strategy.replaces(Config(optimizer="adafactor"), chosen) == (
        "your optimizer adamw is replaced by adafactor (different numerics, same hyperparameters where they apply)")
    assert strategy.replaces(Config(optimizer="adamw"), chosen) == ""
    given = spec(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))  # not explored
    assert strategy.replaces(Config(optimizer="user"), given) == ""
    assert MicroBatch().replaces(Config(micro_batch_size=2), chosen) == ""  # the default: keeps the job as given
