"""Rung 3, activation checkpointing: recompute blocks in backward instead of keeping their activations.

"every_k" checkpoints every k-th block (selective), "full" all blocks. Buys 50-70% of activation memory
at full; costs ~20-35% more compute (tier 0: same math). Hugging Face models use their own switch;
plain models (blocks in an nn.ModuleList / nn.Sequential) get `torch.utils.checkpoint` with
`use_reentrant=False` on the chosen blocks' forward.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch.utils.checkpoint
from torch import nn

from autofit.spec.model_info import find_blocks
from autofit.strategies.base import Option, Strategy

VALUES = ("none", "every_2", "full")


def every(value: str) -> int:
    """0 for "none", k for "every_k", 1 for "full"."""
    if value in ("none", "full"):
        return 0 if value == "none" else 1
    return int(value.removeprefix("every_"))


class Checkpointing(Strategy):
    """none, every 2nd block, all blocks."""

    field = "checkpointing"
    rung = 3

    def options(self, spec) -> list[Option]:
        info = spec.model
        available = info.num_blocks >= 2
        why_not = f"{info.name} has no repeated blocks (nn.ModuleList / nn.Sequential) to checkpoint"
        return [
            Option("none", 0, "keep all activations"),
            Option("every_2", 0, f"recompute every 2nd of {info.num_blocks} blocks" if info.num_blocks >= 3
                   else f"{info.num_blocks} blocks are too few for selective checkpointing",
                   available=info.num_blocks >= 3),
            Option("full", 0, f"recompute all {info.num_blocks} blocks" if available else why_not,
                   available=available),
        ]

    def saves_at_least(self, a: Any, b: Any) -> bool:
        return _share(a) >= _share(b)

    def apply(self, run, value: Any) -> None:
        if value != "none":
            enable(run.model, every(value))


def _share(value: str) -> float:
    k = every(value)
    return 1 / k if k else 0.0


def enable(model: nn.Module, k: int) -> None:
    """Checkpoint every k-th block of `model` (k=1: all), through Hugging Face's switch where it has one."""
    hf_switch = getattr(model, "activation_checkpointing_enable", None)
    if getattr(model, "supports_gradient_checkpointing", False) and hf_switch is not None \
            and "every_n_layers" in inspect.signature(hf_switch).parameters:
        hf_switch(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=k)
        return
    if k == 1 and getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    for index, block in enumerate(find_blocks(model)[1]):
        if index % k == 0 and "forward" not in vars(block):
            block.forward = _checkpointed(block.forward)


def disable(model: nn.Module) -> None:
    """Undo `enable`."""
    if hasattr(model, "gradient_checkpointing_disable") and getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    for block in find_blocks(model)[1]:
        vars(block).pop("forward", None)


def _checkpointed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
