"""The OOM guard for the Hugging Face `Trainer`: a one-line change.

    from autofit.guard.trainer import GuardedTrainer
    trainer = GuardedTrainer(model=model, args=args, train_dataset=...)   # was: Trainer(...)

Each per-device batch the Trainer feeds `training_step` is split when it runs out of memory, each
piece's loss weighted by its share (or left as is when the loss is already normalised by the window's
token count, `num_items_in_batch`, as measured once), inside the Trainer's own accumulation window: the
global batch, the global step and the learning-rate schedule are untouched, unlike
`auto_find_batch_size`, which restarts with a smaller batch. Evaluation batches are split apart from
training's: an OOM in `evaluate` never changes the training micro-batch.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from autofit.errors import UsageError
from autofit.guard.core import GuardGaveUp, OomGuard, framework_precision, optimizer_oom
from autofit.guard.parts import concat_rows
from autofit.probe.oom import classify_oom
from autofit.batches.shares import divides_by_count, target_counts, weighted_sum


class GuardedTrainer(Trainer):
    """`transformers.Trainer` with autofit's OOM guard around `training_step` and `prediction_step`.

    Extra keyword arguments (all optional): `guard_plan` (a plan.json the guard updates),
    `guard_grow_back_after` (clean batches before trying the larger size again),
    `guard_eval_micro_batch_size` (starting evaluation micro-batch; default: the whole eval batch).
    """

    def __init__(self, *args: Any, guard_plan: str | Path | None = None, guard_grow_back_after: int | None = None,
                 guard_eval_micro_batch_size: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._guard_options = {"plan": guard_plan, "grow_back_after": guard_grow_back_after,
                               "eval_micro_batch_size": guard_eval_micro_batch_size}
        self.oom_guard: OomGuard | None = None
        self._guard_weight = 1.0
        self._guard_loss_divides: bool | None = None  # measured on the first split: see _loss_sums_over_window

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`. The guard splits the forward and backward; an OOM in the optimizer step the
        Trainer takes after them (AdamW's states, made at the first step) ends in `GuardGaveUp` naming what
        needs a restart, as `OomGuard.step` ends, not in the allocator's bare error."""
        try:
            return super().train(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, GuardGaveUp) or classify_oom(exc) is None or not _in_optimizer(exc):
                raise
            raise optimizer_oom(self.state.global_step, exc) from exc

    def _guard_for(self, model: nn.Module) -> OomGuard:
        """The guard, made on first use: the Trainer creates its optimizer and wrapped model lazily."""
        if self.oom_guard is None or (self.optimizer is not None and self.oom_guard.optimizer is None):
            if self.is_deepspeed_enabled or self.is_fsdp_enabled:
                raise UsageError("GuardedTrainer guards single-process and DDP training; DeepSpeed and FSDP "
                                 "engines own their backward. Use Trainer, or tune with `autofit tune`.")
            eval_size = self.oom_guard.eval_micro_batch_size if self.oom_guard else None
            options = dict(self._guard_options)
            options["eval_micro_batch_size"] = eval_size or options["eval_micro_batch_size"]
            running = framework_precision(self.accelerator)  # what the Trainer's arguments set (bf16, fp16)
            self.oom_guard = OomGuard(model, self.optimizer, running_precision=running, **options)
            self.oom_guard.weigh_by_targets = getattr(self, "compute_loss_func", None) is None  # else yours
        return self.oom_guard

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """`Trainer.training_step` over the batch, split into smaller pieces when it runs out of memory."""
        guard = self._guard_for(model)
        guard.steps = self.state.global_step
        guard.accumulation_multiplier = self.args.gradient_accumulation_steps
        parent = super().training_step

        def backward(chunk: dict[str, Any], weight: float) -> torch.Tensor:
            self._guard_weight = weight
            try:
                return parent(model, chunk, num_items_in_batch)
            finally:
                self._guard_weight = 1.0

        report = guard.accumulate(inputs, backward)
        if guard.sync.world_size > 1 and self.accelerator.sync_gradients:
            guard.average_gradients()  # every piece ran under no_sync
        return report.loss

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The Trainer's loss, weighted by the piece's share of the batch while the guard splits it."""
        weight = self._guard_weight
        if weight != 1.0 and self._loss_sums_over_window(model, inputs, num_items_in_batch):
            weight = 1.0
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if weight == 1.0:
            return result
        if return_outputs:
            return result[0] * weight, result[1]
        return result * weight

    def _loss_sums_over_window(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> bool:
        """True when the loss is a sum divided by the window's item count: pieces then add up as they are.

        A subclass's `loss_is_scaled_for_ga` is taken at its word. Otherwise `Trainer.training_step`'s test
        (the model takes loss kwargs, or a `compute_loss_func` is set) says only that the count is passed,
        not that the loss divides by it: `BertForTokenClassification` takes `**kwargs` and returns a mean,
        and unweighted pieces of it would multiply the gradient by their number. So that the split keeps
        the gradient the unsplit batch gives, the loss is measured once, at the count and at twice it."""
        declared = getattr(self, "loss_is_scaled_for_ga", None)  # transformers 5.x (#49240); absent before
        if declared is not None:
            return bool(declared)
        takes_count = getattr(self, "model_accepts_loss_kwargs", False) or \
            getattr(self, "compute_loss_func", None) is not None
        passed = num_items_in_batch is not None and takes_count
        if passed and self._guard_loss_divides is None:
            self._guard_loss_divides = self._loss_divides_by_count(model, inputs, num_items_in_batch)
        return passed and bool(self._guard_loss_divides)

    def _loss_divides_by_count(self, model: nn.Module, inputs: dict[str, Any], count: Any) -> bool:
        """Whether the piece's loss halves when the window's item count doubles (evaluation mode, no
        gradients, so dropout and routing noise cannot tell the two apart); an undefined ratio (a loss
        of zero) leaves the Trainer's own reading, that it does."""
        was_training, weight = model.training, self._guard_weight
        model.eval()
        self._guard_weight = 1.0  # your compute_loss, if you override it, as the Trainer calls it, unweighted
        try:
            with torch.no_grad(), self.compute_loss_context_manager():
                return divides_by_count(lambda n: float(self.compute_loss(model, dict(inputs), num_items_in_batch=n)),
                                        count)
        finally:
            model.train(was_training)
            self._guard_weight = weight

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """`Trainer.prediction_step` in evaluation micro-batches of their own, halved on OOM."""
        guard = self._guard_for(model)
        parent = super().prediction_step
        parts = guard.evaluate_chunks(inputs, lambda chunk: parent(model, chunk, prediction_loss_only, ignore_keys))
        losses = [(size, out[0]) for size, out in parts]
        counts = target_counts(model, inputs) if guard.weigh_by_targets else None
        loss = None if losses[0][1] is None else weighted_sum(counts, losses)
        return loss, concat_rows([out[1] for _, out in parts]), concat_rows([out[2] for _, out in parts])


def _in_optimizer(exc: BaseException) -> bool:
    """Whether `exc` was raised inside an optimizer's step (torch's, or bitsandbytes' 8-bit ones)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return any(f.name == "step" and ("torch/optim/" in f.filename or "bitsandbytes/optim/" in f.filename)
               for f in frames)
