"""The OOM guard: a running job survives an out-of-memory error inside its step.

`OomGuard.step(batch)` runs one optimizer step's worth of samples on the user's live model and
optimizer: forward and backward over micro-batches, each loss weighted by its share of the samples (of
the targets for a Hugging Face model's own token-level loss: `autofit.batches.shares`), as
`autofit.strategies.run.TrainRun.step` does, then the optimizer step. When a micro-batch runs out of
memory the guard drops what that attempt held, halves the micro-batch (doubling accumulation) and
replays the remaining samples of the step from the batch it was given. The gradients of micro-batches
that completed are kept. If the OOM struck in a backward after it had added some parameters'
gradients (autograd adds each parameter's whole share at once), those parameters are held out of the
replay of that micro-batch's samples. Either way every sample meets every parameter exactly once, the
step's gradient is the same weighted sum, and the global batch never changes.

At micro-batch 1 it switches on activation checkpointing on the live model, then gives up with an
error naming everything it tried. Each change is logged, recorded in `guard.recoveries`, and written
to the saved plan when one is given. With `grow_back_after=N` it tries the previous configuration
again after N clean steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autofit.batches.batch import call_model, default_loss, leading_dim
from autofit.batches.sample_axis import check_first_batch
from autofit.batches.shares import share, target_counts, weighted_sum
from autofit.models.info import batch_normalises, least_micro_batch
from autofit.config import Checkpointing, Config, Knob
from autofit.errors import AutofitError, UsageError
from autofit.guard.plan import apply_plan
from autofit.prepare import check_same_model
from autofit.batches.batch import slice_rows
from autofit.guard.parts import GradLedger, concat_rows, detach, held, peak_bytes, rows
from autofit.guard.sync import Round, sync_for, unwrap
from autofit.probe.oom import classify_oom, first_line, release_memory
from autofit.probe.outcome import OomKind
from autofit.strategies.run import checked_max_grad_norm, clip_gradients
from autofit.plan import Plan
from autofit.strategies import checkpointing, completed
from autofit.units import format_size

logger = logging.getLogger("autofit.guard.core")
_NOTHING = contextlib.nullcontext()  # reusable; made once rather than per micro-batch

LossFn = Callable[[Any, Any], torch.Tensor]
RESTART_RUNGS = "an 8-bit optimizer, ZeRO/FSDP sharding, CPU offload or LoRA"  # need a new job


class GuardGaveUp(AutofitError):
    """Even micro-batch 1 with activation checkpointing does not fit; the message lists what was tried."""


def optimizer_oom(steps: int, exc: BaseException) -> GuardGaveUp:
    """The guard's answer to an OOM in the optimizer step (AdamW's states are made at the first one): no
    micro-batch helps there, so what needs a restart is named."""
    return GuardGaveUp(f"Out of memory in the optimizer step at step {steps} ({first_line(exc)}); a smaller "
                       f"micro-batch cannot help there. Use {RESTART_RUNGS}.")


class OtherRankFailed(AutofitError):
    """Another rank failed with an error that is not an OOM; this rank stops instead of waiting."""


class RecoveryAction(Knob):
    """What the guard changed."""

    MICRO_BATCH = "micro-batch"  # halved the micro-batch, doubling accumulation (the global batch kept)
    CHECKPOINTING = "checkpointing"  # switched on full activation checkpointing at micro-batch 1
    GROW_BACK = "grow-back"  # went back to the previous configuration after clean steps


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One change of configuration made by the guard."""

    step: int  # the guard's step counter (0-based) when it happened
    action: RecoveryAction
    old: Config
    new: Config
    reason: str  # one line: what ran out of memory, where, and what changed
    peak_before: int | None  # peak bytes the device had held before the change (None: unknown)

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", RecoveryAction.parse(self.action, "action"))


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one guarded step did."""

    loss: torch.Tensor  # mean loss of the step, its pieces weighted by their shares (detached)
    samples: int  # samples whose gradients went into this step (always the batch's size)
    micro_batches: tuple[int, ...]  # sizes of the micro-batches that completed, in order
    recoveries: tuple[Recovery, ...]  # changes made during this step
    grad_norm: float | None = None  # the global gradient norm before clipping, where `max_grad_norm` clips


@dataclasses.dataclass
class _Attempt:
    """The outcome of one micro-batch on this rank."""

    size: int = 0
    loss: torch.Tensor | None = None  # its share of the step's loss, when its gradients are in
    oom: str | None = None  # OOM kind and message
    kind: OomKind | None = None  # OOM kind alone (`autofit.probe.oom.classify_oom`), named in the recovery's reason
    where: str = ""  # "forward" / "backward" (or "forward/backward" for an integration's own step)
    touched: list[nn.Parameter] = dataclasses.field(default_factory=list)  # gradients the failed backward added to
    error: BaseException | None = None  # a non-OOM error, re-raised unchanged


Backward = Callable[[Any, float], torch.Tensor]  # (micro_batch, weight) -> its share of the loss, detached


class OomGuard:
    """Runs optimizer steps on a live model and optimizer, recovering from OOM without losing samples.

        guard = OomGuard(model, optimizer, micro_batch_size=8)
        for batch in loader:
            report = guard.step(batch)      # forward/backward/optimizer step; report.loss

    `plan=` (a plan.json, or a `Plan`) starts from a tuned plan: its precision, attention and checkpointing
    are applied to `model` with the strategies' own code, its optimizer, adapters and engine are checked
    against what the guard is given (a mismatch is a `UsageError` naming the fix), and each change is
    written back to the file (without figures: no probe measured it). `micro_batch_size` beside a plan
    starts from that size, keeping the plan's samples per step. A plan measured for another model (its recorded
    fingerprint differs from `model`'s) is refused naming both, unless `allow_other_model=True`.
    `running_precision` is for integrations whose framework runs the forward (checked, not applied).
    `micro_batch_size=None` runs each batch whole until an OOM (`config.micro_batch_size` reads 0 until
    the first step sets it). `loss_fn(output, micro_batch)` defaults to `output.loss` / a scalar output. Under `torch.distributed`
    (DDP or a plain model) every rank must call `step` with its own shard; the ranks step down together.
    Dropout draws new masks when samples are replayed, as any re-run would. `max_grad_norm` clips the
    step's global gradient norm once every sample is in (`StepReport.grad_norm` is the norm before).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 micro_batch_size: int | None = None, loss_fn: LossFn | None = None,
                 plan: str | Path | Plan | None = None, grow_back_after: int | None = None,
                 eval_micro_batch_size: int | None = None, autocast_dtype: torch.dtype | None = None,
                 scaler: Any = None, escalate: bool = True, process_group: Any = None,
                 running_precision: Any = None, max_grad_norm: float | None = None, allow_other_model: bool = False):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn or default_loss
        # the model's own loss: a token-level one is split by targets (autofit.batches.shares); integrations
        # whose framework computes a loss of yours (the Trainer's compute_loss_func) set it False
        self.weigh_by_targets = loss_fn is None
        self.plan_path, self._plan = _plan_of(plan)
        if self._plan is not None:  # a plan measured for another model is refused, naming both (unless intended)
            check_same_model(self._plan.spec, model, allow_other_model, "OomGuard")
        # the knobs the live model and optimizer show (`Strategy.observed`): a configuration without a plan
        self._observed = {field: value for s in completed() for field, value in s.observed(model, optimizer).items()}
        self.config = _initial_config(self._plan, micro_batch_size, self._observed)
        self.grow_back_after = _positive("grow_back_after", grow_back_after)
        self.eval_micro_batch_size = _positive("eval_micro_batch_size", eval_micro_batch_size)
        self.max_grad_norm = checked_max_grad_norm(max_grad_norm)  # `step` clips the gradients' global norm
        if self._plan is not None:  # the model runs the plan's knobs, or the guard refuses to start
            autocast_dtype, scaler = apply_plan(self._plan.config, model, optimizer, autocast_dtype, scaler,
                                                running_precision)
        self.autocast_dtype = autocast_dtype
        self.scaler = scaler
        self.escalate = escalate
        self.sync = sync_for(model, process_group)
        self.steps = 0  # optimizer steps taken (integrations set it from their own counter)
        self.samples_seen = 0  # samples whose gradients went in
        self.accumulation_multiplier = 1  # batches per optimizer step (accelerate/Trainer accumulation)
        self.recoveries: list[Recovery] = []
        groups = optimizer.param_groups if optimizer is not None else []  # None: evaluation only
        self._ledger = GradLedger([p for g in groups for p in g["params"] if p.requires_grad])
        self.phase = "forward"  # where the current attempt is: "forward", "backward" (logs say where an OOM struck)
        self._undo: list[Config] = []  # configurations stepped down from, most recent last
        self._clean_units = 0
        self._axis_checked = False  # `check_first_batch` ran on the first batch
        self._grow_wait = grow_back_after
        self._tried: list[str] = [self.config.describe()] if self.config is not None else []

    # ---- training -------------------------------------------------------------------------------
    def step(self, batch: Any) -> StepReport:
        """One optimizer step over all samples of `batch` (this rank's share of the global batch)."""
        if self.optimizer is None:
            raise UsageError("OomGuard.step needs an optimizer; this guard was made with optimizer=None "
                             "(evaluation only). Pass the optimizer you train with.")
        report = self.accumulate(batch)
        norm = self._optimizer_step()
        self.steps += 1
        return report if norm is None else dataclasses.replace(report, grad_norm=norm)

    def accumulate(self, batch: Any, backward: Backward | None = None) -> StepReport:
        """Forward and backward of every sample of `batch`, its gradients added to `.grad`, no optimizer
        step. `backward(micro_batch, weight)` replaces the guard's own forward/backward (integrations)."""
        backward = backward or self._forward_backward
        total = rows(batch)
        if not self._axis_checked:
            check_first_batch(self.model, batch)
            self._axis_checked = True
        first_recovery = len(self.recoveries)
        self._maybe_grow_back()
        if self.config is None:  # no size given: the whole batch at once
            self.config = Config(micro_batch_size=total, **self._observed)
            self._tried.append(self.config.describe())
        done, losses, sizes, holds = 0, [], [], []
        counts = functools.cache(lambda: _on_host(target_counts(self.model, batch) if self.weigh_by_targets else None))
        while True:
            size, hold = self._next_chunk(done, total, holds)
            attempt = self._attempt(batch, done, size, total, hold, backward, counts) if size > 0 else _Attempt()
            agreed = self.sync.agree(attempt.oom is not None, attempt.error is not None,
                                     done + attempt.size < total if attempt.loss is not None else size > 0,
                                     attempt.size if attempt.oom else 0)
            if agreed.error:
                _raise_error(attempt, self.sync.rank)
            if attempt.touched:  # those gradients already hold this micro-batch: keep them out of its replay
                holds.append((attempt.touched, done + attempt.size))
            if attempt.loss is not None:
                done = done + attempt.size
                losses.append(attempt.loss)
                sizes.append(attempt.size)
            if agreed.oom:
                self._recover(attempt, agreed, total)
            elif not agreed.busy:
                break
        recoveries = tuple(self.recoveries[first_recovery:])
        self._clean_units = self._clean_units + 1 if all(r.action is RecoveryAction.GROW_BACK for r in recoveries) else 0
        self.samples_seen += total
        accumulation = math.ceil(total / self.config.micro_batch_size) * self.accumulation_multiplier
        if accumulation != self.config.grad_accum_steps:
            self.config = self.config.replace(grad_accum_steps=accumulation)
        loss = torch.stack(losses).sum() if len(losses) > 1 else losses[0] if losses else torch.zeros(())
        return StepReport(loss, total, tuple(sizes), recoveries)

    def _next_chunk(self, done: int, total: int, holds: list) -> tuple[int, list[nn.Parameter]]:
        """The next micro-batch's size and the parameters held out of it. A micro-batch never straddles
        the end of a held range, so every sample meets every parameter exactly once."""
        size = min(self.config.micro_batch_size, total - done)
        active = [(params, until) for params, until in holds if until > done]
        if active:
            size = min(size, min(until for _, until in active) - done)
        return size, [p for params, _ in active for p in params]

    def _forward_backward(self, chunk: Any, weight: float) -> torch.Tensor:
        with self._autocast():
            loss = self.loss_fn(call_model(self.model, chunk), chunk)
        self.phase = "backward"
        scaled = loss * weight
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return scaled.detach()

    def _attempt(self, batch: Any, start: int, size: int, total: int, hold: list[nn.Parameter],
                 backward: Backward, counts: Callable[[], torch.Tensor | None]) -> _Attempt:
        """Forward and backward of samples `start .. start+size`, their loss weighted by their share of the
        step's samples, or of its targets (`counts()`, read only when the step is split); an OOM becomes the
        result. Samples holding none of the step's targets add nothing (their loss, a mean over no targets,
        would be NaN): they are passed over, under `no_sync` like every piece."""
        weight = 1.0 if size == total else share(counts(), start, size, total)
        if weight == 0.0:
            return _Attempt(size=size, loss=torch.zeros((), device=self._device()))
        chunk = batch if size == total else slice_rows(batch, start, size)
        self.phase = "forward" if backward == self._forward_backward else "forward/backward"
        self._ledger.snapshot()
        try:
            with self.sync.no_sync(self.model):
                if hold:
                    with held(hold):
                        contribution = backward(chunk, weight)
                else:
                    contribution = backward(chunk, weight)
            self._ledger.forget()
            if isinstance(contribution, torch.Tensor) and contribution.requires_grad:
                contribution = contribution.detach()
            return _Attempt(size=size, loss=contribution)
        except Exception as exc:  # noqa: BLE001 - classified below; non-OOM errors are re-raised as is
            kind = classify_oom(exc)
            if kind is None:
                self._ledger.forget()
                return _Attempt(size=size, error=exc)
            detail = first_line(exc)
        # Out of the except block: the exception, its traceback and the attempt's tensors are gone.
        touched = self._ledger.touched()
        done = len(touched) == len(self._ledger.params) - len(hold)  # every gradient got in before the OOM
        nothing = torch.zeros((), device=self._device())  # beside the other pieces' losses, stacked at the end
        return _Attempt(size=size, loss=nothing if done else None, oom=f"{kind} ({detail})", kind=kind,
                        where=self.phase, touched=[] if done else touched)

    def _recover(self, attempt: _Attempt, agreed: Round, total: int) -> None:
        """Free what the failed attempt held and step down one notch (the same on every rank)."""
        peak = peak_bytes(self._device())
        release_memory()
        old, floor = self.config, self._smallest_micro_batch
        if min(old.micro_batch_size, agreed.smallest_failure) > floor:
            new_mb = old.micro_batch_size // 2
            while new_mb >= agreed.smallest_failure and new_mb > floor:
                new_mb //= 2
            new, action = old.replace(micro_batch_size=max(new_mb, floor)), RecoveryAction.MICRO_BATCH
        elif self.escalate and old.checkpointing is not Checkpointing.FULL:
            checkpointing.enable(unwrap(self.model), 1)
            new, action = old.replace(checkpointing=Checkpointing.FULL, checkpoint_every=1), RecoveryAction.CHECKPOINTING
        else:
            raise GuardGaveUp(self._gave_up_message(attempt, total, peak))
        new = new.replace(grad_accum_steps=math.ceil(total / new.micro_batch_size) * self.accumulation_multiplier)
        where = f"in the {attempt.where} on this rank ({attempt.kind})" if attempt.oom else \
            f"on another rank ({agreed.smallest_failure} samples)"
        replay = (f"replaying its samples with the {len(attempt.touched)} parameters whose gradients it had "
                  "already added held out" if attempt.touched else "replaying the remaining samples")
        reason = (f"step {self.steps}: out of memory {where}, peak {_size(peak)}; {old.describe()} -> "
                  f"{new.describe()}, {replay}")
        self._change(action, old, new, reason, peak)
        self._undo.append(old)

    @functools.cached_property
    def _smallest_micro_batch(self) -> int:
        """The micro-batch the guard steps down to at most (`least_micro_batch`: 2 with batch norm)."""
        return least_micro_batch(batch_normalises(unwrap(self.model)))

    def _gave_up_message(self, attempt: _Attempt, total: int, peak: int | None) -> str:
        what = attempt.oom or "an OOM on another rank"
        floor = self._smallest_micro_batch
        smallest = "micro-batch 1" if floor == 1 else f"micro-batch {floor} (the least batch norm takes)"
        return (f"Out of memory at step {self.steps} even with {smallest} (of {total} samples per step): "
                f"{what}; peak {_size(peak)}. Tried, in order: {' -> '.join(self._tried)}. What remains needs a "
                f"restart: run `autofit tune` with this budget and allow {RESTART_RUNGS}.")

    def average_gradients(self) -> None:
        """Average the accumulated gradients over the ranks (a no-op in one process). `step` does this
        itself; integrations whose framework steps the optimizer call it at the end of a window."""
        self.sync.average_gradients(self._ledger.params)

    def _optimizer_step(self) -> float | None:
        """Average gradients over ranks, clip them to `max_grad_norm` (returning their norm before), apply
        them, clear them."""
        self.average_gradients()
        norm = None
        if self.max_grad_norm is not None:
            norm = float(clip_gradients(self._ledger.params, self.max_grad_norm, self.optimizer, self.scaler))
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        except Exception as exc:  # noqa: BLE001
            if classify_oom(exc) is None:
                raise
            raise optimizer_oom(self.steps, exc) from exc
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ---- grow-back and bookkeeping --------------------------------------------------------------
    def _maybe_grow_back(self) -> None:
        """After `grow_back_after` clean steps, return to the configuration stepped down from last."""
        if not self._grow_wait or not self._undo or self._clean_units < self._grow_wait:
            return
        old, new = self.config, self._undo.pop()
        if new.checkpointing != old.checkpointing:
            checkpointing.disable(unwrap(self.model))
            if new.checkpointing is not Checkpointing.NONE:
                checkpointing.enable(unwrap(self.model), new.checkpoint_every)
        reason = f"step {self.steps}: {self._clean_units} clean steps; growing back {old.describe()} -> {new.describe()}"
        self._change(RecoveryAction.GROW_BACK, old, new, reason, peak_bytes(self._device()))
        self._clean_units = 0
        self._grow_wait *= 2  # a grow-back that fails again is retried less often

    def _change(self, action: RecoveryAction, old: Config, new: Config, reason: str, peak: int | None) -> None:
        self.config = new
        self._tried.append(new.describe())
        self.recoveries.append(Recovery(self.steps, action, old, new, reason, peak))
        logger.warning("autofit OOM guard: %s", reason)
        if self.plan_path is not None and self.sync.rank == 0:
            self._written(new, reason).save(self.plan_path)

    def _written(self, new: Config, reason: str) -> Plan:
        """The plan written back for `new`: the tuned one when the guard grew back to it; otherwise `new`
        without figures (the tuned ones were measured for the tuned configuration: they stay in the reason)."""
        tuned = self._plan
        if new == tuned.config:
            return tuned
        return dataclasses.replace(tuned, config=new, throughput=None, tokens_per_second=None, images_per_second=None,
                                   peak_memory=None,
                                   reason=f"OOM guard, {reason}. Tuned: {tuned.config.describe()} at "
                                          f"{tuned.figures()}: {tuned.reason}")

    def _device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return _NOTHING
        return torch.autocast(self._device().type, dtype=self.autocast_dtype)

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self, batch: Any, fn: Callable[[nn.Module, Any], Any] | None = None) -> Any:
        """Evaluate `batch` without gradients, in micro-batches sized apart from training's.

        Without `fn`: the mean loss (a 0-d tensor), its pieces weighted as training's are. With
        `fn(model, micro_batch)` returning a tensor (or a tuple/dict of tensors) with a sample axis: those
        outputs concatenated over the batch. An OOM halves `eval_micro_batch_size` only; the training
        configuration is never touched.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._autocast():
                compute = fn or (lambda model, chunk: self.loss_fn(call_model(model, chunk), chunk))
                parts = self.evaluate_chunks(batch, lambda chunk: compute(self.model, chunk))
        finally:
            self.model.train(was_training)
        if fn is None:
            return weighted_sum(target_counts(self.model, batch) if self.weigh_by_targets else None, parts)
        return concat_rows([out for _, out in parts])

    def evaluate_chunks(self, batch: Any, run: Callable[[Any], Any]) -> list[tuple[int, Any]]:
        """`run(micro_batch)` over `batch` in micro-batches of `eval_micro_batch_size`, halving it on OOM;
        returns (size, detached output) per micro-batch, in order."""
        total = leading_dim(batch)
        parts, done = [], 0
        while done < total:
            size = min(self.eval_micro_batch_size or total, total - done)
            try:
                out = run(batch if size == total else slice_rows(batch, done, size))
            except Exception as exc:  # noqa: BLE001
                if classify_oom(exc) is None or size == 1:
                    raise
                detail = first_line(exc)
            else:
                parts.append((size, tree_map(detach, out)))
                done += size
                continue
            release_memory()
            self.eval_micro_batch_size = max(1, size // 2)
            logger.warning("autofit OOM guard: evaluation out of memory at %d samples (%s); eval micro-batch "
                           "-> %d, training unchanged (%s)", size, detail, self.eval_micro_batch_size,
                           self.config.describe() if self.config is not None else "whole batches")
        return parts


def _plan_of(plan: Any) -> tuple[Path | None, Plan | None]:
    """(where to write changes back, the plan) from a plan.json path (written back) or a `Plan` (not written)."""
    if plan is None or isinstance(plan, Plan):
        return None, plan
    if isinstance(plan, (str, Path)):
        return Path(plan), Plan.load(Path(plan))
    raise UsageError(f"plan= takes a path to a plan.json or an autofit.Plan, but got {type(plan).__name__}; "
                     "save the plan (plan.save('plan.json')) and pass its path, so the guard writes its changes back.")


def framework_precision(accelerator: Any) -> str:
    """The precision an accelerate `Accelerator` (the Trainer's own, too) runs the forward in, as
    `OomGuard(running_precision=...)` takes it: its `mixed_precision`, "no" read as fp32."""
    mixed = str(accelerator.mixed_precision)
    return {"no": "fp32"}.get(mixed, mixed)


def _initial_config(plan: Plan | None, micro_batch_size: int | None, observed: dict[str, Any]) -> Config | None:
    """The configuration to start from; None (no plan, no size): the whole batch, sized at the first step.
    Without a plan, the knobs the live objects show (`observed`) at their values."""
    if plan is not None and plan.config is None:
        raise UsageError("The plan given to the OOM guard has no configuration (nothing fitted when it was "
                         "tuned); tune again with a larger budget or pass micro_batch_size= instead.")
    size = _positive("micro_batch_size", micro_batch_size)
    if plan is None:
        return Config(micro_batch_size=size, **observed) if size is not None else None
    if size is None:
        return plan.config
    per_rank = plan.config.micro_batch_size * plan.config.grad_accum_steps  # the samples per step it was tuned for
    return plan.config.replace(micro_batch_size=size, grad_accum_steps=max(1, math.ceil(per_rank / size)))


def _on_host(counts: torch.Tensor | None) -> torch.Tensor | None:
    """Targets per row, read from the device once per step rather than once per piece."""
    return None if counts is None else counts.cpu()


def _positive(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise UsageError(f"{name} must be a positive integer but got {value!r}.")
    return value


def _raise_error(attempt: _Attempt, rank: int) -> None:
    if attempt.error is not None:
        raise attempt.error  # unchanged, with its own traceback
    raise OtherRankFailed(f"Rank {rank} stops its step: another rank failed with an error that is not an OOM "
                          "(see that rank's traceback).")


def _size(value: int | None) -> str:
    return format_size(value) if value is not None else "unknown"
