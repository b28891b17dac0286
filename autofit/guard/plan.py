"""The OOM guard and a tuned plan: the plan's knobs are applied to the model the guard is given, or
checked there, so the configuration the guard starts from (and logs) is the one the model runs.

Every strategy applies its knob to the live model with its own code (`autofit.prepare.apply_in_place`, a
live `TrainRun`): what a live model takes in place is applied (precision: the guard's autocast and fp16
scaler; the attention implementation; checkpointing), what it cannot is checked against what the guard was
given (the optimizer's class, LoRA / quantized base weights, which `autofit.prepare` builds, and an engine:
the guard runs plain torch or DDP steps), each mismatch a `UsageError` naming the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autofit.config import Config
from autofit.errors import UsageError
from autofit.guard.sync import unwrap
from autofit.prepare import apply_in_place
from autofit.strategies import completed


def apply_plan(config: Config, model: nn.Module, optimizer: Any, autocast_dtype: torch.dtype | None, scaler: Any,
               running_precision: Any = None) -> tuple[torch.dtype | None, Any]:
    """Apply `config`'s in-place knobs to `model` and check the rest; returns the guard's autocast dtype
    and scaler. `running_precision`: the precision a framework that runs the forward itself uses
    (accelerate, the Trainer), checked against the plan's instead of applied."""
    run = apply_in_place(config, unwrap(model), optimizer)
    for strategy in completed():  # `Strategy.running_differs`: a framework's own precision is checked, not applied
        differs = strategy.running_differs(config, running_precision, autocast_dtype, run.autocast_dtype)
        if differs:
            raise UsageError(differs)
    if running_precision is not None:
        return autocast_dtype, scaler
    return run.autocast_dtype, scaler if scaler is not None else run.scaler
