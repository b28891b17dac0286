"""Batches as users give them: a tensor, a tuple/list of tensors, or a dict of tensors (Hugging Face).

Every tensor's first axis is the sample axis. A sample batch is turned into a factory of batches of any
size by taking its rows cyclically, so micro-batches are exact slices of the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from autofit.errors import UsageError

Batch = Any
BatchFactory = Callable[[int], Batch]


def leading_dim(batch: Batch) -> int:
    """Number of samples in `batch`; all tensors must agree on their first axis."""
    leaves = [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, torch.Tensor)]
    if not leaves:
        raise UsageError(f"The batch holds no tensors (got {type(batch).__name__}); pass a tensor, "
                         "a tuple of tensors or a dict of tensors.")
    sizes = {tuple(leaf.shape[:1]) for leaf in leaves}
    if () in sizes:
        raise UsageError("The batch holds a 0-dimensional tensor, which cannot be sliced into "
                         "micro-batches; give every tensor a leading sample axis.")
    if len(sizes) > 1:
        raise UsageError(f"The batch's tensors disagree on the sample axis (first dims {sorted(s[0] for s in sizes)}), "
                         "so it cannot be sliced into micro-batches; give every tensor the same first dimension.")
    return sizes.pop()[0]


def take_rows(batch: Batch, start: int, count: int) -> Batch:
    """Rows `start .. start+count` of `batch`, wrapping around its end (the batch is tiled as needed)."""
    size = leading_dim(batch)
    index = torch.arange(start, start + count) % size

    def take(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.index_select(0, index.to(leaf.device))

    return tree_map(take, batch)


def factory_from_sample(sample: Batch) -> BatchFactory:
    """A `make_batch(n)` that returns `n` rows of `sample`, cycling through them."""
    leading_dim(sample)  # validate now, not inside the first probe
    return functools.partial(take_rows, sample, 0)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` with every tensor on `device`."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def tokens_per_sample(batch: Batch) -> int | None:
    """Length of the sequence axis where the batch has one (token ids), else None."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        ids = batch["input_ids"]
        return int(ids.shape[1]) if ids.dim() >= 2 else None
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


def call_model(model: torch.nn.Module, batch: Batch) -> Any:
    """Run `model` on `batch`: dict -> model(**batch); tuple/list -> model(batch[0]); tensor -> model(batch).

    A tuple is read as (inputs, targets, ...): the targets reach the loss through `loss_fn(output, batch)`.
    """
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


def default_loss(output: Any, batch: Batch) -> torch.Tensor:
    """`output.loss` (Hugging Face), `output["loss"]`, or `output` itself when it is a scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise UsageError(
            f"The model returned {shape}, which has no scalar loss. Pass labels in the batch (Hugging Face), "
            "make forward return the loss, or pass loss_fn=lambda output, batch: ... to autofit."
        )
    return loss


def synthesize_batch(config: Any, seq_len: int | None) -> tuple[BatchFactory, str]:
    """A batch factory for a Hugging Face model built from its config, and a one-line description.

    Text models get token ids and labels at `seq_len` (default: the model's maximum positions capped at
    2048); vision models get pixel values at the configured image size and class labels.
    """
    image_size = getattr(config, "image_size", None)
    if image_size is not None and not hasattr(config, "vocab_size"):
        channels = getattr(config, "num_channels", 3)
        side = image_size if isinstance(image_size, int) else image_size[0]
        images = ImageBatches(channels, side, max(int(getattr(config, "num_labels", 2)), 1))
        return images, f"pixel_values {channels}x{side}x{side} and labels"
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise UsageError(f"Cannot synthesize a batch for {type(config).__name__}: it has neither vocab_size "
                         "nor image_size. Pass a batch or a make_batch(batch_size) factory.")
    max_len = max_positions(config)
    length = seq_len or min(max_len or 2048, 2048)
    if max_len is not None and length > max_len:
        raise UsageError(f"seq_len {length} exceeds the model's maximum of {max_len} positions; "
                         f"use --seq-len {max_len} or less.")

    return TokenBatches(vocab, length), f"input_ids and labels of {length} tokens"


@dataclasses.dataclass(frozen=True)
class TokenBatches:
    """make_batch(n) for causal language models: random token ids, labels equal to the inputs."""

    vocab_size: int
    seq_len: int

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab_size, (n, self.seq_len), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids.clone()}


@dataclasses.dataclass(frozen=True)
class ImageBatches:
    """make_batch(n) for image classifiers: random pixel values and class labels."""

    channels: int
    side: int
    num_labels: int

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return {"pixel_values": torch.randn(n, self.channels, self.side, self.side, generator=gen),
                "labels": torch.randint(0, self.num_labels, (n,), generator=gen)}


def max_positions(config: Any) -> int | None:
    """The longest sequence a Hugging Face config allows, when it says."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
