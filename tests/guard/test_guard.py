"""The OOM guard on a plain PyTorch loop, under the CPU budget: recovery is exact and leaves no growth.

Batches are made on the fly inside the loops: the CPU budget counts a batch's storage once a view of
it is taken, so a list of every batch kept alive would look like growth.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from autofit import Config, Plan
from autofit.guard.core import GuardGaveUp, OomGuard
from autofit.devices.memory import CpuBudget
from guard_helpers import assert_same_weights, fresh, loss_fn, make_batch, reference, step_peak

torch.set_num_threads(1)
SHORT, LONG, TOTAL = 8, 32, 16


def _lower_limit_on_forward(model, budget, call: int, limit: int) -> None:
    """Lower `budget.limit` when the model's forward runs for the `call`-th time (1-based)."""
    calls = []

    def hook(*_):
        calls.append(1)
        if len(calls) == call:
            budget.limit = limit

    model.register_forward_pre_hook(hook)


def test_longer_batch_at_step_k_is_recovered_exactly():
    lengths = [SHORT] * 3 + [LONG] * 3  # the batch grows at step 3
    limit = (step_peak(4, LONG) + step_peak(8, LONG)) // 2
    with CpuBudget(limit) as budget:
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=8, loss_fn=loss_fn)
        reports = [guard.step(make_batch(i, TOTAL, length)) for i, length in enumerate(lengths)]
    batches = [make_batch(i, TOTAL, length) for i, length in enumerate(lengths)]
    assert [r.micro_batches for r in reports] == [(8, 8)] * 3 + [(4, 4, 4, 4)] * 3
    assert [len(r.recoveries) for r in reports] == [0, 0, 0, 1, 0, 0]
    recovery = reports[3].recoveries[0]
    assert (recovery.step, recovery.action, recovery.old.micro_batch_size, recovery.new.micro_batch_size) == \
        (3, "micro-batch", 8, 4)
    assert recovery.new.grad_accum_steps == 4 and recovery.peak_before > limit * 0.9
    assert guard.samples_seen == 6 * TOTAL and guard.steps == 6
    assert_same_weights(model, reference(batches, [[8, 8]] * 3 + [[4, 4, 4, 4]] * 3))


def test_budget_lowered_mid_step_keeps_completed_micro_batches_and_memory_settles():
    low = (step_peak(4, LONG) + step_peak(8, LONG)) // 2
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=8, loss_fn=loss_fn)
        _lower_limit_on_forward(model, budget, call=6, limit=low)  # step 2, second micro-batch
        reports, live_after = [], []
        for i in range(7):
            report = guard.step(make_batch(i, TOTAL, LONG))
            reports.append(dataclasses.replace(report, loss=None))  # keep no tensor alive
            del report
            live_after.append(budget.current)
    batches = [make_batch(i, TOTAL, LONG) for i in range(7)]
    assert [r.micro_batches for r in reports] == [(8, 8)] * 2 + [(8, 4, 4)] + [(4, 4, 4, 4)] * 4
    assert "replaying the remaining samples" in reports[2].recoveries[0].reason
    assert guard.samples_seen == 7 * TOTAL
    assert live_after[3:] == [live_after[3]] * 4, f"live bytes grow after recovery: {live_after}"
    expected = reference(batches, [[8, 8]] * 2 + [[8, 4, 4]] + [[4, 4, 4, 4]] * 4)
    assert_same_weights(model, expected)
    # Same sum, other split: the run that used micro-batch 4 from that step on, within fp tolerance.
    assert_same_weights(model, reference(batches, [[8, 8]] * 2 + [[4, 4, 4, 4]] * 5), atol=1e-5)


def test_oom_in_backward_after_gradients_were_added_holds_those_out_of_the_replay():
    batches = [make_batch(i, TOTAL, SHORT) for i in range(4)]  # made outside the budget: not counted
    extra = 100_000  # floats per sample that the heavy layer's backward allocates
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=8, loss_fn=loss_fn)
        guard.step(batches[0])
        budget.limit = budget.peak + 6 * extra * 4  # 8 samples' scratch (3.2 MB) is over, 4 samples' is under
        calls = []
        model.register_forward_pre_hook(lambda *_: calls.append(1) or setattr(model.heavy, "extra",
                                                                               extra if len(calls) >= 2 else 0))
        reports = [guard.step(batch) for batch in batches[1:]]
    recovery = reports[0].recoveries[0]
    assert "in the backward" in recovery.reason and "parameters whose gradients it had already added held out" \
        in recovery.reason
    assert [r.micro_batches for r in reports] == [(8, 4, 4)] + [(4, 4, 4, 4)] * 2
    assert guard.samples_seen == 4 * TOTAL
    # The head's gradient for samples 8..16 came from the failed backward; counted twice, it would differ.
    assert_same_weights(model, reference(batches, [[8, 8], [8, 4, 4]] + [[4, 4, 4, 4]] * 2), atol=1e-5)


