"""Warm probe processes, the launcher's side: one process per launcher (`autofit.probe.zygote`) has
imported torch and the libraries the jobs name, and forks each probe process (each rank) from there, so
a probe no longer pays an interpreter's start and `import torch` (and transformers, for a Hugging Face
model) per probe and rank.

The forked process runs what a fresh `python -m autofit.probe.child` runs, with the same job pipe, result
pipe, environment, working folder and standard streams, in a session of its own; what it measures is the
same either way. The launcher holds a `WarmProcess` for it, shaped as the `subprocess.Popen` it holds for
a fresh one (pid, poll, wait, kill, returncode): the warm process reports each probe's exit status (a
negative signal number when killed, as Popen's: -9 is read as the host's OOM killer).

Probes start fresh instead — with the same outcome, only slower — where `AUTOFIT_WARM_PROBES=0`, off Linux
(fork with torch is not safe on macOS), where the warm process cannot start or refuses (an import made
forking unsafe: `autofit.probe.zygote.unsafe`), and after it was lost more than `MAX_LOSSES` times. A
probe's environment differing from the warm process's in anything but the rank's place (and its job's secret)
starts a new warm process, as what was imported may have read it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import io
import json
import logging
import os
import pickletools
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Iterator

from autofit.probe.orphans import LAUNCHER_PID
from autofit.probe.payload import JOB_KEY

log = logging.getLogger(__name__)

SWITCH = "AUTOFIT_WARM_PROBES"  # "0": a fresh interpreter per probe and rank (slower, same outcome)
# What differs between the probe processes of one launcher: a rank's place, which nothing imported in
# the warm process may read (DeepSpeed, which reads DS_ACCELERATOR, is never imported there), and the secret
# each launch signs its job with (`autofit.probe.payload.JOB_KEY`), which only the probe process reads.
RANK_KEYS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                       "DS_ACCELERATOR", LAUNCHER_PID, JOB_KEY})
# Packages whose modules a job names that the warm process imports ahead (the launcher has them too);
# the user's own modules are left to the probe process, which imports them as a fresh one would.
WARMABLE = frozenset({"torch", "autofit", "transformers", "peft", "torchvision", "timm", "numpy", "cloudpickle"})
ALWAYS = ("torch", "torch.distributed", "cloudpickle", "autofit.probe.run", "autofit.probe.child")
COMMAND = ("-m", "autofit.probe.zygote")  # after sys.executable; its socket's descriptor follows
START_TIMEOUT = 300.0  # seconds a fork may wait on the warm process's imports before probes start fresh
MAX_LOSSES = 3  # warm processes lost (killed from outside) before this process stops starting them


class Unavailable(Exception):
    """The warm process cannot start this probe; the reason is the message."""


class Lost(Unavailable):
    """The warm process ended (killed from outside, or it could not start)."""


@dataclasses.dataclass(eq=False)
class WarmProcess:
    """A probe process forked by the warm process, as the launcher sees it (the parts of `subprocess.Popen`
    it uses). `returncode` stays None where the warm process was lost before it could report."""

    pid: int
    zygote: "Zygote"
    returncode: int | None = None
    ended: bool = False  # its exit is known, or it cannot be (the warm process was lost and it was killed)

    def poll(self) -> int | None:
        self.zygote.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ended:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired([sys.executable, *COMMAND], timeout or 0.0)
            self.zygote.pump(1.0 if left is None else min(left, 1.0))
        return self.returncode

    def kill(self) -> None:
        if not self.ended:
            try:
                os.kill(self.pid, signal.SIGKILL)  # still this launcher's: a zombie until released
            except ProcessLookupError:
                pass


class Zygote:
    """One warm process and the socket to it; `fork` starts a probe, `pump` reads what it reports."""

    def __init__(self, env: dict[str, str], stdout: int | None):
        self.env, self.owner = _shared(env), os.getpid()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen = subprocess.Popen([sys.executable, *COMMAND, str(theirs.fileno())], env=self.env,
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=stdout,
                                          start_new_session=True)
        finally:
            theirs.close()
        self.lock = threading.RLock()
        self.running: dict[int, WarmProcess] = {}
        self.replies: dict[Any, dict] = {}
        self.lost = False
        self.forks = 0  # probe processes started (tests, the bench)
        self._ids = 0

    def usable_for(self, env: dict[str, str]) -> bool:
        return not self.lost and self.owner == os.getpid() and self.popen.poll() is None and _shared(env) == self.env

    def fork(self, job_fd: int, result_fd: int, env: dict[str, str], streams: tuple[int, int],
             modules: list[tuple[str, str | None]]) -> WarmProcess:
        """Start a probe reading its job on `job_fd`, writing to `result_fd`, with `env` and `streams` (stdout,
        stderr)."""
        with self.lock:
            self._ids += 1
            request = {"op": "fork", "id": self._ids, "env": env, "cwd": os.getcwd(),
                       "sys_path": [p for p in sys.path if isinstance(p, str)], "warm": modules}
            reply = self._ask(request, [result_fd, *streams, job_fd], START_TIMEOUT)
            if reply.get("op") != "started":
                raise Unavailable(f"the warm process refused: {reply.get('reason')}")
            process = WarmProcess(reply["pid"], self)
            self.running[process.pid] = process
            self.forks += 1
            return process

    def describe(self) -> dict[str, Any]:
        """The warm process's pid, threads, resident bytes and modules (`autofit.probe.zygote.describe`)."""
        with self.lock:
            return self._ask({"op": "describe", "id": "described"}, [], 60.0)

    def _ask(self, request: dict[str, Any], fds: list[int], timeout: float) -> dict[str, Any]:
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        except OSError as exc:
            self._lose()
            raise Lost(f"the warm process is gone ({exc})") from exc
        deadline = time.monotonic() + timeout
        while request["id"] not in self.replies:
            if self.lost:
                try:
                    code = self.popen.wait(5)
                except subprocess.TimeoutExpired:
                    code = None
                raise Lost(f"the warm process ended (exit code {code})")
            if time.monotonic() > deadline:
                self.close()
                raise Unavailable(f"the warm process did not answer within {timeout:.0f} s")
            self.pump(max(0.0, min(1.0, deadline - time.monotonic())))
        return self.replies.pop(request["id"])

    def pump(self, timeout: float) -> None:
        """Read what the warm process has reported within `timeout` seconds: replies and probes' exits."""
        with self.lock:
            wait = timeout
            while not self.lost and self.sock.fileno() >= 0 and select.select([self.sock], [], [], wait)[0]:
                wait = 0.0
                try:
                    data = self.sock.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    self._lose()
                    break
                self._take(json.loads(data))

    def _take(self, message: dict[str, Any]) -> None:
        if message["op"] == "exited":
            process = self.running.pop(message["pid"], None)
            if process is not None:
                process.returncode, process.ended = message["returncode"], True
            try:  # read: the zombie may go, and its pid with it
                self.sock.send(json.dumps({"op": "release", "pid": message["pid"]}).encode())
            except OSError:
                pass
        else:
            self.replies[message.get("id")] = message

    def _lose(self) -> None:
        """The warm process is gone: its probes have no one to report their exit; kill them and say so."""
        self.lost = True
        for process in self.running.values():
            _kill_group(process.pid)
            process.ended = True
        self.running.clear()

    def close(self) -> None:
        """End the warm process (its running probes with it) and reap it."""
        with self.lock:
            if self.owner != os.getpid():
                self.sock.close()  # a forked copy of the launcher: the warm process is its parent's
                return
            self._lose()
            self.sock.close()  # the warm process reads the end of its socket and exits
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _shared(env: dict[str, str]) -> dict[str, str]:
    """What every probe process of this launcher has in its environment alike."""
    return {key: value for key, value in env.items() if key not in RANK_KEYS}


