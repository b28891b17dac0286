"""The OOM guard in an accelerate loop, with `accelerator.accumulate` semantics.

    guard = AccelerateGuard(accelerator, model, optimizer)        # after accelerator.prepare(...)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = guard.backward(batch)    # was: loss = model(**batch).loss; accelerator.backward(loss)
            optimizer.step(); optimizer.zero_grad()

Each loader batch is one micro-batch of the accumulation window, as in accelerate. When it runs out of
memory the guard splits it (each piece weighted by its share of the batch, then divided by the
accumulation steps by `accelerator.backward`), keeps the smaller size for the batches that follow,
and the window's gradient, the optimizer step and the global batch stay what they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from autofit.batches.batch import call_model
from autofit.errors import UsageError
from autofit.guard.core import LossFn, OomGuard, StepReport, framework_precision


class AccelerateGuard:
    """An `OomGuard` whose backward is `accelerator.backward`; the accelerator steps the optimizer."""

    def __init__(self, accelerator: Any, model: nn.Module, optimizer: Any, *, loss_fn: LossFn | None = None,
                 micro_batch_size: int | None = None, plan: str | Path | None = None,
                 grow_back_after: int | None = None, eval_micro_batch_size: int | None = None,
                 escalate: bool = True):
        if accelerator.distributed_type.value == "DEEPSPEED":
            raise UsageError("AccelerateGuard does not drive DeepSpeed engines (their backward owns "
                             "accumulation); use DDP or a single process, or tune again with `autofit tune`.")
        self.accelerator = accelerator
        self.guard = OomGuard(model, optimizer, micro_batch_size=micro_batch_size, loss_fn=loss_fn, plan=plan,
                              grow_back_after=grow_back_after, eval_micro_batch_size=eval_micro_batch_size,
                              escalate=escalate, running_precision=framework_precision(accelerator))
        self.guard.accumulation_multiplier = accelerator.gradient_accumulation_steps
        self.last_report: StepReport | None = None

    @property
    def config(self):
        """The guard's current configuration (micro-batch per split, accumulation over the window)."""
        return self.guard.config

    @property
    def recoveries(self) -> list:
        """Every step-down and grow-back so far (`autofit.guard.Recovery`), as `OomGuard.recoveries`."""
        return self.guard.recoveries

    def backward(self, batch: Any) -> torch.Tensor:
        """Forward and backward of this loader batch, split on OOM; returns its mean loss (detached)."""
        self.last_report = self.guard.accumulate(batch, self._backward)
        if self.accelerator.sync_gradients:
            self.guard.average_gradients()  # every split ran under no_sync on several ranks
            self.guard.steps += 1
        return self.last_report.loss

    def _backward(self, chunk: Any, weight: float) -> torch.Tensor:
        loss = self.guard.loss_fn(call_model(self.guard.model, chunk), chunk) * weight
        self.guard.phase = "backward"
        self.accelerator.backward(loss)
        return loss.detach()

    def evaluate(self, batch: Any, fn: Callable[[nn.Module, Any], Any] | None = None) -> Any:
        """`OomGuard.evaluate`: evaluation sized and recovered apart from training."""
        return self.guard.evaluate(batch, fn)
