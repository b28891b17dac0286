"""Rung 2, fused attention: SDPA (or flash-attention) instead of eager attention, where the model can switch.

Buys attention memory O(n) instead of O(n^2) in sequence length; costs nothing (tier 0). Only Hugging
Face models expose the switch (`attn_implementation`); other models keep their own attention.
Flash-attention runs in fp16/bf16 only (the rule table excludes it with fp32), on Ampere or later GPUs.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from autofit.config import Attention as A
from autofit.errors import UsageError
from autofit.strategies.base import Option, Strategy

if TYPE_CHECKING:
    from autofit.spec.train import TrainSpec
    from autofit.probe.step import TrainRun


class Attention(Strategy):
    """Hugging Face `attn_implementation`: sdpa, flash_attention_2, or eager when nothing fused is supported."""

    field = "attention"
    rung = 2

    def options(self, spec: "TrainSpec") -> list[Option]:
        if not spec.model.is_hf:
            return [Option(A.DEFAULT, 0, f"{spec.model.name} is not a Hugging Face model: its own attention is kept")]
        if not spec.model.has_attention:
            return [Option(A.DEFAULT, 0, f"{spec.model.name} has no attention layers to switch")]
        sdpa = "sdpa" in spec.model.attention
        flash_ok, flash_why = _flash_available(spec)
        return [
            Option(A.SDPA, 0, "fused scaled-dot-product attention" if sdpa
                   else f"{spec.model.name} does not support SDPA", available=sdpa),
            Option(A.FLASH_ATTENTION_2, 0, flash_why, available=flash_ok),
            Option(A.EAGER, 0, "eager attention: the model supports nothing fused" if not sdpa
                   else "not needed: SDPA is supported", available=not sdpa),
        ]

    def apply(self, run: "TrainRun") -> None:
        value = run.config.attention
        if value is not A.DEFAULT:
            if not hasattr(run.model, "set_attn_implementation"):
                raise UsageError(f"The plan runs attn_implementation={value.value!r}, a Hugging Face model's switch, "
                                 f"but {type(run.model).__name__} is not a Hugging Face model: apply the plan to the "
                                 "model it was tuned for, or tune this one.")
            own_config(run.model)
            run.model.set_attn_implementation(value.value)


def own_config(model: Any) -> None:
    """Give `model` a private copy of its config: a factory may build every model on one config object
    (the user's), and switching attention writes to it."""
    shared = model.config
    private = copy.deepcopy(shared)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = private


def _flash_available(spec: "TrainSpec") -> tuple[bool, str]:
    if "flash_attention_2" not in spec.model.attention:
        return False, f"{spec.model.name} does not support flash-attention"
    if not spec.target.cuda:
        return False, "flash-attention needs CUDA"
    if not spec.target.bf16:  # the GPU's compute capability is under 8.0 (`Target.bf16`)
        return False, (f"flash-attention 2 runs on Ampere or later GPUs (compute capability 8.0+, flash-attn's "
                       f"README); {spec.target.name} is older: SDPA instead")
    if not spec.target.has("flash_attn"):
        return False, "flash-attention is not installed: pip install flash-attn"
    if spec.target.live and not _transformers_can_use_flash():
        return False, ("transformers cannot use the installed flash_attn (is_flash_attn_2_available() is False: the "
                       "flash-attn distribution >= 2.3.3 and CUDA are needed): pip install -U flash-attn")
    return True, "flash-attention 2 kernels (fp16/bf16 only: the rule table excludes fp32)"


def _transformers_can_use_flash() -> bool:
    """transformers' own check (utils/import_utils.py `is_flash_attn_2_available`): the `flash-attn`
    distribution at >= 2.3.3 and CUDA. A module named flash_attn alone (a broken install, or flash-attn 4)
    passes `find_spec` but not this."""
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())
