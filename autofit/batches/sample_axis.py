"""Whether the batch's samples reach the steps axis of the model's time-major modules.

autofit counts and splits samples along every batch tensor's first axis. `nn.LSTM`, `nn.GRU`, `nn.RNN`
and `nn.MultiheadAttention` (so `nn.Transformer` and its layers) take their steps first unless built with
`batch_first=True`. A batch given time-major, `(steps, samples, features)` with its targets the same way,
agrees on its first axis, and would be split across time steps without a word: a micro-batch would hold
some steps of every sample, and "finding the batch" would grow the sequence. Where samples-first batches
are transposed inside `forward` (`self.lstm(x.transpose(0, 1))`), the module's second axis carries them.

The model runs its forward at 1 and 2 samples without computing anything (meta tensors for a model built
on the meta device, fake tensors otherwise), a pre-hook noting the first input of each time-major module:
an axis that doubles with the samples is the one they reach. A forward that cannot run so (an op without a
meta kernel, a value read) decides nothing: the probes run the batch as given.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autofit.errors import UsageError
from autofit.batches import batch as batches

TIME_MAJOR = (nn.RNNBase, nn.MultiheadAttention)


def time_major_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`model`'s modules that take their steps first (`batch_first=False`), by name."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, TIME_MAJOR) and not module.batch_first]


def check_sample_axis(model: nn.Module, batch_factory: batches.BatchFactory) -> None:
    """`UsageError` when the batch's samples reach the steps axis of one of `model`'s time-major modules."""
    modules = time_major_modules(model)
    if not modules:
        return
    inputs = [_inputs(model, modules, batches.made(batch_factory, n)) for n in (1, 2)]
    if None in inputs:
        return
    for name, module in modules:
        one, two = inputs[0].get(name), inputs[1].get(name)
        if one is not None and two is not None and _sample_axis(one, two) == 0:
            raise UsageError(_message(name, module, one))


def check_first_batch(model: nn.Module, batch: Any) -> None:
    """`check_sample_axis` on a training loop's first batch (the guard's, `autofit.prepare`'s), in a lone
    process only: through an engine's hooks (DDP's buffer broadcast, FSDP2's gathers) a forward would run
    collectives, so ranks rely on the search's check."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    check_sample_axis(model, batches.factory_from_sample(batch))


def _inputs(model: nn.Module, modules: list[tuple[str, nn.Module]], batch: Any) -> dict[str, torch.Size] | None:
    """The shape of each module's first input in a forward of `model` on `batch`, run on meta or fake
    tensors; None when the forward cannot run so."""
    seen: dict[str, torch.Size] = {}
    hooks = [module.register_forward_pre_hook(functools.partial(_note, seen, name), with_kwargs=True)
             for name, module in modules]
    try:
        with batches.quiet_transformers():
            _forward_shapes_only(model, batch)
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - no meta kernel, a value read: the probes will tell
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _forward_shapes_only(model: nn.Module, batch: Any) -> None:
    """`model`'s forward on `batch` with tensors that carry shapes only: meta for a model on the meta
    device (autofit's own), else fake tensors standing in for the batch and for the model's parameters and
    buffers alike (`torch.func.functional_call`), so that nothing of the model is changed (batch norm's
    running statistics are updated in place) and nothing is copied."""
    if any(p.is_meta for p in model.parameters()):
        batches.call_model(model, batches.to_device(batch, torch.device("meta")))
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = functools.partial(tree_map, lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t)
        state = fake({**dict(model.named_parameters()), **dict(model.named_buffers())})
        args, kwargs = batches.call_arguments(model, fake(batch))
        torch.func.functional_call(model, state, args, kwargs)


def _note(seen: dict[str, torch.Size], name: str, _module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the first call's input (an RNN's `input`, attention's `query`), when a tensor (a
    `PackedSequence` has no steps axis to mix up)."""
    first = args[0] if args else kwargs.get("input", kwargs.get("query"))
    if isinstance(first, torch.Tensor) and name not in seen:
        seen[name] = first.shape


def _sample_axis(one: torch.Size, two: torch.Size) -> int | None:
    """The one axis that doubles from a 1-sample input to a 2-sample one, all others the same; else None."""
    if len(one) != len(two):
        return None
    grown = [axis for axis, (a, b) in enumerate(zip(one, two)) if a != b]
    return grown[0] if len(grown) == 1 and two[grown[0]] == 2 * one[grown[0]] else None


def _message(name: str, module: nn.Module, shape: torch.Size) -> str:
    kind = type(module).__name__
    return (f"The batch's samples reach the steps axis of {kind} `{name}`: it was built with batch_first=False, so "
            f"it takes (steps, samples, features), and a 1-sample batch gives it {tuple(shape)}, whose first axis "
            "grows with the samples. autofit counts and splits samples along every batch tensor's first axis, so "
            "a time-major batch would be split across its steps. Give the batch samples first (each tensor "
            "x.transpose(0, 1), the targets too) and either build the module with batch_first=True or transpose "
            "inside forward (x.transpose(0, 1) before it, back after).")
