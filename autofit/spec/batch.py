"""Batches as users give them: a tensor, a tuple/list of tensors, or a dict of tensors (Hugging Face).

Every tensor's first axis is the sample axis. A sample batch is turned into a factory of batches of any
size by taking its rows cyclically, so micro-batches are exact slices of the global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from autofit.errors import UsageError

Batch = Any
BatchFactory = Callable[[int], Batch]


def made(batch_factory: BatchFactory, num_samples: int) -> Batch:
    """`batch_factory(num_samples)`, checked to hold exactly that many samples (a factory that returns a
    fixed size would have every micro-batch measured at that size)."""
    batch = plain(batch_factory(num_samples))
    rows = leading_dim(batch)
    if rows != num_samples:
        raise UsageError(f"make_batch({num_samples}) returned a batch of {rows} samples; it must return exactly the "
                         "number it is asked for (autofit asks for 2 and 3 up front, then for each micro-batch "
                         "size it measures)." + _time_major_hint(_leaves(batch), {num_samples}))
    return batch


def _leaves(batch: Batch) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, torch.Tensor)]


def check_factory(make_batch: BatchFactory) -> None:
    """`UsageError` when `make_batch` cannot be called with the number of samples alone."""
    if not binds(make_batch, (1,), {}):
        raise UsageError(f"make_batch{signature_text(make_batch)} must take the number of samples to make, as "
                         "make_batch(num_samples) -> batch (e.g. lambda n: torch.randn(n, 32)); or pass one sample "
                         "batch instead of a factory.")


def leading_dim(batch: Batch) -> int:
    """Number of samples in `batch`; all tensors must agree on their first axis, but those of a dict
    field holding one dict per sample (`_targets`: detection targets), which holds one per sample."""
    batch = plain(batch)
    batched = {k: v for k, v in batch.items() if not _targets(v)} if isinstance(batch, dict) else batch
    size = _tensor_rows(batched, batch)
    for key, value in (batch.items() if isinstance(batch, dict) else ()):
        if _targets(value) and len(value) != size:
            raise UsageError(f"batch[{key!r}] holds {len(value)} per-sample entries, but the batch's tensors hold "
                             f"{size} samples; give one entry per sample.")
    return size


def _tensor_rows(batched: Batch, batch: Batch) -> int:
    """The first axis every tensor of `batched` (the batch less its per-sample fields) agrees on."""
    leaves = _leaves(batched)
    if not leaves:
        raise UsageError(f"The batch holds no tensors (got {type(batch).__name__}); pass a tensor, "
                         "a tuple of tensors or a dict of tensors.")
    sizes = {tuple(leaf.shape[:1]) for leaf in leaves}
    if () in sizes:
        raise UsageError("The batch holds a 0-dimensional tensor, which cannot be sliced into "
                         "micro-batches; give every tensor a leading sample axis.")
    if len(sizes) > 1:
        raise UsageError(f"The batch's tensors disagree on the sample axis (first dims {sorted(s[0] for s in sizes)}), "
                         "so it cannot be sliced into micro-batches; give every tensor the same first dimension."
                         + _time_major_hint(leaves, {leaf.shape[0] for leaf in leaves}))
    return sizes.pop()[0]


def _time_major_hint(leaves: list[torch.Tensor], counts: set[int]) -> str:
    """Where a tensor holds one of the sample `counts` (the other tensors' first axes; the count a factory was
    asked for) on its second axis and not its first, it is likely time-major (steps first), as `nn.LSTM`,
    `nn.GRU` and `nn.Transformer` take by default."""
    for leaf in leaves:
        if leaf.dim() in (2, 3) and leaf.shape[1] in counts - {leaf.shape[0]}:  # ids or features, not images
            samples_first = (leaf.shape[1], leaf.shape[0], *leaf.shape[2:])
            return (f" A tensor of shape {tuple(leaf.shape)} looks time-major (steps first, samples second: the "
                    "default of nn.LSTM, nn.GRU and nn.Transformer without batch_first=True); autofit slices the "
                    f"first axis: pass it samples first, {samples_first}, and build those layers with "
                    "batch_first=True or transpose it inside forward.")
    return ""


def take_rows(batch: Batch, start: int, count: int) -> Batch:
    """Rows `start .. start+count` of `batch`, wrapping around its end (the batch is tiled as needed)."""
    size = leading_dim(batch)
    index = torch.arange(start, start + count) % size

    def take(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.index_select(0, index.to(leaf.device))

    rows = index.tolist()
    return map_fields(plain(batch), size, lambda part: tree_map(take, part), lambda values: [values[i] for i in rows])


def map_fields(batch: Batch, size: int, tensors: Callable[[Any], Any], per_sample: Callable[[Any], Any]) -> Batch:
    """`batch` with `tensors` applied to its tensor parts and, in a dict batch, `per_sample` to each field that
    holds one plain value per sample (a list or tuple of `size` strings or numbers, such as raw texts), so
    slicing keeps them beside their samples."""
    if not isinstance(batch, dict):
        return tensors(batch)
    return {key: per_sample(value) if _per_sample(value, size) else tensors(value) for key, value in batch.items()}


def _per_sample(value: Any, size: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == size and size > 0 and (_targets(value) or all(
        isinstance(v, (str, bytes, int, float, bool)) or v is None for v in value))


def _targets(value: Any) -> bool:
    """A dict field holding one dict or one tensor per sample, as object detectors and mask segmenters take
    their targets (DETR, YOLOS, RT-DETR: `labels=[{"class_labels": ..., "boxes": ...}, ...]`; Mask2Former,
    MaskFormer: `mask_labels=[objects x height x width, ...]`, `class_labels=[objects, ...]`): its
    tensors' first axes count objects, not samples."""
    return isinstance(value, (list, tuple)) and bool(value) and (
        all(isinstance(v, Mapping) for v in value) or all(isinstance(v, torch.Tensor) for v in value))


