"""What a probe process (or a simulation worker) receives on its standard input (`send`), never through a file:
its job's fields as one line of JSON, plain values checked where they are read, then the spec and the strategies
serialised once with cloudpickle (`framed`, `unframed`). Only that last part is unpickled: it is the user's own
code (the model factory, the batch, the loss), which the process runs. The whole job is signed with a secret its
launcher made for it (`new_key`) and gave the process in its environment alone (`JOB_KEY`): a job anyone else
wrote (a named pipe on standard input passes for a pipe) is refused before its fields are parsed, its import
path taken or its spec unpickled.

cloudpickle serialises by value what plain pickle can only name (lambdas, closures, functions and
classes of `__main__`, a notebook or standard input), and by reference what a module defines, so the
probe process needs nothing of the user's `__main__`. What cannot be serialised at all (an open file,
a lock, a live connection captured by a factory) is found once, before any probe, and named in one
`UsageError` with the fix.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
import threading
import weakref
from typing import IO, TYPE_CHECKING, Any, Iterator, Sequence

from autofit.errors import UsageError

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy

# id(spec) -> (the spec, weakly; the strategies' ids; the payload). A search probes one spec many
# times; a model given as a module is serialised with its weights, so once is enough.
_CACHE: dict[int, tuple[weakref.ref, tuple[int, ...], bytes]] = {}


def payload(spec: "TrainSpec", strategies: Sequence["Strategy"]) -> bytes:
    """`(spec, strategies)` serialised for a probe process (cached per spec and strategies); raises
    `UsageError` naming the part that cannot be serialised and the fix."""
    key = tuple(id(s) for s in strategies)
    entry = _CACHE.get(id(spec))
    if entry is not None and entry[0]() is spec and entry[1] == key:
        return entry[2]
    import cloudpickle

    try:
        data = cloudpickle.dumps((spec, list(strategies)))
    except Exception as exc:  # noqa: BLE001 - any object can refuse; name it below
        raise _unserialisable(spec, strategies, exc) from exc
    _CACHE.clear()  # one spec at a time: the payload may hold a model's weights
    _CACHE[id(spec)] = (weakref.ref(spec), key, data)
    return data


def check_serialisable(spec: "TrainSpec", strategies: Sequence["Strategy"]) -> None:
    """Raise the one `UsageError` a spec that cannot reach a probe process deserves, before any probe."""
    payload(spec, strategies)


FIELDS_BYTES = 1 << 20  # the longest line of fields a job may start with (an import path, a configuration)
JOB_KEY = "AUTOFIT_JOB_KEY"  # the environment variable a launched process finds its launcher's secret in
_SIGNATURE_BYTES = 65  # a SHA-256 HMAC in hex, and its newline


def new_key() -> str:
    """A secret for one launch's jobs (`framed`), for the processes it starts to find in `JOB_KEY`."""
    return secrets.token_hex(32)


def job_key() -> str | None:
    """This process's launcher's secret, taken out of the environment: the user's code the job runs (and what
    that starts) never sees it."""
    return os.environ.pop(JOB_KEY, None)


def _signature(key: str, *parts: bytes) -> bytes:
    """The job's signature line: the HMAC-SHA256 of its `parts` (read apart, never joined: the spec may hold a
    model's weights) with `key`, in hex."""
    mac = hmac.new(key.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.hexdigest().encode() + b"\n"


def framed(fields: dict[str, Any], data: bytes, key: str) -> bytes:
    """A job as a launched process reads it (`unframed`): its signature with `key`, then `fields` (JSON values)
    with this process's import path (`sys_path`), as one line of JSON, then `data` (`payload`)."""
    path = [p for p in sys.path if isinstance(p, str)]
    line = json.dumps({"sys_path": path, **fields}).encode() + b"\n"
    return _signature(key, line, data) + line + data


def unframed(stream: IO[bytes], key: str | None) -> tuple[dict[str, Any], bytes]:
    """The fields and the serialised spec `framed` wrote, read from `stream` (a process's standard input); the
    parent's import path put first in `sys.path` (modules its objects were pickled by reference from, a test's
    helpers or the user's package, import here as they did there). `ValueError` where the job is not signed with
    `key` (`job_key`: none, or another launcher's), or its first line is not a JSON object whose `sys_path` is a
    list of strings: nothing of it is parsed, let alone unpickled."""
    if not key:
        raise ValueError(f"no {JOB_KEY} in this process's environment: a job is read only from its launcher")
    signature, line = stream.readline(_SIGNATURE_BYTES), stream.readline(FIELDS_BYTES)
    data = stream.read()
    if not hmac.compare_digest(signature, _signature(key, line, data)):
        raise ValueError("the job is not signed by this process's launcher")
    if not line.endswith(b"\n"):
        raise ValueError("the job's fields are not one line of JSON")
    fields = json.loads(line)  # ValueError (json.JSONDecodeError, UnicodeDecodeError) where it is not JSON
    path = fields.get("sys_path") if isinstance(fields, dict) else None
    if not isinstance(path, list) or not all(isinstance(entry, str) for entry in path):
        raise ValueError("the job's fields are not an object with an import path (sys_path: a list of strings)")
    sys.path[:0] = [entry for entry in path if entry not in sys.path]
    return fields, data


def piped(stream: IO[bytes]) -> IO[bytes]:
    """`stream` where it is a pipe, as every launcher's job comes (`send`); `ValueError` where it is a file or a
    terminal: a job is never read from a file, whose spec whoever could write the file would have run as code."""
    if not stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode):
        raise ValueError("a job comes through the pipe its launcher writes, not from a file")
    return stream


def send(fd: int, data: bytes) -> None:
    """Write `data` to the pipe `fd` (a process's standard input) from a thread, and close it: the caller goes on
    while the process starts and reads it (a model given as an instance travels with its weights). A process gone
    first gets nothing; it reports nothing, and its launcher takes it as died."""
    threading.Thread(target=_write_all, args=(fd, data), name="autofit-send-job", daemon=True).start()


def _write_all(fd: int, data: bytes) -> None:
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(data)
    except OSError:
        pass


def _parts(spec: "TrainSpec", strategies: Sequence["Strategy"]) -> Iterator[tuple[str, Any]]:
    yield "the model (or model factory)", spec.model_factory
    yield "the batch (or make_batch factory)", spec.batch_factory
    yield "the loss function (loss_fn)", spec.loss_fn
    yield "the optimizer (factory or instance)", spec.optimizer.factory
    yield "the Hugging Face model config", spec.model.hf_config
    for strategy in strategies:
        yield f"the strategy {type(strategy).__name__}", strategy


def _unserialisable(spec: "TrainSpec", strategies: Sequence["Strategy"], exc: Exception) -> UsageError:
    import cloudpickle

    culprit, error = "the training spec", exc
    for name, part in _parts(spec, strategies):
        try:
            cloudpickle.dumps(part)
        except Exception as part_exc:  # noqa: BLE001
            culprit, error = f"{name} ({_short(part)})", part_exc
            break
    return UsageError(
        f"{culprit} cannot be sent to the probe processes ({type(error).__name__}: {error}): probes on several "
        "ranks, or with an engine, run in their own processes and rebuild it there. Make it self-contained: "
        "open files, locks, sockets and live connections cannot travel; create them inside the factory "
        "instead of capturing them.")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