_current: Zygote | None = None
_off: str | None = None  # why warm processes are off in this process
_losses = 0


def off_reason() -> str | None:
    """Why probes start as fresh processes here, or None where they are forked warm."""
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{SWITCH}={os.environ[SWITCH]}"
    if not sys.platform.startswith("linux"):
        return f"warm probe processes run on Linux only (this is {sys.platform})"
    return _off


def start(job_fd: int, result_fd: int, env: dict[str, str], streams: tuple[int, int],
          modules: list[tuple[str, str | None]]) -> WarmProcess | None:
    """A probe process forked warm, reading its job on `job_fd` (`result_fd`, `env`, `streams`: stdout, stderr;
    `modules` imported first: `warm_list`), or None where it must start fresh (`off_reason`; a warm process
    that refuses turns them off for this process)."""
    global _current, _off, _losses
    if off_reason():
        return None
    why = None
    for _ in range(2):  # a warm process lost since the last probe is replaced once
        if _current is not None and not _current.usable_for(env):
            _losses += _current.lost or _current.popen.poll() is not None
            stop()
        if _losses > MAX_LOSSES:
            why = f"the warm process was lost {_losses} times ({why})"
            break
        try:
            if _current is None:
                _current = Zygote(env, streams[0])
            return _current.fork(job_fd, result_fd, env, streams, modules)
        except Lost as exc:
            why = str(exc)  # the reason where its replacement is lost too
        except (Unavailable, OSError) as exc:
            why = str(exc)
            break
    _off = why
    log.info("probes start as fresh processes from now on: %s", why)
    stop()
    return None