def factory_from_sample(sample: Batch) -> BatchFactory:
    """A `make_batch(n)` that returns `n` rows of `sample`, cycling through them."""
    if leading_dim(sample) == 0:  # validate now, not inside the first probe
        raise UsageError("The sample batch holds 0 samples, so there is nothing to train on; give a batch with at "
                         "least one sample (ideally at the largest shape the job will see).")
    return functools.partial(take_rows, sample, 0)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` with every tensor on `device`."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, plain(batch))


def plain(batch: Batch) -> Batch:
    """`batch` as a dict when it is another kind of mapping (a tokenizer's `BatchEncoding`, a `UserDict`),
    which torch's pytree would take as one opaque leaf; anything else as it is."""
    return dict(batch) if isinstance(batch, Mapping) and not isinstance(batch, dict) else batch


def tokens_per_sample(batch: Batch) -> int | None:
    """Tokens per sample where the batch has a sequence axis (token ids), else None: a multiple-choice
    sample's (choices, tokens) count all. Labels count as tokens only as (samples, tokens): a
    segmentation's (samples, height, width) are pixels."""
    if isinstance(batch, dict):
        ids = next((batch[k] for k in ("input_ids", "labels") if isinstance(batch.get(k), torch.Tensor)
                    and (batch[k].dim() == 2 or k == "input_ids" and batch[k].dim() > 2)
                    and not batch[k].is_floating_point()), None)
        return int(ids[0].numel()) if ids is not None else None
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


@contextlib.contextmanager
def quiet_transformers() -> Any:
    """transformers' warnings held back while autofit runs a model to look at it (a meta forward, a
    simulated step): what it warns of there (`use_cache` under the checkpointing a simulation switched
    on, the loss it picks for a head) concerns autofit's look, not the plan; a dry-run printed them
    above its table. torch's fake tensors log a traceback for each op that fails under them (a batch the model
    cannot take): the look's own error says it once. Probes and the user's own training keep them."""
    import logging as std_logging

    from transformers.utils import logging

    level, fake = logging.get_verbosity(), std_logging.getLogger("torch._subclasses.fake_tensor")
    fake_level = fake.level
    logging.set_verbosity_error()
    fake.setLevel(std_logging.CRITICAL)
    try:
        yield
    finally:
        logging.set_verbosity(level)
        fake.setLevel(fake_level)


def call_model(model: torch.nn.Module, batch: Batch) -> Any:
    """Run `model` on `batch`: dict -> model(**batch); tuple/list -> model(batch[0]); tensor -> model(batch).

    A tuple is read as (inputs, targets, ...): the targets reach the loss through `loss_fn(output, batch)`.
    A dict's keys that `forward` does not take (`labels` for a model whose loss is `loss_fn`'s) are left out
    of the call and reach the loss alone, as the Trainer leaves out columns the model does not take.
    """
    args, kwargs = call_arguments(model, batch)
    return model(*args, **kwargs)


def call_arguments(model: torch.nn.Module, batch: Batch) -> tuple[tuple, dict]:
    """The positional and keyword arguments `call_model` passes `model` for `batch`."""
    if isinstance(batch, Mapping):
        return (), dict(forward_fields(model, batch))
    if isinstance(batch, (tuple, list)):
        return (batch[0],), {}
    return (batch,), {}


def forward_fields(model: torch.nn.Module, batch: Mapping) -> Mapping:
    """The fields of a dict `batch` that `model`'s forward takes by name: all of them when it takes any
    keyword (`**kwargs`, as Hugging Face models do)."""
    names = forward_names(model)
    if names is None or names.issuperset(batch):
        return batch
    return {key: value for key, value in batch.items() if key in names}


def forward_names(model: torch.nn.Module) -> frozenset[str] | None:
    """The keyword arguments `model`'s forward takes, None for any. A pass-through wrapper (DDP and DeepSpeed's
    engine: `forward(*inputs, **kwargs)` around `.module`; peft's `PeftModel`; `torch.compile`'s module) is
    read through to the forward it calls."""
    try:
        parameters = inspect.signature(getattr(model, "forward", model)).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return None
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        return frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    inner = wrapped_module(model) if any(p.kind is p.VAR_POSITIONAL for p in parameters) else None
    return None if inner is None else forward_names(inner)


def wrapped_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module a pass-through wrapper calls, if `model` is one."""
    for inner in (getattr(model, "_orig_mod", None), getattr(model, "module", None)):
        if isinstance(inner, torch.nn.Module):
            return inner
    base = getattr(model, "get_base_model", None)  # peft
    inner = base() if callable(base) else None
    return inner if isinstance(inner, torch.nn.Module) and inner is not model else None


def check_call(model: torch.nn.Module, batch: Batch, loss_fn: Any) -> None:
    """`UsageError` when `model.forward` cannot take `batch` as `call_model` passes it, or `loss_fn` cannot
    take (output, batch): found by binding the signatures, before any probe runs."""
    if loss_fn is not None and not binds(loss_fn, (None, None), {}):
        raise UsageError(f"loss_fn{signature_text(loss_fn)} must take two arguments, (output, batch), and return the "
                         "scalar loss tensor, e.g. loss_fn=lambda output, batch: F.cross_entropy(output, batch[1]).")
    if model._forward_pre_hooks:  # a hook may rewrite the arguments
        return
    name = f"{type(model).__name__}.forward{signature_text(model.forward)}"
    if isinstance(batch, dict):
        _check_fields(model, name, batch, loss_fn)
    elif isinstance(batch, (tuple, list)):
        if not binds(model.forward, (batch[0],), {}):
            raise UsageError(f"{name} cannot take a tuple batch's first element alone (a tuple (inputs, targets, "
                             "...) is passed as model(inputs), the rest reaches loss_fn): give a dict batch to pass "
                             "several arguments by name, as model(**batch); keys forward does not take (the "
                             "targets) reach loss_fn alone.")
    elif not binds(model.forward, (batch,), {}):
        raise UsageError(f"{name} cannot take the batch as its one argument (a tensor batch is passed as "
                         "model(batch)): give a dict batch to pass arguments by name, as model(**batch).")


def _check_fields(model: torch.nn.Module, name: str, batch: dict, loss_fn: Any) -> None:
    """A dict batch: forward takes the keys it names, and a key it does not take is there for `loss_fn`."""
    taken = forward_fields(model, batch)
    left = sorted(set(batch) - set(taken))
    if left and loss_fn is None:
        raise UsageError(f"{name} does not take the batch's keys {left}, and no loss_fn reads them (a dict batch is "
                         "passed as model(**batch), less the keys forward does not take): pass loss_fn(output, "
                         "batch) computing the loss from them, or name the keys after forward's parameters.")
    if not binds(model.forward, (), taken):
        raise UsageError(f"{name} cannot be called with the batch's keys {sorted(taken)} as keyword arguments (a "
                         "dict batch is passed as model(**batch), less the keys forward does not take): name the "
                         "keys after forward's parameters.")


def binds(function: Any, args: tuple, kwargs: dict) -> bool:
    """Whether `function(*args, **kwargs)` matches its signature (True when it has none to read)."""
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin)
        return True
    return True


def signature_text(function: Any) -> str:
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return "(...)"


def default_loss(output: Any, batch: Batch) -> torch.Tensor:
    """`output.loss` (Hugging Face), `output["loss"]`, `output` itself when it is a scalar tensor, or the one
    scalar tensor of a tuple (nanoGPT's `(logits, loss)`, a `return_dict=False` model's `(loss, logits)`)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if loss is None and isinstance(output, (tuple, list)):
        scalars = [x for x in output if isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()]
        loss = scalars[0] if len(scalars) == 1 else None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UsageError(
            f"The model returned {_described(output)}, which has no scalar loss. Pass labels in the batch (Hugging "
            "Face), make forward return the loss, or pass loss_fn=lambda output, batch: ... to autofit (autofit "
            "tune: --loss-fn FILE.py:fn, or a factory returning (model, make_batch, loss_fn))."
            + (" A tuple batch gives the model its first item alone: a dict batch whose keys are forward's "
               "arguments (e.g. {'idx': x, 'targets': y}) gives it the targets too." if isinstance(batch, tuple) else "")
        )
    return loss


def _described(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, (tuple, list)):
        scalars = sum(isinstance(x, torch.Tensor) and x.dim() == 0 for x in output)
        return f"a {type(output).__name__} of {len(output)} items, {scalars} of them a scalar tensor"
    return f"a {type(output).__name__}"


def checked_loss(loss: Any) -> torch.Tensor:
    """`loss` when it is what backward needs (a one-element tensor that depends on trainable parameters),
    else the `UsageError` naming what `loss_fn` returned and the fix."""
    if not isinstance(loss, torch.Tensor):
        value = f" ({loss!r})" if isinstance(loss, (int, float)) else ""
        raise UsageError(f"loss_fn returned a {type(loss).__name__}{value}, not a tensor: return the loss tensor "
                         "itself (without .item() or float()), e.g. loss_fn=lambda output, batch: "
                         "F.cross_entropy(output, batch[1]).")
    if loss.numel() != 1:
        raise UsageError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar: reduce it, e.g. "
                         "with .mean() (or reduction='mean' in the loss).")
    if not loss.requires_grad:
        raise UsageError("The loss does not depend on any trainable parameter (it was detached, computed under "
                         "torch.no_grad(), or every parameter is frozen): return the loss autograd can backward through.")
    return loss


def synthesize_batch(config: Any, seq_len: int | None, model_class: str | None = None) -> tuple[BatchFactory, str]:
    """A batch factory for a Hugging Face model built from its config, and a one-line description.

    The batch follows what the model's `forward` takes (`model_class` names the transformers class; the
    config's `architectures` otherwise): speech encoder-decoders (Whisper) get log-mel `input_features`
    of the encoder's full window and decoder `labels` of `seq_len` tokens, other log-mel models frames as
    rows (`_feature_frames`: Speech2Text, Parakeet, Wav2Vec2-BERT); waveform models (wav2vec2)
    `seq_len` audio samples and CTC transcripts or clip labels (`_audio`); image-text models (CLIP,
    SigLIP) token ids, pixel values and `return_loss`; vision-language models an image's placeholder
    tokens and text (`VisionLanguageBatches`); image-to-text encoder-decoders (VisionEncoderDecoder:
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
        if getattr(config, "image_token_id", None) is not None:
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


def takes_labels(params: frozenset[str]) -> bool:
    """Whether a forward with these arguments takes targets for its loss (`labels`, `next_sentence_label`,
    DETR's list of `labels`, `mc_labels`): a model whose forward takes none computes its loss alone (ViTMAE)
    or has no head at all (`presets.check_head`)."""
    return any("label" in param for param in params)


def forward_parameters(model_class: str | None) -> frozenset[str]:
    """Names of the arguments of transformers class `model_class`'s forward (empty when unknown)."""
    import transformers

    cls = getattr(transformers, model_class, None) if model_class else None
    if cls is None or not hasattr(cls, "forward"):
        return frozenset()
    return frozenset(inspect.signature(cls.forward).parameters) - {"self", "kwargs"}


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


def _image_text_to_text(config: Any, seq_len: int | None, name: str,
                        params: frozenset[str]) -> tuple[BatchFactory, str]:
    """Vision-language models trained as a language model over an image's tokens (LLaVA, PaliGemma,
    Gemma 3, InternVL): `VisionLanguageBatches` of `seq_len` tokens (default the text model's maximum
    positions, at most 2048), one image at the vision config's size."""
    count, text = image_tokens(config), getattr(config, "text_config", config)
    if count is None or getattr(config, "image_grid_pinpoints", None):  # LLaVA-NeXT's tiles follow the image
        raise UsageError(f"Cannot synthesize a batch for {name or type(config).__name__}: the tokens it gives an "
                         "image follow the image's size and tiling; pass a batch (its processor's output for an image "
                         "and a text) or a make_batch(batch_size) factory.")
    length = _length(text, seq_len)
    if length <= count:
        raise UsageError(f"seq_len {length} leaves no text after the image's {count} tokens in {name}; give "
                         f"--seq-len above {count}.")
    pixels, _ = _pixels(config.vision_config)
    batches = VisionLanguageBatches(pixels, int(config.image_token_id), count, length, int(text.vocab_size),
                                    "token_type_ids" in params)
    return batches, (f"input_ids of {length} tokens ({count} image tokens, {length - count} of text, labels on the "
                     f"text) and pixel_values {_shape(pixels)}")


@dataclasses.dataclass(frozen=True)
class Field:
    """One tensor of a synthesized batch: its name, its shape per sample, and its values (`high` > 0:
    integers in [low, high), token ids or labels; 0: standard normal floats, pixels or features)."""

    name: str
    shape: tuple[int, ...]
    high: int = 0
    low: int = 0
    end: int | None = None  # the id each sample's last position holds and no other does (an `<eos>`)

    def make(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """The field's tensor for `n` samples."""
        shape = (n, *self.shape)
        if not self.high:
            return torch.randn(shape, generator=gen)
        if self.end is None:
            return torch.randint(self.low, self.high, shape, generator=gen)
        values = _ids_without(self.end, self.low, self.high, shape, gen)
        values[..., -1] = self.end
        return values


def _ids_without(skipped: int, low: int, high: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random ids in [low, high) that are never `skipped` (an `<eos>`, an image's placeholder)."""
    ids = torch.randint(low, high - 1, shape, generator=gen)
    return ids + (ids >= skipped).long()


@dataclasses.dataclass(frozen=True)
class SyntheticBatches:
    """make_batch(n): the fields' tensors with a leading axis of n samples, plus fixed keyword
    arguments (`extras`, such as CLIP's return_loss=True). Picklable, so child probes rebuild it."""

    fields: tuple[Field, ...]
    extras: tuple[tuple[str, Any], ...] = ()

    def __call__(self, n: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(0)
        batch: dict[str, Any] = {}
        for f in self.fields:
            batch[f.name] = f.make(n, gen)
        batch.update(self.extras)
        return batch


@dataclasses.dataclass(frozen=True)
class VisionLanguageBatches:
    """make_batch(n) for a vision-language model: an image's `image_tokens` placeholders (`image_token`)
    then random text ids (never the placeholder), labels on the text (-100 on the image: no loss there),
    the image's pixel values, and `token_type_ids` where the model takes them (0 on the image, 1 on the
    text: PaliGemma's and Gemma 3's training masks)."""

    pixels: Field
    image_token: int
    image_tokens: int
    length: int
    vocab: int
    token_types: bool = False

    def __call__(self, n: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(0)
        text = _ids_without(self.image_token, 0, self.vocab, (n, self.length - self.image_tokens), gen)
        image = torch.full((n, self.image_tokens), self.image_token)
        batch = {"input_ids": torch.cat([image, text], dim=1),
                 "labels": torch.cat([torch.full_like(image, -100), text], dim=1),
                 self.pixels.name: torch.randn((n, *self.pixels.shape), generator=gen)}
        if self.token_types:
            batch["token_type_ids"] = torch.cat([torch.zeros_like(image), torch.ones_like(text)], dim=1)
        return batch


@dataclasses.dataclass(frozen=True)
class WithPixels:
    """make_batch(n): `text`'s batch of n samples with their images' `pixels` (`_document`)."""

    text: BatchFactory
    pixels: Field

    def __call__(self, n: int) -> dict[str, Any]:
        return {**self.text(n), self.pixels.name: torch.randn((n, *self.pixels.shape),
                                                              generator=torch.Generator().manual_seed(1))}


OBJECTS_PER_IMAGE = 8  # COCO's images hold 7.3 annotated objects on average (its 2017 train split)


@dataclasses.dataclass(frozen=True)
class _ObjectBatches:
    """make_batch(n) for models trained on objects in images: pixel values and, per image, `objects` targets
    of `classes` classes (`_targets`)."""

    pixels: Field
    classes: int
    objects: int = OBJECTS_PER_IMAGE

    def __call__(self, n: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(0)
        pixels = torch.randn((n, *self.pixels.shape), generator=gen)
        return {self.pixels.name: pixels, **self._targets(n, gen)}

    def _targets(self, n: int, gen: torch.Generator) -> dict[str, list]:
        raise NotImplementedError


class DetectionBatches(_ObjectBatches):
    """Object detectors (DETR, YOLOS, RT-DETR, ...): targets as transformers' detection losses take them,
    `labels`, a list of one dict per image of `class_labels` and `boxes` (centre x, centre y, width,
    height, relative to the image)."""

    def _targets(self, n: int, gen: torch.Generator) -> dict[str, list]:
        return {"labels": [{"class_labels": torch.randint(0, self.classes, (self.objects,), generator=gen),
                            "boxes": 0.25 + 0.5 * torch.rand(self.objects, 4, generator=gen)} for _ in range(n)]}


MASK_SEGMENTERS = ("ForUniversalSegmentation", "ForInstanceSegmentation")  # Mask2Former, MaskFormer: a mask per object


class MaskBatches(_ObjectBatches):
    """Mask segmenters (Mask2Former, MaskFormer): per image, the `mask_labels` (objects x height x width,
    binary) and `class_labels` (objects) their losses take."""

    def _targets(self, n: int, gen: torch.Generator) -> dict[str, list]:
        masks = [(torch.rand(self.objects, *self.pixels.shape[1:], generator=gen) > 0.5).float() for _ in range(n)]
        return {"mask_labels": masks, "class_labels": [torch.randint(0, self.classes, (self.objects,), generator=gen)
                                                       for _ in range(n)]}


@dataclasses.dataclass(frozen=True)
class TokenBatches:
    """make_batch(n) for causal language models: random token ids, labels equal to the inputs."""

    vocab_size: int
    seq_len: int

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab_size, (n, self.seq_len), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids.clone()}


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
