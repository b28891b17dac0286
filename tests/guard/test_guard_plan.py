"""`OomGuard(..., plan=...)`: the plan's knobs are applied to the model the guard is given (or checked),
so what the guard logs is what the model runs, and its fallback chain stays."""

from __future__ import annotations

import pytest
import torch

from autofit import Config, Plan, UsageError
from autofit.guard.core import OomGuard
from autofit.devices.memory import CpuBudget
from guard_helpers import fresh, loss_fn, make_batch

torch.set_num_threads(1)


def saved(tmp_path, config: Config):
    plan = Plan(fits=True, config=config, throughput=1.0, tokens_per_second=None, peak_memory=1, reason="tuned",
                probes=(), spec={})
    return plan.save(tmp_path / "plan.json")


def test_the_plans_precision_and_checkpointing_are_applied_to_the_model(tmp_path):
    path = saved(tmp_path, Config(precision="bf16", checkpointing="full", optimizer="adafactor", micro_batch_size=4,
                                  grad_accum_steps=2))
    torch.manual_seed(0)
    model, _ = fresh()
    optimizer = torch.optim.Adafactor(model.parameters())
    dtypes = []
    model.blocks[0].register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    guard = OomGuard(model, optimizer, micro_batch_size=8, plan=path, loss_fn=loss_fn)
    assert guard.config.describe() == "bf16, ckpt=full, mb=8x1, opt=adafactor"  # the plan's 8 samples per step
    assert all("forward" in vars(block) for block in model.blocks)  # checkpointed for real
    guard.step(make_batch(0, 8, 4))
    assert dtypes and set(dtypes) == {torch.bfloat16}  # the forward ran under the plan's autocast


@pytest.mark.parametrize("given, message", [
    (lambda m: torch.optim.AdamW(m.parameters()), "measured with Adafactor .* given AdamW; pass a Adafactor"),
])
def test_an_optimizer_the_plan_was_not_measured_with_is_refused(tmp_path, given, message):
    path = saved(tmp_path, Config(optimizer="adafactor"))
    model, _ = fresh()
    with pytest.raises(UsageError, match=message):
        OomGuard(model, given(model), plan=path, loss_fn=loss_fn)


@pytest.mark.parametrize("config, message", [
    (Config(lora=8), "trains LoRA adapters .* the model has none; build them with autofit.prepare"),
    (Config(sharding="zero2", num_gpus=2), "trains through deepspeed"),
])
def test_knobs_a_live_model_cannot_take_are_checked(tmp_path, config, message):
    model, optimizer = fresh()
    with pytest.raises(UsageError, match=message):
        OomGuard(model, optimizer, plan=saved(tmp_path, config), loss_fn=loss_fn)


def test_with_a_plan_the_guard_still_recovers_by_checkpointing(tmp_path):
    """The issue's case: with plan= the same loop must recover as it does without (micro-batch 1, then
    checkpointing on), not give up believing checkpointing was already on."""
    batch = make_batch(0, 2, 64)
    peaks = {}
    for ckpt in (False, True):
        with CpuBudget(None) as budget:
            model, optimizer = fresh()
            guard = OomGuard(model, optimizer, micro_batch_size=1, loss_fn=loss_fn,
                             plan=saved(tmp_path, Config(checkpointing="full" if ckpt else "none")))
            guard.step(batch)
            budget.reset_peak()
            guard.step(batch)
            peaks[ckpt] = budget.peak
    assert peaks[True] < peaks[False]  # a plan with checkpointing is applied: its steps peak lower
    path = saved(tmp_path, Config(micro_batch_size=2))
    with CpuBudget((peaks[True] + peaks[False]) // 2):
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=1, plan=path, loss_fn=loss_fn)
        guard.step(batch)
        guard.step(batch)
    assert [r.new.checkpointing for r in guard.recoveries] == ["full"]
    assert Plan.load(path).config.checkpointing == "full"  # the plan follows what the model now runs


def test_a_plan_object_is_taken_and_anything_else_named():
    plan = Plan(fits=True, config=Config(micro_batch_size=4, grad_accum_steps=2), throughput=1.0,
                tokens_per_second=None, peak_memory=1, reason="tuned", probes=(), spec={})
    model, optimizer = fresh()
    guard = OomGuard(model, optimizer, plan=plan, loss_fn=loss_fn)
    assert guard.config == plan.config and guard.plan_path is None  # nothing to write back to
    with pytest.raises(UsageError, match="plan= takes a path to a plan.json or an autofit.Plan, but got Config"):
        OomGuard(model, optimizer, plan=Config(), loss_fn=loss_fn)


def test_a_framework_or_an_autocast_in_another_precision_than_the_plans_is_refused(tmp_path):
    path = saved(tmp_path, Config(precision="bf16", micro_batch_size=4))
    model, optimizer = fresh()
    with pytest.raises(UsageError, match=r"The plan was measured in bf16 but this job runs fp16; launch with the "
                                         r"plan's mixed precision .* or tune again for fp16\."):
        OomGuard(model, optimizer, plan=path, loss_fn=loss_fn, running_precision="fp16")
    with pytest.raises(UsageError, match=r"autocast_dtype=torch.float16 disagrees with the plan's precision bf16; "
                                         r"leave autocast_dtype out"):
        OomGuard(fresh()[0], optimizer, plan=path, loss_fn=loss_fn, autocast_dtype=torch.float16)
    guard = OomGuard(fresh()[0], optimizer, plan=path, loss_fn=loss_fn, running_precision="bf16")  # the same: runs
    assert guard.config.precision.value == "bf16"
