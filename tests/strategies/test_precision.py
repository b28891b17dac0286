import torch
from forcing import budget_between, long_batch, peak, tune
from models import make_mlp, mlp_loss

from autofit.config import Config
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.strategies import MicroBatch, MixedPrecision, default_strategies


def test_options_on_cpu():
    spec = make_spec(make_mlp, long_batch, global_batch_size=1, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss)
    options = {o.value: o for o in MixedPrecision().options(spec)}
    assert options["fp32"].tier == 0 and options["bf16"].tier == 1 and options["bf16"].available
    assert not options["fp16"].available and "bf16 is native" in options["fp16"].reason


def test_bf16_and_fp16_set_autocast_and_scaler():
    spec = make_spec(make_mlp, long_batch, global_batch_size=1, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss)
    assert build_run(spec, Config(precision="bf16"), default_strategies()).autocast_dtype is torch.bfloat16
    run = build_run(spec, Config(precision="fp16"), default_strategies())
    assert run.autocast_dtype is torch.float16 and run.scaler is not None


def test_forced_by_a_budget_only_bf16_meets():
    fp32 = peak(make_mlp, long_batch, Config(micro_batch_size=1), loss_fn=mlp_loss)
    bf16 = peak(make_mlp, long_batch, Config(precision="bf16", micro_batch_size=1), loss_fn=mlp_loss)
    plan = tune(make_mlp, long_batch, [MixedPrecision(), MicroBatch()], budget_between(bf16, fp32), 1, loss_fn=mlp_loss)
    assert plan.fits and plan.config.precision == "bf16"
    assert [p.status.value for p in plan.probes if p.config.precision == "fp32"] == ["oom"]


class _Scatter(torch.nn.Module):
    """Rows routed through a layer and added back into a buffer made like the input (an MoE's combine)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        out = torch.zeros_like(x)
        return out.index_add_(0, torch.arange(len(x)), self.proj(x)).sum()


def test_a_buffer_the_forward_makes_in_fp32_is_named_as_the_cause_under_autocast():
    from autofit.probe.run import run_probe

    spec = make_spec(_Scatter, lambda n: torch.randn(n, 8), global_batch_size=4, device="cpu", memory_budget="1GiB")
    failed = run_probe(spec, Config(precision="bf16", micro_batch_size=4), default_strategies())
    assert failed.status.value == "error" and "index_add_" in failed.reason, failed.reason
    assert "under bf16 autocast, matmuls and convolutions return bf16" in failed.reason
    assert "pure bf16" not in failed.reason  # one knob's words: the one in use
    assert run_probe(spec, Config(micro_batch_size=4), default_strategies()).fits
