"""Which layers the simulation gives LoRA's adapters (`autofit.strategies.lora` builds them as peft does, on
the meta device, when it shapes a simulated step): the planned strategy's targets, named by their paths inside
a repeated block so that they name the same layers in a model rebuilt with fewer blocks
(`autofit.estimate.simulation.step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

from autofit.strategies.lora import is_adapted  # noqa: F401 (re-exported: how a simulated layer is matched)

if TYPE_CHECKING:
    from autofit.strategies.base import Strategy


def within_block(name: str) -> str:
    """A layer's name as `is_adapted` reads it: its path inside its repeated block ('model.layers.5.self_attn.q_proj'
    -> 'self_attn.q_proj'), so that it names the same layer in a model rebuilt with fewer blocks; a name
    outside the blocks (no index in it) whole."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return name if index is None else ".".join(parts[index + 1:])


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
