"""A model's own overflow checks read as a healthy step's under fake tensors (`healthy_checks`)."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from autofit.config import Config
from autofit.estimate.simulation.healthy_checks import healthy_checks
from autofit.estimate.simulation.step import simulate_step


class Checked(nn.Module):
    """Clamps where its activations overflowed, as DETR's encoder layers do while training."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.clamped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if not torch.isfinite(h).all() or torch.isinf(h).any() or h.isnan().any().item():
            self.clamped += 1
            h = torch.clamp(h, -1e4, 1e4)
        return h


def test_a_check_reads_healthy_under_fake_tensors_and_raises_without():
    model = Checked()
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(8, 64)
        with pytest.raises(DataDependentOutputException):
            model(x)
        with healthy_checks():
            model(x)
    assert model.clamped == 0


def test_a_model_that_checks_for_overflow_is_simulated():
    with torch.device("meta"):
        model = Checked()
    peak = simulate_step(model, torch.zeros(8, 64), lambda out, _batch: out.sum(), Config(micro_batch_size=8),
                         device="cpu")
    assert peak.largest > 0 and model.clamped == 0
    # a check's truth value asked for outside a check's reduction is still data: it raises
    with FakeTensorMode(allow_non_fake_inputs=True), healthy_checks():
        with pytest.raises(DataDependentOutputException):
            bool((torch.randn(4) > 0).all())


def test_transformers_checks_are_off_while_simulating_and_as_they_were_after(monkeypatch):
    import os

    from autofit.estimate.simulation.healthy_checks import TRANSFORMERS_CHECKS, transformers_checks_off

    monkeypatch.delenv(TRANSFORMERS_CHECKS, raising=False)
    with transformers_checks_off():
        assert os.environ[TRANSFORMERS_CHECKS] == "1"
    assert TRANSFORMERS_CHECKS not in os.environ
    monkeypatch.setenv(TRANSFORMERS_CHECKS, "0")
    with transformers_checks_off():
        assert os.environ[TRANSFORMERS_CHECKS] == "1"
    assert os.environ[TRANSFORMERS_CHECKS] == "0"
