"""What one training sample costs in arithmetic: the positions each stack of the model processes, and
the FLOPs that follow, for the dry-run's speed model.

A sample is not one token: a ViT-B/16 image at 224 px is 197 positions (196 patches and a class token),
thirty seconds of Whisper audio is 1,500 encoder frames plus the decoder's tokens, and a T5 example is
its input tokens through the encoder plus its target tokens through the decoder (which also attends to
every encoder position). Counted per sample (forward and backward, matmuls only):

- `per_token * parameters * positions` for each stack (6 FLOPs per weight and position for training:
  forward 2, backward 4; embeddings looked up rather than multiplied are left out of the encoder's share);
- self-attention `12 * layers * positions^2 * width` (QK^T and AV: 4 * T^2 * width forward, x3 with
  backward), and cross-attention `12 * layers * target positions * source positions * width`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

from autofit.estimate.facts import config_int, formula_positions
from autofit.batches.synthetic import feature_layout, image_sides

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec


@dataclasses.dataclass(frozen=True)
class Stack:
    """One stack of layers: the positions per sample it processes and the weights it multiplies them by."""

    name: str  # "model", "encoder" or "decoder"
    positions: int  # tokens, patches or frames per sample
    params: int  # parameters applied to every position (matmul weights)
    layers: int
    width: int  # attention width: heads x head dimension
    attends_to: int = 0  # positions of another stack it cross-attends to (an encoder-decoder's decoder)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Per-sample arithmetic of a model: its stacks and how their positions were found (one phrase)."""

    stacks: tuple[Stack, ...]
    how: str

    @property
    def positions(self) -> int:
        """Positions per sample over all stacks (a stand-in for "tokens" in utilisation)."""
        return sum(s.positions for s in self.stacks)

    def flops(self, per_param_position: float, recompute_share: float = 0.0) -> float:
        """Training FLOPs per sample: `per_param_position` FLOPs per weight and position (6 for full
        training, 4 with a frozen base), attention FLOPs growing by a third of `recompute_share` (the
        forward recomputed under activation checkpointing)."""
        total = 0.0
        for s in self.stacks:
            attention = 12 * s.layers * s.positions * (s.positions + s.attends_to) * s.width
            total += per_param_position * s.params * s.positions + attention * (1 + recompute_share / 3)
        return total


def workload(spec: "TrainSpec", num_params: int, num_blocks: int) -> Workload:
    """The `Workload` of `spec`'s model: vision (patches), speech (frames), encoder-decoder (source and
    target tokens) or one stack of `spec.tokens_per_sample` positions (1 when the batch has none)."""
    hf = spec.model.hf_config
    sample = spec.batch_factory(1)
    if hf is not None and getattr(hf, "is_encoder_decoder", False):
        return _encoder_decoder(spec, hf, sample, num_params)
    width = _width(hf) if hf is not None else 0
    layers = config_int(hf, "num_hidden_layers", "n_layer", "num_layers", default=num_blocks) if hf is not None else num_blocks
    patches = _patches(hf) if hf is not None else None
    if patches is not None:
        return Workload((Stack("model", patches, num_params, layers, width),),
                        f"{patches} patches per image ({'x'.join(map(str, image_sides(hf)))} px in {hf.patch_size} px "
                        "patches, a class token)")
    frames = _frames(hf, sample) if hf is not None else None
    if frames is not None:
        return Workload((Stack("model", frames, num_params, layers, width),), f"{frames} frames per sample")
    tiles = _spectrogram_patches(hf) if hf is not None else None
    if tiles is not None:
        return Workload((Stack("model", tiles, num_params, layers, width),),
                        f"{tiles} spectrogram patches per clip ({hf.max_length} frames x {hf.num_mel_bins} mel bins)")
    tokens = spec.tokens_per_sample or _sequence(sample, "input_ids")
    if tokens:
        return Workload((Stack("model", tokens, num_params, layers, width),), f"{tokens} tokens per sample")
    applied = _weight_applications(spec, num_params)
    if applied is None:
        return Workload((Stack("model", 1, num_params, layers, width),),
                        "1 position per sample (no sequence axis in the batch; its FLOPs could not be counted)")
    # the count holds the attention's FLOPs too: no attention term on top
    return Workload((Stack("model", applied, num_params, layers, width=0),),
                    f"each weight applied {'once' if applied == 1 else f'{applied:,} times'} per sample "
                    "(FLOPs of one sample's forward counted)")


