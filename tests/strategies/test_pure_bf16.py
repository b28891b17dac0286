"""Pure bf16: weights, gradients and optimizer states in bf16; chosen where only it fits; predicted."""

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
from autofit.job.target import Target
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch, MixedPrecision, PureBf16, default_strategies


def _spec(**kwargs):
    return make_spec(WideBlocks, thin_batch, global_batch_size=4, device="cpu", memory_budget="1GiB", **kwargs)


def test_offered_where_bf16_is_native_with_reason():
    options = {o.value: o for o in PureBf16().options(_spec())}
    assert options["pure_bf16"].available and options["pure_bf16"].tier == 1
    v100 = PureBf16().options(type("S", (), {"target": Target.from_profile(get_gpu("v100-32gb"), 1)})())
    assert not v100[1].available and "native bf16" in v100[1].reason


def test_weights_and_optimizer_states_are_bf16_after_a_step():
    spec = _spec()
    run = build_run(spec, Config(precision="pure_bf16", micro_batch_size=4), default_strategies())
    run.step([thin_batch(4)])  # float32 inputs: cast by the pre-hook
    assert run.autocast_dtype is None
    assert {p.dtype for p in run.model.parameters()} == {torch.bfloat16}
    states = [t for s in run.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert states and {t.dtype for t in states} == {torch.bfloat16}


def test_pure_bf16_is_excluded_under_an_engine():
    target = Target.from_profile(get_gpu("a100-80gb"), 2)
    assert "fp32 master weights" in violation(Config(precision="pure_bf16", sharding="zero2", num_gpus=2), target)[1]
    assert violation(Config(precision="pure_bf16", num_gpus=2), target) is None


def test_forced_by_a_budget_only_pure_bf16_meets():
    mixed = peak(WideBlocks, thin_batch, Config(precision="bf16", micro_batch_size=4))
    pure = peak(WideBlocks, thin_batch, Config(precision="pure_bf16", micro_batch_size=4))
    assert pure < 0.6 * mixed  # 8 bytes per parameter instead of 16
    plan = tune(WideBlocks, thin_batch, [MixedPrecision(), PureBf16(), MicroBatch()], budget_between(pure, mixed), 4)
    assert plan.fits and plan.config.precision == "pure_bf16", plan.reason
    assert {p.status.value for p in plan.probes if p.config.precision != "pure_bf16" and p.measured} == {"oom"}


def test_estimator_predicts_the_peak_within_its_tolerance():
    spec = _spec()
    config = Config(precision="pure_bf16", micro_batch_size=4)
    measured = run_probe(spec, config, default_strategies()).peak_bytes
    predicted = Estimator(spec).predict(config).peak_bytes
    assert abs(predicted / measured - 1) <= PREDICTION_TOLERANCE["cpu"], (predicted, measured)


class _Fp32Embedding(torch.nn.Module):
    """A timestep embedding made in fp32 inside the forward, as diffusion models make theirs."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, t):
        freqs = torch.exp(-torch.arange(4, device=t.device) / 4)
        return self.proj(torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], 1)).sum()


def test_a_tensor_the_forward_makes_in_fp32_is_named_as_the_cause_under_pure_bf16_only():
    spec = make_spec(_Fp32Embedding, lambda n: torch.rand(n), global_batch_size=4, device="cpu", memory_budget="1GiB")
    failed = run_probe(spec, Config(precision="pure_bf16", micro_batch_size=4), default_strategies())
    assert failed.status.value == "error" and "same dtype" in failed.reason, failed.reason
    assert "no autocast to cast for it" in failed.reason and "`.to(x.dtype)`" in failed.reason
    assert "test_pure_bf16.py" in failed.reason  # where it was raised comes first, then the hint
    assert run_probe(spec, Config(precision="bf16", micro_batch_size=4), default_strategies()).fits
    assert PureBf16().explain(Config(precision="bf16"), RuntimeError("got Float and BFloat16")) == ""
    assert PureBf16().explain(Config(precision="pure_bf16"), RuntimeError("index out of range")) == ""


class Spectral(torch.nn.Module):
    """A Fourier layer's complex weights beside a real one (a Fourier neural operator's)."""

    def __init__(self):
        super().__init__()
        self.modes = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.cfloat))
        self.mix = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.mix(x) + (x.to(torch.cfloat) @ self.modes).real.to(x.dtype)


def test_complex_weights_stay_complex_and_whole():
    """`Module.to(torch.bfloat16)` casts complex weights too, discarding their imaginary part."""
    from autofit.strategies.pure_bf16 import enable

    model = Spectral()
    modes = model.modes.detach().clone()
    enable(model)
    assert model.mix.weight.dtype is torch.bfloat16
    assert model.modes.dtype is torch.cfloat and torch.equal(model.modes.detach(), modes)