def test_escalates_to_checkpointing_then_gives_up_naming_what_it_tried():
    batch = make_batch(0, 4, LONG)
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=4, loss_fn=loss_fn)
        guard.step(batch)
        budget.limit = budget.current + 1000  # room for no activations at all
        with pytest.raises(GuardGaveUp) as info:
            guard.step(batch)
    message = str(info.value)
    for tried in ("mb=4x1", "mb=2x2", "mb=1x4", "ckpt=full, mb=1x4", "autofit tune"):
        assert tried in message
    assert [r.action for r in guard.recoveries] == ["micro-batch", "micro-batch", "checkpointing"]
    assert all("forward" in vars(block) for block in model.blocks)  # checkpointing is on, live
    assert guard.samples_seen == 4  # the failed step counted nothing


def test_a_model_with_batch_norm_steps_down_to_two_samples_at_least():
    """Batch norm in training takes its statistics over the micro-batch: one sample's fail (BatchNorm1d:
    "Expected more than 1 value per channel") or normalise it by itself, so 2 is the guard's floor."""
    batch = make_batch(0, 4, LONG)
    with CpuBudget(None) as budget:
        model, _ = fresh()
        model.blocks[0].append(torch.nn.BatchNorm1d(LONG))  # over (samples, positions, width): a channel a position
        guard = OomGuard(model, torch.optim.AdamW(model.parameters()), micro_batch_size=4, loss_fn=loss_fn)
        guard.step(batch)
        budget.limit = budget.current + 1000  # room for no activations at all
        with pytest.raises(GuardGaveUp, match=r"even with micro-batch 2 \(the least batch norm takes\)") as info:
            guard.step(batch)
    assert [r.action for r in guard.recoveries] == ["micro-batch", "checkpointing"]
    assert [r.new.micro_batch_size for r in guard.recoveries] == [2, 2] and "mb=1x4" not in str(info.value)


def test_checkpointing_rescues_micro_batch_one():
    batch = make_batch(0, 2, 64)
    peaks = {}
    for ckpt in (False, True):
        with CpuBudget(None) as budget:
            model, optimizer = fresh()
            guard = OomGuard(model, optimizer, micro_batch_size=1, loss_fn=loss_fn)
            if ckpt:
                from autofit.strategies.checkpointing import enable
                enable(model, 1)
            guard.step(batch)
            budget.reset_peak()
            guard.step(batch)
            peaks[ckpt] = budget.peak
    assert peaks[True] < peaks[False]
    with CpuBudget((peaks[True] + peaks[False]) // 2):
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=1, loss_fn=loss_fn)
        guard.step(batch)
        guard.step(batch)
    assert [r.new.checkpointing for r in guard.recoveries] == ["full"]
    assert_same_weights(model, reference([batch, batch], [[1, 1], [1, 1]]))


def test_non_oom_errors_pass_through_unchanged_with_their_traceback():
    def broken_loss(output, batch):
        raise KeyError("no labels in this batch")

    model, optimizer = fresh()
    guard = OomGuard(model, optimizer, micro_batch_size=4, loss_fn=broken_loss)
    with pytest.raises(KeyError, match="no labels") as info:
        guard.step(make_batch(0, 8, SHORT))
    assert info.traceback[-1].name == "broken_loss"
    assert guard.recoveries == [] and guard.config.micro_batch_size == 4


def test_evaluation_oom_shrinks_evaluation_only():
    train, evaluation = make_batch(0, TOTAL, SHORT), make_batch(1, 64, LONG)
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=8, loss_fn=loss_fn)
        guard.step(train)
        with torch.no_grad():  # the unsplit evaluation, before any budget
            expected_out = model(evaluation[0])
            expected_loss = loss_fn(expected_out, evaluation)
        budget.limit = budget.current + 300_000  # the whole eval batch at once needs more
        loss = guard.evaluate(evaluation)
        outputs = guard.evaluate(evaluation, fn=lambda m, b: m(b[0]))
        guard.step(train)
    assert 1 <= guard.eval_micro_batch_size < 64
    assert guard.config.micro_batch_size == 8 and guard.recoveries == []
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(outputs, expected_out)


