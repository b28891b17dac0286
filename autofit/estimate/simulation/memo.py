"""Estimate: simulated steps kept for the life of the process (`SIMULATIONS`), keyed by `workload_key`
(what a simulated step depends on beside its configuration) and `simulation_key` (what of the configuration,
and of the libraries' behaviour the calibration may set, the strategies say it depends on), and on disk for the next process where the
model is a library's (`shareable`), in the folder `autofit.estimate.simulation.disk_cache` names (`AUTOFIT_CACHE`)."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from autofit.config import Config
from autofit.estimate.simulation.disk_cache import Kept, cache_folder
from autofit.estimate.simulation.step import ActivationPeak

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy


class Simulations(Kept):
    """Simulated steps: a second dry-run or tune of the same model and batch (another GPU, budget or rank
    count, in a notebook or a script planning several) simulates nothing again. Keyed by `workload_key`
    and the simulation key; a `shared` step (`shareable`) is also read by later processes (a dry-run for
    another card or rank count, the CLI run again); a failed simulation is not written."""

    def keeps(self, value: Any) -> bool:
        return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], ActivationPeak)


# modules whose code is fixed by a version in `code_version`: a model built only of their classes is shared
_LIBRARIES = ("torch.", "transformers.", "peft.", "bitsandbytes.", "autofit.")


def shareable(meta: nn.Module, spec: "TrainSpec") -> bool:
    """Whether this model's simulated steps may be kept on disk for other processes: every module's class
    and the loss function come from a library `code_version` names (or autofit). A class of your own (a
    notebook's, a script's) may change its code under the same name and shapes between two runs, which
    `workload_key` would not see: its steps are kept for the process only."""
    loss = spec.loss_fn.func if isinstance(spec.loss_fn, functools.partial) else spec.loss_fn
    owners = [type(module).__module__ for module in meta.modules()] + [getattr(loss, "__module__", None) or ""]
    return all(owner.startswith(_LIBRARIES) for owner in owners)


SIMULATIONS = Simulations(folder=cache_folder())


def workload_key(meta: nn.Module, spec: "TrainSpec", sim_device: str, adapted: frozenset[str],
                 adapter_dropout: float = 0.0) -> str:
    """What a simulated step depends on besides its config: the model (class, modules and their shapes,
    a Hugging Face config in full), the batch's structure, shapes and dtypes, the loss function's code,
    the simulating device, the layers LoRA adapts and whether its adapters drop out their inputs."""
    hf = getattr(meta, "config", None)
    described = {k: v for k, v in hf.to_dict().items() if k != "_name_or_path"} if hasattr(hf, "to_dict") else {}
    parts = [type(meta).__module__, type(meta).__qualname__, _described(meta), json.dumps(described, sort_keys=True, default=str),
             _structure(spec.batch_factory(1)), _code(spec.loss_fn), sim_device, sorted(adapted), adapter_dropout > 0]
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


def _described(meta: nn.Module) -> str:
    """The model's modules as `repr` prints them; where a module's repr reads a value (I-BERT's quantizers print
    their ranges with `.item()`, which a meta tensor has none of), its modules' names and types and its
    parameters' and buffers' shapes."""
    try:
        return repr(meta)
    except Exception:  # noqa: BLE001 - a repr of one's own that reads values
        modules = (f"{name}:{type(module).__qualname__}" for name, module in meta.named_modules())
        tensors = (f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in (*meta.named_parameters(), *meta.named_buffers()))
        return "\n".join((*modules, *tensors))


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


def simulated_facts(config: Config, strategies: Sequence["Strategy"]) -> dict[str, Any]:
    """What `config`'s simulated step depends on, as the strategies shaping it name it (`Strategy.simulated_as`,
    merged in rung order over `strategies` and every built-in and plug-in one they leave out)."""
    from autofit.strategies import completed

    facts: dict[str, Any] = {}
    for strategy in completed(strategies):
        facts.update(strategy.simulated_as(config, facts))
    return facts


def simulation_key(facts: dict[str, Any], mb: int) -> tuple:
    """What a simulated forward + backward at micro-batch `mb` depends on of its configuration (`facts`:
    `simulated_facts`, those named with a leading "_" left to the strategies): one simulation serves every
    config with the same key."""
    return (mb, *sorted(((name, value) for name, value in facts.items() if not name.startswith("_")),
                        key=lambda item: item[0]))
