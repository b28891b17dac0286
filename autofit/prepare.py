"""Using a plan in your own training loop: `autofit.prepare(plan, model, optimizer)`.

    prepared = autofit.prepare("runs/x/plan.json", model, optimizer)
    for batch in loader:                    # prepared.batch_size samples per optimizer step (per rank)
        loss = prepared.step(batch)         # micro-batches, autocast, backward, accumulation, optimizer step

In the spirit of `accelerator.prepare`: every knob of the plan is applied with the code the probe ran
(`Strategy.apply` on a `TrainRun`, as `autofit.strategies.run.build_run` does, for every strategy in rung
order, each rebuilt as the plan recorded it: `Strategy.recorded`): precision (autocast, the fp16 GradScaler),
attention implementation, checkpointing, the optimizer, LoRA / quantized base weights, the engine (DDP,
ZeRO, FSDP2), and any plug-in technique. So what was measured is what runs. The pieces stay reachable for a loop
of your own (`prepared.model`, `.optimizer`, `.micro_batch_size`, `.grad_accum_steps`, `.autocast()`,
`.micro_batches(batch)`, `.forward_backward(micro_batch, weight)`, `.optimizer_step()`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from autofit.config import Config
from autofit.errors import UsageError
from autofit.strategies.run import TrainRun, checked_max_grad_norm
from autofit.batches.batch import default_loss, leading_dim, slice_rows, to_device
from autofit.batches.sample_axis import check_first_batch
from autofit.models.info import inspect_model
from autofit.batches.shares import micro_batch_shares
from autofit.job.target import Target
from autofit.job.train_spec import LossFn, OptimizerSpec, TrainSpec
from autofit.strategies import completed, for_plan, in_order, resolve_strategies, with_required
from autofit.strategies.base import Placement, Strategy
from autofit.strategies.optimizer import CLASS_NAMES as OPTIMIZER_CLASSES
from autofit.strategies.optimizer import given_optimizer


@dataclasses.dataclass
class Prepared:
    """A model, its optimizer and the step the plan measured, ready for a training loop."""

    config: Config  # the plan's configuration, applied
    run: TrainRun  # the training run the strategies shaped (the same class the probe trains)
    _axis_checked: bool = dataclasses.field(default=False, init=False, repr=False)  # `check_first_batch` ran

    @property
    def model(self) -> nn.Module:
        """The model to train (LoRA-wrapped, engine-wrapped or sharded where the plan says)."""
        return self.run.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the plan chose, over the model's trainable parameters."""
        return self.run.optimizer

    @property
    def device(self) -> torch.device:
        """Where the model trains."""
        return self.run.device

    @property
    def micro_batch_size(self) -> int:
        """Samples per forward/backward."""
        return self.config.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.grad_accum_steps

    @property
    def batch_size(self) -> int:
        """Samples per optimizer step on this rank (micro-batch x accumulation): a DataLoader's batch_size."""
        return self.config.micro_batch_size * self.config.grad_accum_steps

    def gradient_accumulation_plugin(self) -> Any:
        """accelerate's `GradientAccumulationPlugin` for the plan, for `Accelerator(gradient_accumulation_plugin=
        ...)`: its accumulation, with the gradients reduced on every micro-batch where the plan measured
        that (`Strategy.accumulation_kwargs`, FSDP2's): `accumulate()` otherwise skips the reduce-scatter
        until the last micro-batch, and every rank holds the whole model's unsharded gradients."""
        from accelerate.utils import GradientAccumulationPlugin

        kwargs = {"sync_each_batch": False}
        for strategy in completed():
            kwargs.update(strategy.accumulation_kwargs(self.config))
        return GradientAccumulationPlugin(num_steps=self.grad_accum_steps, **kwargs)

    def autocast(self) -> Any:
        """The plan's autocast context for forward and loss (a no-op in fp32 or where an engine casts)."""
        return self.run.autocast()

    def micro_batches(self, batch: Any) -> list[Any]:
        """`batch` split along its sample axis into micro-batches of `micro_batch_size`, on the device
        (views of the batch where it already is there: nothing is copied)."""
        total, size = leading_dim(batch), self.micro_batch_size
        if not self._axis_checked:
            check_first_batch(self.run.model, batch)
            self._axis_checked = True
        batch = to_device(batch, self.device)
        return [slice_rows(batch, start, min(size, total - start)) for start in range(0, total, size)]

    def weights(self, micro_batches: list[Any]) -> list[float | torch.Tensor]:
        """Each micro-batch's share of the step's loss, for `forward_backward`: of the samples, or of the
        targets for a Hugging Face model's own token-level loss (rows padded with -100 labels hold fewer;
        0-d tensors on the labels' device), so that the step's gradient is the whole batch's
        (`autofit.batches.shares`)."""
        return micro_batch_shares(self.run.model, micro_batches, self.run.spec.loss_fn)

    def forward_backward(self, micro_batch: Any, weight: float = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch with its loss scaled by `weight` (its share of the step's
        loss: `weights`); returns the unscaled loss, detached."""
        return self.run.forward_backward(micro_batch, weight)

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients (through the scaler or the engine), clipped to `max_grad_norm`
        where one was given, and clear them."""
        self.run.optimizer_step()

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (None: not clipped, or no step yet)."""
        deepspeed = getattr(self.run.model, "get_global_grad_norm", None)  # the engine, which clips itself
        norm = (deepspeed() if self.run.max_grad_norm else None) if callable(deepspeed) else self.run.grad_norm
        return None if norm is None else float(norm)

    def step(self, batch: Any) -> torch.Tensor:
        """One optimizer step over every sample of `batch`, in micro-batches; returns the mean loss.
        Give it `batch_size` samples to train as the plan was measured; any other size works (the
        gradient is the mean over the samples given)."""
        return self.run.step(self.micro_batches(batch))


def prepare(plan: Any, model: nn.Module, optimizer: Any = None, *, loss_fn: LossFn | None = None,
            device: str | torch.device | None = None, strategies: Sequence[Any] | None = None,
            nvme_path: str | os.PathLike | None = None, engine: bool = True,
            max_grad_norm: float | None = None, allow_other_model: bool = False) -> Prepared:
    """Apply every knob of `plan` to `model` with the strategies' own code; return what a loop needs.

    Args:
        plan: an `autofit.Plan`, a path to a plan.json, or an `autofit.Config`.
        model: the model to train; changed in place where a knob allows (checkpointing, attention) and
            moved to the device; `prepared.model` is what to train (it may be a wrapper).
        optimizer: None (the optimizer the probes trained, with their hyperparameters: `plan.settings["optimizer"]`;
            a plan tuned with your own optimizer instance rebuilds its class where it imports), an optimizer instance
            (kept when it is the plan's kind over exactly the trainable parameters; otherwise one of the
            plan's kind is built with its hyperparameters), or a factory `params -> optimizer`. A plan
            tuned with your own factory, or a class that does not import here, needs it again.
        loss_fn: `loss_fn(output, micro_batch) -> scalar` for `step`; default `output.loss` or a scalar output.
        device: where to train; default the plan's device kind (cuda:LOCAL_RANK under a launcher), else the CPU.
        strategies: the strategies the plan was tuned with, when not the defaults, as `autofit.autofit` takes
            them (names or instances; plug-ins defined so far are included by default); the optimizer's
            joins them where they leave it out, as it joined the search. LoRA's adapters are those the plan
            recorded (`plan.settings["lora"]`: target modules, alpha, dropout) unless strategies are given.
        nvme_path: folder for NVMe offload, when the plan offloads there.
        engine: False leaves the ranks and the engine (DDP, ZeRO, FSDP2) to a launcher that builds them
            itself (`accelerator.prepare`, the Trainer): every other knob is applied, nothing is wrapped.
        max_grad_norm: the largest global gradient norm `optimizer_step` (and `step`) lets through, clipped
            after fp16's unscaling and over every rank's shard (DeepSpeed clips in its engine, from its
            config); None clips nothing. `prepared.grad_norm` is the last step's norm before clipping.
        allow_other_model: True applies a plan measured for another model (`check_same_model`: its recorded
            fingerprint differs from `model`'s); by default that is a `UsageError` naming both.
    """
    config, summary, settings = _config_of(plan)
    check_same_model(summary, model, allow_other_model, "prepare")
    max_grad_norm = checked_max_grad_norm(max_grad_norm)
    chosen = _strategies(strategies, engine, config, settings, summary)
    where = _device(device, summary, config)
    if engine and max(s.placement(config) for s in chosen) is Placement.RANKS:
        _join_ranks(config, where)
    given = given_optimizer(optimizer, config, settings.get("optimizer", {}))
    spec = _spec(model, where, config, summary, given.spec, loss_fn, nvme_path or summary.get("nvme_path"))
    run = TrainRun(spec=spec, config=config, model=model, max_grad_norm=max_grad_norm or 0.0)
    model.train()
    for strategy in chosen:
        strategy.apply(run)
    given.adopt(run)
    run.ready()
    given.check(run)
    return Prepared(config, run)


def apply_in_place(config: Config, model: nn.Module, optimizer: Any = None) -> TrainRun:
    """`config` applied to a live `model` trained with `optimizer` (the OOM guard's), by every strategy's
    own code on a live run (`TrainRun.live`): what a live model takes in place (precision: the run's autocast
    dtype and fp16 scaler; the attention implementation; checkpointing) is applied, what it cannot is checked
    against it (the optimizer's class, adapters, an engine: a `UsageError` naming the fix)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    run = TrainRun(spec=_spec(model, device, config, {}, OptimizerSpec("adamw"), None), config=config, model=model,
                   optimizer=optimizer, live=True)
    for strategy in completed():
        strategy.apply(run)
    return run


WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")  # hold the user's model as `.module`


def check_same_model(summary: dict[str, Any], model: nn.Module, allow_other_model: bool, who: str) -> None:
    """`UsageError` naming both fingerprints where the plan (its spec `summary`) was measured for another model
    than `model` (parameter names, shapes, dtypes and which train: `inspect_model`), unless `allow_other_model`.
    Nothing to compare for a plan without a fingerprint (a `Config`, autofit 0.1's) or a model already carrying
    PEFT adapters (their names are not the tuned model's); `who` names the caller ("prepare", "OomGuard")."""
    recorded = summary.get("model_fingerprint")
    if not recorded or allow_other_model:
        return
    base = model
    while type(base).__name__ in WRAPPERS and isinstance(getattr(base, "module", None), nn.Module):
        base = base.module
    if hasattr(base, "peft_config"):
        return
    info = inspect_model(base)
    if info.fingerprint != recorded:
        raise UsageError(f"{who}: the plan was measured for another model ({summary.get('model', '?')}, fingerprint "
                         f"{recorded}) than the one given ({info.name}, fingerprint {info.fingerprint}): their "
                         "parameter names, shapes or dtypes differ, so its measured memory says nothing of this one. "
                         f"Tune this model, or pass allow_other_model=True to {who} if applying it is intended.")


def _config_of(plan: Any) -> tuple[Config, dict[str, Any], dict[str, dict[str, Any]]]:
    """The plan's config, its spec summary and its knobs' settings (`Plan.settings`)."""
    from autofit.plan import Plan

    if isinstance(plan, Config):
        return plan, {}, {}
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(Path(plan))
    if not isinstance(plan, Plan):
        raise UsageError(f"prepare takes a Plan, a path to a plan.json or a Config, but got {type(plan).__name__}.")
    if not plan.fits or plan.config is None:
        raise UsageError(f"This plan does not fit, so there is nothing to apply: {plan.reason} Tune again with "
                         "what the message allows.")
    return plan.config, dict(plan.spec), dict(plan.settings)


def _device(device: Any, summary: dict[str, Any], config: Config) -> torch.device:
    if device is not None:
        from autofit.devices.device import resolve_device

        return resolve_device(device)
    if str(summary.get("device", "cpu")).startswith("cuda") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _join_ranks(config: Config, device: torch.device) -> None:
    """Join (or start) the process group an engine or several ranks need."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise look for a GPU
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "0"))
        if not world and config.num_gpus > 1:
            raise UsageError(f"This plan trains on {config.num_gpus} ranks ({config.describe()}); start them with "
                             "a launcher: bash launch/torchrun.sh train.py (torchrun), which sets WORLD_SIZE.")
        if not world:  # one rank with an engine (offload on one GPU): a process group of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                              LOCAL_RANK="0")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=30))
    if dist.get_world_size() != config.num_gpus:
        raise UsageError(f"The plan was tuned for {config.num_gpus} ranks but {dist.get_world_size()} are running; "
                         f"launch it with --nproc_per_node {config.num_gpus}, or tune for this many ranks.")


def _spec(model: nn.Module, device: torch.device, config: Config, summary: dict[str, Any], optimizer: OptimizerSpec,
          loss_fn: LossFn | None, nvme_path: Any = None) -> TrainSpec:
    """The spec the strategies read while they apply (no batches: the loop brings its own)."""
    budget = int(summary.get("memory_budget") or 0)
    return TrainSpec(model_factory=lambda: model, batch_factory=_no_batches, model=inspect_model(model),
                     device=device, target=Target.from_device(device, config.num_gpus, budget),
                     memory_budget=budget, budget_reason="the plan's", global_batch_size=config.global_batch_size,
                     num_gpus=config.num_gpus, optimizer=optimizer, loss_fn=loss_fn or default_loss,
                     nvme_path=str(nvme_path) if nvme_path else None)


def _no_batches(_: int) -> Any:
    raise RuntimeError("a prepared run trains the batches its loop gives it")


def _strategies(strategies: Sequence[Any] | None, engine: bool, config: Config, settings: dict[str, dict[str, Any]],
                summary: dict[str, Any]) -> list[Strategy]:
    """The strategies given (with those every run needs: `with_required`, as the search had them), else every
    built-in and plug-in one, each as the plan recorded it (`for_plan`: LoRA's adapters unless strategies are
    given); without `engine`, none that runs launched ranks (`Placement.RANKS`: DDP, ZeRO, FSDP2, offload)."""
    if strategies is None:
        chosen = for_plan(settings, summary)
    else:
        chosen = in_order(with_required(resolve_strategies(strategies)))
    return [s for s in chosen if engine or s.placement(config) is not Placement.RANKS]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = ["OPTIMIZER_CLASSES", "Prepared", "apply_in_place", "prepare"]
