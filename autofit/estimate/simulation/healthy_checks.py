"""A model's own checks for overflow read as a healthy step's while a step is simulated.

Some models look at their activations while training and clamp them where they overflowed (DETR and its
kin, RT-DETR, Deformable and Conditional DETR, Grounding DINO, Table Transformer, ...: `if not
torch.isfinite(hidden_states).all(): hidden_states = torch.clamp(...)`, transformers' modeling_detr.py
`DetrEncoderLayer.forward`). Such a check's truth value is data, and fake tensors hold none: it raises
`DataDependentOutputException`. Under `healthy_checks()` it reads as a healthy step's, finite
everywhere (`isfinite(x).all()` true, `isinf(x).any()` and `isnan(x).any()` false), so the clamp is
skipped as in a step without overflow; the boolean tensors the check makes are still counted.

transformers checks its inputs the same way (`torch_compilable_check`: a vision-language model's image
placeholders against its image features, `n_image_tokens * width == features.numel()`, LLaVA's
`get_placeholder_mask`); `transformers_checks_off()` switches those off while a step is simulated, by
transformers' own switch (`TRANSFORMERS_DISABLE_TORCH_CHECK=1`). The synthesized batch is built to pass
them, and a probe's real step runs them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

CHECKS = {"isfinite": ("all", True), "isinf": ("any", False), "isnan": ("any", False)}  # check: (reduction, healthy)
_CHECK, _HEALTHY = "_autofit_check", "_autofit_healthy"


class healthy_checks(TorchFunctionMode):  # noqa: N801 - used as a context manager, as torch's modes are
    """While active, `isfinite(x).all()`, `isinf(x).any()` and `isnan(x).any()` read as a healthy step's
    when their truth value is asked for (`bool`, `if`, `.item()`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("__bool__", "item") and args and hasattr(args[0], _HEALTHY):
            return getattr(args[0], _HEALTHY)
        out = func(*args, **(kwargs or {}))
        if name in CHECKS and isinstance(out, torch.Tensor):
            setattr(out, _CHECK, CHECKS[name])
        elif name in ("all", "any") and args and getattr(args[0], _CHECK, ("",))[0] == name:
            setattr(out, _HEALTHY, getattr(args[0], _CHECK)[1])
        return out


TRANSFORMERS_CHECKS = "TRANSFORMERS_DISABLE_TORCH_CHECK"  # transformers/utils/import_utils.py torch_compilable_check


@contextlib.contextmanager
def transformers_checks_off() -> Iterator[None]:
    """transformers' `torch_compilable_check`s skipped (its documented switch), the variable restored after."""
    before = os.environ.get(TRANSFORMERS_CHECKS)
    os.environ[TRANSFORMERS_CHECKS] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TRANSFORMERS_CHECKS, None)
        else:
            os.environ[TRANSFORMERS_CHECKS] = before
