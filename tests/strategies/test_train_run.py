import torch
from models import make_mlp, make_mlp_batch, mlp_loss

from autofit.batches.batch import take_rows
from autofit.config import Config
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.strategies import default_strategies


def grads_after_step(micro_sizes):
    spec = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss, optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    run = build_run(spec, Config(optimizer="user", micro_batch_size=8), default_strategies())
    batch = make_mlp_batch(8)
    starts = [sum(micro_sizes[:i]) for i in range(len(micro_sizes))]
    micro_batches = [take_rows(batch, s, n) for s, n in zip(starts, micro_sizes)]
    run.optimizer_step = lambda: None  # keep the gradients to compare them
    run.step(micro_batches)
    return [p.grad.clone() for p in run.model.parameters()]


def test_accumulated_gradient_is_the_mean_over_the_whole_step():
    whole = grads_after_step([8])
    for split in ([4, 4], [2, 2, 2, 2], [3, 5], [1] * 8):
        for a, b in zip(whole, grads_after_step(split)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_loss_that_is_a_number_stops_the_search_with_the_fix():
    import pytest

    from autofit import UsageError
    from autofit.probe.run import run_probe

    # A given module is not run on the meta device before the search: the step itself checks the loss.
    spec = make_spec(make_mlp(), make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=lambda output, batch: mlp_loss(output, batch).item())
    with pytest.raises(UsageError, match=r"loss_fn returned a float \(\d.*without \.item\(\)"):
        run_probe(spec, Config(micro_batch_size=8), default_strategies())
