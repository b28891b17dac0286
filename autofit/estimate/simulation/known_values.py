"""Values a simulated step computes from the batch's integers, kept beside the fake tensors that hold none.

Fake tensors hold shapes only, so an op whose output's shape depends on values fails under them
(`DynamicOutputShapeException`, `DataDependentOutputException`): a classifier that pools at each
sequence's `<eos>` (BART, mBART, PLBart, MVP, LED, T5: `hidden[input_ids.eq(eos), :]`, after checking with
`torch.unique_consecutive` that every row holds as many) or that picks its labelled samples
(DeBERTa: `(labels >= 0).nonzero()`). Those values come from the batch's token ids and labels, which the
synthesized batch holds for real. `KnownValues` keeps a real copy beside each fake tensor of the batch's
integers and computes every op whose inputs are all known on the copies too (for outputs of at most
`KNOWN_NUMEL` elements: ids, masks, counts, positions); an op that fails on values then takes its shape
from the real result, and a boolean index it knows becomes the positions it selects. Activations,
weights and whatever is computed from them stay unknown: an op that needs their values still fails, and
the simulation says so as before.

A value read to decide (`if mask.any()`) is the batch's own. What no input determines stays unknown: a
random draw, an allocation left unfilled (`torch.empty`). An in-place op whose inputs are not all known
forgets the value of what it writes (not of its index or source: Qwen3-VL writes its activations at a known
mask's positions layer after layer). A tensor made of scalars read from known values (`torch.tensor(list)`,
Qwen2-VL's rope index) is made of their values and known.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           unset_fake_temporarily)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
KNOWN_NUMEL = 1 << 20  # the largest output kept for real (4 MiB of int32 ids): masks and counts, not activations
_VALUE_ERRORS = (DynamicOutputShapeException, DataDependentOutputException)
_UNFILLED = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                       aten.new_empty_strided.default, aten.empty_like.default})
_BOOL_INDEXED = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._unsafe_index.Tensor)


class KnownValues(TorchDispatchMode):
    """Real copies of fake tensors computed from the batch (see the module's docstring). Enter it inside the
    `FakeTensorMode`, below any mode that must see the step's outputs (the storage counter)."""

    def __init__(self) -> None:
        super().__init__()
        self._values = WeakTensorKeyDictionary()

    def know(self, batch: Any, real: Any) -> None:
        """Keep `real`'s integer and boolean tensors as the values of `batch`'s fake tensors, leaf by leaf."""
        for fake, value in zip(tree_flatten(batch)[0], tree_flatten(real)[0]):
            if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor) and not value.is_floating_point() \
                    and not value.is_complex() and value.numel() <= KNOWN_NUMEL:
                with unset_fake_temporarily():  # a copy: an in-place op computed on it leaves the batch as it was
                    self._values[fake] = value.detach().cpu().clone()

    def __enter__(self) -> "KnownValues":
        self._constants = _KnownConstants(self)
        self._constants.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._constants.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = list(_tensors(args, kwargs))
        known = _determined(func) and all(self._known(t) for t in tensors)
        try:
            out = func(*args, **kwargs)
        except _VALUE_ERRORS:
            if known:
                return self._from_real(func, args, kwargs)
            if func in _BOOL_INDEXED and self._bool_indices_known(args):
                return func(*self._positions(args), **kwargs)
            raise
        if not (known and self._compute(func, args, kwargs, out)) and _writes(func):
            for tensor in _written(func, args, kwargs):  # written with values not computed: what it (and its base)
                self._values.pop(tensor, None)            # held is not its value; its index and source keep theirs
                if tensor._base is not None:
                    self._values.pop(tensor._base, None)
        return out

    def _known(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s value is known: kept beside it, or a real tensor (a constant the step made,
        `torch.tensor(1)`), which holds its own."""
        return tensor in self._values or not isinstance(tensor, FakeTensor)

    def _value(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._values[tensor] if isinstance(tensor, FakeTensor) else tensor

    def _real(self, func: Any, args: tuple, kwargs: dict, shape: torch.Size | None = None) -> Any:
        """`func` on the real copies (on the CPU, outside every mode); raises what it raises. `shape`: a
        pointwise op's output shape, computed once along the dimensions every input is broadcast over
        (`_compacted`) and broadcast back: a mask expanded to batch x heads x queries x keys costs one row."""
        def real(leaf: Any) -> Any:
            return self._value(leaf) if isinstance(leaf, torch.Tensor) else leaf

        real_args, real_kwargs = tree_map(real, (args, kwargs))
        if shape is not None:
            with unset_fake_temporarily():
                real_args, real_kwargs = _compacted((real_args, real_kwargs), shape)
            with _disable_current_modes(), unset_fake_temporarily():
                return self._real_call(func, real_args, real_kwargs).expand(shape)
        with _disable_current_modes(), unset_fake_temporarily():
            return self._real_call(func, real_args, real_kwargs)

    @staticmethod
    def _real_call(func: Any, real_args: tuple, real_kwargs: dict) -> Any:
        if "device" in real_kwargs:
            real_kwargs = {**real_kwargs, "device": torch.device("cpu")}
        return func(*real_args, **real_kwargs)

    def _compute(self, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        """Keep the real result of `func` beside its fake `out` where it is small; False where it is not kept
        (too large, or it fails: a kernel the CPU lacks)."""
        fakes = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        large = any(fake.numel() > KNOWN_NUMEL for fake in fakes)
        if not fakes or large and not _free(func) and not (len(fakes) == 1 and _pointwise(func)):
            return False
        try:
            real = self._real(func, args, kwargs, fakes[0].shape if large and not _free(func) else None)
        except Exception:
            return False
        for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor) and fake.shape == value.shape:
                self._values[fake] = value
        return True

    def _from_real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func`'s outputs where their shapes or values depend on known values: a scalar as it is, a tensor
        as a fake one of the real result's shape (an allocation the modes above count) holding its value."""
        real = self._real(func, args, kwargs)
        device = next(leaf.device for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor))

        def fake(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            made = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            self._values[made] = value
            return made

        return tree_map(fake, real)

    def _bool_indices_known(self, args: tuple) -> bool:
        masks = [index for index in args[1] if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)]
        return bool(masks) and all(self._known(mask) for mask in masks)

    def _positions(self, args: tuple) -> tuple:
        """`args` of an indexing op with each known boolean index replaced by the positions it selects, as
        advanced indexing reads a mask (one index per dimension it covers)."""
        indices: list[Any] = []
        for index in args[1]:
            if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
                with unset_fake_temporarily():  # real: the fake mode takes them as constants
                    positions = self._value(index).nonzero().unbind(1)
                # on the mask's device, as the fake tensors' devices must agree (a no-op where they are on the CPU)
                indices.extend(position.to(index.device) for position in positions)
            else:
                indices.append(index)
        return (args[0], indices, *args[2:])


