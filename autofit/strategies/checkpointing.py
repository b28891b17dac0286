"""Rung 3, activation checkpointing: recompute blocks in backward instead of keeping their activations.

"every_k" checkpoints every k-th block (selective), "full" all blocks. Buys 50-70% of activation memory
at full; costs ~20-35% more compute (tier 0: same math). Hugging Face models use their own switch;
plain models (blocks in an nn.ModuleList / nn.Sequential) get `torch.utils.checkpoint` with
`use_reentrant=False` on the chosen blocks' forward.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch.utils.checkpoint
from torch import nn

from autofit.config import Checkpointing as C
from autofit.config import Config
from autofit.spec.model_info import find_blocks
from autofit.strategies.base import Option, Strategy

if TYPE_CHECKING:
    from autofit.spec.train import TrainSpec
    from autofit.probe.step import TrainRun

EVERY = (2,)  # selective frequencies offered: every k-th block


class Checkpointing(Strategy):
    """none, every k-th block, all blocks."""

    field = "checkpointing"
    rung = 3

    def options(self, spec: "TrainSpec") -> list[Option]:
        blocks = spec.model.num_blocks
        why_not = f"{spec.model.name} has no repeated blocks (nn.ModuleList / nn.Sequential) to checkpoint"
        selective = [Option(C.EVERY_K, 0, f"recompute every {k}th of {blocks} blocks" if blocks > k
                            else f"{blocks} blocks are too few to checkpoint every {k}th",
                            available=blocks > k, also=(("checkpoint_every", k),)) for k in EVERY]
        return [Option(C.NONE, 0, "keep all activations"), *selective,
                Option(C.FULL, 0, f"recompute all {blocks} blocks" if blocks >= 2 else why_not,
                       available=blocks >= 2)]

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return a.checkpointed_share >= b.checkpointed_share

    def apply(self, run: "TrainRun") -> None:
        config = run.config
        if config.checkpointing is not C.NONE:
            enable(run.model, config.checkpoint_every)


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
