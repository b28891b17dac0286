"""The OOM guard in an accelerate loop: a loader batch that runs out of memory is split inside its
accumulation window; the weights match the loop that never ran out of memory."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from autofit.guard.accelerate import AccelerateGuard
from autofit.devices.memory import CpuBudget
from guard_helpers import SCRATCH, WIDTH, assert_same_weights, fresh, loss_fn

torch.set_num_threads(1)
ACCUMULATION, BATCH, LENGTH = 2, 8, 8


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(64, LENGTH, WIDTH, generator=gen), torch.randn(64, LENGTH, 1, generator=gen))


def _train(guarded: bool):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(_data(), batch_size=BATCH))
        guard = AccelerateGuard(accelerator, model, optimizer, loss_fn=loss_fn) if guarded else None
        losses = []
        for index, batch in enumerate(loader):
            if guarded and index == 3:  # second batch of the second window: more memory than is left
                model.heavy.forward_extra = SCRATCH
                budget.limit = budget.peak + 6 * SCRATCH * 4
            with accelerator.accumulate(model):
                if guard is not None:
                    losses.append(guard.backward(batch).item())
                else:
                    loss = loss_fn(model(batch[0]), batch)
                    accelerator.backward(loss)
                    losses.append(loss.item())
                optimizer.step()
                optimizer.zero_grad()
    return accelerator.unwrap_model(model), guard, losses


def test_accelerate_loop_recovers_inside_the_accumulation_window():
    model, guard, losses = _train(guarded=True)
    reference, _, reference_losses = _train(guarded=False)
    assert guard.guard.recoveries and guard.guard.recoveries[0].new.micro_batch_size == 4
    assert guard.config.grad_accum_steps == 2 * ACCUMULATION  # two pieces per batch, two batches per step
    assert guard.last_report.micro_batches == (4, 4)
    assert guard.guard.samples_seen == 64 and guard.guard.steps == 64 // (BATCH * ACCUMULATION)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-5, atol=1e-6)
    assert_same_weights(model, reference, atol=1e-5)
