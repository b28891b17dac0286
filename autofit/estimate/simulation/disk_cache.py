"""Estimate: what a dry-run found, kept for the next one: for the life of the process, and in a folder
for later processes (`AUTOFIT_CACHE` names it, default ~/.cache/autofit/simulations under `XDG_CACHE_HOME`
when set; `off` keeps none), each value filed under `code_version` as data (`entry_file`: never code, never a
pickle; the folder may be shared). Simulated steps (`autofit.estimate.simulation.memo`) and the caching
allocator's reserves replayed from their events (`RESERVES`, `autofit.estimate.cuda.training_replay.reserve`)."""

from __future__ import annotations

import array
import collections
import enum
import functools
import hashlib
import importlib.metadata
import os
from pathlib import Path
from typing import Any

import torch

from autofit.estimate.simulation import entry_file


class Kept:
    """Values kept for the life of the process, least recently used dropped past `size`, and with a
    `folder`, a `shared` one also written there and read by later processes. Its file is named by the key
    and by `code_version` (autofit's own code and the libraries' versions), so a value found by other code
    is never read; the oldest files go past `files`.

    A file holds data only (`autofit.estimate.simulation.entry_file`: JSON and arrays of integers, never a
    pickle): the folder may be shared, and what another user wrote there is read as numbers, checked
    (`decode`), and found again where it does not check out. `encode` says what a value is as data (None: it
    is not written); `decode` builds it back (None: not whole)."""

    def __init__(self, size: int = 20_000, folder: Path | None = None, files: int = 4_000):
        self.size, self.folder, self.files = size, folder, files
        self.kept: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._written = 0

    def encode(self, value: Any) -> tuple[dict[str, Any], dict[str, array.array]] | None:
        """`value` as (JSON values, arrays) for its file; None: not one to write."""
        return None

    def decode(self, meta: dict[str, Any], arrays: dict[str, array.array]) -> Any | None:
        """The value a file's (meta, arrays) hold, or None where they are not one `encode` makes."""
        return None

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
        if shared and self.folder is not None:
            self._write(key, value)

    def _name(self, key: Any) -> str:
        return hashlib.sha256((_canonical(key) + code_version()).encode()).hexdigest()

    def _open(self, create: bool) -> int | None:
        return entry_file.open_folder(self.folder, create) if self.folder is not None and entry_file.supported() else None

    def _read(self, key: Any) -> Any | None:
        folder = self._open(create=False)
        if folder is None:
            return None
        try:
            name = self._name(key)
            data = entry_file.read(folder, name)
            found = entry_file.decode(name, data) if data is not None else None
        finally:
            os.close(folder)
        if found is None:
            return None
        try:
            return self.decode(*found)
        except (TypeError, ValueError, KeyError, OverflowError):  # fields of the wrong kinds: found again
            return None

    def _write(self, key: Any, value: Any) -> None:
        encoded = self.encode(value)
        if encoded is None:
            return
        folder = self._open(create=True)
        if folder is None:
            return  # a read-only or full disk, a link where the folder should be: the process keeps its own
        try:
            name = self._name(key)
            if not entry_file.write(folder, name, entry_file.encode(name, *encoded)):
                return
            self._written += 1
            if self._written % max(64, self.files // 64) == 1:  # a look over the folder per ~1.5% of its files
                self._prune(folder)
        finally:
            os.close(folder)

    def prune(self) -> None:
        """Drop the oldest files past `files` now (a write does so now and then)."""
        folder = self._open(create=False)
        if folder is not None:
            try:
                self._prune(folder)
            finally:
                os.close(folder)

    def _prune(self, folder: int) -> None:
        """Drop the oldest files past `files` (and temporaries a killed process left): only files named as
        autofit names them, the folder may be shared."""
        kept, written = entry_file.own_files(folder)  # oldest first
        stale = kept[:max(0, len(kept) - self.files)] + written[:max(0, len(written) - 8)]  # the newest
        # temporaries may be other processes' writes under way
        entry_file.remove(folder, [name for _, name in stale])


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

    FIELDS = ("fragmentation", "least_fragmentation")

    def encode(self, value: Any) -> tuple[dict[str, Any], dict[str, array.array]] | None:
        return ({"reserve": {field: value[field] for field in self.FIELDS}}, {}) if _reserve(value) else None

    def decode(self, meta: dict[str, Any], arrays: dict[str, array.array]) -> Any | None:
        found = meta.get("reserve")
        return dict(found) if set(meta) == {"reserve"} and not arrays and _reserve(found) else None


def _reserve(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == set(Reserves.FIELDS) \
        and all(type(v) is int and v >= 0 for v in value.values())


def _reserves_folder() -> Path | None:
    folder = cache_folder()
    return None if folder is None else folder / "reserves"


RESERVES = Reserves(size=100_000, folder=_reserves_folder(), files=20_000)  # the README's GPT-2 dry-run writes 664
