"""Rung 2, chunked loss: a causal language model's head and cross-entropy run chunk by chunk.

The logits of a whole batch are `tokens x vocabulary` values -- with a 128k vocabulary, 4096 tokens
are 2 GiB in fp32, kept for backward along with their log-softmax. Here the model's base runs as usual,
then the output head and the cross-entropy run on `CHUNKS` slices of the tokens, each slice under
`torch.utils.checkpoint`, so only one slice's logits are ever live, in forward and in backward. Costs
one more head matmul (the recomputation); same math up to the order of the sum (tier 0).

Applies where the model exposes its output head: a Hugging Face causal LM (`get_output_embeddings()`
a Linear, its base model under `base_model_prefix`, `labels` in forward) trained on its own loss
(`output.loss`), with no logit scaling or soft-capping between head and loss.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from autofit.config import Config
from autofit.config import Loss as L
from autofit.batches import batch as batches
from autofit.strategies.base import Option, Strategy

if TYPE_CHECKING:
    from autofit.strategies.costs import StepFacts
    from autofit.strategies.run import TrainRun
    from autofit.job.train_spec import TrainSpec

CHUNKS = 8  # slices of the tokens (torchtune's chunked cross-entropy uses 8 as well)
IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"
SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class ChunkedLoss(Strategy):
    """full (the model's own loss), chunked."""

    field = "loss"
    rung = 2
    order = 1

    def relieves(self, config: Config) -> Config | None:
        # the head's forward runs once more: more FLOPs and kernels at the same micro-batch
        return config.replace(loss=L.FULL) if config.loss is L.CHUNKED else None

    def options(self, spec: "TrainSpec") -> list[Option]:
        why_not = _why_not(spec)
        return [Option(L.FULL, 0, "the model's own loss over all logits at once"),
                Option(L.CHUNKED, 0, why_not or f"head and cross-entropy in {CHUNKS} chunks, each recomputed in "
                       "backward: one chunk of logits live", available=why_not is None)]

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return a.loss is L.CHUNKED or b.loss is L.FULL

    def apply(self, run: "TrainRun") -> None:
        if run.config.loss is L.CHUNKED and not run.live:  # a live model's forward is the user's (the guard)
            enable(run.model)

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        return {"loss": config.loss.value}

    def extra_flops(self, config: Config, step: "StepFacts") -> float:
        """The head's forward again, chunk by chunk, in the backward: 2 * vocabulary * hidden FLOPs per
        token (a model without a Hugging Face config: none known)."""
        if config.loss is not L.CHUNKED or step.hf is None:
            return 0
        return 2 * getattr(step.hf, "vocab_size", 0) * getattr(step.hf, "hidden_size", 0) * step.tokens

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if config.loss is not L.CHUNKED:
            return []
        return ["from autofit.strategies.chunked_loss import enable as chunk_loss",
                "chunk_loss(model)  # head + cross-entropy in chunks when labels are given"]


def _why_not(spec: "TrainSpec") -> str | None:
    if not spec.model.is_hf:
        return f"{spec.model.name} is not a Hugging Face causal LM: its output head is not known"
    if spec.loss_fn is not batches.default_loss:
        return "your loss_fn reads the model's output: the chunked loss replaces the logits"
    scaled = [name for name in SCALED_LOGITS if getattr(spec.model.hf_config, name, None) not in (None, 1, 1.0)]
    if scaled:
        return f"{spec.model.name} scales its logits ({scaled[0]}) between head and loss"
    from autofit.models.info import meta_model

    return head_problem(meta_model(spec.model_factory))


def head_problem(model: nn.Module) -> str | None:
    """Why `model` exposes no output head to chunk (None when it does)."""
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return (f"{name} is an encoder-decoder model: its decoder reads the labels shifted right, not the "
                "causal LM's loss over shifted logits")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(head, nn.Linear) or not isinstance(base, nn.Module) or base is model:
        return f"{name} exposes no Linear output head over a base model"
    if "labels" not in inspect.signature(model.forward).parameters:
        return f"{name}.forward takes no labels: it computes no loss of its own"
    return None


def enable(model: nn.Module, chunks: int = CHUNKS) -> nn.Module:
    """Make `model`'s forward compute its loss in `chunks` chunks whenever labels are given (the logits
    are then not returned); without labels it runs as before. Returns `model`."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    problem = head_problem(model)
    if problem:
        raise ValueError(problem)
    original, head = model.forward, model.get_output_embeddings()
    base = getattr(model, model.base_model_prefix)

    @functools.wraps(original)
    def forward(*args: Any, labels: Any = None, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(*args, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs.setdefault("use_cache", False)  # the cache would be dropped with the logits anyway
        hidden = base(*args, **kwargs)[0]
        return CausalLMOutputWithPast(loss=chunked_cross_entropy(hidden, labels, head, chunks, num_items_in_batch))

    model.forward = forward
    return model


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, chunks: int = CHUNKS,
                          num_items_in_batch: Any = None) -> torch.Tensor:
    """Hugging Face's causal-LM loss (labels shifted left by one, `IGNORE_INDEX` skipped, fp32 logits, mean
    over the counted tokens or sum / `num_items_in_batch`) from the last hidden states, `chunks` slices
    of tokens at a time, each slice's logits recomputed in backward rather than kept."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h, y in zip(flat.chunk(chunks), targets.chunk(chunks)):
        total = total + checkpoint(functools.partial(_chunk_loss, head), h, y, use_reentrant=False)
    count = num_items_in_batch if num_items_in_batch is not None else (targets != IGNORE_INDEX).sum()
    return total / count


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
