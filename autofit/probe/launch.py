"""The launcher: one code that runs a probe outside the caller's process, as one child or as N ranks.

Where a probe runs is the strategies' call (`Strategy.placement`): a CHILD is one process (bitsandbytes
paging, kernels: process-global state stays out of the caller); RANKS are `num_gpus` processes joined
in a process group as torchrun would launch them (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), over
NCCL on CUDA or gloo on the CPU; engines (ZeRO, FSDP2, offload) run there even on one rank.

Each process is `python -m autofit.probe.child`, an autofit entry point: nothing of the user's
`__main__` is imported or re-run there. The spec and the strategies travel with cloudpickle on the
process's standard input (never through a file), so lambdas, closures and factories defined in a
notebook, on standard input or in a script without a main guard work; what cannot be serialised at all
is one `UsageError` naming it, before any probe (`check_serialisable`). Each process runs the ordinary
probe (`run_probe`) under its own budget and reports one JSON result; the parent:
- takes the first failure (OOM, error) as the candidate's and kills the others at once, since they may
  be waiting for it in a collective, so none is left hanging;
- kills every process past the timeout and records an error;
- reads a process killed by SIGKILL (exit code -9: the kernel's OOM killer) as an OOM of the host;
- always kills and reaps every process (and what it started), whatever happens.
A fit is the slowest rank's step time and the largest rank's peak; every rank's peak is kept
(`ProbeResult.rank_peaks`), and the reason names the rank that set the maximum.
A plan over several nodes is probed on one (`ranks_here`): the reason says which figures that measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Sequence

import torch

from autofit.config import Config
from autofit.version import PACKAGE
from autofit.errors import Param, UsageError
from autofit.probe.orphans import LAUNCHER_PID
from autofit.probe import warm
from autofit.probe.handover import parent_state
from autofit.probe.payload import JOB_KEY, framed, new_key, payload, send
from autofit.probe.outcome import OomKind, ProbeResult, ProbeStatus
from autofit.job.train_spec import TrainSpec
from autofit.strategies.base import Placement
from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.strategies.base import Strategy

DEFAULT_TIMEOUT = 600.0  # seconds for every process of one probe; a probe is a few steps, so this only stops a hang
_GRACE = 5.0  # seconds the other ranks get to report once one has


def check_ranks(device: torch.device, num_ranks: int) -> None:
    """`UsageError` when `num_ranks` CUDA ranks cannot run here, starting at `device`'s index. On the CPU any
    number of ranks may run (that is how several GPUs are rehearsed in tests)."""
    if device.type != "cuda":
        return
    visible, first = torch.cuda.device_count(), device.index or 0
    if first + num_ranks > visible:
        raise UsageError(f"{{given}} but {max(visible - first, 0)} CUDA device(s) are visible from cuda:{first} on "
                         f"({visible} in all); use {{name}} of at most {max(visible - first, 0)}, an earlier device, "
                         "make more devices visible (CUDA_VISIBLE_DEVICES), or plan for a larger machine with "
                         "autofit dry-run --num-gpus.", given=Param("num_gpus", num_ranks), name=Param("num_gpus"))


def check_host_budget(spec: TrainSpec) -> None:
    """`UsageError` when CPU probes would be given more than this machine's RAM: they allocate what they count,
    so a probe past the RAM is killed by the operating system (and the process with it, where it runs in this
    one) rather than running out of the budget. Every rank of a CPU rehearsal of several GPUs holds its own."""
    if spec.device.type != "cpu":
        return
    import psutil

    ram, ranks = psutil.virtual_memory(), max(spec.num_gpus, 1)
    if spec.memory_budget * ranks <= ram.total:
        return
    each = f" per rank, {format_size(spec.memory_budget * ranks)} for {ranks} ranks," if ranks > 1 else ""
    raise UsageError(f"memory_budget {format_size(spec.memory_budget)}{each} exceeds this machine's "
                     f"{format_size(ram.total)} of RAM: CPU probes allocate what they count, so one past the RAM "
                     "would be killed by the operating system instead of running out of the budget. Give at most "
                     f"{format_size(ram.available // ranks)}{' per rank' if ranks > 1 else ''} (free now), or plan "
                     "for a larger card without probing: autofit.dry_run(..., gpu_memory=...) (autofit dry-run "
                     "--gpu-memory).")


def probe_placed(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"], placement: Placement,
                 timeout: float = DEFAULT_TIMEOUT, step_limit: float | None = None) -> ProbeResult:
    """Probe `config` where `placement` says: in this process, a child, or launched ranks; in a child
    instead of this process once an earlier probe here left memory allocated (`fresh_placement`)."""
    placement = fresh_placement(spec, strategies, placement)
    if placement is Placement.IN_PROCESS:
        from autofit.probe.run import run_probe

        return run_probe(spec, config, strategies, step_limit, timeout)
    return launch(spec, config, strategies, placement, timeout, step_limit)


def fresh_placement(spec: TrainSpec, strategies: Sequence["Strategy"], placement: Placement) -> Placement:
    """`placement`, or CHILD for an in-process probe on a card where earlier probes in this process left
    memory allocated (`autofit.devices.memory.memory_left_behind`): a fresh process measures what the user's
    job will have. A spec that cannot be serialised stays here (its probes then start with less room)."""
    from autofit.devices.memory import memory_left_behind
    from autofit.probe.payload import check_serialisable

    if placement is not Placement.IN_PROCESS or not memory_left_behind(spec.device):
        return placement
    try:
        check_serialisable(spec, strategies)
    except UsageError:
        return placement
    return Placement.CHILD


def launch(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"], placement: Placement,
           timeout: float = DEFAULT_TIMEOUT, step_limit: float | None = None) -> ProbeResult:
    """Probe `config` in a child process (CHILD) or in `config.num_gpus` ranks (RANKS); never raises
    but for bad input (a spec that cannot be serialised: `UsageError`)."""
    ranks = placement is Placement.RANKS
    world = ranks_here(spec, config) if ranks else 1
    if ranks:
        check_ranks(spec.device, world)
    data, key = payload(spec, strategies), new_key()
    job = framed(make_job(spec, config, world, timeout, step_limit), data, key)
    processes: list[_Process] = []
    try:
        processes = _start(job, key, world, ranks, spec.device, data)
        reports = _collect(processes, config, timeout)
    finally:
        _reap(processes)
    result = combine(spec, config, reports)
    if world < config.num_gpus and result.status is ProbeStatus.FIT:
        result = dataclasses.replace(result, reason=f"{result.reason}; {one_node_note(config)}")
    return result


def ranks_here(spec: TrainSpec, config: Config) -> int:
    """The ranks a probe of `config` launches here: one node's on CUDA where the plan spans several (the
    others are like it: probe one node, plan many), else every rank (on the CPU a rehearsal of every node,
    where hybrid sharding's mesh has all its dimensions)."""
    if config.nodes > 1 and spec.device.type == "cuda":
        return config.gpus_per_node
    return config.num_gpus


def one_node_note(config: Config) -> str:
    """What a probe on one node of a multi-node `config` measured and what it leaves to prediction."""
    return (f"measured on one node of {config.nodes} ({config.gpus_per_node} ranks): the peak per GPU is what a "
            "node holds (sharding within a node holds the same across nodes; sharding over every GPU holds less "
            "there, so the figure is an upper bound), the step time leaves out the collectives across nodes, and "
            "samples/s over every node is predicted from it (autofit dry-run --nodes charges those collectives)")


def make_job(spec: TrainSpec, config: Config, world: int, timeout: float, step_limit: float | None) -> dict:
    """The fields each probe process reads beside the serialised spec (`autofit.probe.child.run_job`), plain
    values: the config, the limits, and the parent's cards and TF32/cuDNN flags (`autofit.probe.handover`)."""
    return {"config": config.to_dict(), "step_limit": step_limit, "timeout": timeout,
            "state": parent_state(spec.device, world)}


@dataclasses.dataclass
class _Process:
    """One probe process (fresh, or forked by the warm process) and the read end of its result pipe."""

    popen: subprocess.Popen | warm.WarmProcess
    result_fd: int
    data: bytearray = dataclasses.field(default_factory=bytearray)


def _start(job: bytes, key: str, world: int, ranks: bool, device: torch.device,
           job_payload: bytes) -> list[_Process]:
    """One process per rank: forked by the warm process (`autofit.probe.warm`) or, where it cannot, fresh; each
    reads `job` on its standard input (`autofit.probe.payload.send`), signed with `key`, which it finds in its
    environment."""
    port = _free_port() if ranks else None
    streams = (sys.__stderr__.fileno() if sys.__stderr__ else 1, 2)  # stdout stays the caller's (--json)
    modules = warm.warm_list(job_payload) if warm.off_reason() is None else []
    processes = []
    for rank in range(world):
        read_fd, write_fd = os.pipe()
        job_in, job_out = os.pipe()
        try:
            env = dict(_environment(rank, world, port, device), **{JOB_KEY: key})
            popen = warm.start(job_in, write_fd, env, streams, modules) or subprocess.Popen(
                [sys.executable, "-m", "autofit.probe.child", str(write_fd)], env=env, pass_fds=(write_fd,),
                stdin=job_in, stdout=streams[0],
                start_new_session=True)  # its own process group: a kill reaches what it started too
        except BaseException:
            os.close(read_fd)
            os.close(job_out)
            raise
        finally:
            os.close(write_fd)
            os.close(job_in)
        send(job_out, job)
        processes.append(_Process(popen, read_fd))
    return processes


def _environment(rank: int, world: int, port: int | None, device: torch.device) -> dict[str, str]:
    """The child's environment: the caller's, autofit importable as here, and the rank's place in the
    process group as torchrun sets it (ranks only)."""
    env = dict(os.environ, **{LAUNCHER_PID: str(os.getpid())})
    here = str(PACKAGE.parent)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    if port is not None:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        if device.type != "cuda":
            env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise look for a GPU
    return env


def _collect(processes: list[_Process], config: Config, timeout: float) -> list[ProbeResult]:
    """Each process's result; stops waiting (the caller kills the rest) at the first failure or the timeout."""
    deadline = time.monotonic() + timeout
    reports: dict[int, ProbeResult] = {}
    while len(reports) < len(processes) and time.monotonic() < deadline:
        waiting = {p.result_fd: i for i, p in enumerate(processes) if i not in reports}
        readable, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
        for fd in readable:
            index = waiting[fd]
            report = _receive(processes[index], config, index, len(processes))
            if report is not None:
                reports[index] = report
        if any(r.status is not ProbeStatus.FIT for r in reports.values()):
            deadline = min(deadline, time.monotonic() + _GRACE)  # a failed rank's peers are stuck in collectives
    if not reports:
        what = f"probe of {len(processes)} ranks" if len(processes) > 1 else "probe"
        return [ProbeResult(config, ProbeStatus.ERROR, f"{what} timed out after {timeout:.0f} s")]
    for index in range(len(processes)):  # silent ranks: stuck behind a failed peer, or hung past the timeout
        reports.setdefault(index, ProbeResult(config, ProbeStatus.ERROR, f"rank {index} did not report: timed out"))
    return [reports[i] for i in sorted(reports)]


def _receive(process: _Process, config: Config, index: int, world: int) -> ProbeResult | None:
    """The process's result once its pipe is closed, or None while it is still writing."""
    chunk = os.read(process.result_fd, 1 << 20)
    if chunk:
        process.data += chunk
        return None
    if process.data:
        return ProbeResult.from_dict(json.loads(process.data.decode()))
    try:  # the process closed the pipe without reporting: it died
        process.popen.wait(_GRACE)
    except subprocess.TimeoutExpired:
        pass
    return died(config, process.popen.returncode, f"rank {index}" if world > 1 else "child process")


def died(config: Config, exitcode: int | None, who: str) -> ProbeResult:
    """The result of a probe process that died without reporting: SIGKILL (-9, the kernel's OOM killer
    most likely) is an OOM of the host; anything else an error. No exit status (None): the process was
    still running `_GRACE` seconds after it closed its pipe, or the warm process that forked it was lost."""
    if exitcode is None:
        return ProbeResult(config, ProbeStatus.ERROR, f"{who} ended its result pipe without reporting; its exit "
                                                      "status is unknown")
    if exitcode == -9:
        return ProbeResult(config, ProbeStatus.OOM, f"{who} killed (SIGKILL), likely out of host memory",
                           oom_kind=OomKind.HOST_KILLED)
    return ProbeResult(config, ProbeStatus.ERROR, f"{who} died with exit code {exitcode}")


def _reap(processes: list[_Process]) -> None:
    """Kill every process still running, with what it started (its own process group), and wait for it."""
    for p in processes:
        if p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.popen.kill()
    for p in processes:
        p.popen.wait()
        os.close(p.result_fd)


# What a rank's collective raises when a peer has left, a consequence of the peer's outcome, never the
# cause: gloo's "Connection closed by peer" (third_party/gloo/gloo/transport/tcp/pair.cc, seen here on CPU
# ranks) or "reset"; NCCL's ncclGetErrorString(ncclRemoteError), and torch's ProcessGroupNCCL comm getter
# (TORCH_CHECK "NCCL communicator was aborted on rank N") once the watchdog has aborted it.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
             "NCCL communicator was aborted")


