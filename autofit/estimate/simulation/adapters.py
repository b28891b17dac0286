"""Which layers the simulation gives adapters (a strategy's `adapted_layers`, LoRA's, which builds them as peft
does on the meta device when it shapes a simulated step): the planned strategies' targets, named by their paths
inside a repeated block so that they name the same layers in a model rebuilt with fewer blocks
(`autofit.estimate.simulation.step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

if TYPE_CHECKING:
    from autofit.strategies.base import Strategy


def within_block(name: str) -> str:
    """A layer's name as a simulated strategy matches it: its path inside its repeated block
    ('model.layers.5.self_attn.q_proj' -> 'self_attn.q_proj'), so that it names the same layer in a model
    rebuilt with fewer blocks; a name outside the blocks (no index in it) whole."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return name if index is None else ".".join(parts[index + 1:])


def block_linears(model: nn.Module) -> list[str]:
    """Names of the linear layers inside the model's repeated blocks (the adapted layers without a strategy
    that names them)."""
    from autofit.models.info import find_blocks

    path, blocks = find_blocks(model)
    return [name for block in blocks for name, m in block.named_modules() if isinstance(m, nn.Linear)
            or type(m).__name__ == "Conv1D"]


def planned_dropout(strategies: Sequence["Strategy"]) -> float:
    """The adapters' dropout of the first planned strategy that adds adapters (`Strategy.adapter_dropout`;
    0 without one)."""
    return next((p for s in strategies if (p := s.adapter_dropout()) is not None), 0.0)


def planned_targets(model: nn.Module, strategies: Sequence["Strategy"]) -> list[str] | None:
    """The layers the first planned strategy that adds adapters adapts (`Strategy.adapted_layers`: LoRA's
    `target_modules`), or None without one."""
    return next((t for s in strategies if (t := s.adapted_layers(model)) is not None), None)
