"""The probe's clock and warm-up where CUDA runs differ from plain CPU ones: engine setup before the first
step (DeepSpeed initialisation, NCCL communicators, kernel builds) and fp16 steps that GradScaler skips.
Both are decisions of the probe loop, so they run for real on the CPU."""

import time

import torch
from torch import nn

from autofit import Config, ProbeStatus
from autofit.probe.run import run_probe
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch, MixedPrecision
from autofit.strategies.base import Option, Strategy

WIDTH = 64


def _batch(n):
    return torch.randn(n, WIDTH)


class SlowSetup(Strategy):
    """Stands in for an engine's one-time setup (deepspeed.initialize, NCCL communicators): 1.5 s before
    the first step, then steps as fast as any."""

    field = "slow_setup"
    rung = 9

    def options(self, spec):
        return [Option(None, 0, "setup")]

    def apply(self, run):
        time.sleep(1.5)


def test_one_time_setup_does_not_count_against_the_deadline(monkeypatch):
    # Defect 11: the clock started before the model was built, so engine probes were stopped as too slow.
    monkeypatch.setattr("autofit.probe.run.MIN_ALLOWANCE", 1.0)
    spec = make_spec(nn.Linear(WIDTH, WIDTH), _batch, device="cpu", global_batch_size=2,
                     loss_fn=lambda out, b: out.pow(2).mean(), warmup_steps=1, timed_steps=1)
    result = run_probe(spec, Config(micro_batch_size=2), [MicroBatch(), SlowSetup()], step_limit=0.01)
    assert result.status is ProbeStatus.FIT, result.reason


def overflowing_loss(output, batch):
    """fp16 gradients of 6 x the loss scale overflow until GradScaler has halved 2**16 down to 2**12."""
    return (output.half() * 6).sum()


def calm_loss(output, batch):
    return (output.half() * 1e-3).sum()


def _fp16_peak(loss_fn):
    spec = make_spec(nn.Linear(WIDTH, WIDTH), _batch, device="cpu", global_batch_size=2, loss_fn=loss_fn,
                     memory_budget="1GiB", warmup_steps=2, timed_steps=1)
    result = run_probe(spec, Config(micro_batch_size=2, precision="fp16"), [MicroBatch(), MixedPrecision()])
    assert result.status is ProbeStatus.FIT, result.reason
    return result.peak_bytes


def test_fp16_peak_includes_optimizer_states_when_the_first_steps_overflow():
    # Defect 13: the first fp16 steps overflowed, GradScaler skipped optimizer.step(), and the peak was
    # taken before AdamW's states existed (2 x 16.6 kB here).
    assert _fp16_peak(overflowing_loss) == _fp16_peak(calm_loss)


def always_overflowing_loss(output, batch):
    return (output.half() * 6e4).sum() * float("inf")


def test_fp16_that_always_overflows_is_an_error_naming_why():
    spec = make_spec(nn.Linear(WIDTH, WIDTH), _batch, device="cpu", global_batch_size=2,
                     loss_fn=always_overflowing_loss, warmup_steps=1, timed_steps=1)
    result = run_probe(spec, Config(micro_batch_size=2, precision="fp16"), [MicroBatch(), MixedPrecision()])
    assert result.status is ProbeStatus.ERROR and "optimizer states never existed" in result.reason
