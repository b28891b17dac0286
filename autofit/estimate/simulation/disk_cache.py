"""Estimate: what a dry-run found, kept for the next one: for the life of the process, and in a folder
for later processes (`AUTOFIT_CACHE` names it, default ~/.cache/autofit/simulations under `XDG_CACHE_HOME`
when set; `off` keeps none), each value filed under `code_version`. Simulated steps
(`autofit.estimate.simulation.memo`) and the caching allocator's reserves replayed from their events
(`RESERVES`, `autofit.estimate.cuda.training_replay.reserve`)."""

from __future__ import annotations

import collections
import enum
import functools
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch


class Kept:
    """Values kept for the life of the process, least recently used dropped past `size`, and with a
    `folder`, a `shared` one also written there and read by later processes. Its file is named by the key
    and by `code_version` (autofit's own code and the libraries' versions), so a value found by other code
    is never read; a value `keeps` refuses is not written (nor read back); the oldest files go past `files`."""

    def __init__(self, size: int = 20_000, folder: Path | None = None, files: int = 4_000):
        self.size, self.folder, self.files = size, folder, files
        self.kept: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._written = 0

    def keeps(self, value: Any) -> bool:
        """Whether `value` is one to write to the folder, and one read back from it is whole."""
        return True

    def get(self, key: Any, shared: bool = False) -> Any | None:
        found = self.kept.get(key)
        if found is None and shared and self.folder is not None:
            found = self._read(key)
            if found is not None:
                self.kept[key] = found
        if found is not None:
            self.kept.move_to_end(key)
        return found

    def put(self, key: Any, value: Any, shared: bool = False) -> None:
        self.kept[key] = value
        self.kept.move_to_end(key)
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)
        if shared and self.folder is not None and self.keeps(value):
            self._write(key, value)

    def _path(self, key: Any) -> Path:
        assert self.folder is not None
        return self.folder / f"{hashlib.sha256((_canonical(key) + code_version()).encode()).hexdigest()}.pkl"

    def _read(self, key: Any) -> Any | None:
        try:
            with open(self._path(key), "rb") as file:
                found = pickle.load(file)
        except Exception:  # noqa: BLE001 - absent, half written by a killed process, unreadable: found again
            return None
        return found if self.keeps(found) else None

    def _write(self, key: Any, value: Any) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as file:
                pickle.dump(value, file, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(file.name, path)  # whole or not at all, for a process reading it meanwhile
        except OSError:
            return  # a read-only or full disk: the process keeps its own
        self._written += 1
        if self._written % max(64, self.files // 64) == 1:  # a look over the folder per ~1.5% of its files
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


CACHE_ENV = "AUTOFIT_CACHE"  # the folder kept values are shared through; off / 0 / no: none
_OFF = {"", "0", "off", "no", "false", "none"}


def cache_folder() -> Path | None:
    """Where what is kept is shared between processes: `AUTOFIT_CACHE`, else
    $XDG_CACHE_HOME/autofit/simulations (~/.cache when unset); None where `AUTOFIT_CACHE` turns it off."""
    named = os.environ.get(CACHE_ENV)
    if named is not None:
        return None if named.strip().lower() in _OFF else Path(named).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "autofit" / "simulations"


@functools.cache
def code_version() -> str:
    """What a kept value was found by: every source file of autofit as installed (any change of its
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


def _canonical(value: Any) -> str:
    """`value` (a cache key) as the same text in every process: sets sorted, enums by name."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_canonical(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_canonical(v) for v in value)) + "}"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    return repr(value)


class Reserves(Kept):
    """The caching allocator's reserves of a step's events (`training_replay.reserve`: a roomy replay's and a
    bisection's two numbers, keyed by `allocator.Replay.digest`, the events themselves): the same events
    replay the same, whichever model, configuration or process they came from, so every one is kept in the
    folder."""

    def keeps(self, value: Any) -> bool:
        return isinstance(value, dict) and set(value) == {"fragmentation", "least_fragmentation"} \
            and all(isinstance(v, int) for v in value.values())


def _reserves_folder() -> Path | None:
    folder = cache_folder()
    return None if folder is None else folder / "reserves"


RESERVES = Reserves(size=100_000, folder=_reserves_folder(), files=20_000)  # the README's GPT-2 dry-run writes 664
