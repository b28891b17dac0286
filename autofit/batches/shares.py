"""How much of a step's loss each micro-batch carries, so that split batches add up to the whole one.

A loss that is a mean over samples is kept by weighting each micro-batch by its share of the samples.
A Hugging Face model's own token-level loss (a causal or masked LM, a token classifier, a sequence-to-
sequence model) is a mean over the targets its labels hold, `-100` marking none: padded rows hold
fewer, so a micro-batch's share is its share of the targets, counted as `Trainer._get_num_items_in_batch`
counts them (a decoder-only causal LM's from the second position on, its loss shifting them; a
collator's `shift_labels` as they are). Weighted by samples instead, a step over rows of 5 to 64
targets moves a GPT-2's gradient by 1.8% split in two, by 28% in four (bench/diag/token_shares.py).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autofit.batches.batch import default_loss, leading_dim, wrapped_module

IGNORE_INDEX = -100
TOKEN_LOSSES = ("ForMaskedLMLoss", "ForTokenClassification")  # in transformers' LOSS_MAPPING, beside causal LMs
# Loss types transformers 4.46's LOSS_MAPPING lacks, whose models compute that mean in their own forward: the
# functions later releases map them to
LATER_LOSSES = {"ForConditionalGeneration": "ForCausalLMLoss", "ForMaskedLM": "ForMaskedLMLoss"}


def divides_by_count(loss_at: Callable[[int], float], count: int) -> bool:
    """Whether a loss handed the window's item count (`num_items_in_batch`, the Trainer's) divides by it:
    `loss_at(n)` halves when the count doubles (1.0 for a mean over the piece that ignores it). Measure it in
    evaluation mode with no gradient, so that dropout and routing noise cannot tell the two apart. An undefined
    ratio (a loss of zero) reads as dividing: the Trainer's own reading stands."""
    once, twice = loss_at(count), loss_at(count * 2)
    if once == 0.0 or not math.isfinite(twice / once):
        return True
    return twice / once < 0.75


def target_counts(model: nn.Module, batch: Any) -> torch.Tensor | None:
    """Targets per sample of `batch` where `model`'s own loss averages over its labels' targets, else None
    (every sample weighs alike). Only for the model's own loss: a `loss_fn` of yours is read as a mean
    over samples."""
    if not isinstance(batch, Mapping):
        return None
    shifted = batch.get("shift_labels")
    labels = shifted if isinstance(shifted, torch.Tensor) else batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.is_floating_point():
        return None  # a label per sample (classification, regression), or none
    loss = _token_loss(model)
    if loss is None:
        return None
    if loss == "causal" and shifted is None and not getattr(_config(model), "is_encoder_decoder", False):
        labels = labels[:, 1:]
    return labels.ne(IGNORE_INDEX).flatten(1).sum(1)


def share(counts: torch.Tensor | None, start: int, size: int, total: int) -> float:
    """Samples `start .. start+size`'s share of the step's loss: of its targets when `counts` holds them,
    else of its samples."""
    if counts is None:
        return size / total
    whole = int(counts.sum())
    return int(counts[start:start + size].sum()) / whole if whole else size / total


def micro_batch_shares(model: nn.Module, micro_batches: Sequence[Any], loss_fn: Any) -> list[float | torch.Tensor]:
    """Each of a step's micro-batches' share of its loss: of the targets for the model's own token-level
    loss (0-d tensors where the labels are: reading them would wait for the device in a timed step), else
    of the samples."""
    sizes = [leading_dim(micro_batch) for micro_batch in micro_batches]
    by_samples = [size / sum(sizes) for size in sizes]
    counts = [target_counts(model, micro_batch) for micro_batch in micro_batches] if loss_fn is default_loss else []
    if not counts or any(count is None for count in counts):
        return by_samples
    held = torch.stack([count.sum() for count in counts]).float()
    whole = held.sum()
    shares = torch.where(whole > 0, held / whole.clamp(min=1), torch.tensor(by_samples, device=held.device))
    return list(shares.unbind())


def weighted_sum(counts: torch.Tensor | None, parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The whole batch's loss from its pieces' `(size, loss)`, in order, each weighted by its `share`; a
    piece with no share (no targets: its loss, a mean over none, is NaN) left out."""
    total, start, result = sum(size for size, _ in parts), 0, torch.zeros(())
    for size, loss in parts:
        weight = share(counts, start, size, total)
        start += size
        if weight:
            result = result + loss.float() * weight
    return result


def _token_loss(model: nn.Module) -> str | None:
    """"causal" or "tokens" where the Hugging Face model inside `model` (read through DDP, peft and
    `torch.compile`) computes a mean over its labels' targets, None for another loss or a model of your
    own. A causal LM is told as the Trainer tells it for label smoothing (its class among the causal LMs)
    or by its loss type; `loss_type` alone is None for some (GPT2LMHeadModel)."""
    model = _innermost(model)
    if hasattr(model, "loss_type"):
        return _loss_kind(type(model), model.loss_type)
    if hasattr(type(model), "loss_function"):  # transformers 4.46 keeps none: its class name says
        return _loss_kind(type(model), getattr(_config(model), "loss_type", None) or _loss_type_of(type(model)))
    return None


def _loss_type_of(model_class: type) -> str | None:
    """The loss type transformers reads from a class name (its LOSS_MAPPING key, or the first key in the
    name: `BertForTokenClassification` -> "ForTokenClassification"), as its `loss_function` does in releases
    whose models keep no `loss_type` (4.46)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    name, known = model_class.__name__, [*LOSS_MAPPING, *LATER_LOSSES]
    if name in known:
        return name
    found = re.findall(f"({'|'.join(known)})", name)
    return found[0] if found else None


@functools.lru_cache(maxsize=64)
def _loss_kind(model_class: type, loss_type: str | None) -> str | None:
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    function = getattr(LOSS_MAPPING.get(loss_type), "__name__", None) or LATER_LOSSES.get(loss_type)
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())  # FSDP2 subclasses the model's class
    if function == "ForCausalLMLoss" or any(cls.__name__ in causal_classes for cls in model_class.__mro__):
        return "causal"
    return "tokens" if function in TOKEN_LOSSES else None


def _config(model: nn.Module) -> Any:
    return getattr(_innermost(model), "config", None)


def _innermost(model: nn.Module) -> nn.Module:
    """The model inside pass-through wrappers (DDP, DeepSpeed's engine, peft, `torch.compile`), which
    hand attribute reads on to it (peft) or not (DDP), but are not its class."""
    while (inner := wrapped_module(model)) is not None:
        model = inner
    return model
