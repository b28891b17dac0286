from forcing import budget_between, long_batch, peak, tune
from models import make_mlp, mlp_loss

from autofit.config import Config
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch


def spec(global_batch):
    return make_spec(make_mlp, long_batch, global_batch_size=global_batch, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss)


def test_sizes_divide_the_global_batch():
    assert [o.value for o in MicroBatch().options(spec(12))] == [12, 6, 4, 3, 2, 1]


def test_powers_of_two_when_finding_the_batch():
    found = make_spec(make_mlp, long_batch, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss, max_micro_batch=20)
    assert [o.value for o in MicroBatch().options(found)] == [16, 8, 4, 2, 1]


def test_forced_by_a_budget_the_full_micro_batch_misses():
    full = peak(make_mlp, long_batch, Config(micro_batch_size=8), loss_fn=mlp_loss)
    half = peak(make_mlp, long_batch, Config(micro_batch_size=4, grad_accum_steps=2), loss_fn=mlp_loss)
    plan = tune(make_mlp, long_batch, [MicroBatch()], budget_between(half, full), 8, loss_fn=mlp_loss)
    probed = [p.config.micro_batch_size for p in plan.probes if p.source == "probed"]
    assert probed == [8, 2, 4]  # bisection: 8 runs out of memory, 2 fits, 4 fits; 1 only adds work to 2
    assert plan.fits and plan.config.global_batch_size == 8
    # 2 and 4 run at about the same speed: both are re-measured back to back, and 2 replaces 4 (the
    # larger micro-batch, the walk's prior) only when clearly faster there, never on one noisy probe
    confirmation = plan.confirmation
    finalists = [f.config.micro_batch_size for f in confirmation.finalists]
    assert finalists[0] == 4 and set(finalists) <= {4, 2}  # 2 joins when its probe came within 20% of 4's
    if plan.config.micro_batch_size == 2:
        (comparison,) = confirmation.comparisons
        assert comparison.won and comparison.ratio.median >= 1.03 and comparison.ratio.wins >= 0.7
    else:
        assert plan.config.micro_batch_size == 4 and plan.config.grad_accum_steps == 2


def _normed():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))


def test_a_model_with_batch_norm_takes_two_samples_at_least_and_a_smaller_micro_batch_changes_its_numerics():
    """One sample fails batch norm in training (the search stopped: 'every configuration failed the same
    way'); fewer samples than the rank's change the statistics it normalises with, as a numerics change does."""
    import torch

    normed = make_spec(_normed, lambda n: torch.randn(n, 16), global_batch_size=8, device="cpu", memory_budget="1GiB",
                       loss_fn=lambda output, batch: output.square().mean())
    options = MicroBatch().options(normed)
    assert [(o.value, o.tier) for o in options] == [(8, 0), (4, 1), (2, 1)]
    assert "batch norm's statistics over 4 samples, not 8" in options[1].reason
    assert [(o.value, o.tier) for o in MicroBatch().options(spec(4))] == [(4, 0), (2, 0), (1, 0)]  # no batch norm
