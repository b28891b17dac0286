"""Rung 1, mixed precision: bf16 autocast, or fp16 autocast + GradScaler where bf16 is unsupported.

Buys ~half the activation memory and faster matmuls; costs numerics (tier 1). Weights and optimizer
states stay fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from autofit.config import Precision as P
from autofit.spec.devices import bf16_support
from autofit.strategies.base import Option, Strategy


class Precision(Strategy):
    """fp32, bf16 autocast, fp16 autocast with loss scaling."""

    field = "precision"
    rung = 1

    def options(self, spec) -> list[Option]:
        bf16_ok, why = bf16_support(spec.device)
        return [
            Option(P.FP32.value, 0, "full precision, the baseline"),
            Option(P.BF16.value, 1, f"bf16 autocast ({why})", available=bf16_ok),
            Option(P.FP16.value, 1,
                   "fp16 autocast + GradScaler, bf16 being unsupported" if not bf16_ok
                   else "not needed: bf16 is supported and needs no loss scaling", available=not bf16_ok),
        ]

    def apply(self, run, value: Any) -> None:
        if value == P.BF16.value:
            run.autocast_dtype = torch.bfloat16
        elif value == P.FP16.value:
            run.autocast_dtype = torch.float16
            run.scaler = torch.amp.GradScaler(run.device.type)