def _lost_peer(result: ProbeResult) -> bool:
    return result.status is ProbeStatus.ERROR and any(text in result.reason for text in PEER_LOST)


def combine(spec: TrainSpec, config: Config, reports: list[ProbeResult]) -> ProbeResult:
    """One result for the candidate: the first OOM, else the first error or prune (an error that only
    says a peer left comes after the peer's own prune), else the fit with the largest peak and the slowest
    step (throughput over all ranks' samples). Every rank's peak is kept."""
    if len(reports) == 1:
        return dataclasses.replace(reports[0], config=config)
    peaks = tuple(r.peak_bytes for r in reports)
    causes = [[r for r in reports if r.status is ProbeStatus.OOM],
              [r for r in reports if r.status is ProbeStatus.ERROR and not _lost_peer(r)],
              [r for r in reports if r.status is ProbeStatus.PRUNED],
              [r for r in reports if _lost_peer(r)]]
    for failed in causes:
        if failed:
            return dataclasses.replace(failed[0], config=config, rank_peaks=peaks,
                                       reason=f"{failed[0].reason} (on {len(failed)} of {len(reports)} ranks)")
    rank = max(range(len(reports)), key=lambda i: reports[i].peak_bytes or 0)
    seconds = max(r.step_seconds for r in reports)
    samples = config.global_batch_size / seconds
    tokens = samples * spec.tokens_per_sample if spec.tokens_per_sample else None
    images = samples * spec.images_per_sample if spec.images_per_sample else None
    every = ", ".join(format_size(p) for p in peaks)
    return dataclasses.replace(reports[rank], config=config, step_seconds=seconds, samples_per_s=samples,
                               tokens_per_s=tokens, images_per_s=images, rank_peaks=peaks,
                               reason=f"{reports[rank].reason} per rank, set by rank {rank} of {len(reports)} "
                                      f"(every rank: {every})")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = ["DEFAULT_TIMEOUT", "check_host_budget", "check_ranks", "combine", "died", "launch", "probe_placed"]