def _weight_applications(spec: "TrainSpec", num_params: int) -> int | None:
    """How many times one sample applies the average weight (a convolution's at every pixel it slides
    over): the forward FLOPs of one sample, counted by `torch.utils.flop_counter` under fake tensors
    (nothing allocated) on two (batch norm in training takes more than one value per channel), over 2
    FLOPs per weight. None when the forward cannot be counted."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from autofit.models.info import meta_model
    from autofit.estimate.simulation.step import as_fake
    from autofit.batches.batch import call_model, quiet_transformers

    if num_params <= 0:
        return None
    try:
        model = meta_model(spec.model_factory)
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model.to_empty(device="cpu")
            batch = as_fake(fake, spec.batch_factory(2), "cpu")
            with FlopCounterMode(display=False, custom_mapping=_RECURRENT_FLOPS) as counter, torch.no_grad(), \
                    quiet_transformers():
                call_model(model, batch)
    except Exception:  # noqa: BLE001 - an op without a fake kernel: the plain count stands, and says so
        return None
    return max(1, round(counter.get_total_flops() / 2 / (2 * num_params)))


def _recurrent_matmuls(input_shape: tuple[int, ...], weight_shapes: Any) -> int:
    """FLOPs of a recurrent kernel's matmuls: every 2-D weight (input-to-hidden and hidden-to-hidden, per layer
    and direction) applied at every step of every sample (the input's rows: steps x samples, or packed)."""
    return 2 * math.prod(input_shape[:-1]) * sum(w[0] * w[1] for w in weight_shapes if len(w) == 2)


# `torch.utils.flop_counter` has no formula for the fused recurrent kernels, and counted an LSTM as no work:
# oneDNN's layer (`mkldnn_rnn_layer`: input, then its weights w0 .. w3) and cuDNN's stack (`_cudnn_rnn`:
# input, then the list of every layer's weights). Keyed by op packet, as the counter looks formulas up;
# called with the tensors' shapes.
_RECURRENT_FLOPS = {
    torch.ops.aten.mkldnn_rnn_layer: lambda input, *weights, **_: _recurrent_matmuls(input, weights[:4]),
    torch.ops.aten._cudnn_rnn: lambda input, weights, *_, **__: _recurrent_matmuls(input, weights),
}


def _encoder_decoder(spec: "TrainSpec", hf: Any, sample: Any, num_params: int) -> Workload:
    """Two stacks: the encoder over the source (speech frames, image patches of a composite image-to-text
    model's encoder config, or tokens) and the decoder over the target tokens, attending to the source."""
    enc_hf, dec_hf = _parts(hf)
    frames, patches = _frames(hf, sample), None if enc_hf is hf else _patches(enc_hf)
    source = frames or patches or _sequence(sample, "input_ids") or spec.tokens_per_sample or 1
    target = _sequence(sample, "labels") or _sequence(sample, "decoder_input_ids") or \
        config_int(dec_hf, "max_target_positions", default=source)
    encoder = _encoder_params(spec)
    enc_layers = config_int(enc_hf, "encoder_layers", "num_layers", "num_hidden_layers", default=1)
    dec_layers = config_int(dec_hf, "decoder_layers", "num_decoder_layers", "num_layers", "num_hidden_layers",
                            "n_layer", default=1)
    what = "frames" if frames else "patches" if patches else "tokens"
    return Workload((Stack("encoder", source, encoder, enc_layers, _width(enc_hf)),
                     Stack("decoder", target, num_params - encoder, dec_layers, _width(dec_hf), attends_to=source)),
                    f"{source} source {what} through the encoder and {target} target tokens through the decoder")


def _parts(hf: Any) -> tuple[Any, Any]:
    """(encoder config, decoder config): a composite model's own (VisionEncoderDecoder, EncoderDecoder), else
    the one config twice."""
    encoder, decoder = getattr(hf, "encoder", None), getattr(hf, "decoder", None)
    composite = all(hasattr(part, "to_dict") for part in (encoder, decoder))
    return (encoder, decoder) if composite else (hf, hf)


def _encoder_params(spec: "TrainSpec") -> int:
    """Matmul weights of the encoder: its parameters less the embeddings it only looks up."""
    from torch import nn

    from autofit.models.info import meta_model

    model = meta_model(spec.model_factory)
    encoder = model.get_encoder()
    looked_up = {id(p) for m in encoder.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in encoder.parameters() if id(p) not in looked_up)


def _patches(hf: Any) -> int | None:
    """A vision transformer's positions: its image in patches, and a class token."""
    return formula_positions(hf, None)


def _frames(hf: Any, sample: Any) -> int | None:
    """Encoder frames of a speech model: Whisper's fixed window (`max_source_positions`, 1,500 for 30 s),
    log-mel rows over the frames per encoder position (`feature_layout`: Speech2Text's 4), or a waveform
    model's samples over its convolutions' total stride."""
    if getattr(hf, "num_mel_bins", None) is not None and getattr(hf, "max_source_positions", None):
        return int(hf.max_source_positions)
    features, layout = _sequence(sample, "input_features"), feature_layout(hf)
    if features and layout:
        return max(1, features // layout[2])
    stride = getattr(hf, "conv_stride", None)
    values = sample.get("input_values") if isinstance(sample, dict) else None
    if stride and values is not None:
        return int(values.shape[-1]) // math.prod(stride)
    return None


def _spectrogram_patches(hf: Any) -> int | None:
    """Positions of the Audio Spectrogram Transformer: its spectrogram cut into `patch_size` squares at
    `frequency_stride` x `time_stride`, plus a class and a distillation token (ASTEmbeddings)."""
    names = ("patch_size", "frequency_stride", "time_stride", "num_mel_bins", "max_length")
    patch, f_stride, t_stride, mels, length = (getattr(hf, name, None) for name in names)
    if not all(isinstance(v, int) and v > 0 for v in (patch, f_stride, t_stride, mels, length)):
        return None
    return ((mels - patch) // f_stride + 1) * ((length - patch) // t_stride + 1) + 2


def _sequence(sample: Any, key: str) -> int | None:
    value = sample.get(key) if isinstance(sample, dict) else None  # a detector's labels are dicts: no sequence
    return int(value.shape[1]) if isinstance(value, torch.Tensor) and value.dim() >= 2 else None


def _width(hf: Any) -> int:
    heads, head_dim = config_int(hf, "num_heads", "num_attention_heads", "n_head", default=0), getattr(hf, "d_kv", None)
    if heads and head_dim:
        return heads * head_dim
    return config_int(hf, "hidden_size", "d_model", "n_embd", default=0)
