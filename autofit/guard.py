"""The OOM guard: a running job survives an out-of-memory error inside its step.

`OomGuard.step(batch)` runs one optimizer step's worth of samples on the user's live model and
optimizer: forward and backward over micro-batches, each loss weighted by its share of the samples
(as `autofit.step.TrainRun.step` does), then the optimizer step. When a micro-batch runs out of
memory the guard drops what that attempt held, halves the micro-batch (doubling accumulation) and
replays the remaining samples of the step from the batch it was given. The gradients of micro-batches
that completed are kept; if the OOM struck in a backward after some gradients were already added,
they are cleared and the whole step is replayed. Either way every sample is counted exactly once and
the step's gradient is the same weighted sum; the global batch never changes.

At micro-batch 1 it switches on activation checkpointing on the live model, then gives up with an
error naming everything it tried. Each change is logged, recorded in `guard.recoveries`, and written
to the saved plan when one is given. With `grow_back_after=N` it tries the previous configuration
again after N clean steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autofit.batch import call_model, default_loss, leading_dim
from autofit.config import Config
from autofit.errors import AutofitError, UsageError
from autofit.guard_sync import LocalSync, Round, sync_for, unwrap
from autofit.oom import classify_oom, first_line, release_memory
from autofit.plan import Plan
from autofit.strategies import checkpointing
from autofit.units import format_size

logger = logging.getLogger("autofit.guard")

LossFn = Callable[[Any, Any], torch.Tensor]
RESTART_RUNGS = "an 8-bit optimizer, ZeRO/FSDP sharding, CPU offload or LoRA"  # need a new job


class GuardGaveUp(AutofitError):
    """Even micro-batch 1 with activation checkpointing does not fit; the message lists what was tried."""


class OtherRankFailed(AutofitError):
    """Another rank failed with an error that is not an OOM; this rank stops instead of waiting."""


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One change of configuration made by the guard."""

    step: int  # the guard's step counter (0-based) when it happened
    action: str  # "micro-batch", "checkpointing" or "grow-back"
    old: Config
    new: Config
    reason: str  # one line: what ran out of memory, where, and what changed
    peak_before: int | None  # peak bytes the device had held before the change (None: unknown)


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one guarded step did."""

    loss: torch.Tensor  # sample-weighted mean loss of the step (detached)
    samples: int  # samples whose gradients went into this step (always the batch's size)
    micro_batches: tuple[int, ...]  # sizes of the micro-batches that completed, in order
    recoveries: tuple[Recovery, ...]  # changes made during this step


@dataclasses.dataclass
class _Attempt:
    """The outcome of one micro-batch on this rank."""

    size: int = 0
    loss: torch.Tensor | None = None
    oom: str | None = None  # OOM kind
    where: str = ""  # "forward" / "backward"
    touched: bool = False  # the failed backward had already added to some gradients
    error: BaseException | None = None  # a non-OOM error, re-raised unchanged


class OomGuard:
    """Runs optimizer steps on a live model and optimizer, recovering from OOM without losing samples.

        guard = OomGuard(model, optimizer, micro_batch_size=8)
        for batch in loader:
            report = guard.step(batch)      # forward/backward/optimizer step; report.loss

    `loss_fn(output, micro_batch)` defaults to `output.loss` / a scalar output. Under `torch.distributed`
    (DDP or a plain model) every rank must call `step` with its own shard; the ranks step down together.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 micro_batch_size: int | None = None, loss_fn: LossFn | None = None,
                 plan: str | Path | None = None, grow_back_after: int | None = None,
                 eval_micro_batch_size: int | None = None, autocast_dtype: torch.dtype | None = None,
                 scaler: Any = None, escalate: bool = True, process_group: Any = None):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn or default_loss
        self.plan_path = Path(plan) if plan is not None else None
        self._plan = Plan.load(self.plan_path) if self.plan_path is not None else None
        self.config = _initial_config(self._plan, micro_batch_size)
        self.grow_back_after = _positive("grow_back_after", grow_back_after)
        self.eval_micro_batch_size = _positive("eval_micro_batch_size", eval_micro_batch_size)
        self.autocast_dtype = autocast_dtype
        self.scaler = scaler
        self.escalate = escalate
        self.sync = sync_for(model, process_group)
        self.steps = 0  # optimizer steps taken
        self.samples_seen = 0  # samples whose gradients went into an optimizer step
        self.recoveries: list[Recovery] = []
        self._undo: list[Config] = []  # configurations stepped down from, most recent last
        self._clean_steps = 0
        self._grow_wait = grow_back_after
        self._tried: list[str] = [self.config.describe()]

    # ---- training -------------------------------------------------------------------------------
    def step(self, batch: Any) -> StepReport:
        """One optimizer step over all samples of `batch` (this rank's share of the global batch)."""
        total = leading_dim(batch)
        first_recovery = len(self.recoveries)
        self._maybe_grow_back()
        if self.config.micro_batch_size == 0:  # no size given: the whole batch at once
            self.config = self.config.replace(micro_batch_size=total)
        done, loss, sizes = 0, None, []
        while True:
            size = min(self.config.micro_batch_size, total - done)
            attempt = self._attempt(batch, done, size, total) if size > 0 else _Attempt()
            agreed = self.sync.agree(attempt.oom is not None, attempt.error is not None,
                                     done + attempt.size < total if attempt.loss is not None else size > 0,
                                     attempt.size if attempt.oom else 0)
            if agreed.error:
                _raise_error(attempt, self.sync.rank)
            if attempt.loss is not None:
                share = attempt.loss.float() * (attempt.size / total)
                done, loss = done + attempt.size, share if loss is None else loss + share
                sizes.append(attempt.size)
            if attempt.touched:  # gradients of the failed backward are mixed in: replay the whole step
                self.optimizer.zero_grad(set_to_none=True)
                done, loss, sizes = 0, None, []
            if agreed.oom:
                self._recover(attempt, agreed, total)
            elif not agreed.busy:
                break
        self._finish_step(total, clean=all(r.action == "grow-back" for r in self.recoveries[first_recovery:]))
        return StepReport(loss if loss is not None else torch.zeros(()), total, tuple(sizes), tuple(self.recoveries[first_recovery:]))

    def _attempt(self, batch: Any, start: int, size: int, total: int) -> _Attempt:
        """Forward and backward of samples `start .. start+size`; an OOM becomes the result."""
        chunk = batch if size == total else slice_rows(batch, start, size)
        where, versions = "forward", None
        try:
            with self.sync.no_sync(self.model):
                with self._autocast():
                    loss = self.loss_fn(call_model(self.model, chunk), chunk)
                where, versions = "backward", _grad_versions(self.optimizer)
                scaled = loss * (size / total)
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            return _Attempt(size=size, loss=loss.detach())
        except Exception as exc:  # noqa: BLE001 - classified below; non-OOM errors are re-raised as is
            kind = classify_oom(exc)
            if kind is None:
                return _Attempt(size=size, error=exc)
            detail = first_line(exc)
        # Out of the except block: the exception, its traceback and the attempt's tensors are gone.
        touched = versions is not None and _grads_changed(self.optimizer, versions)
        return _Attempt(size=size, oom=f"{kind} ({detail})", where=where, touched=touched)

    def _recover(self, attempt: _Attempt, agreed: Round, total: int) -> None:
        """Free what the failed attempt held and step down one notch (the same on every rank)."""
        peak = peak_bytes(self._device())
        release_memory()
        old = self.config
        mb = min(old.micro_batch_size, agreed.smallest_failure)
        if mb > 1:
            new_mb = old.micro_batch_size // 2
            while new_mb >= agreed.smallest_failure and new_mb > 1:
                new_mb //= 2
            new, action = old.replace(micro_batch_size=new_mb), "micro-batch"
        elif self.escalate and old.checkpointing != "full":
            checkpointing.enable(unwrap(self.model), 1)
            new, action = old.replace(checkpointing="full"), "checkpointing"
        else:
            raise GuardGaveUp(self._gave_up_message(attempt, total, peak))
        new = new.replace(grad_accum_steps=math.ceil(total / new.micro_batch_size))
        where = f"in the {attempt.where} on this rank" if attempt.oom else f"on another rank ({agreed.smallest_failure} samples)"
        replay = "replaying the whole step" if attempt.touched else "replaying the remaining samples"
        reason = (f"step {self.steps}: out of memory {where}, peak {_size(peak)}; {old.describe()} -> "
                  f"{new.describe()}, {replay}")
        self._change(action, old, new, reason, peak)
        self._undo.append(old)

    def _gave_up_message(self, attempt: _Attempt, total: int, peak: int | None) -> str:
        what = attempt.oom or "an OOM on another rank"
        return (f"Out of memory at step {self.steps} even with micro-batch 1 (of {total} samples per step): "
                f"{what}; peak {_size(peak)}. Tried, in order: {' -> '.join(self._tried)}. What remains needs a "
                f"restart: run `autofit tune` with this budget and allow {RESTART_RUNGS}.")

    def _finish_step(self, total: int, clean: bool) -> None:
        """Average gradients over ranks, apply them, clear them; count the samples."""
        self.sync.average_gradients(p for group in self.optimizer.param_groups for p in group["params"]
                                    if p.requires_grad)
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        except Exception as exc:  # noqa: BLE001
            if classify_oom(exc) is None:
                raise
            raise GuardGaveUp(f"Out of memory in the optimizer step at step {self.steps} ({first_line(exc)}); a "
                              f"smaller micro-batch cannot help there. Use {RESTART_RUNGS}.") from exc
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.samples_seen += total
        self._clean_steps = self._clean_steps + 1 if clean else 0
        if self.config.grad_accum_steps != math.ceil(total / self.config.micro_batch_size):
            self.config = self.config.replace(grad_accum_steps=math.ceil(total / self.config.micro_batch_size))

    # ---- grow-back and bookkeeping --------------------------------------------------------------
    def _maybe_grow_back(self) -> None:
        """After `grow_back_after` clean steps, return to the configuration stepped down from last."""
        if not self._grow_wait or not self._undo or self._clean_steps < self._grow_wait:
            return
        old, new = self.config, self._undo.pop()
        if new.checkpointing != old.checkpointing:
            checkpointing.disable(unwrap(self.model))
            if new.checkpointing != "none":
                checkpointing.enable(unwrap(self.model), checkpointing.every(new.checkpointing))
        reason = f"step {self.steps}: {self._clean_steps} clean steps; growing back {old.describe()} -> {new.describe()}"
        self._change("grow-back", old, new, reason, peak_bytes(self._device()))
        self._clean_steps = 0
        self._grow_wait *= 2  # a grow-back that fails again is retried less often

    def _change(self, action: str, old: Config, new: Config, reason: str, peak: int | None) -> None:
        self.config = new
        self._tried.append(new.describe())
        self.recoveries.append(Recovery(self.steps, action, old, new, reason, peak))
        logger.warning("autofit OOM guard: %s", reason)
        if self.plan_path is not None and self.sync.rank == 0:
            plan = dataclasses.replace(self._plan, config=new, reason=f"OOM guard, {reason}. Tuned: {self._plan.reason}")
            plan.save(self.plan_path)

    def _device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device().type, dtype=self.autocast_dtype)

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self, batch: Any, fn: Callable[[nn.Module, Any], Any] | None = None) -> Any:
        """Evaluate `batch` without gradients, in micro-batches sized apart from training's.

        Without `fn`: the sample-weighted mean loss (a 0-d tensor). With `fn(model, micro_batch)`
        returning a tensor (or a tuple/dict of tensors) with a sample axis: those outputs concatenated
        over the batch. An OOM halves `eval_micro_batch_size` only; the training configuration is
        never touched.
        """
        total = leading_dim(batch)
        was_training = self.model.training
        self.model.eval()
        try:
            parts = self._evaluate_chunks(batch, total, fn)
        finally:
            self.model.train(was_training)
        if fn is None:
            return sum(loss.float() * (size / total) for size, loss in parts)
        return concat_rows([out for _, out in parts])

    def _evaluate_chunks(self, batch: Any, total: int, fn: Callable | None) -> list[tuple[int, Any]]:
        parts, done = [], 0
        while done < total:
            size = min(self.eval_micro_batch_size or total, total - done)
            chunk = batch if size == total else slice_rows(batch, done, size)
            try:
                with torch.no_grad(), self._autocast():
                    out = fn(self.model, chunk) if fn else self.loss_fn(call_model(self.model, chunk), chunk)
            except Exception as exc:  # noqa: BLE001
                if classify_oom(exc) is None or size == 1:
                    raise
                detail = first_line(exc)
            else:
                parts.append((size, tree_map(_detach, out)))
                done += size
                continue
            release_memory()
            self.eval_micro_batch_size = max(1, size // 2)
            logger.warning("autofit OOM guard: evaluation out of memory at %d samples (%s); eval micro-batch "
                           "-> %d, training unchanged (%s)", size, detail, self.eval_micro_batch_size,
                           self.config.describe())
        return parts


def _initial_config(plan: Plan | None, micro_batch_size: int | None) -> Config:
    if plan is not None and plan.config is None:
        raise UsageError("The plan given to the OOM guard has no configuration (nothing fitted when it was "
                         "tuned); tune again with a larger budget or pass micro_batch_size= instead.")
    base = plan.config if plan is not None else Config(micro_batch_size=0)  # 0: whole batch
    if micro_batch_size is not None:
        base = base.replace(micro_batch_size=_positive("micro_batch_size", micro_batch_size))
    return base


def _positive(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise UsageError(f"{name} must be a positive integer but got {value!r}.")
    return value


def _raise_error(attempt: _Attempt, rank: int) -> None:
    if attempt.error is not None:
        raise attempt.error  # unchanged, with its own traceback
    raise OtherRankFailed(f"Rank {rank} stops its step: another rank failed with an error that is not an OOM "
                          "(see that rank's traceback).")


def _grad_versions(optimizer: torch.optim.Optimizer) -> list[tuple[Any, int]]:
    """Each parameter's gradient and its in-place version, to tell later whether a backward added to it."""
    return [(p.grad, p.grad._version if p.grad is not None else -1)
            for group in optimizer.param_groups for p in group["params"]]


def _grads_changed(optimizer: torch.optim.Optimizer, versions: list[tuple[Any, int]]) -> bool:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return any(p.grad is not grad or (grad is not None and grad._version != version)
               for p, (grad, version) in zip(params, versions))


def slice_rows(batch: Any, start: int, count: int) -> Any:
    """Rows `start .. start+count` of every tensor in `batch`, as views (no copy)."""
    return tree_map(lambda x: x.narrow(0, start, count) if isinstance(x, torch.Tensor) else x, batch)


def concat_rows(parts: list[Any]) -> Any:
    """Concatenate micro-batch outputs (tensors, or tuples/dicts of them) along the sample axis."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else torch.stack(parts)
    if isinstance(first, dict):
        return {key: concat_rows([p[key] for p in parts]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat_rows(list(items)) for items in zip(*parts))
    return parts


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def peak_bytes(device: torch.device) -> int | None:
    """The peak bytes `device` has held so far: CUDA's allocator peak, or the active CPU budget's peak."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from autofit.memory import CpuBudget

    budgets = [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, CpuBudget)]
    return budgets[-1].peak if budgets else None


def _size(value: int | None) -> str:
    return format_size(value) if value is not None else "unknown"
