"""LoRA's adapters as the simulation builds them: peft's two rank-r factors on each adapted linear layer,
in the dtype peft makes them, over a frozen base (`autofit.estimate.simulation.step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from autofit.config import Config
from autofit.strategies.lora import DEFAULT_RANK

if TYPE_CHECKING:
    from autofit.strategies.base import Strategy

# peft keeps LoRA's adapters in fp32 beside a 16-bit base (`get_peft_model(..., autocast_adapter_dtype=True)`,
# its default) and casts each input to their dtype; releases before that made them in the base's dtype (the
# calibration's fsdp_qlora runs, on PEFT 0.10, set this so: `bench/calibration/measured_code.py`)
PEFT_UPCASTS_ADAPTERS = True
ADAPTERS = ("lora_A", "lora_B")  # the parameters `add` makes, named as peft's modules
LORA_SCALING = 2.0  # peft's lora_alpha / r; any constant costs the same multiply


def add(model: nn.Module, adapted: frozenset[str], config: Config, half_weights: bool, dropout: float) -> None:
    """Give the layers `adapted` names (`is_adapted`) `config`'s rank of adapters: fp32 as peft makes them
    (`PEFT_UPCASTS_ADAPTERS`), or in the model's dtype where an engine casts the whole model
    (`half_weights` without pure bf16); with `dropout` on their inputs (`_add`)."""
    fp32 = PEFT_UPCASTS_ADAPTERS and (config.pure_bf16 or not half_weights)
    _add(model, adapted, config.lora or DEFAULT_RANK, dropout, torch.float32 if fp32 else None)


def freeze_all_but_adapters(model: nn.Module) -> None:
    """Freeze every parameter but the adapters `add` made."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.rpartition(".")[2] in ADAPTERS)


def _add(model: nn.Module, adapted: frozenset[str], rank: int, p: float,
                  dtype: torch.dtype | None) -> None:
    """Give each adapted layer peft's LoRA adapters (peft/tuners/lora/layer.py `Linear.forward`: `result +
    lora_B(lora_A(dropout(x))) * scaling`, cast back to the result's dtype): rank-`rank` factors in `dtype`
    (None: the layer's weight's), the input cast to it (`LoraLayer._cast_input_dtype`; bitsandbytes' 4-bit
    layer under autocast leaves it, peft/tuners/lora/bnb.py), with dropout `p` a dropped-out copy and its
    mask (`nn.functional.dropout`, as peft's `nn.Dropout` calls it). So the step keeps what peft's keeps:
    the adapters' inputs (an fp32 copy of a 16-bit input beside fp32 adapters), their matmuls' outputs under
    op-level checkpointing, and the adapters' own gradients and optimizer states. On the meta device,
    before the model is made of fake tensors."""
    from autofit.strategies.quantization import SimulatedLinear4bit

    def add(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if not (isinstance(module, SimulatedLinear4bit) and torch.is_autocast_enabled(x.device.type)):
            x = x.to(module.lora_A.dtype)
        x = nn.functional.dropout(x, p, True) if p else x
        # one expression, as peft's: the adapters' output is freed once scaled, not held through the sum
        return (out + nn.functional.linear(nn.functional.linear(x, module.lora_A), module.lora_B)
                * LORA_SCALING).to(out.dtype)

    for module in _adapted_layers(model, adapted):
        n_in, n_out = _features(module)
        made = dtype or module.weight.dtype
        module.lora_A = nn.Parameter(torch.empty(rank, n_in, dtype=made, device="meta"))
        module.lora_B = nn.Parameter(torch.empty(n_out, rank, dtype=made, device="meta"))
        module.register_forward_hook(add)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer: nn.Linear's and `SimulatedLinear4bit`'s attributes, a
    transformers Conv1D's (in, out) weight."""
    if hasattr(module, "in_features"):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)


def _adapted_layers(model: nn.Module, adapted: frozenset[str]) -> list[nn.Module]:
    """The linear layers (nn.Linear, transformers' Conv1D, a quantized layer simulated) `is_adapted` names."""
    from autofit.strategies.quantization import SimulatedLinear4bit  # SimulatedLinear8bit is one too

    return [module for name, module in model.named_modules() if is_adapted(name, adapted)
            and (isinstance(module, (nn.Linear, SimulatedLinear4bit)) or type(module).__name__ == "Conv1D")]


def within_block(name: str) -> str:
    """A layer's name as `is_adapted` reads it: its path inside its repeated block ('model.layers.5.self_attn.q_proj'
    -> 'self_attn.q_proj'), so that it names the same layer in a model rebuilt with fewer blocks; a name
    outside the blocks (no index in it) whole."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return name if index is None else ".".join(parts[index + 1:])


def is_adapted(name: str, adapted: frozenset[str]) -> bool:
    """Whether the module `name` is one of `adapted` (`within_block` names), matched as peft matches a target
    module: the whole name or a suffix after a dot. A wrapper's generic name ('attn.linear' beside
    'mlp.fc.linear') stays distinct."""
    return any(name == target or name.endswith("." + target) for target in adapted)


def block_linears(model: nn.Module) -> list[str]:
    """Names of the linear layers inside the model's repeated blocks (LoRA's default without a strategy)."""
    from autofit.models.info import find_blocks

    path, blocks = find_blocks(model)
    return [name for block in blocks for name, m in block.named_modules() if isinstance(m, nn.Linear)
            or type(m).__name__ == "Conv1D"]


def planned_dropout(strategies: Sequence["Strategy"]) -> float:
    """The planned LoRA strategy's adapter dropout (0 without one)."""
    from autofit.strategies.lora import Lora

    return next((s.dropout for s in strategies if isinstance(s, Lora)), 0.0)


def planned_targets(model: nn.Module, strategies: Sequence["Strategy"]) -> list[str] | None:
    """The linear layers the planned LoRA strategy adapts (its `target_modules`), or None without one."""
    from autofit.strategies.lora import Lora

    lora = next((s for s in strategies if isinstance(s, Lora)), None)
    return lora.targets(model) if lora is not None else None
