"""A Hugging Face model at another depth: the field of its config that sets how many identical blocks it
has (`depth_key`), and its class built on the meta device with fewer of them (`rebuild`, `shallow`). The
estimator simulates deep models at one and two blocks; a spec checks its loss on one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autofit.models.info import find_blocks

DECODER_DEPTHS = ("decoder_layers", "num_decoder_layers")  # a seq2seq config's decoder depth: BART's, ProphetNet's


def depth_key(model: nn.Module) -> str | None:
    """The config attribute that sets a Hugging Face model's depth, when the model can be rebuilt at
    another depth with identical blocks (decoder-only or encoder-only, every weight trainable)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(type(model), "_from_config"):
        return None
    if not all(p.requires_grad for p in model.parameters()):
        return None
    key = _depth_field(config)
    blocks = find_blocks(model)[1]
    if getattr(config, key, None) != len(blocks):
        return None
    # ConvNeXt's "layers" are stages of growing width (its num_hidden_layers is num_stages, its widths a
    # list per stage): fewer of them is another model, not a shallower one
    shapes = {tuple(p.shape for p in block.parameters()) for block in blocks}
    return key if len(shapes) == 1 else None


def shallow(model: nn.Module, depth: int = 1) -> nn.Module:
    """`model` rebuilt on the meta device with `depth` blocks where `depth_key` allows it and it is deeper,
    else `model` itself (also where the rebuild fails: a shallow copy only saves time)."""
    key = depth_key(model)
    if key is None or getattr(model.config, key) <= depth:
        return model
    try:
        return rebuild(model, key, depth)
    except Exception:  # noqa: BLE001 - a config that refuses another depth: the model as it is
        return model


def _depth_field(config: Any) -> str:
    """The field of `config` that holds the model's depth. A seq2seq config's decoder trained alone
    (`BartForCausalLM`, `ProphetNetForCausalLM`: `is_decoder` set, no encoder) is as deep as its decoder
    field says; its `num_hidden_layers` is the encoder's (BART's attribute map) or the sum of both
    (ProphetNet's property), which a shallow copy's decoder does not follow."""
    fields = config.to_dict()
    if getattr(config, "is_decoder", False):
        decoder = next((name for name in DECODER_DEPTHS if name in fields), None)
        if decoder is not None:
            return decoder
    return getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")


def _keep_patterns(data: dict, depth: int) -> None:
    """GPT-Neo spells its per-layer attention kinds as (pattern, repeats) pairs, `[[["global", "local"], 12]]`,
    which its config expands to `attention_layers` and checks against the depth: the shallow copy's pairs
    are its first `depth` layers', one layer each."""
    layers = data.get("attention_layers")
    if isinstance(data.get("attention_types"), list) and isinstance(layers, list) and len(layers) == depth:
        data["attention_types"] = [[[kind], 1] for kind in layers]


def _keep_stages(data: dict, depth: int) -> None:
    """A backbone config (DINOv2, BEiT: one stage per block) names the stages it outputs, which the shallow
    copy's config checks against its own `stem, stage1 .. stage{depth}`: keep the ones it still has, or
    its default (the last) where none is left."""
    if not isinstance(data.get("stage_names"), list):
        return
    data["stage_names"] = ["stem", *(f"stage{i}" for i in range(1, depth + 1))]
    kept = [name for name in data.get("out_features") or () if name in data["stage_names"]]
    data["out_features"] = kept or None
    data["out_indices"] = [data["stage_names"].index(name) for name in kept] or None


def rebuild(model: nn.Module, key: str, depth: int) -> nn.Module:
    """`model`'s class built on the meta device from its config with `depth` blocks."""
    data = model.config.to_dict()
    total = data[key]
    data[key] = depth
    for name, value in data.items():  # one entry per layer: Gemma's layer_types, Longformer's attention_window
        if isinstance(value, list) and len(value) == total:
            data[name] = value[:depth]
    _keep_patterns(data, depth)
    _keep_stages(data, depth)
    config = type(model.config).from_dict(data)
    config._attn_implementation = model.config._attn_implementation
    dtype = next(model.parameters()).dtype  # a bf16 model is rebuilt in bf16
    with torch.device("meta"):
        return type(model)._from_config(config).to(dtype)
