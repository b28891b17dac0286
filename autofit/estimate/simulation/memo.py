"""Estimate: simulated steps kept for the life of the process (`SIMULATIONS`), keyed by `workload_key`
(what a simulated step depends on beside its configuration) and `simulation_key` (what of the configuration,
and of the libraries' behaviour the calibration may set, the strategies say it depends on), and on disk for the next process where the
model is a library's (`shareable`), in the folder `autofit.estimate.simulation.disk_cache` names (`AUTOFIT_CACHE`)."""

from __future__ import annotations

import array
import functools
import hashlib
import json
import types
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from autofit.config import Config
from autofit.estimate.simulation.disk_cache import Kept, cache_folder
from autofit.estimate.cuda.allocator import Replay
from autofit.estimate.simulation.step import PEAK_FIELDS, ActivationPeak

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy


class Simulations(Kept):
    """Simulated steps: a second dry-run or tune of the same model and batch (another GPU, budget or rank
    count, in a notebook or a script planning several) simulates nothing again. Keyed by `workload_key`
    and the simulation key; a `shared` step (`shareable`) is also read by later processes (a dry-run for
    another card or rank count, the CLI run again), as data (`encode_peak`); a failed simulation is not written."""

    def encode(self, value: Any) -> tuple[dict[str, Any], dict[str, array.array]] | None:
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], ActivationPeak)
                and isinstance(value[1], str)):
            return None
        return encode_peak(*value)

    def decode(self, meta: dict[str, Any], arrays: dict[str, array.array]) -> Any | None:
        return decode_peak(meta, arrays)


_HISTORY = ("resident", "states", "temporaries")  # `training_replay.history`'s lists, then its micro-steps
_EVENTS = ("keys", "sizes", "params")  # `Replay`'s arrays beside `ops`


def encode_peak(peak: ActivationPeak, how: str) -> tuple[dict[str, Any], dict[str, array.array]] | None:
    """A simulated step (its `ActivationPeak` and how it was found) as JSON values and arrays of integers;
    None where a field is not the kind a simulation makes."""
    numbers = {name: getattr(peak, name) for name in PEAK_FIELDS}
    if not all(type(v) is int for v in numbers.values()):
        return None
    meta: dict[str, Any] = {"how": how, "peak": numbers, "whole_depth": bool(peak.whole_depth)}
    arrays: dict[str, array.array] = {}
    for part, history in (("history", peak.history), ("training", peak.replay and peak.replay.training)):
        if history is not None:
            meta[part] = history[-1]
            arrays.update({f"{part}.{name}": array.array("q", values) for name, values in zip(_HISTORY, history)})
    if peak.replay is not None:
        arrays["replay.ops"] = array.array("B", peak.replay.ops)
        arrays.update({f"replay.{name}": getattr(peak.replay, name) for name in _EVENTS})
    return meta, arrays


def decode_peak(meta: dict[str, Any], arrays: dict[str, array.array]) -> tuple[ActivationPeak, str] | None:
    """`encode_peak`'s (meta, arrays) as they were, or None where they do not check out: every number an
    integer of its kind, every event an event (`Replay.valid`)."""
    numbers = meta.get("peak")
    if not (isinstance(meta.get("how"), str) and isinstance(numbers, dict) and set(numbers) == set(PEAK_FIELDS)
            and all(type(v) is int and v >= 0 for v in numbers.values()) and type(meta.get("whole_depth")) is bool):
        return None
    histories = {part: _history(meta, arrays, part) for part in ("history", "training")}
    if any(found is False for found in histories.values()):
        return None
    replay = None
    if "replay.ops" in arrays:
        events = [arrays.get(f"replay.{name}") for name in _EVENTS]
        if any(values is None or values.typecode != "q" for values in events) or arrays["replay.ops"].typecode != "B":
            return None
        replay = Replay(arrays["replay.ops"].tobytes(), *events, training=histories["training"])
        if not replay.valid():
            return None
    elif histories["training"] is not None:
        return None
    expected = {f"{part}.{name}" for part in histories if histories[part] is not None for name in _HISTORY}
    if set(arrays) - {"replay.ops", *(f"replay.{name}" for name in _EVENTS)} != expected:
        return None
    return ActivationPeak(**numbers, replay=replay, history=histories["history"],
                          whole_depth=meta["whole_depth"]), meta["how"]


def _history(meta: dict[str, Any], arrays: dict[str, array.array], part: str) -> tuple | None | bool:
    """What training holds beside the step (`training_replay.history`: three lists of bytes and the micro-steps)
    as `encode_peak` wrote it under `part`; None where none was; False where it does not check out."""
    if part not in meta:
        return None
    lists = [arrays.get(f"{part}.{name}") for name in _HISTORY]
    steps = meta[part]
    if type(steps) is not int or steps < 1 or any(v is None or v.typecode != "q" or min(v, default=0) < 0 for v in lists):
        return False
    return (*(list(values) for values in lists), steps)


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
    return name + (_code_digest(code) if isinstance(code, types.CodeType) else repr(fn))


def _code_digest(code: types.CodeType) -> str:
    """A function's code as one hash that is the same in every process: its bytecode, the names it reads and its
    constants, a nested function's or comprehension's code by its own digest (its repr holds its address, which
    made every process's key of `default_loss` its own: nothing was ever read back)."""
    digest = hashlib.sha256(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        digest.update(_constant(const).encode() + b"\0")
    return digest.hexdigest()


def _constant(value: Any) -> str:
    """A code object's constant as text the same in every process (a frozenset's order follows string hashing,
    which differs between processes)."""
    if isinstance(value, types.CodeType):
        return _code_digest(value)
    if isinstance(value, (tuple, frozenset)):
        items = [_constant(item) for item in value]
        return f"{type(value).__name__}({', '.join(sorted(items) if isinstance(value, frozenset) else items)})"
    return repr(value)


def simulated_facts(config: Config, strategies: Sequence["Strategy"]) -> dict[str, Any]:
    """What `config`'s simulated step depends on, as the strategies shaping it name it (`Strategy.simulated_as`,
    merged in rung order over `strategies` and every built-in and plug-in one they leave out)."""
    from autofit.strategies import completed

    return merged_facts(config, completed(strategies))


def merged_facts(config: Config, shaping: Sequence["Strategy"]) -> dict[str, Any]:
    """`simulated_facts` over strategies already `completed` (the estimator's, kept: completing them sorts
    every built-in and plug-in strategy, and a dry-run keys tens of thousands of steps)."""
    facts: dict[str, Any] = {}
    for strategy in shaping:
        facts.update(strategy.simulated_as(config, facts))
    return facts


def simulation_key(facts: dict[str, Any], mb: int) -> tuple:
    """What a simulated forward + backward at micro-batch `mb` depends on of its configuration (`facts`:
    `simulated_facts`, those named with a leading "_" left to the strategies): one simulation serves every
    config with the same key."""
    return (mb, *sorted(((name, value) for name, value in facts.items() if not name.startswith("_")),
                        key=lambda item: item[0]))
