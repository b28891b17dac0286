"""Tiny models and batches shared by the tests (module-level, so they pickle into child processes)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A residual MLP block: activations grow with the batch, parameters with the width."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class BlockMLP(nn.Module):
    """A plain model with repeated blocks in an nn.ModuleList; forward(x) returns logits."""

    def __init__(self, width: int = 64, depth: int = 4, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_mlp() -> BlockMLP:
    """Model factory: seeded, so every build has the same weights."""
    torch.manual_seed(0)
    return BlockMLP()


def make_mlp_batch(n: int, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) with 32 tokens per sample, so activations dominate memory."""
    gen = torch.Generator().manual_seed(n)
    return torch.randn(n, 32, width, generator=gen), torch.randint(0, 10, (n, 32), generator=gen)


def mlp_loss(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the logits against the batch's targets."""
    return nn.functional.cross_entropy(output.flatten(0, 1), batch[1].flatten())


class WideMlp(nn.Module):
    """Two linear layers 512 -> 2048 -> 512 with a GELU: transients large beside its weights, for the
    allocator tests (batches of `torch.randn(n, 300, 512)`)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))

    def forward(self, x):
        return self.layers(x)


def make_gpt2():
    """A ~0.2M-parameter GPT-2 with random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=256, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def long_gpt2():
    """A GPT-2 whose activations dominate at 4096 tokens over 8 blocks (the CUDA tests' tight budgets)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=256, n_head=4, vocab_size=1024, n_positions=4096,
                                      bos_token_id=0, eos_token_id=0))


class LinearBlocks(nn.Module):
    """`depth` blocks of Linear(width, width) + ReLU in an nn.ModuleList; forward(x) returns a scalar loss.
    Subclass it with a no-argument constructor where a factory must pickle into rank processes."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class WideBlocks(LinearBlocks):
    """Model states dominate: 4 x 512^2 weights, with `thin_batch` a thin batch."""

    def __init__(self):
        super().__init__(512, 4)


def thin_batch(n):
    return torch.randn(n, 512, generator=torch.Generator().manual_seed(n))


def run_ranks(spec, config, strategies, timeout=600.0, step_limit=None):
    """Probe `config` on `config.num_gpus` launched ranks (plain data parallelism where no engine shards)."""
    from autofit.probe.launch import launch
    from autofit.strategies import DataParallel, Placement

    return launch(spec, config, [*strategies, DataParallel()], Placement.RANKS, timeout, step_limit)
