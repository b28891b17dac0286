"""Rung 2, fused attention: SDPA (or flash-attention) instead of eager attention, where the model can switch.

Buys attention memory O(n) instead of O(n^2) in sequence length; costs nothing (tier 0). Only Hugging
Face models expose the switch (`attn_implementation`); other models keep their own attention.
Flash-attention runs in fp16/bf16 only (the rule table excludes it with fp32), on Ampere or later GPUs.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from torch import nn

from autofit.config import Attention as A
from autofit.config import Config
from autofit.errors import UsageError
from autofit.strategies.base import Option, Rule, Strategy

if TYPE_CHECKING:
    from autofit.job.target import Target
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.run import TrainRun


class FusedAttention(Strategy):
    """Hugging Face `attn_implementation`: sdpa, flash_attention_2, or eager when nothing fused is supported."""

    field = "attention"
    rung = 2
    order = 0
    activation_knobs = ("attention",)

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

    def rules(self) -> tuple[Rule, ...]:
        return (Rule("flash-attention needs half precision", ("attention", "precision"), _flash_needs_half),)

    def apply(self, run: "TrainRun") -> None:
        value = run.config.attention
        if run.simulated:
            if value is not A.DEFAULT and hasattr(run.model, "set_attn_implementation"):
                # flash-attention has no CPU kernel; SDPA's memory is the same O(n)
                run.model.set_attn_implementation(implementations(run.model, fused_stand_in(run.model)
                                                                  if value.fused else value.value))
            return
        if value is not A.DEFAULT:
            if _runs_already(run.model, value.value):
                return
            if not hasattr(run.model, "set_attn_implementation"):
                _no_switch(run.model, value.value)
                raise UsageError(f"The plan runs attn_implementation={value.value!r}, a Hugging Face model's switch, "
                                 f"but {type(run.model).__name__} is not a Hugging Face model: apply the plan to the "
                                 "model it was tuned for, or tune this one.")
            own_config(run.model)
            run.model.set_attn_implementation(implementations(run.model, value.value))


    def fuses_attention(self, config: Config) -> bool:
        return config.attention.fused

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        # every fused attention is simulated as SDPA (`fused_stand_in`)
        return {"attention": "fused" if config.attention.fused else config.attention.value}

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        value = config.attention
        if value is A.DEFAULT or fmt != "trainer":  # autofit.prepare switches it for the other formats
            return []
        return [f'# Build the model with attn_implementation="{value}" '
                f'(e.g. AutoModelForCausalLM.from_config(config, attn_implementation="{value}")).']


def _runs_already(model: Any, value: str) -> bool:
    """Whether a transformers model without `set_attn_implementation` (4.46 has none) already runs `value`:
    it picked it when built (SDPA, where supported), so there is nothing to switch."""
    config = getattr(model, "config", None)
    return not hasattr(model, "set_attn_implementation") and getattr(config, "_attn_implementation", None) == value


def _no_switch(model: Any, value: str) -> None:
    """The one-line refusal where a transformers model built with another attention cannot be switched."""
    import transformers

    built = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if built is not None:
        raise UsageError(f"The plan runs attn_implementation={value!r} but {type(model).__name__} was built with "
                         f"{built!r}, and transformers {transformers.__version__} cannot switch a built model "
                         "(set_attn_implementation: 4.57 has it): build it with "
                         f"attn_implementation={value!r}, or upgrade transformers.")


SUPPORT_FLAGS = {"sdpa": ("_supports_sdpa",), "flash_attention_2": ("_supports_flash_attn", "_supports_flash_attn_2")}


def implementations(model: Any, value: str) -> str | dict[str, Any]:
    """What `set_attn_implementation` takes to run `value` wherever the model can: `value` itself, or, where
    a sub-model cannot run it (DETR's ResNet backbone has no attention, so no SDPA: transformers raises for
    it), a dict by sub-config (transformers' format) keeping such a sub-model's own implementation."""
    kept = _kept(model, model.config, value)
    return {"": value, **kept} if kept else value


def _kept(model: Any, config: Any, value: str) -> dict[str, Any]:
    """{sub-config key: its current implementation, or a nested dict} for the sub-models under `config`
    that cannot run `value`."""
    kept: dict[str, Any] = {}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is None:
            continue
        owners = [m for m in model.modules() if getattr(m, "config", None) is sub and hasattr(m, "_supports_sdpa")]
        if owners and not all(_supports(owner, value) for owner in owners):
            kept[key] = sub._attn_implementation
        elif nested := _kept(model, sub, value):
            kept[key] = {"": value, **nested}
    return kept


def _supports(model: Any, value: str) -> bool:
    """Whether `model` can run `value`: eager always, SDPA and flash-attention by the model's flags, an
    implementation registered by name (the simulation's stand-in) as transformers checks it, not at all."""
    if value not in SUPPORT_FLAGS:
        return True
    return any(getattr(model, flag, False) for flag in SUPPORT_FLAGS[value])


def own_config(model: Any) -> None:
    """Give `model` a private copy of its config: a factory may build every model on one config object
    (the user's), and switching attention writes to it. A sub-model keeps the copy of its own sub-config
    (transformers finds a sub-model's implementation by its config's identity)."""
    copies: dict[int, Any] = {}  # deepcopy's memo: id(original) -> copy, the sub-configs (a backbone's) too
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) in copies:
            module.config = copies[id(config)]


def _flash_needs_half(c: Config, t: "Target") -> str | None:
    """The rule: flash-attention where no strategy makes the forward compute in 16 bits (`compute_dtype`)."""
    from autofit.strategies import completed

    if c.attention is A.FLASH_ATTENTION_2 and all(s.compute_dtype(c) is None for s in completed()):
        return "flash-attention kernels run in fp16/bf16 only, not fp32"
    return None


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


FUSED_STAND_IN = "autofit_fused_memory"  # SDPA under a name of its own, soft-capping dropped: memory only


def fused_stand_in(model: nn.Module) -> str:
    """The attention implementation a fused kernel (flash-attention, SDPA) is simulated with: SDPA, whose
    fused kernels keep what flash-attention keeps (the output and its log-sum-exp). A model that refuses
    SDPA for what only flash-attention's kernels do (Gemma-2's soft-capped attention scores:
    `_supports_sdpa = False`, and transformers' SDPA raises on `softcap`) gets SDPA registered under
    `FUSED_STAND_IN`, which drops the soft-capping: the memory is the fused kernel's, the numbers are
    not (fake tensors hold none)."""
    if getattr(type(model), "_supports_sdpa", True):
        return "sdpa"
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def fused(module: nn.Module, *args: Any, softcap: Any = None, **kwargs: Any) -> Any:
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register(FUSED_STAND_IN, fused)
    AttentionMaskInterface.register(FUSED_STAND_IN, sdpa_mask)
    return FUSED_STAND_IN
