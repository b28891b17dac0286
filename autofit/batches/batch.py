"""Batches as users give them: a tensor, a tuple/list of tensors, or a dict of tensors (Hugging Face).

Every tensor's first axis is the sample axis, but the images Qwen2-VL and its kin pack over the samples
(`PACKED`), which go with the samples whose placeholders they fill. A sample batch is turned into a factory
of batches of any size by taking its rows cyclically, so micro-batches are exact slices of the global batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Mapping
from typing import Any, Callable, Sequence

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
    batched = {k: v for k, v in without_packed(batch).items() if not _targets(v)} if isinstance(batch, dict) else batch
    size = _tensor_rows(batched, batch)
    for fields in packed_fields(batch):
        _sample_spans(batch, size, *fields)  # checks the packed images against the samples' placeholders
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

    rows, batch = index.tolist(), plain(batch)
    taken = map_fields(without_packed(batch), size, lambda part: tree_map(take, part),
                       lambda values: [values[i] for i in rows])
    return {**taken, **packed_rows(batch, size, rows)} if packed_fields(batch) else taken


# Qwen2-VL and its kin (Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V) take every image's patches packed in one
# tensor, patches first, and one row per image of its grid (frames, height, width in patches); the tokens that
# stand for them are marked in `mm_token_type_ids`, 1 for an image's and 2 for a video's (transformers'
# Qwen2VLProcessor, `create_mm_token_type_ids`). A sample's images are the next ones in order whose tokens
# (patches over the merge factor, the same for every image) make its count.
PACKED = (("pixel_values", "image_grid_thw", 1), ("pixel_values_videos", "video_grid_thw", 2))


def packed_fields(batch: Batch) -> list[tuple[str, str, int]]:
    """The (patches, grid, token type) fields of `PACKED` a dict batch holds."""
    if not isinstance(batch, dict):
        return []
    return [fields for fields in PACKED if isinstance(batch.get(fields[1]), torch.Tensor)
            and isinstance(batch.get(fields[0]), torch.Tensor)]


def without_packed(batch: Batch) -> Batch:
    """`batch` less its packed patches and grids (its fields with a sample axis)."""
    packed = {name for fields in packed_fields(batch) for name in fields[:2]}
    return {key: value for key, value in batch.items() if key not in packed} if packed else batch


def packed_rows(batch: dict, size: int, rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """The packed patches and grids of samples `rows` (of `size`), in their order: views where the rows are
    one run, as a micro-batch's are."""
    out = {}
    for patches, grid, kind in packed_fields(batch):
        spans = _sample_spans(batch, size, patches, grid, kind)
        for name, pick in ((patches, 0), (grid, 1)):
            out[name] = _span_rows(batch[name], [spans[row][pick] for row in rows])
    return out


