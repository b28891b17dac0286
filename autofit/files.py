"""Writing into a user's folder: atomically, never through a link, never over a file autofit did not write.

Every file autofit writes (a plan, report.html, the launcher files, a run folder's log, the tune lock) goes
through here:

- `write_file` writes a temporary file beside the target (`O_EXCL`, no link followed), flushes it to disk and
  renames it over the target (`os.replace`, atomic in one folder): a reader sees the old file or the new one,
  never half of one, and a link planted at the target is refused (with `force`, the link itself is replaced;
  what it points to is never touched).
- A target that exists is replaced only when autofit wrote it: its bytes are what the folder's record of
  autofit's writes (`MANIFEST`, one JSON document per folder: name -> SHA-256) says autofit last wrote there,
  or the caller recognises it as its own kind (`ours`: a plan.json is a plan). Anything else (a file of
  yours, one you edited since) is refused with the fix, unless the caller says `force`.
- `make_folder` makes a folder autofit names itself (a run's launch/) and refuses a link in its place.
- `append_line` appends to a log autofit made, opened without following a link.

The record is data like any other file autofit reads: validated, never executed; one that does not parse is
refused, naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable

from autofit.errors import UsageError

MANIFEST = ".autofit-files.json"  # per folder: what autofit wrote there (file name -> SHA-256 of its bytes)
MANIFEST_VERSION = 1
FORCE_WORDS = "pass force=True (on the command line, --force)"


def write_file(path: str | os.PathLike, data: str | bytes, *, executable: bool = False, force: bool = False,
               ours: Callable[[bytes], bool] | None = None, record: bool = True) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically and return the path. `executable` sets the execute
    bits (as the umask allows); `force` replaces a file autofit did not write (or a link, itself); `ours(bytes)`
    says whether an existing file is one of the caller's own kind; `record` notes the write in the folder's
    `MANIFEST`. `UsageError` naming the file and the fix where it may not be replaced."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if not path.parent.is_dir():
        raise UsageError(f"Cannot write {str(path)!r}: its folder {str(path.parent)!r} does not exist.")
    check_replaceable(path, force=force, ours=ours)
    mode = (0o777 if executable else 0o666) & ~_umask()
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
            os.fchmod(handle.fileno(), mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if record:
        _remember(path, hashlib.sha256(payload).hexdigest(), force)
    return path


def check_replaceable(path: Path, *, force: bool = False, ours: Callable[[bytes], bool] | None = None) -> None:
    """`UsageError` unless `path` is absent, or a regular file autofit wrote (or `ours` recognises), or `force`
    (which never replaces a folder)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        if force:
            return
        raise UsageError(f"{str(path)!r} is a link (to {os.readlink(path)!r}); autofit never writes through a link. "
                         f"Remove the link, choose another folder, or {FORCE_WORDS} to replace the link itself.")
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{str(path)!r} exists and is not a file; move it away or choose another folder.")
    if force or written_by_autofit(path) or (ours is not None and ours(_read(path))):
        return
    raise UsageError(f"{str(path)!r} exists and autofit did not write it (or it was changed since): it is left as "
                     f"it is. Move it away, choose another folder, or {FORCE_WORDS} to replace it.")


def written_by_autofit(path: str | os.PathLike) -> bool:
    """Whether `path` is a regular file (not a link) holding what autofit last wrote there (its folder's record)."""
    path = Path(path)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
    except FileNotFoundError:
        return False
    recorded = read_manifest(path.parent).get(path.name)
    return recorded is not None and recorded == _digest(path)


def make_folder(path: str | os.PathLike) -> Path:
    """Make folder `path` (and its parents) and return it; `UsageError` where a link or a file is in its place
    (autofit writes into a folder it names only when the folder is really there, not through a link)."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        path.mkdir(parents=True, exist_ok=True)
        return path
    if stat.S_ISLNK(info.st_mode):
        raise UsageError(f"{str(path)!r} is a link (to {os.readlink(path)!r}); autofit writes its files into a folder "
                         "it makes there, never through a link. Remove the link, or choose another folder.")
    if not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{str(path)!r} is a file, where autofit writes a folder; move it away or choose another "
                         "folder.")
    return path


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` (a newline added) to the log at `path`, made when missing; `UsageError` where `path` is a
    link or not a regular file."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if os.path.islink(path):
            raise UsageError(f"{str(path)!r} is a link; autofit never writes through a link. Remove it, or choose "
                             "another folder.") from None
        raise UsageError(f"Cannot append to {str(path)!r}: {exc.strerror}.") from None
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise UsageError(f"{str(path)!r} is not a file; move it away or choose another folder.")
        handle.write(line + "\n")


def read_manifest(folder: str | os.PathLike) -> dict[str, str]:
    """What autofit wrote in `folder` (file name -> SHA-256 hex); {} where it wrote nothing. `UsageError`
    naming the record where it is not one autofit wrote (a link, not JSON, another shape)."""
    path = Path(folder) / MANIFEST
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return {}
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "it is a link or not a file"
    else:
        try:
            data = json.loads(_read(path))
        except (ValueError, UnicodeDecodeError) as exc:
            data, problem = None, f"it is not JSON ({exc})"
        problem = problem or _manifest_problem(data)
    if problem:
        raise UsageError(f"{str(path)!r} is not the record of autofit's files it should be: {problem}. Remove it "
                         "(autofit then treats the files beside it as yours and replaces none of them).")
    return dict(data["files"])


def _manifest_problem(data: object) -> str | None:
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return "it has no 'files' object"
    if data.get("format_version") != MANIFEST_VERSION:
        return f"its format_version is {data.get('format_version')!r}, this autofit reads {MANIFEST_VERSION}"
    for name, digest in data["files"].items():
        if not isinstance(name, str) or "/" in name or not isinstance(digest, str) or len(digest) != 64:
            return f"its entry {name!r} is not a file name and a SHA-256"
    return None


def _remember(path: Path, digest: str, force: bool) -> None:
    folder = path.parent
    try:
        files = read_manifest(folder)
    except UsageError:
        if not force:
            raise
        files = {}
    files[path.name] = digest
    document = json.dumps({"format_version": MANIFEST_VERSION, "written_by": "autofit", "files": files},
                          indent=2, sort_keys=True) + "\n"
    write_file(folder / MANIFEST, document, force=True, record=False)


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc), else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


__all__ = ["FORCE_WORDS", "MANIFEST", "append_line", "check_replaceable", "make_folder", "read_manifest",
           "write_file", "written_by_autofit"]
