"""A plain image classifier with `(images, labels)` batches: not a Hugging Face model, no `.loss` output.

`make()` returns what `autofit tune --model examples/classifier.py:make` needs for such a model: the
model, `make_batch(n)` and `loss_fn(output, batch)`. The pieces are importable on their own.

    autofit tune --model examples/classifier.py:make --global-batch-size 32 --device cpu --memory-budget 24MiB
"""

from __future__ import annotations

import torch
from torch import nn

IMAGE_SIZE, CLASSES = 16, 10


class Block(nn.Module):
    """A residual convolution block: activations grow with the batch. Group norm normalises each sample by
    itself, so a smaller micro-batch with accumulation keeps the math exact (batch norm's statistics would
    change with the micro-batch: autofit counts that as a numerics change)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(4, channels), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class Net(nn.Module):
    """Stem, `depth` residual blocks (in an nn.ModuleList, so autofit can checkpoint them), pooled head."""

    def __init__(self, channels: int = 16, depth: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(Block(channels) for _ in range(depth))
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def make_model() -> Net:
    """The model, with random weights."""
    return Net()


def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` samples: images and their labels."""
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE), torch.randint(0, CLASSES, (n,))


def loss_fn(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the logits against the batch's labels."""
    return nn.functional.cross_entropy(output, batch[1])


def make_dataset(n: int = 256) -> torch.utils.data.TensorDataset:
    """A training set of `n` random samples (for the exported training scripts' --dataset)."""
    return torch.utils.data.TensorDataset(*make_batch(n))


def make() -> tuple[Net, object, object]:
    """(model, make_batch, loss_fn): everything `autofit tune` needs for a model without `.loss`."""
    return make_model(), make_batch, loss_fn