class _KnownConstants(TorchFunctionMode):
    """`torch.tensor(data)` over scalars the step read from known values (Qwen2-VL's rope index gathers each
    sample's `positions.max() + 1 - length` in a list and makes a tensor of it): made of the values, which
    fake tensors cannot give it ("its data is not allocated"), and known itself."""

    def __init__(self, known: KnownValues) -> None:
        super().__init__()
        self._known = known

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in (torch.tensor, torch.as_tensor) or not args or not isinstance(args[0], (list, tuple)):
            return func(*args, **kwargs)
        fakes = [leaf for leaf in tree_flatten(args[0])[0] if isinstance(leaf, FakeTensor)]
        if not fakes or not all(self._known._known(fake) for fake in fakes):
            return func(*args, **kwargs)
        data = tree_map(lambda leaf: self._known._value(leaf).tolist() if isinstance(leaf, FakeTensor) else leaf,
                        args[0])
        out = func(data, *args[1:], **kwargs)
        with unset_fake_temporarily():
            self._known._values[out] = torch.tensor(data, dtype=out.dtype)
        return out


def _compacted(arguments: Any, shape: torch.Size) -> Any:
    """The real `arguments` of a pointwise op of output `shape`, each broadcast to it and cut to one element
    along every dimension that all of them repeat (stride 0); `KNOWN_NUMEL` elements at most, else ValueError."""
    tensors = [leaf for leaf in tree_flatten(arguments)[0] if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise ValueError("no input to repeat")
    spread = [torch.broadcast_to(t, shape) for t in tensors]
    repeated = [d for d in range(len(shape)) if all(t.stride(d) == 0 for t in spread)]
    compact = torch.Size(1 if d in repeated else n for d, n in enumerate(shape))
    if compact.numel() > KNOWN_NUMEL:
        raise ValueError(f"{tuple(shape)} repeats too little to be kept")
    cut = {id(t): s[tuple(slice(0, 1) if d in repeated else slice(None) for d in range(len(shape)))]
           for t, s in zip(tensors, spread)}
    return tree_map(lambda leaf: cut[id(leaf)] if isinstance(leaf, torch.Tensor) else leaf, arguments)


@functools.lru_cache(maxsize=None)
def _free(func: Any) -> bool:
    """Whether `func` makes no new memory on real tensors (a view: `expand`, `select`), whatever its size."""
    return bool(getattr(func, "is_view", False))


@functools.lru_cache(maxsize=None)
def _pointwise(func: Any) -> bool:
    """Whether `func` computes each element from the same elements of its inputs (a cast too)."""
    return func is aten._to_copy.default or torch.Tag.pointwise in getattr(func, "tags", ())


def _tensors(args: tuple, kwargs: dict) -> Any:
    """The tensors among an op's arguments, given alone or in a list (`cat`, `index`): every op runs through
    here, so no pytree walk."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from (item for item in arg if isinstance(item, torch.Tensor))


@functools.lru_cache(maxsize=None)
def _determined(func: Any) -> bool:
    """Whether `func`'s output is determined by its inputs: not a random draw, not an unfilled allocation."""
    return func not in _UNFILLED and torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ())


@functools.lru_cache(maxsize=None)
def _writes(func: Any) -> bool:
    """Whether `func` writes one of its arguments (an in-place or `out=` op)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and schema.is_mutable


def _written(func: Any, args: tuple, kwargs: dict) -> Any:
    """The tensors `func` writes: its arguments the schema marks written (`Tensor(a!)`: `index_put_`'s self,
    not its indices or values), given alone or in a list."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        yield from _tensors((value,), {})
