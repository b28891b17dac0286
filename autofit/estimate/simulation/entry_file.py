"""Estimate: one kept value as a file of data (`autofit.estimate.simulation.disk_cache`): never code, never a
pickle. A folder of them may be shared between users, so a file is read as bytes, checked field by field, and
one that does not check out is as if absent (its value is found again).

The layout, little-endian::

    MAGIC | header length (8 bytes) | header (JSON, UTF-8) | the arrays' bytes, in the header's order

    header = {"format_version": 1, "name": the file's own name (a file copied to another name is not read),
              "meta": {...} (JSON values), "arrays": [[name, typecode, count], ...]}

Arrays are `array.array`s of a `TYPECODES` kind. Files are read and written inside a folder opened once per call
(`dir_fd`): a folder or file that is a symbolic link is neither followed nor written through, a file is written
whole under a temporary name and renamed over its own name (a reader meanwhile sees the old file or the new one).
"""

from __future__ import annotations

import array
import json
import os
import re
import secrets
import stat
import sys
from typing import Any

MAGIC = b"AUTOFIT-KEPT\n"
FORMAT_VERSION = 1
TYPECODES = {"B": 1, "q": 8}  # unsigned bytes, signed 64-bit integers: what a simulated step's events hold
MAX_HEADER_BYTES = 1 << 20
MAX_FILE_BYTES = 512 << 20  # a 32-block step's events at full depth are a few MiB; anything past this is not ours
SUFFIX = ".kept"
TEMPORARY = ".tmp"
NAME = re.compile(r"[0-9a-f]{64}")  # a kept file's stem: a sha256 (`Kept._name`)
_KEPT = re.compile(r"[0-9a-f]{64}" + re.escape(SUFFIX))
_WRITING = re.compile(r"[0-9a-f]{64}\.[0-9a-f]{8}" + re.escape(TEMPORARY))  # `write`'s temporary names
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def supported() -> bool:
    """Whether this platform opens files relative to a folder without following links (POSIX): else nothing is
    kept on disk."""
    # `os.replace` takes folders where `os.rename` does (the same call; only `rename` is listed)
    return bool(_NOFOLLOW and _DIRECTORY) and {os.open, os.rename, os.unlink} <= os.supports_dir_fd \
        and os.scandir in os.supports_fd


def open_folder(folder: os.PathLike | str, create: bool) -> int | None:
    """A descriptor of `folder`, made where `create` and absent; its last part may not be a link (the parts above
    are the user's to choose). None where it cannot be opened so."""
    try:
        if create:
            os.makedirs(folder, exist_ok=True)
        return os.open(folder, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except OSError:
        return None


def encode(name: str, meta: dict[str, Any], arrays: dict[str, array.array]) -> bytes:
    """The file's bytes for the value `meta` and `arrays` (typecodes in `TYPECODES`) kept as `name`."""
    listed = [[key, values.typecode, len(values)] for key, values in arrays.items()]
    header = json.dumps({"format_version": FORMAT_VERSION, "name": name, "meta": meta, "arrays": listed},
                        separators=(",", ":"), allow_nan=False).encode()
    body = bytearray(MAGIC + len(header).to_bytes(8, "little") + header)
    for values in arrays.values():
        if sys.byteorder != "little":
            values = array.array(values.typecode, values)
            values.byteswap()
        body += values.tobytes()
    return bytes(body)


def decode(name: str, data: bytes) -> tuple[dict[str, Any], dict[str, array.array]] | None:
    """(meta, arrays) from a file's bytes, or None where anything does not check out: the magic, the header's
    length, its JSON and its fields, `name`, each array's kind and count, the bytes left for them."""
    start = len(MAGIC) + 8
    if len(data) < start or not data.startswith(MAGIC):
        return None
    length = int.from_bytes(data[len(MAGIC):start], "little")
    if length > min(MAX_HEADER_BYTES, len(data) - start):
        return None
    try:
        header = json.loads(data[start:start + length].decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(header, dict) or set(header) != {"format_version", "name", "meta", "arrays"} \
            or header["format_version"] != FORMAT_VERSION or header["name"] != name \
            or not isinstance(header["meta"], dict) or not isinstance(header["arrays"], list):
        return None
    arrays, at = {}, start + length
    for entry in header["arrays"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[0] not in arrays
                and entry[1] in TYPECODES and type(entry[2]) is int and entry[2] >= 0):
            return None
        key, code, count = entry
        end = at + count * TYPECODES[code]
        if end > len(data):
            return None
        values = array.array(code)
        values.frombytes(data[at:end])
        if sys.byteorder != "little":
            values.byteswap()
        arrays[key], at = values, end
    return (header["meta"], arrays) if at == len(data) else None


def read(folder: int, name: str) -> bytes | None:
    """The bytes of the regular file `name` + `SUFFIX` in the open `folder` (not through a link, at most
    `MAX_FILE_BYTES`), or None."""
    try:
        handle = os.open(name + SUFFIX, os.O_RDONLY | _NOFOLLOW, dir_fd=folder)
    except OSError:
        return None
    try:
        found = os.fstat(handle)
        if not stat.S_ISREG(found.st_mode) or found.st_size > MAX_FILE_BYTES:
            return None
        with os.fdopen(handle, "rb", closefd=False) as file:
            return file.read(MAX_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(handle)


def write(folder: int, name: str, data: bytes) -> bool:
    """Write `data` as `name` + `SUFFIX` in the open `folder`: whole under a temporary name made for it (never an
    existing file, never through a link), then renamed over its own name. False where the disk refused."""
    temporary = f"{name}.{secrets.token_hex(4)}{TEMPORARY}"
    try:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=folder)
    except OSError:
        return False
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, name + SUFFIX, src_dir_fd=folder, dst_dir_fd=folder)
        return True
    except OSError:
        try:
            os.unlink(temporary, dir_fd=folder)
        except OSError:
            pass
        return False


def own_files(folder: int) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """(kept files, temporaries) in the open `folder` that autofit names so, each (mtime, file name), regular files
    only: what pruning may remove (a shared folder holds other files too)."""
    kept, temporaries = [], []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                found = kept if _KEPT.fullmatch(entry.name) else temporaries if _WRITING.fullmatch(entry.name) else None
                if found is not None and entry.is_file(follow_symlinks=False):
                    found.append((entry.stat(follow_symlinks=False).st_mtime, entry.name))
    except OSError:
        pass
    return sorted(kept), sorted(temporaries)


def remove(folder: int, names: list[str]) -> None:
    """Remove the files `names` from the open `folder` (a link is removed, never followed)."""
    for name in names:
        try:
            os.unlink(name, dir_fd=folder)
        except OSError:
            pass
