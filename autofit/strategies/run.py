"""The training step that probes measure and the OOM guard runs: forward, backward over micro-batches
with gradient accumulation, then one optimizer step.

Strategies shape a `TrainRun` (model, autocast, scaler, optimizer factory) before it trains, with the same
`Strategy.apply` that shapes the estimator's `SimulatedRun` (a step under fake tensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, ClassVar, Iterable, Protocol, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autofit.errors import UsageError
from autofit.batches.batch import call_model, checked_loss
from autofit.batches.shares import micro_batch_shares
from autofit.config import Config
from autofit.job.train_spec import TrainSpec

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
DEFAULT_GRADIENT_CLIPPING = 1.0  # what the exports clip the global gradient norm at: common practice, no memory cost


class Engine(Protocol):
    """What a distributed engine does in place of torch's backward and optimizer step."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's (already weighted) loss, accumulating gradients."""

    def step(self) -> None:
        """The optimizer step after the last micro-batch, gradients cleared."""


def checked_max_grad_norm(value: Any) -> float | None:
    """`max_grad_norm` as given (None: no clipping), or the `UsageError` naming the bad value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UsageError(f"max_grad_norm must be a positive number (the largest global gradient norm, e.g. 1.0) "
                         f"or None for no clipping, but got {value!r}.")
    return float(value)


