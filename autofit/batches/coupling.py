"""Whether a step's loss couples its samples, so that a micro-batch smaller than the rank's batch changes it.

Gradient accumulation is exact for a loss made of one term per sample (their mean, weighted by targets for
a token-level loss, or their sum): split in micro-batches and weighted by their shares, the step's gradient
is the whole batch's. A loss that couples samples is not: a contrastive loss (CLIP's and SigLIP's, SimCLR's
InfoNCE) takes each sample's negatives from its batch, so at micro-batch 8 of 256 it sees 7 negatives, not
255, and trains something else; a loss of yours that averages over the batch's targets (padded rows holding
fewer) weighs them otherwise once split, as autofit weighs your loss's micro-batches by their samples.
Such a model is then searched like one with batch norm: a micro-batch smaller than the rank's batch is a
numerics change (tier 1), taken only when it clears `exact_margin` or nothing exact fits, and the plan's
reason says what it changes.

How it is found: a Hugging Face model asked for its contrastive loss (`return_loss=True`) is known to, and
its other heads' own losses (a mean over samples or targets) are known not to; any other loss (yours, or a
plain model's) is computed for real on two samples together and on each alone (eval mode, so that
dropout and batch norm's batch statistics stay out; no gradient; the random state restored): a loss of the
pair that is neither the weighted mean nor the sum of the two alone couples them. A forward whose loss is
random even so (a VAE's sampling) or cannot run in eval mode decides nothing, nor is a model of more than
`SIZE_LIMIT` bytes of parameters run (four forwards of a 7B model on a CPU take minutes; a factory's model
is built once on the CPU for the check).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch import nn

from autofit.errors import UsageError
from autofit.batches import batch as batches
from autofit.models.info import hf_model
from autofit.batches.shares import micro_batch_shares

SIZE_LIMIT = 1 << 30  # bytes of parameters of a model checked (a factory's built once on the CPU for it)
# Relative, between a separable loss of 2 samples and its parts' (fp32 kernels at 1 and 2 rows differ ~1e-6; TF32
# is switched off for the check: `_full_precision`); 16-bit weights: HALF_TOLERANCE. An untrained model's
# per-sample losses are close, so a token-weighted mean differs from the sample mean by ~1e-3 only.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_TOLERANCE = 2e-2


def sample_coupling(model: nn.Module | None, factory: Callable[[], nn.Module], batch_factory: batches.BatchFactory,
                    loss_fn: Any) -> str | None:
    """What couples the samples of `model`'s loss (a phrase for a reason), or None: separable, or not found
    out. `model` is the user's module, or a factory's built on the meta device (None: it could not be)."""
    pair = batches.made(batch_factory, 2)
    if model is not None and _asks_contrastive(model, pair):
        return f"{type(model).__name__}'s contrastive loss takes each sample's negatives from its batch"
    if model is None or _bytes(model) > SIZE_LIMIT or (loss_fn is batches.default_loss and hf_model(model)):
        return None  # too large to run 4 forwards of, or a Hugging Face head's own loss: a mean per target
    return _measured(factory() if any(p.is_meta for p in model.parameters()) else model, pair, loss_fn)


def _asks_contrastive(model: nn.Module, batch: Any) -> bool:
    """A Hugging Face model whose batch asks for its contrastive loss (CLIP, SigLIP: `return_loss=True`)."""
    return isinstance(batch, Mapping) and bool(batch.get("return_loss")) and \
        "return_loss" in inspect.signature(model.forward).parameters


def _bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _measured(model: nn.Module, pair: Any, loss_fn: Any) -> str | None:
    """Compare the loss of `pair` with its samples' alone (see the module's docstring)."""
    one, two = batches.take_rows(pair, 0, 1), batches.take_rows(pair, 1, 1)
    device = next(model.parameters(), torch.empty(0)).device
    try:
        with _evaluating(model), _buffers_kept(model), _full_precision(), torch.no_grad(), \
                batches.quiet_transformers():
            whole, again = (_loss(model, pair, loss_fn, device, seed) for seed in (0, 1))
            alone = [_loss(model, part, loss_fn, device, 0) for part in (one, two)]
            shares = [float(s) for s in micro_batch_shares(model, [one, two], loss_fn)]
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - a model that trains only in training mode, a loss of its own: no verdict
        return None
    tolerance = TOLERANCE.get(next(model.parameters()).dtype, HALF_TOLERANCE)
    close = lambda a, b: math.isclose(a, b, rel_tol=tolerance, abs_tol=1e-6)  # noqa: E731
    mean = sum(s * loss for s, loss in zip(shares, alone))
    if not close(whole, again) or close(whole, mean) or close(whole, sum(alone)):
        return None  # random whatever the batch, or one term per sample
    return (f"the loss couples samples, as a contrastive loss's negatives or a mean over the batch's targets (rows "
            f"holding different counts) do: 2 samples together {whole:.4g}, alone {alone[0]:.4g} and "
            f"{alone[1]:.4g}, neither their mean nor their sum")


def _loss(model: nn.Module, batch: Any, loss_fn: Any, device: torch.device, seed: int) -> float:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        on_device = batches.to_device(batch, device)
        return float(loss_fn(batches.call_model(model, on_device), on_device))


@contextlib.contextmanager
def _full_precision() -> Iterator[None]:
    """fp32 matmuls, convolutions and RNNs at full precision, the caller's settings restored on leaving, each
    through the API family it was set with (`autofit.devices.flags`: a legacy getter raises after a setting
    through torch 2.9's new one). TF32 reads 10 bits of each input's mantissa (pytorch
    docs/source/notes/numerical_accuracy.rst, "TensorFloat-32(TF32) on Nvidia Ampere devices"): ~1e-3 of
    error, ten times the tolerance, and the kernels of 1 and 2 rows need not round alike. Not run on a GPU."""
    from autofit.devices.flags import apply_backend_flags, backend_flags, without_tf32

    saved = backend_flags()
    apply_backend_flags(without_tf32(saved))
    try:
        yield
    finally:
        apply_backend_flags(saved)


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """`model`'s buffers as they were on leaving, the same tensors with the same values: a forward may
    update them even in eval mode and without gradients (a MoCo queue of negatives and its pointer, a step
    counter), and the model is the user's own (a search never changes what it was given)."""
    kept = [(module, name, buffer, buffer.clone()) for module in model.modules()
            for name, buffer in module._buffers.items() if buffer is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, value in kept:
                buffer.copy_(value)
                module._buffers[name] = buffer  # a forward may have put another tensor in its place


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode, each module's own mode restored on leaving."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
