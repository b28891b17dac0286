"""Rung 1, pure bf16: weights, gradients and optimizer states in bf16, no autocast and no fp32 copy.

Mixed precision (the `precision` strategy's bf16) keeps fp32 weights (4 bytes), fp32 gradients (4) and
fp32 AdamW moments (8): 16 bytes per parameter. Pure bf16 keeps 2 + 2 + 4 = 8, and computes in bf16
without casting the weights in every forward. Costs update precision (tier 1): a bf16 weight cannot
absorb an update smaller than ~1/256 of itself, which slows late training at small learning rates.

Which optimizer: torch's own AdamW over the bf16 parameters (its moments follow the parameter dtype),
as torchtune and litgpt train "bf16-true". The numerically safer variants -- torchao's AdamW with
bf16 stochastic rounding, or Kahan-compensated bf16 -- are not searched here: torchao's optimizers
compile their step with `torch.compile` (minutes of compilation per probe on a CPU, and a C++
toolchain), and they change the optimizer rather than the precision; see docs/new-rungs.md.

Plain models get their floating-point inputs cast to bf16 by a forward pre-hook (autocast did that).
A tensor the model makes in fp32 inside its forward (a sinusoidal embedding from `torch.arange`, a float
buffer re-made each step) then meets bf16 weights, which autocast would have cast: the probe's error says
so and what to change (`PureBf16.explain`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autofit.config import Config, Precision as P
from autofit.errors import UsageError
from autofit.strategies.base import EngineInputs, Option, Strategy, mixes_dtypes
from autofit.strategies.run import cast_floating, cast_inputs  # noqa: F401 (the casts live with the run)

if TYPE_CHECKING:
    from autofit.strategies.run import TrainRun
    from autofit.job.train_spec import TrainSpec


class PureBf16(Strategy):
    """fp32 (the baseline, shared with the precision strategy), pure bf16."""

    field = "precision"
    rung = 1
    order = 1

    def options(self, spec: "TrainSpec") -> list[Option]:
        target = spec.target
        return [Option(P.FP32, 0, "full precision, the baseline"),
                Option(P.PURE_BF16, 1, "pure bf16: weights, gradients and AdamW states in bf16 (8 bytes per "
                       "parameter instead of 16)" if target.bf16 else f"pure bf16 needs native bf16 "
                       f"({target.bf16_reason})", available=target.bf16, degree=2)]

    def apply(self, run: "TrainRun") -> None:
        # a live model keeps its weights (the guard trains what it is given); a simulated one casts as a probe's
        if run.config.pure_bf16 and not run.live:
            enable(run.model)  # bf16 weights, and the inputs cast as the probe casts them

    def compute_dtype(self, config: Config) -> torch.dtype | None:
        return torch.bfloat16 if config.pure_bf16 else None

    def half_gradients(self, config: Config) -> bool:
        return config.pure_bf16

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        # 16-bit weights without autocast: the step an engine's bf16 mode simulates too
        return {"weights16": True} if config.pure_bf16 else {}

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if not config.pure_bf16:
            return []
        return ["from autofit.strategies.pure_bf16 import enable as pure_bf16",
                "pure_bf16(model)  # bf16 weights and inputs; build the optimizer afterwards (bf16 states)"]

    def refuses(self, config: Config, fmt: str) -> str | None:
        if config.pure_bf16 and fmt == "deepspeed":
            return ("DeepSpeed's bf16 mode keeps fp32 master weights; the plan trains pure bf16 weights with "
                    "torch's optimizer: export trainer or torchrun instead")
        return None

    def deepspeed_keys(self, config: Config, inputs: EngineInputs) -> dict[str, Any]:
        """None: DeepSpeed has no pure bf16 mode (its bf16 keeps fp32 master weights); refused, as the
        search's rule and the deepspeed format refuse it."""
        if config.pure_bf16:
            raise UsageError("precision='pure_bf16' trains bf16 weights with torch's optimizer; DeepSpeed's bf16 mode "
                             "keeps fp32 master weights: use precision='bf16' with ZeRO, or pure bf16 without it.")
        return {}

    def explain(self, config: Config, exc: BaseException) -> str:
        if not (config.pure_bf16 and mixes_dtypes(exc)):
            return ""
        return ("; pure bf16 runs with no autocast to cast for it: a tensor your forward makes in fp32 "
                "(torch.arange, torch.exp, a float constant or buffer) meets the bf16 weights. Cast it to "
                "theirs (`.to(x.dtype)`) for pure bf16 to be a candidate; the other precisions are unaffected")



def enable(model: nn.Module) -> nn.Module:
    """Cast `model`'s parameters and buffers to bf16 and its floating-point inputs too (a forward
    pre-hook); build the optimizer afterwards so its states are bf16 as well. Returns `model`."""
    cast_floating(model, torch.bfloat16)
    cast_inputs(model, torch.bfloat16)
    return model
