"""Estimate: simulated steps kept for the life of the process (`SIMULATIONS`), keyed by `workload_key`,
what a simulated step depends on beside its configuration, and on disk for the next process where the
model is a library's (`shareable`): `AUTOFIT_CACHE` names the folder (default
~/.cache/autofit/simulations, under `XDG_CACHE_HOME` when set; `off` keeps none)."""

from __future__ import annotations

import collections
import enum
import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autofit.estimate.simulate import ActivationPeak

if TYPE_CHECKING:
    from autofit.spec.train import TrainSpec


class Simulations:
    """Simulated steps kept for the life of the process, least recently used dropped past `size`: a second
    dry-run or tune of the same model and batch (another GPU, budget or rank count, in a notebook or a
    script planning several) simulates nothing again. Keyed by `workload_key` and the simulation key.

    With a `folder`, a `shared` step (`shareable`) is also written there and read by later processes: a
    dry-run for another card or rank count, the CLI run again. Its file is named by the key and by
    `code_version` (autofit's own code and the libraries' versions), so a step simulated by other code is
    never read; a failed simulation is not written; the oldest files go past `files`."""

    def __init__(self, size: int = 20_000, folder: Path | None = None, files: int = 4_000):
        self.size, self.folder, self.files = size, folder, files
        self.kept: collections.OrderedDict[tuple, tuple[ActivationPeak | None, str]] = collections.OrderedDict()
        self._written = 0

    def get(self, key: tuple, shared: bool = False) -> tuple[ActivationPeak | None, str] | None:
        found = self.kept.get(key)
        if found is None and shared and self.folder is not None:
            found = self._read(key)
            if found is not None:
                self.kept[key] = found
        if found is not None:
            self.kept.move_to_end(key)
        return found

    def put(self, key: tuple, value: tuple[ActivationPeak | None, str], shared: bool = False) -> None:
        self.kept[key] = value
        self.kept.move_to_end(key)
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)
        if shared and self.folder is not None and value[0] is not None:
            self._write(key, value)

    def _path(self, key: tuple) -> Path:
        assert self.folder is not None
        return self.folder / f"{hashlib.sha256((_canonical(key) + code_version()).encode()).hexdigest()}.pkl"

    def _read(self, key: tuple) -> tuple[ActivationPeak | None, str] | None:
        try:
            with open(self._path(key), "rb") as file:
                found = pickle.load(file)
        except Exception:  # noqa: BLE001 - absent, half written by a killed process, unreadable: simulate again
            return None
        return found if isinstance(found, tuple) and isinstance(found[0], ActivationPeak) else None

    def _write(self, key: tuple, value: tuple[ActivationPeak | None, str]) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as file:
                pickle.dump(value, file, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(file.name, path)  # whole or not at all, for a process reading it meanwhile
        except OSError:
            return  # a read-only or full disk: the process keeps its own
        self._written += 1
        if self._written % 64 == 1:
            self._prune()

    def _prune(self) -> None:
        """Drop the oldest files past `files` (and temporaries a killed process left)."""
        assert self.folder is not None
        try:
            found = sorted(self.folder.iterdir(), key=lambda f: f.stat().st_mtime)  # oldest first
            kept = [f for f in found if f.suffix == ".pkl"]
            written = [f for f in found if f.suffix == ".tmp"]  # the newest may be other processes' writes
            for stale in kept[:max(0, len(kept) - self.files)] + written[:max(0, len(written) - 8)]:
                stale.unlink(missing_ok=True)  # only files of its own kinds: the folder may be shared
        except OSError:
            pass


CACHE_ENV = "AUTOFIT_CACHE"  # the folder simulated steps are shared through; off / 0 / no: none
_OFF = {"", "0", "off", "no", "false", "none"}


def cache_folder() -> Path | None:
    """Where simulated steps are shared between processes: `AUTOFIT_CACHE`, else
    $XDG_CACHE_HOME/autofit/simulations (~/.cache when unset); None where `AUTOFIT_CACHE` turns it off."""
    named = os.environ.get(CACHE_ENV)
    if named is not None:
        return None if named.strip().lower() in _OFF else Path(named).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "autofit" / "simulations"


@functools.cache
def code_version() -> str:
    """What a kept step was simulated by: every source file of autofit as installed (any change of its
    code, even uncommitted, is another version) and the versions of the libraries whose code it runs."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
        try:
            digest.update(f"{name}={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name}=-".encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()


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


def _canonical(value: Any) -> str:
    """`value` (a cache key) as the same text in every process: sets sorted, enums by name."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_canonical(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_canonical(v) for v in value)) + "}"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    return repr(value)


SIMULATIONS = Simulations(folder=cache_folder())


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
