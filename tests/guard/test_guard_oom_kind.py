"""The guard's recovery reason names the OOM kind (`autofit.probe.oom.classify_oom`): the GPU test
(tests/guard/test_guard_gpu.py) expects "cuda-allocator" there; on the CPU the kind is the budget's."""

from __future__ import annotations

from autofit.guard.core import OomGuard
from autofit.devices.memory import CpuBudget
from guard_helpers import fresh, loss_fn, make_batch, step_peak

LONG, TOTAL = 32, 16


def test_the_recovery_reason_names_the_oom_kind():
    # Defect 8: the reason said "out of memory in the forward on this rank", never which OOM, so the GPU
    # test's `"cuda" in reason` could not hold.
    limit = (step_peak(4, LONG) + step_peak(8, LONG)) // 2
    with CpuBudget(limit):
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=8, loss_fn=loss_fn)
        guard.step(make_batch(0, TOTAL, LONG))
    assert guard.recoveries and "on this rank (cpu-budget), peak" in guard.recoveries[0].reason


def test_a_recovery_records_its_action_as_an_enum():
    import pytest

    from autofit.config import Config
    from autofit.guard import Recovery, RecoveryAction

    limit = (step_peak(4, LONG) + step_peak(8, LONG)) // 2
    with CpuBudget(limit):
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=8, loss_fn=loss_fn)
        guard.step(make_batch(0, TOTAL, LONG))
    assert guard.recoveries[0].action is RecoveryAction.MICRO_BATCH and guard.recoveries[0].action == "micro-batch"
    with pytest.raises(ValueError, match="action='halve' is not known"):
        Recovery(0, "halve", Config(), Config(), "why", None)
