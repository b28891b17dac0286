"""The OOM guard and a tuned plan: the plan's knobs are applied to the model the guard is given, or
checked there, so the configuration the guard starts from (and logs) is the one the model runs.

Applied on the live model with the strategies' own code (`autofit.prepare.apply_in_place`): precision
(the guard's autocast and fp16 scaler), attention implementation, checkpointing. Checked, because a live
model and optimizer cannot take them in place: the optimizer's class, LoRA / quantized base weights
(`autofit.prepare` builds those), and the engine (the guard runs plain torch or DDP steps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autofit.config import Config, Engine, Optimizer, Precision
from autofit.errors import UsageError
from autofit.guard.sync import unwrap
from autofit.prepare import OPTIMIZER_CLASSES, apply_in_place

PREPARE_FIRST = ("build them with autofit.prepare(plan, model, optimizer) and guard prepared.model and "
                 "prepared.optimizer")


def apply_plan(config: Config, model: nn.Module, optimizer: Any, autocast_dtype: torch.dtype | None, scaler: Any,
               running_precision: Any = None) -> tuple[torch.dtype | None, Any]:
    """Apply `config`'s in-place knobs to `model` and check the rest; returns the guard's autocast dtype
    and scaler. `running_precision`: the precision a framework that runs the forward itself uses
    (accelerate, the Trainer), checked against the plan's instead of applied."""
    _check_engine(config)
    _check_adapters(config, model)
    _check_optimizer(config, optimizer)
    if running_precision is not None:
        running = Precision.parse(running_precision, "precision")
        if running is not config.precision:
            raise UsageError(f"The plan was measured in {config.precision.value} but this job runs "
                             f"{running.value}; launch with the plan's mixed precision (accelerate's "
                             f"mixed_precision / the Trainer's bf16/fp16) or tune again for {running.value}.")
        apply_in_place(config, unwrap(model), precision=False)
        return autocast_dtype, scaler
    run = apply_in_place(config, unwrap(model))
    if autocast_dtype is not None and autocast_dtype != run.autocast_dtype:
        raise UsageError(f"autocast_dtype={autocast_dtype} disagrees with the plan's precision "
                         f"{config.precision.value}; leave autocast_dtype out (the plan sets it) or tune again.")
    return run.autocast_dtype, scaler if scaler is not None else run.scaler


def _check_engine(config: Config) -> None:
    if config.engine is not Engine.TORCH or config.offloads:
        raise UsageError(f"The plan trains through {config.engine.value} ({config.describe()}); the OOM guard runs "
                         "plain torch or DDP steps. Train that plan with autofit.prepare (bash launch/torchrun.sh), "
                         "or tune again without sharding for the guard.")


def _check_adapters(config: Config, model: nn.Module) -> None:
    has = hasattr(unwrap(model), "peft_config")
    if config.adapters and not has:
        raise UsageError(f"The plan trains LoRA adapters ({config.describe()}) but the model has none; "
                         f"{PREPARE_FIRST}.")
    if has and not config.adapters:
        raise UsageError("The model carries LoRA adapters but the plan trains every weight; give the guard the plan "
                         "it was tuned with.")


def _check_optimizer(config: Config, optimizer: Any) -> None:
    if optimizer is None or config.optimizer is Optimizer.USER:
        return
    expected, given = OPTIMIZER_CLASSES[config.optimizer], type(optimizer).__name__
    if given != expected:
        raise UsageError(f"The plan's memory was measured with {expected} (optimizer={config.optimizer.value!r}) but "
                         f"the guard was given {given}; pass a {expected}, {PREPARE_FIRST}, or tune again with "
                         f"optimizer={given!r}.")
