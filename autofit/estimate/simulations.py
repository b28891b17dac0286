"""Estimate: simulated steps kept for the life of the process (`SIMULATIONS`), keyed by `workload_key`,
what a simulated step depends on beside its configuration."""

from __future__ import annotations

import collections
import functools
import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autofit.estimate.simulate import ActivationPeak

if TYPE_CHECKING:
    from autofit.spec.train import TrainSpec


class Simulations:
    """Simulated steps kept for the life of the process, least recently used dropped past `size`: a second
    dry-run or tune of the same model and batch (another GPU, budget or rank count, in a notebook or a
    script planning several) simulates nothing again. Keyed by `workload_key` and the simulation key."""

    def __init__(self, size: int = 20_000):
        self.size = size
        self.kept: collections.OrderedDict[tuple, tuple[ActivationPeak | None, str]] = collections.OrderedDict()

    def get(self, key: tuple) -> tuple[ActivationPeak | None, str] | None:
        found = self.kept.get(key)
        if found is not None:
            self.kept.move_to_end(key)
        return found

    def put(self, key: tuple, value: tuple[ActivationPeak | None, str]) -> None:
        self.kept[key] = value
        self.kept.move_to_end(key)
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)


SIMULATIONS = Simulations()


def workload_key(meta: nn.Module, spec: "TrainSpec", sim_device: str, adapted: frozenset[str],
                 adapter_dropout: float = 0.0) -> str:
    """What a simulated step depends on besides its config: the model (class, modules and their shapes,
    a Hugging Face config in full), the batch's structure, shapes and dtypes, the loss function's code,
    the simulating device, the layers LoRA adapts and whether its adapters drop out their inputs."""
    hf = getattr(meta, "config", None)
    described = {k: v for k, v in hf.to_dict().items() if k != "_name_or_path"} if hasattr(hf, "to_dict") else {}
    parts = [type(meta).__module__, type(meta).__qualname__, repr(meta), json.dumps(described, sort_keys=True, default=str),
             _structure(spec.batch_factory(1)), _code(spec.loss_fn), sim_device, sorted(adapted), adapter_dropout > 0]
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


def _structure(value: Any) -> str:
    """Shapes and dtypes of every tensor in a batch, keys and nesting kept; other leaves by type."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_structure(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[" + ",".join(_structure(v) for v in value) + "]"
    return type(value).__qualname__


def _code(fn: Any) -> str:
    """A loss function by its code (a partial by its function and arguments); None is the default loss."""
    if fn is None:
        return "default"
    if isinstance(fn, functools.partial):
        return f"partial({_code(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    code = getattr(fn, "__code__", None)
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    return name + (hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest() if code else repr(fn))
