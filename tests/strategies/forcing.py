"""Helpers for "each rung is forced by some budget": measure two configs' peaks, set the budget between."""

import torch

import autofit
from autofit.config import Config
from autofit.probe.run import run_probe
from autofit.job.train_spec import DEFAULT_SAFETY_MARGIN, make_spec
from autofit.strategies import default_strategies

FAST = dict(device="cpu", warmup_steps=1, timed_steps=1)


def long_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """512 tokens per sample: activations dominate memory."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 512, 64, generator=gen), torch.randint(0, 10, (n, 512), generator=gen)


def peak(model, batch, config: Config, **kwargs) -> int:
    spec = make_spec(model, batch, global_batch_size=config.global_batch_size, memory_budget="4GiB",
                     **FAST, **kwargs)
    result = run_probe(spec, config, default_strategies())
    assert result.fits, result.reason
    return result.peak_bytes


def budget_between(smaller: int, larger: int) -> int:
    """A budget whose fit limit (budget less the safety margin) lies halfway between two peaks."""
    assert smaller < larger, (smaller, larger)
    return int((smaller + larger) / 2 / (1 - DEFAULT_SAFETY_MARGIN))


def tune(model, batch, strategies, budget, global_batch, **kwargs):
    """Tune by probing alone (no estimator), so the probes themselves show the rung being forced."""
    return autofit.autofit(model, batch, global_batch_size=global_batch, memory_budget=budget,
                           strategies=strategies, predict=False, **FAST, **kwargs)
