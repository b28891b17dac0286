"""The warm process: `python -m autofit.probe.zygote CONTROL_FD`, started by `autofit.probe.warm`.

It imports torch and the libraries a job names (import only: no tensor is made, no CUDA call is made,
no thread pool is started, nothing is unpickled), then forks one process per probe and rank; each runs
exactly what `python -m autofit.probe.child RESULT_FD` runs (`autofit.probe.child.main`) with the
probe's environment, working folder, standard streams, job pipe and result pipe, in a session of its own so
that the launcher's kill of its process group reaches what it starts. The launcher's requests and this
process's replies travel over one Unix socket (JSON messages; the result pipe's write end, the launcher's
stdout / stderr and the read end of the pipe the job comes on travel as file descriptors with the request):

- `fork` (a job, its environment, the modules to import first): replies `started` with the pid, or
  `refused` with the reason when an import left this process unsafe to fork from (`unsafe`);
- `release` (a pid whose exit the launcher has read): the zombie is reaped only then, so a pid the
  launcher may still kill is never reused meanwhile;
- `describe`: this process's pid, threads, resident memory and modules (tests, the bench);
- and on its own, `exited` with a probe's pid and exit status (a negative signal number, as Popen's).

It ends when the launcher is gone (the socket closes, or its parent changes), killing the probes it
started.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
from typing import Any

from autofit.probe.orphans import LAUNCHER_PID, exit_process

# Imported but unsafe to fork from: where one of these is in this process, probes start fresh instead.
# DeepSpeed picks its accelerator when imported (DS_ACCELERATOR, which a rank's environment sets);
# bitsandbytes loads its CUDA library when imported.
UNSAFE_MODULES = ("deepspeed", "bitsandbytes")
UNSAFE_LIBRARIES = ("libcuda.so",)  # the CUDA driver: a process forked after it was loaded cannot use CUDA
MESSAGE_BYTES = 1 << 20  # the largest request (a probe's environment and its module list)
FORK_FDS = 4  # what comes with a fork request: the result pipe, stdout, stderr, the job pipe
POLL_SECONDS = 1.0  # how often the launcher's presence is checked when nothing arrives


def main(argv: list[str] | None = None) -> int:
    """Serve the launcher on the socket descriptor `argv[0]` until it is gone."""
    control = socket.socket(fileno=int((argv if argv is not None else sys.argv[1:])[0]))
    Zygote(control).serve()
    return 0


class Zygote:
    """The loop: requests from the launcher, probes' exits, and the launcher's presence."""

    def __init__(self, control: socket.socket):
        self.control, self.launcher = control, os.getppid()
        self.wake = os.pipe()
        os.set_blocking(self.wake[1], False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a probe's exit wakes the loop through the pipe
        signal.set_wakeup_fd(self.wake[1])
        self.probes: set[int] = set()  # pids whose exit is not yet reported
        self.refusal: str | None = None  # once an import made forking unsafe, every fork is refused

    def serve(self) -> None:
        while os.getppid() == self.launcher:
            readable, _, _ = select.select([self.control, self.wake[0]], [], [], POLL_SECONDS)
            if self.wake[0] in readable:
                os.read(self.wake[0], 4096)
            self.report_exits()
            if self.control in readable:
                try:
                    message, fds, _, _ = socket.recv_fds(self.control, MESSAGE_BYTES, FORK_FDS)
                except OSError:
                    break
                if not message:
                    break  # the launcher closed its end: it is gone, or done with this process
                try:
                    self.answer(json.loads(message), fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        self.end_probes()

    def answer(self, request: dict[str, Any], fds: list[int]) -> None:
        op = request.get("op")
        if op == "release":
            _reap(request["pid"])
        elif op == "describe":
            self.send({"op": "described", "id": request.get("id"), **describe()})
        elif op == "fork":
            # the launcher's import path first, as the probe process puts it (autofit.probe.child.main)
            sys.path[:0] = [entry for entry in request["sys_path"] if entry not in sys.path]
            self.refusal = self.refusal or warm(request["warm"])
            reply = {"op": "refused", "reason": self.refusal} if self.refusal else self.fork(request, fds)
            self.send({**reply, "id": request["id"]})
        else:
            self.send({"op": "refused", "id": request.get("id"), "reason": f"unknown request {op!r}"})

    def fork(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if len(fds) != FORK_FDS:
            return {"op": "refused", "reason": f"{len(fds)} descriptors came with the request, not {FORK_FDS}"}
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            return {"op": "refused", "reason": f"fork failed ({exc})"}
        if pid == 0:
            _run_probe(request, fds, [self.control.fileno(), *self.wake])  # never returns
        self.probes.add(pid)
        return {"op": "started", "pid": pid}

    def report_exits(self) -> None:
        """Tell the launcher each probe that has exited, leaving it a zombie (its pid still reserved) until
        the launcher releases it."""
        for pid in list(self.probes):
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = None
            if info is None:
                continue
            killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            self.probes.discard(pid)
            self.send({"op": "exited", "pid": pid, "returncode": -info.si_status if killed else info.si_status})

    def end_probes(self) -> None:
        """The launcher is gone: kill what each running probe started, and reap it."""
        for pid in self.probes:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in self.probes:
            _reap(pid)

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.control.send(json.dumps(message).encode())
        except OSError:
            pass  # the launcher is gone: the loop ends at its next turn


def warm(modules: list[list[Any]]) -> str | None:
    """Import `modules` ([name, the file the launcher has it from]); the reason this process is no longer
    safe to fork probes from (`unsafe`, or a module found at another file than the launcher's), or None."""
    for name, origin in modules:
        new = name not in sys.modules
        if new:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - the probe process will meet (and report) it itself
                return f"importing {name} failed here ({type(exc).__name__}: {exc})"
        found = getattr(sys.modules[name], "__file__", None)
        if origin is not None and found is not None and os.path.realpath(found) != os.path.realpath(origin):
            return f"{name} imported from {found}, the launcher's from {origin}"
        why = unsafe(sys.modules, _mapped()) if new else None
        if why:
            return f"{why} (imported with {name})"
    return None


def unsafe(modules: dict[str, Any], mapped: str) -> str | None:
    """Why a process with `modules` imported and `mapped` (its /proc/self/maps) cannot fork probes: a module
    that reads a rank's environment when imported, or the CUDA driver loaded (a CUDA context may exist)."""
    for name in UNSAFE_MODULES:
        if name in modules:
            return f"{name} is imported, which reads the rank's environment when imported"
    for library in UNSAFE_LIBRARIES:
        if library in mapped:
            return f"the CUDA driver ({library}) is loaded: a forked process could not use CUDA"
    torch = modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised: a forked process could not use it"
    return None


def _mapped() -> str:
    try:
        with open("/proc/self/maps") as maps:
            return maps.read()
    except OSError:
        return ""


def describe() -> dict[str, Any]:
    """This process: its pid, threads (1 unless an import started a pool), resident memory (bytes), the
    number of modules imported, and which unsafe ones are among them."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    resident = None
    try:
        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return {"pid": os.getpid(), "threads": threads, "resident_bytes": resident, "modules": len(sys.modules),
            "unsafe_modules": [name for name in UNSAFE_MODULES if name in sys.modules],
            "cuda_initialised": "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()}


def _run_probe(request: dict[str, Any], fds: list[int], zygotes: list[int]) -> None:
    """In the forked process: become what `python -m autofit.probe.child` would be (the zygote's own
    descriptors `zygotes` closed), run it, exit."""
    code = 1
    try:
        os.setsid()  # its own process group, as start_new_session gives a fresh one
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in zygotes:
            os.close(fd)
        result_fd, stdout_fd, stderr_fd, job_fd = fds
        for source, target in ((job_fd, 0), (stdout_fd, 1), (stderr_fd, 2)):
            os.dup2(source, target)
        for fd in (job_fd, stdout_fd, stderr_fd):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"], **{LAUNCHER_PID: str(os.getppid())})  # this process's death ends it
        from autofit.probe import child

        sys.argv = [child.__file__, str(result_fd)]
        code = child.main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a fresh interpreter
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        exit_process(code, forked=True)  # as an interpreter's exit would, without its parent's finalizers


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


if __name__ == "__main__":
    exit_process(main())  # its launcher waits for it: the interpreter's teardown is skipped