def current() -> Zygote | None:
    """This process's warm process, if one runs (tests, the bench)."""
    return _current


def stop() -> None:
    """End this process's warm process, if any (at exit; tests). The next probe starts a new one."""
    global _current
    if _current is not None:
        _current.close()
        _current = None


@contextlib.contextmanager
def ending() -> Iterator[None]:
    """Probes launched inside fork from one warm process, which ends with the block (`stop`): a search's, so
    that a notebook does not keep the warm process's memory once its plan is made."""
    try:
        yield
    finally:
        stop()


def _forget_after_fork() -> None:
    global _current
    if _current is not None:
        _current.sock.close()  # the parent's: a forked copy starts its own when it probes
        _current = None


atexit.register(stop)
os.register_at_fork(after_in_child=_forget_after_fork)


def warm_list(payload: bytes) -> list[tuple[str, str | None]]:
    """The modules the warm process imports ahead for a job, with the file the launcher has each from:
    `ALWAYS`, and those of `WARMABLE` packages the payload names that this process has imported, with
    their imported siblings (a configuration's module names its model's, as `configuration_gpt2` does
    `modeling_gpt2`)."""
    named = [name for name in modules_named(payload) if name.split(".")[0] in WARMABLE and name in sys.modules]
    siblings = [other for name in named if name.count(".") >= 2 for other in _imported_under(name.rsplit(".", 1)[0])]
    found = []
    for name in dict.fromkeys([*ALWAYS, *named, *siblings]):
        module = sys.modules.get(name)
        if module is not None:
            found.append((name, getattr(module, "__file__", None)))
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            found.append((name, spec.origin if spec.has_location else None))
    return found


def _imported_under(package: str) -> Iterable[str]:
    prefix = package + "."
    return [name for name in list(sys.modules) if name.startswith(prefix) and "." not in name[len(prefix):]]


def modules_named(payload: bytes) -> list[str]:
    """The modules a pickle's globals come from (GLOBAL and STACK_GLOBAL), read without unpickling it."""
    names: list[str] = []
    memo: dict[int, Any] = {}
    recent: list[Any] = []  # the values pushed last: STACK_GLOBAL takes the module and name from there
    for op, arg in _opcodes(payload):
        if op == "GLOBAL":
            names.append(str(arg).split(" ", 1)[0])
        elif op == "STACK_GLOBAL" and len(recent) >= 2 and isinstance(recent[-2], str):
            names.append(recent[-2])
        if op == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif op in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = recent[-1] if recent else None
        elif op in ("GET", "BINGET", "LONG_BINGET"):
            recent.append(memo.get(int(arg)))
        else:
            recent.append(arg if isinstance(arg, str) and "UNICODE" in op else None)
        del recent[:-2]
    return list(dict.fromkeys(names))


# Arguments stepped over rather than read (their width of length): the bytes of tensors and buffers, which
# name no module (a model given as an instance travels with its weights: `pickletools.genops` would copy them)
_STEPPED_OVER = {pickletools.bytes1: 1, pickletools.bytes4: 4, pickletools.bytes8: 8, pickletools.bytearray8: 8}


def _opcodes(payload: bytes) -> Iterable[tuple[str, Any]]:
    """Each opcode's name and argument, as `pickletools.genops` gives them (None for stepped-over bytes)."""
    stream = io.BytesIO(payload)
    while code := stream.read(1):
        op = pickletools.code2op[code.decode("latin-1")]
        if op.arg in _STEPPED_OVER:
            stream.seek(int.from_bytes(stream.read(_STEPPED_OVER[op.arg]), "little"), io.SEEK_CUR)
            yield op.name, None
        else:
            yield op.name, None if op.arg is None else op.arg.reader(stream)
        if op.name == "STOP":
            return


__all__ = ["SWITCH", "WarmProcess", "Zygote", "current", "modules_named", "off_reason", "start", "stop",
           "warm_list"]
