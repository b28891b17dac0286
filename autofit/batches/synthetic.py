"""Batches synthesized from a Hugging Face config, for a model given without one: what its `forward` takes
(token ids and the labels its head takes, pixel values, log-mel features or waveforms, an image's
placeholder tokens), at the largest shape the job will see, as a factory `make_batch(n)`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any


from autofit.errors import UsageError
from autofit.batches.batch import BatchFactory
from autofit.models.info import forward_parameters, takes_labels
from autofit.batches.synthetic_batches import (OBJECTS_PER_IMAGE, DetectionBatches, Field, MaskBatches, SyntheticBatches,
                                            PackedImageBatches, TokenBatches, VisionLanguageBatches,
                                            WithPixels)


def synthesize_batch(config: Any, seq_len: int | None, model_class: str | None = None) -> tuple[BatchFactory, str]:
    """A batch factory for a Hugging Face model built from its config, and a one-line description.

    The batch follows what the model's `forward` takes (`model_class` names the transformers class; the
    config's `architectures` otherwise): speech encoder-decoders (Whisper) get log-mel `input_features`
    of the encoder's full window and decoder `labels` of `seq_len` tokens, other log-mel models frames as
    rows (`_feature_frames`: Speech2Text, Parakeet, Wav2Vec2-BERT); waveform models (wav2vec2)
    `seq_len` audio samples and CTC transcripts or clip labels (`_audio`); image-text models (CLIP,
    SigLIP) token ids, pixel values and `return_loss`; vision-language models an image's placeholder
    tokens and text (`VisionLanguageBatches`; `PackedImageBatches` where the image's patches are packed over
    the samples, Qwen2-VL and its kin); image-to-text encoder-decoders (VisionEncoderDecoder:
    TrOCR, Donut, captioners) pixel values and decoder labels of `seq_len` tokens; image models pixel
    values and a label per image or per pixel, video models a clip of frames (`_image`; a `seq_len` is refused
    there); token classifiers a label per token; sequence classifiers a label per sample (ids ending in one
    `<eos>` where the head pools there: `_pools_at_eos`); multiple choice `MULTIPLE_CHOICES`
    sequences and the right one; BERT's next-sentence and pretraining heads their pair labels; question
    answering an answer span; text encoder-decoders (T5, BART) and language models token ids and labels
    of `seq_len` tokens (default: the model's maximum positions capped at 2048).
    """
    name = model_class or next(iter(getattr(config, "architectures", None) or ()), None) or ""
    params = forward_parameters(name)
    if "input_features" in params:
        return _speech(config, seq_len, name)
    if "input_values" in params:
        return _audio(config, seq_len, name)
    if "pixel_values" in params and "input_ids" in params:
        if image_token(config) is not None:
            return _image_text_to_text(config, seq_len, name, params)
        if "return_loss" in params:
            return _image_text(config, seq_len)
        return _document(config, seq_len, name, params)
    if "pixel_values" in params and "decoder_input_ids" in params:
        return _image_to_text(config, seq_len)
    image_size = getattr(config, "image_size", None)
    if "pixel_values" in params or (image_size is not None and not hasattr(config, "vocab_size")):
        _no_sequence(seq_len, name or type(config).__name__, "images of the config's image_size")
        return _image(config, name)
    return _text(config, seq_len, name, params)


def _text(config: Any, seq_len: int | None, name: str, params: frozenset[str]) -> tuple[BatchFactory, str]:
    """Token models: ids and the labels the head takes (see `synthesize_batch`)."""
    if params and not params & {"input_ids"}:
        raise UsageError(f"Cannot synthesize a batch for {name or type(config).__name__}: its forward takes "
                         f"{sorted(params)[:6]}, none of which autofit synthesizes. Pass a batch or a "
                         "make_batch(batch_size) factory.")
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise UsageError(f"Cannot synthesize a batch for {type(config).__name__}: it has neither vocab_size "
                         "nor image_size. Pass a batch or a make_batch(batch_size) factory.")
    length = _length(config, seq_len)
    ids = Field("input_ids", (length,), vocab)
    labels = _classes(config)
    if name.endswith("ForTokenClassification"):
        return SyntheticBatches((ids, Field("labels", (length,), labels))), \
            f"input_ids of {length} tokens and a label per token ({labels} classes)"
    if name.endswith("ForSequenceClassification"):
        eos = getattr(config, "eos_token_id", None) if _pools_at_eos(name) else None
        if isinstance(eos, int):  # each sample ends in its <eos> and holds no other, as a tokenizer makes it
            ids = dataclasses.replace(ids, end=eos)
        ending = f", each ending in <eos> (id {eos}: the head pools there)" if ids.end is not None else ""
        return SyntheticBatches((ids, Field("labels", (), labels))), \
            f"input_ids of {length} tokens{ending} and a label per sample ({labels} classes)"
    if name.endswith("ForNextSentencePrediction"):
        return SyntheticBatches((ids, Field("labels", (), 2))), f"input_ids of {length} tokens and whether B follows A"
    if name.endswith("ForMultipleChoice"):  # SWAG, RACE, ARC: 4 endings a question
        choices = Field("input_ids", (MULTIPLE_CHOICES, length), vocab)
        return SyntheticBatches((choices, Field("labels", (), MULTIPLE_CHOICES))), \
            f"input_ids of {MULTIPLE_CHOICES} choices x {length} tokens and the right choice"
    if "next_sentence_label" in params:  # BERT's pretraining: masked tokens and next sentence together
        both = (Field("labels", (length,), vocab), Field("next_sentence_label", (), 2))
        return SyntheticBatches((ids, *both)), f"input_ids and labels of {length} tokens and whether B follows A"
    if {"start_positions", "end_positions"} <= params:  # extractive question answering
        spans = (Field("start_positions", (), length), Field("end_positions", (), length))
        return SyntheticBatches((ids, *spans)), f"input_ids of {length} tokens and an answer span"
    if getattr(config, "is_encoder_decoder", False):  # decoder inputs given: no decoder_start_token_id needed
        decoder = (Field("decoder_input_ids", (length,), vocab), Field("labels", (length,), vocab))
        return SyntheticBatches((ids, *decoder)), f"input_ids and decoder labels of {length} tokens each"
    return TokenBatches(vocab, length), f"input_ids and labels of {length} tokens"


def _pools_at_eos(model_class: str) -> bool:
    """Whether transformers class `model_class` classifies from each sequence's `<eos>` (BART, mBART, PLBart,
    MVP, BigBird-Pegasus, T5, mT5, UMT5: `input_ids.eq(self.config.eos_token_id)`, then "All examples must
    have the same number of <eos> tokens"), read from its source: random ids hold none, or several."""
    import transformers

    try:
        return "input_ids.eq(self.config.eos_token_id)" in inspect.getsource(getattr(transformers, model_class).forward)
    except (AttributeError, OSError, TypeError):  # not a transformers class, or no source to read
        return False


def _length(config: Any, seq_len: int | None, cap: int = 2048) -> int:
    """`seq_len`, checked against the model's maximum positions (default: that maximum, at most `cap`)."""
    max_len = max_positions(config)
    length = seq_len or min(max_len or cap, cap)
    if max_len is not None and length > max_len:
        raise UsageError(f"seq_len {length} exceeds the model's maximum of {max_len} positions; "
                         f"use --seq-len {max_len} or less.")
    return length


def _speech(config: Any, seq_len: int | None, name: str) -> tuple[BatchFactory, str]:
    """Whisper-style: the encoder reads its whole window of log-mel frames (2 per position after its
    stride-2 convolution); the decoder is trained on `seq_len` label tokens. Other speech models read
    frames as rows (`_feature_frames`)."""
    mels, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    vocab = getattr(config, "vocab_size", None)
    if getattr(config, "model_type", "") != "whisper":
        return _feature_frames(config, seq_len, name)
    if not (mels and positions and vocab):
        raise UsageError(f"Cannot synthesize speech features for {type(config).__name__}: its config names no "
                         "num_mel_bins, max_source_positions or vocab_size; pass a batch or a make_batch(batch_size) "
                         "factory.")
    frames = 2 * positions
    if _clip_classifier(name):  # WhisperForAudioClassification: its encoder and a label per clip
        _no_sequence(seq_len, name, "the encoder's whole window of frames")
        classes = _classes(config)
        return SyntheticBatches((Field("input_features", (mels, frames)), Field("labels", (), classes))), \
            f"input_features {mels}x{frames} and a label per clip ({classes} classes)"
    length = _length(config, seq_len, cap=getattr(config, "max_target_positions", 448))
    fields = (Field("input_features", (mels, frames)), Field("labels", (length,), vocab))
    return SyntheticBatches(fields), f"input_features {mels}x{frames} and decoder labels of {length} tokens"


def _clip_classifier(name: str) -> bool:
    """Whether transformers class `name` classifies a whole clip (one label per sample)."""
    return name.endswith(("ForAudioClassification", "ForSequenceClassification"))


def feature_layout(config: Any) -> tuple[int, int, int] | None:
    """(features per frame, frames per second, frames per encoder position) of a speech model reading
    log-mel frames as rows of `input_features`: Speech2Text's 80 x channels at a 10 ms hop, subsampled by
    its convolutions (2 each); Parakeet's 80 mel bins, by its `subsampling_factor`; Wav2Vec2-BERT's and
    SeamlessM4T's 160 (two 80-bin frames stacked, 50 a second), one position each. None where the config
    names none of these."""
    per_channel = getattr(config, "input_feat_per_channel", None)
    if isinstance(per_channel, int) and per_channel > 0:
        return per_channel * getattr(config, "input_channels", 1), 100, 2 ** getattr(config, "num_conv_layers", 0)
    stacked = getattr(config, "feature_projection_input_dim", None)
    if isinstance(stacked, int) and stacked > 0:
        return stacked, 50, 1
    encoder = getattr(config, "encoder_config", None)
    mels = getattr(encoder, "num_mel_bins", None)
    if isinstance(mels, int) and mels > 0:
        return mels, 100, getattr(encoder, "subsampling_factor", 1)
    return None


def _feature_frames(config: Any, seq_len: int | None, name: str) -> tuple[BatchFactory, str]:
    """Speech models reading (frames, features) log-mel input (`feature_layout`): `AUDIO_SECONDS` of frames
    with decoder labels of `seq_len` tokens (an encoder-decoder: Speech2Text), or `seq_len` frames (default
    `AUDIO_SECONDS`) with CTC transcripts of a token per 3 encoder positions (Parakeet, Wav2Vec2-BERT) or a
    label per clip."""
    layout, vocab = feature_layout(config), getattr(config, "vocab_size", None)
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    if layout is None or not (_clip_classifier(name) or vocab and (encoder_decoder or name.endswith("ForCTC"))):
        raise UsageError(f"Cannot synthesize speech features for {name or type(config).__name__} (autofit knows "
                         "Whisper's layout, and frames as rows for Speech2Text, Parakeet and Wav2Vec2-BERT with a "
                         "decoder, CTC or a clip classifier); pass a batch or a make_batch(batch_size) factory.")
    features, rate, per_position = layout
    if _clip_classifier(name):
        frames, classes = seq_len or rate * AUDIO_SECONDS, _classes(config)
        return SyntheticBatches((Field("input_features", (frames, features)), Field("labels", (), classes))), \
            f"input_features {frames}x{features} ({frames / rate:.1f} s of frames) and a label per clip " \
            f"({classes} classes)"
    if encoder_decoder:
        frames = rate * AUDIO_SECONDS
        length = _length(config, seq_len, cap=getattr(config, "max_target_positions", 448))
        return SyntheticBatches((Field("input_features", (frames, features)), Field("labels", (length,), vocab))), \
            f"input_features {frames}x{features} ({AUDIO_SECONDS} s of frames) and decoder labels of {length} tokens"
    frames = seq_len or rate * AUDIO_SECONDS
    tokens = max(1, frames // per_position // 3)
    low, high = ctc_ids(config)
    mask = (Field("attention_mask", (frames,), 2, 1),)  # all ones: Parakeet's CTC loss reads its lengths there
    return SyntheticBatches((Field("input_features", (frames, features)), Field("labels", (tokens,), high, low),
                             *mask)), \
        f"input_features {frames}x{features} ({frames / rate:.1f} s of frames) and CTC transcripts of {tokens} tokens"


def ctc_ids(config: Any) -> tuple[int, int]:
    """[low, high) of a CTC head's target ids: its vocabulary without the blank, the pad id (wav2vec2's 0,
    Parakeet's last)."""
    vocab, blank = int(config.vocab_size), getattr(config, "pad_token_id", 0)
    return (0, vocab - 1) if blank == vocab - 1 else (1, vocab)


def _classes(config: Any) -> int:
    """Label classes of a classification head (`num_labels`, transformers' default 2)."""
    return max(int(getattr(config, "num_labels", 2)), 1)


def _no_sequence(seq_len: int | None, name: str, takes: str) -> None:
    """`UsageError` when a sequence length is given for a model whose input has a fixed size."""
    if seq_len is not None:
        raise UsageError(f"seq_len {seq_len} does not apply to {name}: it takes {takes}. Leave seq_len "
                         "(--seq-len) out, or pass a batch of the size you train on.")


MASK_SEGMENTERS = ("ForUniversalSegmentation", "ForInstanceSegmentation")  # Mask2Former, MaskFormer: a mask per object


DEFAULT_IMAGE_SIZE = 224  # what the image processors of convolutional models without one resize to (ResNet, RegNet)


def _image_to_text(config: Any, seq_len: int | None) -> tuple[BatchFactory, str]:
    """Image-to-text encoder-decoders (VisionEncoderDecoder): pixel values at the encoder's image size and
    decoder inputs and labels of `seq_len` tokens (default: the decoder's maximum positions, at most 2048).
    The decoder inputs are given, so no decoder_start_token_id is needed."""
    pixels, size = _pixels(config.encoder)
    length, vocab = _length(config.decoder, seq_len), config.decoder.vocab_size
    text = (Field("decoder_input_ids", (length,), vocab), Field("labels", (length,), vocab))
    return SyntheticBatches((pixels, *text)), f"pixel_values {_shape(pixels)} and decoder labels of {length} tokens{size}"


def _image(config: Any, name: str) -> tuple[BatchFactory, str]:
    """Image models: pixel values at the config's size, and a class label per image, or per pixel for
    semantic segmentation (SegFormer, BEiT, DPT: `labels` of the image's height x width), or object
    detection targets (`DetectionBatches`). A video model (VideoMAE, ViViT, TimeSformer: `...ForVideoClassification`)
    gets a clip of the config's `num_frames` images, frames first, as its forward takes them."""
    pixels, size = _pixels(config)
    frames = getattr(config, "num_frames", None) if "Video" in name else None
    if isinstance(frames, int) and frames > 0:
        pixels = dataclasses.replace(pixels, shape=(frames, *pixels.shape))
    labels = _classes(config)
    if name.endswith("ForObjectDetection"):
        return DetectionBatches(pixels, labels), (f"pixel_values {_shape(pixels)} and {OBJECTS_PER_IMAGE} objects per "
                                                  f"image (class and box, {labels} classes){size}")
    if name.endswith(MASK_SEGMENTERS):
        return MaskBatches(pixels, labels), (f"pixel_values {_shape(pixels)} and {OBJECTS_PER_IMAGE} objects per "
                                             f"image (a class and a mask each, {labels} classes){size}")
    if name.endswith("ForSemanticSegmentation"):
        return SyntheticBatches((pixels, Field("labels", pixels.shape[1:], labels))), \
            f"pixel_values {_shape(pixels)} and a label per pixel ({labels} classes){size}"
    params = forward_parameters(name)
    if params and not takes_labels(params):  # ViTMAE: masked patches, its own loss
        return SyntheticBatches((pixels,)), f"pixel_values {_shape(pixels)} (no labels: the model's own loss){size}"
    return SyntheticBatches((pixels, Field("labels", (), labels))), f"pixel_values {_shape(pixels)} and labels{size}"


def _pixels(config: Any) -> tuple[Field, str]:
    """Pixel values at a vision config's size, and a note when it names none: a convolutional model
    (ResNet, RegNet take any size) gets `DEFAULT_IMAGE_SIZE`, and its description says so."""
    channels = getattr(config, "num_channels", 3)
    sides, backbone = image_sides(config), getattr(config, "backbone_config", None)
    if sides is None and backbone is not None and image_sides(backbone) is not None:  # Mask2Former's Swin
        (height, width) = image_sides(backbone)
        size = " (the backbone config's image size; pass a batch of your images' size)"
    else:
        height, width = sides or (DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)
        size = "" if sides else \
            f" ({height}x{width}, the usual size: the config names none; pass a batch of your images' size)"
    return Field("pixel_values", (channels, height, width)), size


def image_sides(config: Any) -> tuple[int, int] | None:
    """(height, width) of a vision config's `image_size`: one side for square images (ViT's 224), or
    [height, width] (YOLOS' [512, 864]), LayoutLMv3's page image `input_size`; None where it names none."""
    size = getattr(config, "image_size", None) or (getattr(config, "input_size", None)
                                                   if getattr(config, "visual_embed", False) else None)
    if isinstance(size, int) and size > 0:
        return size, size
    if isinstance(size, (list, tuple)) and size and all(isinstance(side, int) for side in size):
        return size[0], size[-1]
    return None


def _shape(field: Field) -> str:
    """A pixel field's shape as read: `3x224x224`, or a clip's `16 frames of 3x224x224`."""
    image = "x".join(map(str, field.shape[-3:]))
    return f"{field.shape[0]} frames of {image}" if len(field.shape) > 3 else image


MULTIPLE_CHOICES = 4  # a multiple-choice head's endings per question when synthesized (SWAG, RACE, ARC)
AUDIO_RATE = 16_000  # samples per second: what every waveform model in transformers was trained on
AUDIO_SECONDS = 10  # default clip when no --seq-len is given


def _audio(config: Any, seq_len: int | None, name: str) -> tuple[BatchFactory, str]:
    """Waveform models (wav2vec2, HuBERT, WavLM): `seq_len` audio samples at 16 kHz (default 10 s) with
    CTC transcripts (a character per 3 output frames, about 17 per second at wav2vec2's 20 ms frames;
    ids from 1, the blank being the pad id 0), a label per clip, or for a waveform encoder-decoder
    (SpeechT5's speech-to-text) decoder labels of as many characters, at most its `max_text_positions`.
    The Audio Spectrogram Transformer takes a spectrogram of `max_length` frames x `num_mel_bins` instead."""
    labels = _classes(config)
    if getattr(config, "model_type", "") == "audio-spectrogram-transformer":
        _no_sequence(seq_len, name, "spectrograms of the config's max_length frames")
        shape = (int(config.max_length), int(config.num_mel_bins))
        return SyntheticBatches((Field("input_values", shape), Field("labels", (), labels))), \
            f"input_values {shape[0]}x{shape[1]} (spectrogram frames x mel bins) and a label per clip"
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    transcribes = name.endswith("ForSpeechToText") and getattr(config, "is_encoder_decoder", False)
    if not (kernels and strides) or not (name.endswith("ForCTC") or transcribes or _clip_classifier(name)):
        raise UsageError(f"Cannot synthesize audio for {name or type(config).__name__} (autofit knows "
                         "waveform CTC, speech-to-text and clip classification heads, and the Audio Spectrogram "
                         "Transformer); pass a batch or a make_batch(batch_size) factory.")
    samples = seq_len or AUDIO_RATE * AUDIO_SECONDS
    frames = samples
    for kernel, stride in zip(kernels, strides):
        frames = (frames - kernel) // stride + 1
    if frames < 1:
        raise UsageError(f"seq_len {samples} audio samples is shorter than {name}'s convolutions take in; "
                         f"give --seq-len in samples at {AUDIO_RATE // 1000} kHz, e.g. {AUDIO_RATE} for a second.")
    audio = Field("input_values", (samples,))
    clip = f"input_values of {samples:,} samples ({samples / AUDIO_RATE:.1f} s at {AUDIO_RATE // 1000} kHz)"
    if transcribes:
        characters = max(1, min(frames // 3, getattr(config, "max_text_positions", frames // 3)))
        return SyntheticBatches((audio, Field("labels", (characters,), config.vocab_size))), \
            f"{clip} and decoder labels of {characters} characters"
    if name.endswith("ForCTC"):
        characters = max(1, frames // 3)
        low, high = ctc_ids(config)
        return SyntheticBatches((audio, Field("labels", (characters,), high, low))), \
            f"{clip} and CTC transcripts of {characters} characters"
    return SyntheticBatches((audio, Field("labels", (), labels))), f"{clip} and a label per clip ({labels} classes)"


def _document(config: Any, seq_len: int | None, name: str, params: frozenset[str]) -> tuple[BatchFactory, str]:
    """Models that read a page's text and its image together (LayoutLMv3's classifiers and question
    answering, GIT's captioner): the text batch its head takes, and the image's pixel values."""
    text, description = _text(config, seq_len, name, params)
    pixels, size = _pixels(getattr(config, "vision_config", config))
    return WithPixels(text, pixels), f"{description}, and pixel_values {_shape(pixels)}{size}"


def _image_text(config: Any, seq_len: int | None) -> tuple[BatchFactory, str]:
    """CLIP-style contrastive models: token ids, pixel values and `return_loss=True`."""
    text = getattr(config, "text_config", config)
    vision = getattr(config, "vision_config", config)
    length = _length(text, seq_len, cap=max_positions(text) or 77)
    pixels, _ = _pixels(vision)
    fields = (Field("input_ids", (length,), text.vocab_size), pixels)
    return SyntheticBatches(fields, (("return_loss", True),)), \
        f"input_ids of {length} tokens and pixel_values {_shape(pixels)} (contrastive loss)"


def image_tokens(config: Any) -> int | None:
    """Placeholder tokens a vision-language model gives one image, where its config fixes them: LLaVA's
    and InternVL's `image_seq_length`, Gemma 3's `mm_tokens_per_image`, BLIP-2's and InstructBLIP's query
    tokens (`num_query_tokens`), PaliGemma's text config's `num_image_tokens`; None where they follow the
    image's size (LLaVA-NeXT, Qwen2-VL, Idefics3)."""
    for holder, name in ((config, "image_seq_length"), (config, "mm_tokens_per_image"), (config, "num_query_tokens"),
                         (getattr(config, "text_config", None), "num_image_tokens")):
        count = getattr(holder, name, None)
        if isinstance(count, int) and count > 0:
            return count
    return None


def image_token(config: Any) -> int | None:
    """The id of the placeholder token an image's features replace: `image_token_id`, which transformers 4.x
    names `image_token_index` on LLaVA, LLaVA-NeXT and kin (4.46); None for a config without one."""
    found = getattr(config, "image_token_id", None)
    return found if found is not None else getattr(config, "image_token_index", None)


def _image_text_to_text(config: Any, seq_len: int | None, name: str,
                        params: frozenset[str]) -> tuple[BatchFactory, str]:
    """Vision-language models trained as a language model over an image's tokens (LLaVA, PaliGemma,
    Gemma 3, InternVL): `VisionLanguageBatches` of `seq_len` tokens (default the text model's maximum
    positions, at most 2048), one image at the vision config's size."""
    if "image_grid_thw" in params:
        return _packed_image_text(config, seq_len, name)
    count, text = image_tokens(config), getattr(config, "text_config", config)
    if count is None or getattr(config, "image_grid_pinpoints", None):  # LLaVA-NeXT's tiles follow the image
        raise UsageError(f"Cannot synthesize a batch for {name or type(config).__name__}: the tokens it gives an "
                         "image follow the image's size and tiling; pass a batch (its processor's output for an image "
                         "and a text) or a make_batch(batch_size) factory.")
    length = _length(text, seq_len)
    _room_for_text(length, count, name)
    pixels, _ = _pixels(config.vision_config)
    batches = VisionLanguageBatches(pixels, int(image_token(config)), count, length, int(text.vocab_size),
                                    "token_type_ids" in params)
    return batches, (f"input_ids of {length} tokens ({count} image tokens, {length - count} of text, labels on the "
                     f"text) and pixel_values {_shape(pixels)}")


def _room_for_text(length: int, count: int, name: str) -> None:
    if length <= count:
        raise UsageError(f"seq_len {length} leaves no text after the image's {count} tokens in {name}; give "
                         f"--seq-len above {count}.")


PACKED_IMAGE_SIDE = 32  # patches along each side of a synthesized image: 448 x 448 pixels at Qwen2-VL's 14, 256 tokens


def _packed_image_text(config: Any, seq_len: int | None, name: str) -> tuple[BatchFactory, str]:
    """Vision-language models whose images' patches are packed over the samples and whose tokens follow the
    image's size (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V): `PackedImageBatches` of `seq_len` tokens
    (default the text model's maximum positions, at most 2048), one image of `PACKED_IMAGE_SIDE` patches a
    side per sample."""
    vision, text = config.vision_config, getattr(config, "text_config", config)
    patch, frames = int(vision.patch_size), int(vision.temporal_patch_size)
    batches = PackedImageBatches(int(image_token(config)), (1, PACKED_IMAGE_SIDE, PACKED_IMAGE_SIDE),
                                 int(vision.spatial_merge_size) ** 2, int(vision.in_channels) * frames * patch * patch,
                                 _length(text, seq_len), int(text.vocab_size))
    count, length = batches.image_tokens, batches.length
    _room_for_text(length, count, name)
    side = PACKED_IMAGE_SIDE * patch
    return batches, (f"input_ids of {length} tokens ({count} image tokens, {length - count} of text, labels on the "
                     f"text) and one {side}x{side} image's {batches.patches} patches packed")


# Models that number positions from padding_idx + 1, as fairseq did (transformers'
# `create_position_ids_from_input_ids`, models/roberta/modeling_roberta.py, with `padding_idx` on their
# position embeddings): of roberta-base's 514 position embeddings, 512 hold tokens, and a 514-token batch
# fails with "index 514 is out of bounds".
POSITIONS_AFTER_PADDING = frozenset({
    "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm", "data2vec-text", "longformer",
    "ibert", "xmod", "luke", "markuplm", "mpnet", "lilt", "layoutlmv3", "esm", "clap_text_model",
    "altclip_text_model", "bridgetower_text_model"})


def max_positions(config: Any) -> int | None:
    """The longest sequence a Hugging Face config allows, when it says (`POSITIONS_AFTER_PADDING`: less the
    padding id and the one before it)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            if name == "max_position_embeddings" and getattr(config, "model_type", None) in POSITIONS_AFTER_PADDING:
                return value - (getattr(config, "pad_token_id", None) or 0) - 1
            return value
    return None
