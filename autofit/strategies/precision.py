"""Rung 1, mixed precision: bf16 autocast, or fp16 autocast + GradScaler where bf16 is not native.

Buys ~half the activation memory and faster matmuls; costs numerics (tier 1). Weights and optimizer
states stay fp32.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import Config, Precision as P
from autofit.strategies.base import EngineInputs, Option, Strategy, mixes_dtypes

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.run import TrainRun

DTYPES = {P.BF16: torch.bfloat16, P.FP16: torch.float16}
ACCELERATE = {P.FP32: "no", P.BF16: "bf16", P.FP16: "fp16"}  # accelerate's `mixed_precision`
# precision -> DeepSpeed's section. fp16 uses dynamic loss scaling (loss_scale 0), as GradScaler does.
DEEPSPEED = {P.BF16: {"bf16": {"enabled": True}},
             P.FP16: {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}}


class MixedPrecision(Strategy):
    """fp32, bf16 autocast, fp16 autocast with loss scaling."""

    field = "precision"
    rung = 1
    order = 0

    def options(self, spec: "TrainSpec") -> list[Option]:
        target = spec.target
        return [
            Option(P.FP32, 0, "full precision, the baseline"),
            Option(P.BF16, 1, f"bf16 autocast ({target.bf16_reason})", available=target.bf16),
            Option(P.FP16, 1,
                   "fp16 autocast + GradScaler, bf16 not being native" if not target.bf16
                   else "not needed: bf16 is native and needs no loss scaling", available=not target.bf16),
        ]

    def apply(self, run: "TrainRun") -> None:
        precision = run.config.precision
        if run.simulated:
            # CPU autocast stands in for fp16 with bf16 (the same size); CUDA's fused attention runs in fp16
            if precision in DTYPES:
                run.autocast_dtype = torch.float16 if precision is P.FP16 and run.device.type == "cuda" \
                    else torch.bfloat16
                run.attention_dtype = DTYPES[precision]
            return
        run.autocast_dtype = DTYPES.get(precision)
        if precision is P.FP16:
            run.scaler = torch.amp.GradScaler(run.device.type)

    def running_differs(self, config: Config, running_precision: Any, autocast_dtype: torch.dtype | None,
                        planned_dtype: torch.dtype | None) -> str | None:
        if running_precision is not None:  # the framework's autocast runs, not the guard's
            running = P.parse(running_precision, "precision")
            if running is config.precision:
                return None
            return (f"The plan was measured in {config.precision.value} but this job runs {running.value}; launch "
                    "with the plan's mixed precision (accelerate's mixed_precision / the Trainer's bf16/fp16) or "
                    f"tune again for {running.value}.")
        if autocast_dtype is not None and autocast_dtype != planned_dtype:
            return (f"autocast_dtype={autocast_dtype} disagrees with the plan's precision {config.precision.value}; "
                    "leave autocast_dtype out (the plan sets it) or tune again.")
        return None

    def compute_dtype(self, config: Config) -> torch.dtype | None:
        return DTYPES.get(config.precision)

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        # autocast to fp16 and to bf16 cast the same ops to types of the same size (one list per device,
        # AT_FORALL_LOWER_PRECISION_FP in aten/src/ATen/autocast_mode.h): one simulation serves both
        return {"half": config.half_precision}

    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        if fmt == "trainer":
            return {"bf16": config.precision is P.BF16, "fp16": config.precision is P.FP16}
        if fmt == "accelerate":  # pure bf16 casts in the script: no mixed precision
            return {"mixed_precision": ACCELERATE.get(config.precision, "no")}
        return {}

    def deepspeed_keys(self, config: Config, inputs: EngineInputs) -> dict[str, Any]:
        """DeepSpeed's bf16 or fp16 mode (16-bit weights and gradients, fp32 master weights); none in fp32.
        A copy: callers may edit theirs."""
        return copy.deepcopy(DEEPSPEED.get(config.precision, {}))

    def explain(self, config: Config, exc: BaseException) -> str:
        if config.precision not in DTYPES or not mixes_dtypes(exc):
            return ""
        half = config.precision.value
        return (f"; under {half} autocast, matmuls and convolutions return {half} while a tensor your code makes "
                "(torch.zeros_like of an fp32 input, a buffer) stays fp32, and an op taking one dtype (index_add_, "
                "copy_, an in-place update) fails where they meet: make it in the result's dtype "
                f"(torch.zeros_like(x, dtype=y.dtype)) or cast (.to(y.dtype)) for {half} to be a candidate")
