"""A plan applied to a model it was not measured for (issue 54): `autofit.prepare` and `OomGuard(plan=...)`
compare the plan's recorded fingerprint with the model's and refuse naming both, unless it is intended."""

from __future__ import annotations

import pytest
import torch
from models import make_mlp, make_mlp_batch, mlp_loss

import autofit
from autofit import OomGuard, UsageError


@pytest.fixture(scope="module")
def plan():
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=4, device="cpu", memory_budget="64MiB",
                           loss_fn=mlp_loss, allow=0, max_probes=1, warmup_steps=1, timed_steps=1)
    assert plan.fits and plan.spec["model_fingerprint"]
    return plan


def other_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 10))


def test_prepare_refuses_a_plan_of_another_model_naming_both_fingerprints(plan):
    with pytest.raises(UsageError) as refused:
        autofit.prepare(plan, other_model(), loss_fn=mlp_loss)
    words = str(refused.value)
    assert plan.spec["model_fingerprint"] in words and "allow_other_model=True" in words
    assert autofit.prepare(plan, other_model(), loss_fn=mlp_loss, allow_other_model=True).model is not None
    assert autofit.prepare(plan, make_mlp(), loss_fn=mlp_loss).model is not None  # its own model: applied


def test_the_guard_refuses_a_plan_of_another_model_unless_intended(plan, tmp_path):
    path = plan.save(tmp_path / "plan.json")
    model = other_model()
    optimizer = torch.optim.AdamW(model.parameters())
    fingerprint = plan.spec["model_fingerprint"]
    with pytest.raises(UsageError, match=f"OomGuard: the plan was measured for another model.*{fingerprint}"):
        OomGuard(model, optimizer, plan=path, loss_fn=mlp_loss)
    OomGuard(model, optimizer, plan=path, loss_fn=mlp_loss, allow_other_model=True)
    mine = make_mlp()
    OomGuard(mine, torch.optim.AdamW(mine.parameters()), plan=path, loss_fn=mlp_loss)