def _span_rows(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return tensor.narrow(0, spans[0][0], spans[-1][1] - spans[0][0])
    index = torch.cat([torch.arange(start, end) for start, end in spans])
    return tensor.index_select(0, index.to(tensor.device))


def _sample_spans(batch: dict, size: int, patches: str, grid: str,
                  kind: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each sample's (first, end) rows of `batch[patches]` and of `batch[grid]`; `UsageError` where the
    packed images do not make the samples' placeholder tokens."""
    types = batch.get("mm_token_type_ids")
    if not isinstance(types, torch.Tensor) or types.dim() != 2 or types.shape[0] != size:
        raise UsageError(f"batch[{patches!r}] packs every sample's patches in one tensor (with {grid!r}, as Qwen2-VL's "
                         "processor makes them); autofit needs the processor's 'mm_token_type_ids' too, one row per "
                         "sample, to tell which images are whose: pass the processor's whole output.")
    tokens = (types == kind).sum(dim=1).tolist()
    sizes = batch[grid].prod(dim=1).tolist()
    if sum(sizes) != batch[patches].shape[0] or not sum(tokens) or sum(sizes) % sum(tokens):
        raise UsageError(f"batch[{grid!r}] gives {sum(sizes)} patches for batch[{patches!r}]'s "
                         f"{batch[patches].shape[0]} rows and the {sum(tokens)} placeholder tokens "
                         f"'mm_token_type_ids' marks {kind}: pass the processor's output as it made it.")
    merge, spans, image, patch = sum(sizes) // sum(tokens), [], 0, 0
    for count in tokens:
        first = (patch, image)
        while count > 0 and image < len(sizes):
            count, patch, image = count - sizes[image] // merge, patch + sizes[image], image + 1
        if count:
            raise UsageError(f"batch[{grid!r}]'s images do not make each sample's placeholder tokens in order "
                             f"('mm_token_type_ids' == {kind}): pass the processor's output as it made it.")
        spans.append(((first[0], patch), (first[1], image)))
    return spans


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
    segmentation's (samples, height, width) are pixels. A dict without `input_ids` or `labels` reads its
    first other field of token ids (a plain model's {"idx", "targets"}), as a tuple reads its inputs."""
    if isinstance(batch, dict):
        ids = next((batch[k] for k in ("input_ids", "labels") if isinstance(batch.get(k), torch.Tensor)
                    and (batch[k].dim() == 2 or k == "input_ids" and batch[k].dim() > 2)
                    and not batch[k].is_floating_point()), None)
        if ids is None:
            ids = next((value for value in batch.values() if _token_ids(value)), None)
        return int(ids[0].numel()) if ids is not None else None
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


def _token_ids(value: Any) -> bool:
    """Whether `value` reads as token ids: integers (not a bool mask) as (samples, tokens), more than one
    token (a (samples, 1) column is a label)."""
    return (isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] > 1
            and not value.is_floating_point() and not value.is_complex() and value.dtype is not torch.bool)


IMAGE_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA: the channel axis that tells an image tensor from other 4-D floats


def images_per_sample(batch: Batch) -> int | None:
    """Images per sample where the batch holds images, else None: a floating tensor (samples, channels,
    height, width) with 1, 3 or 4 channels holds one; a video, (samples, frames, channels, height, width)
    or (samples, channels, frames, height, width), one per frame. A dict's `pixel_values` is read first,
    then its other fields; a tuple's inputs (its first item)."""
    if isinstance(batch, dict):
        fields = [batch["pixel_values"]] if "pixel_values" in batch else []
        candidates = fields + [value for key, value in batch.items() if key != "pixel_values"]
    else:
        candidates = [batch[0] if isinstance(batch, (tuple, list)) and batch else batch]
    for value in candidates:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if value.dim() == 4 and value.shape[1] in IMAGE_CHANNELS and min(value.shape[2:]) > 1:
            return 1
        if value.dim() == 5 and value.shape[2] in IMAGE_CHANNELS:
            return int(value.shape[1])
        if value.dim() == 5 and value.shape[1] in IMAGE_CHANNELS:
            return int(value.shape[2])
    return None


@contextlib.contextmanager
def quiet_transformers() -> Any:
    """transformers' warnings held back while autofit runs a model to look at it (a meta forward, a
    simulated step): what it warns of there (`use_cache` under the checkpointing a simulation switched
    on, the loss it picks for a head) concerns autofit's look, not the plan; a dry-run printed them
    above its table. torch's fake tensors log a traceback for each op that fails under them (a batch the model
    cannot take): the look's own error says it once. Probes and the user's own training keep them."""
    import logging as std_logging

    logging = sys.modules.get("transformers.utils.logging")  # not imported: no transformers model to quiet
    level = logging.get_verbosity() if logging is not None else None
    fake = std_logging.getLogger("torch._subclasses.fake_tensor")
    fake_level = fake.level
    if logging is not None:
        logging.set_verbosity_error()
    fake.setLevel(std_logging.CRITICAL)
    try:
        yield
    finally:
        if logging is not None:
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


def slice_rows(batch: Any, start: int, count: int) -> Any:
    """Rows `start .. start+count` of every tensor in `batch`, as views (no copy)."""
    # Fast paths for the common shapes (a tensor, a flat tuple/list/dict of tensors): pytree's
    # tree_map costs tens of microseconds per call, which a tiny step would notice.
    if isinstance(batch, torch.Tensor):
        return batch.narrow(0, start, count)
    if type(batch) in (tuple, list) and all(isinstance(x, torch.Tensor) for x in batch):
        return type(batch)(x.narrow(0, start, count) for x in batch)
    batch = plain(batch)
    packed = packed_fields(batch)  # Qwen2-VL's images: patches packed over the samples
    if type(batch) is dict and not packed and all(isinstance(x, torch.Tensor) for x in batch.values()):
        return {key: x.narrow(0, start, count) for key, x in batch.items()}
    size = leading_dim(without_packed(batch))  # the packed images are checked once, by packed_rows
    sliced = map_fields(without_packed(batch), size, lambda part: tree_map(
        lambda x: x.narrow(0, start, count) if isinstance(x, torch.Tensor) else x, part),
        lambda values: values[start:start + count])
    return {**sliced, **packed_rows(batch, size, range(start, start + count))} if packed else sliced