def clip_gradients(params: Sequence[nn.Parameter], max_norm: float, optimizer: Any, scaler: Any) -> torch.Tensor:
    """Clip the global norm of `params`' gradients to `max_norm` (unscaled first under fp16's GradScaler,
    as its docs prescribe); returns the norm before clipping. Gradients sharded by FSDP2 (DTensors) have
    their norm reduced over the ranks before they are scaled, as torchtitan's `clip_grad_norm_` does
    (torchtitan/distributed/utils.py)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    with_grads = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grads])
    full = getattr(norm, "full_tensor", None)  # a DTensor norm (FSDP2): the sum over the ranks
    norm = full() if callable(full) else norm
    torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm)
    return norm.detach()


@dataclasses.dataclass
class TrainRun:
    """A model being trained under one configuration. Mutable while strategies apply; then `ready()`."""

    spec: TrainSpec
    config: Config
    model: nn.Module
    autocast_dtype: torch.dtype | None = None  # set by the precision strategy
    scaler: Any = None  # torch.amp.GradScaler for fp16
    optimizer_factory: OptimizerFactory | None = None  # set by the optimizer strategy
    optimizer: torch.optim.Optimizer | None = None
    placed: bool = False  # True once the model is on the device (a strategy may place it itself)
    # A distributed engine (DeepSpeed) that owns backward and the optimizer step: set by `ready()`
    # from `engine_factory(run)`, which an engine strategy provides, once every strategy has applied.
    # A factory that only wraps the model last (FSDP2) returns None: torch's backward and step remain.
    engine_factory: Callable[["TrainRun"], "Engine | None"] | None = None
    engine: "Engine | None" = None
    nvme_path: str | None = None  # folder for NVMe offload, set by the offload strategy for the engine
    # The optimizer's hyperparameters (lr, betas, ...; defaults filled in), set by the optimizer strategy for an
    # engine that builds the optimizer from its config (DeepSpeed); None: the optimizer's defaults.
    hyperparameters: dict[str, Any] | None = None
    phase: str = "build"  # what the run is doing (`autofit.probe.outcome.PHASES`): an OOM records it
    # The largest global gradient norm before the step (`autofit.prepare`'s `max_grad_norm`); 0 clips nothing.
    # None (probes): as the exports run, DeepSpeed's config clipping at 1.0, torch's steps unclipped.
    max_grad_norm: float | None = None
    grad_norm: torch.Tensor | None = None  # the last step's norm before clipping, where this run clipped
    # The model is one a user trains already, its optimizer built (`optimizer`; the OOM guard): a value a live
    # model cannot take in place is checked instead (`Strategy.apply`).
    live: bool = False
    simulated: ClassVar[bool] = False  # True for the estimator's `SimulatedRun`
    steps_taken: int = 0  # optimizer steps `step` has started: what a probe or a re-measurement spent

    @property
    def device(self) -> torch.device:
        """The device this run trains on."""
        return self.spec.device

    def ready(self) -> "TrainRun":
        """Move the model to the device and create the optimizer over the trainable parameters."""
        if not self.placed:
            self.model.to(self.device)
            self.placed = True
        if self.engine_factory is not None and self.engine is None:
            self.engine = self.engine_factory(self)  # may replace model and optimizer
            if self.engine is not None:
                return self
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is None:
            factory = self.optimizer_factory or (lambda ps: torch.optim.AdamW(ps))
            self.optimizer = factory(params)
        return self

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for the forward pass and loss, per the precision strategy."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_backward(self, micro_batch: Any, weight: float) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss scaled by `weight`; returns the unscaled loss."""
        self.phase = "forward"
        with self.autocast():
            output = call_model(self.model, micro_batch)
            loss = checked_loss(self.spec.loss_fn(output, micro_batch))
        scaled = loss * weight
        self.phase = "backward"
        if self.engine is not None:
            self.engine.backward(scaled)
        else:
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients and clear them."""
        self.phase = "step"
        if self.max_grad_norm and self.engine is None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            self.grad_norm = clip_gradients(params, self.max_grad_norm, self.optimizer, self.scaler)
        if self.engine is not None:
            self.engine.step()
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """One optimizer step over `micro_batches`; each loss is weighted by its share of the samples (of
        the targets, for a Hugging Face model's own token-level loss: `autofit.batches.shares`), so the
        gradient is the whole step's however the samples are split."""
        self.steps_taken += 1
        loss = torch.zeros((), device=self.device)
        for micro_batch, weight in zip(micro_batches, micro_batch_shares(self.model, micro_batches,
                                                                         self.spec.loss_fn)):
            loss += self.forward_backward(micro_batch, weight) * weight
        self.optimizer_step()
        return loss


@dataclasses.dataclass(kw_only=True)
class SimulatedRun(TrainRun):
    """The estimator's simulated step (`autofit.estimate.simulation.step`) while strategies shape it: `model`
    is on the meta device and becomes fake tensors (shapes, no data) after every strategy has applied, so a
    strategy transforms it as for a probe, with a stand-in where the real layer cannot run on fake tensors
    (bitsandbytes' quantized layers), and sets what the step runs under. No spec: a simulation may run a
    model and batch alone."""

    spec: Any = None
    device_type: str = "cpu"  # the device the step is simulated on ("cpu", "cuda")
    adapted: frozenset[str] | None = None  # layers that adapters go on (paths inside a block); None: none added
    adapter_dropout: float = 0.0  # dropout on the adapters' inputs
    attention_dtype: torch.dtype = torch.bfloat16  # the 16-bit type a GPU's fused attention would compute in
    cast_whole: bool = False  # an engine casts the whole model to 16 bits (adapters made afterwards included)
    tie_weights: bool = True  # a weight two modules share is held once (one process without an engine)
    repeatable: bool = True  # the step's units repeat alike (`autofit.estimate.simulation.deepen` may read it deep)
    # Contexts entered around the forward and loss, each made from the step's counter (`counter.offloaded`:
    # bytes moved to host memory; `counter.kernels`: kernels launched), when the forward begins
    forward_contexts: list[Callable[[Any], contextlib.AbstractContextManager]] = dataclasses.field(
        default_factory=list)
    simulated: ClassVar[bool] = True

    @property
    def device(self) -> torch.device:
        """The device type the step is simulated on."""
        return torch.device(self.device_type)


def cast_floating(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)` for its floating-point parameters and buffers only. `Module.to` casts complex ones
    too (torch/nn/modules/module.py `to`, its `convert`: `dtype if t.is_floating_point() or t.is_complex()`),
    which to a real dtype discards their imaginary part: a Fourier layer's complex weights would train as
    something else. They stay as they are. Returns `model`."""
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def cast_inputs(module: nn.Module, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors among `module`'s forward arguments to `dtype` (a forward pre-hook;
    returns its handle): what autocast did for a model whose weights are now 16-bit, and what a model
    taking float inputs (pixels, audio features) needs to meet them."""
    return module.register_forward_pre_hook(functools.partial(_cast, dtype), with_kwargs=True)


def _cast(dtype: torch.dtype, _module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return tree_map(cast, args), tree_map(cast, kwargs)


def build_run(spec: TrainSpec, config: Config, strategies: Sequence[Any]) -> TrainRun:
    """A fresh model from the spec with every strategy's value from `config` applied, ready to train."""
    model = spec.model_factory()
    model.train()
    run = TrainRun(spec=spec, config=config, model=model)
    from autofit.strategies import in_order

    for strategy in in_order(strategies):
        strategy.apply(run)
    return run.ready()