def test_recovery_is_logged_and_written_to_the_plan(tmp_path, caplog):
    plan = Plan(fits=True, config=Config(micro_batch_size=8, grad_accum_steps=2), throughput=1.0,
                tokens_per_second=None, peak_memory=1, reason="tuned", probes=(), spec={})
    path = plan.save(tmp_path / "plan.json")
    limit = (step_peak(4, LONG) + step_peak(8, LONG)) // 2
    with CpuBudget(limit), caplog.at_level(logging.WARNING, logger="autofit.guard.core"):
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, plan=path, loss_fn=loss_fn)
        guard.step(make_batch(0, TOTAL, LONG))
    saved = Plan.load(path)
    assert (saved.config.micro_batch_size, saved.config.grad_accum_steps) == (4, 4)
    assert saved.reason.startswith("OOM guard, step 0") and saved.reason.endswith(
        "Tuned: fp32, mb=8x2, opt=adamw at 1.00 samples/s, peak 1 B: tuned")
    assert saved.throughput is None and saved.peak_memory is None  # measured for mb=8x2, not for mb=4x4
    assert "not measured (the OOM guard changed" in saved.summary()
    assert "step 0: out of memory in the" in caplog.text and "mb=8x2" in caplog.text
    assert "mb=4x4" in caplog.text and "peak" in caplog.text


def test_grows_back_after_clean_steps_and_backs_off_when_it_fails_again():
    low = (step_peak(4, LONG) + step_peak(8, LONG)) // 2
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=8, loss_fn=loss_fn, grow_back_after=2)
        guard.step(make_batch(0, TOTAL, LONG))
        budget.limit = low
        sizes = [guard.step(make_batch(i, TOTAL, LONG)).micro_batches for i in range(1, 4)]  # OOM, clean, clean
        budget.limit = None
        sizes += [guard.step(make_batch(i, TOTAL, LONG)).micro_batches for i in range(4, 9)]
    batches = [make_batch(i, TOTAL, LONG) for i in range(9)]
    assert sizes[0] == (4, 4, 4, 4) and sizes[3] == (8, 8)
    assert [r.action for r in guard.recoveries] == ["micro-batch", "grow-back"]
    assert guard.samples_seen == 9 * TOTAL
    schedule = [[8, 8]] + [[4, 4, 4, 4]] * 3 + [[8, 8]] * 5
    assert_same_weights(model, reference(batches, schedule), atol=1e-5)


def test_bad_arguments_name_the_value():
    model, optimizer = fresh()
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer but got 0"):
        OomGuard(model, optimizer, micro_batch_size=0)


def test_a_clean_guarded_step_holds_no_more_memory_than_the_bare_loop():
    batch = make_batch(0, TOTAL, LONG)
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        guard = OomGuard(model, optimizer, micro_batch_size=8, loss_fn=loss_fn)
        for _ in range(2):  # the second step runs with AdamW's states in place
            budget.reset_peak()
            guard.step(batch)
        guarded_peak, guarded_between = budget.peak, budget.current
    bare_peak = step_peak(8, LONG)
    assert bare_peak <= guarded_peak <= bare_peak * 1.01  # at most a micro-batch's loss-sized tensor more
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        for _ in range(2):
            for start in (0, 8):
                chunk = (batch[0][start:start + 8], batch[1][start:start + 8])
                (loss_fn(model(chunk[0]), chunk) * 0.5).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert guarded_between == budget.current  # nothing (no gradient, no snapshot) kept between steps


def test_without_a_plan_the_guard_names_the_optimizer_it_is_given():
    model, _ = fresh()
    kinds = {type(opt).__name__: OomGuard(model, opt, micro_batch_size=2).config.optimizer.value
             for opt in (torch.optim.AdamW(model.parameters()), torch.optim.Adafactor(model.parameters()),
                         torch.optim.SGD(model.parameters(), lr=0.1))}
    assert kinds == {"AdamW": "adamw", "Adafactor": "adafactor", "SGD": "user"}  # not searched: your own
    assert OomGuard(model, torch.optim.Adafactor(model.parameters())).config is None  # sized at the first step
