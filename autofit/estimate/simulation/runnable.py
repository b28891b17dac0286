"""A model and batch made runnable under fake tensors (`autofit.estimate.simulation.step`), at the memory their
training step takes: the steps whose shapes depend on the data switched off or stood in for, kernels fake
tensors cannot run routed to ones with the same memory, and the model's configs set back afterwards.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import torch
from torch import nn

from autofit.estimate.simulation import stand_in_losses


@contextlib.contextmanager
def configs_restored(model: nn.Module) -> Any:
    """Set every Hugging Face config `model`'s modules hold (sub-configs included) back as it was on
    exit. A simulation sets the attention implementation and switches off random layer skips on the
    model's config, which is the caller's own object when a factory builds its model from one."""
    configs: dict[int, Any] = {}
    stack = [getattr(module, "config", None) for module in model.modules()]
    while stack:
        config = stack.pop()
        if config is None or id(config) in configs or not hasattr(config, "to_dict"):
            continue
        configs[id(config)] = (config, dict(vars(config)))
        stack.extend(value for value in vars(config).values() if hasattr(value, "to_dict"))
    try:
        yield
    finally:
        for config, saved in configs.values():
            vars(config).clear()
            vars(config).update(saved)


LAYERDROPS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
SPEC_AUGMENT_PROBABILITIES = ("mask_time_prob", "mask_feature_prob")  # SpecAugment's, per frame and per feature


def without_data_dependent_steps(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> tuple:
    """The batch and loss a simulation runs for `model`: as given, but where the model's own training
    step has shapes that depend on the data, which fake tensors hold none of.

    LayerDrop (wav2vec2's and Parakeet's 0.1 by default) skips each layer at random (`torch.rand([]) <
    layerdrop`): switched off in the config and in every module that keeps its own, every layer runs, the
    most memory a step takes (a step that drops none). Waveform
    models (wav2vec2, HuBERT) mask random spans of their features in training (SpecAugment:
    `hidden_states[mask] = masked_spec_embed`, an in-place write through a boolean mask, whose backward
    fake tensors cannot size): switched off, by `apply_spec_augment` and by its probabilities (data2vec-audio
    has no such switch), which leaves out a boolean mask of batch x frames. Heads whose own loss has
    shapes that depend on the data (CTC's tensor lengths; DETR's and Mask2Former's matching with scipy on
    the host) run a stand-in that keeps what the loss keeps (`autofit.estimate.simulation.stand_in_losses`)."""
    from autofit.batches.batch import default_loss

    config = getattr(model, "config", None)
    for holder in (config, *model.modules()):  # read from the config (wav2vec2) or kept by a module (Parakeet)
        for name in LAYERDROPS:
            if isinstance(getattr(holder, name, None), float) and getattr(holder, name) > 0:
                setattr(holder, name, 0.0)
    if getattr(config, "apply_spec_augment", False):
        config.apply_spec_augment = False
    # data2vec-audio's config has no `apply_spec_augment` (its model reads a missing one as True): by these
    for name in SPEC_AUGMENT_PROBABILITIES:
        if isinstance(getattr(config, name, None), float) and getattr(config, name) > 0:
            setattr(config, name, 0.0)
    found = stand_in_losses.stand_in(model, batch) if loss_fn is default_loss else None
    return (batch, loss_fn) if found is None else found


@contextlib.contextmanager
def fake_friendly_kernels() -> Any:
    """Route mixture-of-experts layers to transformers' own grouped-matmul op while simulating.

    transformers' experts run `torch._grouped_mm`, whose fake (meta) kernel mirrors the CUDA checks and
    accepts bf16 inputs only, while under autocast the experts see fp32 master weights. transformers'
    fallback op (`transformers::grouped_mm_fallback`, transformers/integrations/moe.py) registers a fake
    kernel of the same output shape and saves the same two tensors (input, weight) for backward, so the
    memory it shows is the grouped kernel's."""
    moe = sys.modules.get("transformers.integrations.moe")  # imported by every model with experts
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
