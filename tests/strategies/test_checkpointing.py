from forcing import budget_between, long_batch, peak, tune
from models import make_gpt2, make_mlp, mlp_loss

from autofit.config import Config
from autofit.spec.train import make_spec
from autofit.probe.step import build_run
from autofit.strategies import Checkpointing, MicroBatch, default_strategies
from autofit.strategies.checkpointing import disable, enable


def test_plain_model_blocks_are_checkpointed_every_k():
    model = make_mlp()
    enable(model, 2)
    assert ["forward" in vars(b) for b in model.blocks] == [True, False, True, False]
    disable(model)
    assert not any("forward" in vars(b) for b in model.blocks)


def test_hf_model_uses_its_own_switch():
    spec = make_spec(make_gpt2, global_batch_size=2, device="cpu", memory_budget="1GiB", seq_len=16)
    run = build_run(spec, Config(checkpointing="every_k", checkpoint_every=2, micro_batch_size=2), default_strategies())
    flags = [layer.gradient_checkpointing for layer in run.model.transformer.h]
    assert flags == [True, False, True, False]


def test_unavailable_without_repeated_blocks():
    import torch

    spec = make_spec(lambda: torch.nn.Linear(4, 1), lambda n: torch.randn(n, 4), device="cpu",
                     memory_budget="1GiB", loss_fn=lambda out, batch: out.sum())
    options = {o.value: o for o in Checkpointing().options(spec)}
    assert options["none"].available and not options["full"].available
    assert "no repeated blocks" in options["full"].reason


def test_full_saves_at_least_every_2():
    strategy = Checkpointing()
    full, every_2, none = Config(checkpointing="full"), Config(checkpointing="every_k", checkpoint_every=2), Config()
    assert strategy.saves_at_least(full, every_2) and strategy.saves_at_least(every_2, none)
    assert not strategy.saves_at_least(none, full)


def test_forced_by_a_budget_only_checkpointing_meets():
    none = peak(make_mlp, long_batch, Config(micro_batch_size=1), loss_fn=mlp_loss)
    full = peak(make_mlp, long_batch, Config(checkpointing="full", micro_batch_size=1), loss_fn=mlp_loss)
    plan = tune(make_mlp, long_batch, [Checkpointing(), MicroBatch()], budget_between(full, none), 1,
                loss_fn=mlp_loss)
    assert plan.fits and plan.config.checkpointing != "none"
    assert plan.peak_memory < none
