"""The launcher: one code that runs a probe outside the caller's process, as one child or as N ranks.

Where a probe runs is the strategies' call (`Strategy.placement`): a CHILD is one spawned process
(bitsandbytes paging, kernels: process-global state stays out of the caller); RANKS are `num_gpus`
spawned processes joined in a process group as torchrun would launch them (MASTER_ADDR/PORT, RANK,
WORLD_SIZE, LOCAL_RANK), over NCCL on CUDA or gloo on the CPU; engines (ZeRO, FSDP2, offload) run there
even on one rank. Each process runs the ordinary probe (`run_probe`) under its own budget; the parent:
- takes the first failure (OOM, error) as the candidate's and kills the others at once, since they may
  be waiting for it in a collective, so none is left hanging;
- kills every process past the timeout and records an error;
- reads a process killed by SIGKILL (exit code -9: the kernel's OOM killer) as an OOM of the host;
- always kills and joins every process, whatever happens.
A fit is the slowest rank's step time and the largest rank's peak.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import time
from typing import TYPE_CHECKING, Sequence

import torch

from autofit.config import Config
from autofit.errors import UsageError
from autofit.probe.handover import adopt, parent_state
from autofit.probe.outcome import ProbeResult, ProbeStatus
from autofit.spec.train import TrainSpec
from autofit.strategies.base import Placement

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
        raise UsageError(f"num_gpus={num_ranks} but {max(visible - first, 0)} CUDA device(s) are visible from "
                         f"cuda:{first} on ({visible} in all); use num_gpus<={max(visible - first, 0)}, an earlier "
                         "device, make more devices visible (CUDA_VISIBLE_DEVICES), or plan for a larger machine with "
                         "autofit dry-run --num-gpus.")


def probe_placed(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"], placement: Placement,
                 timeout: float = DEFAULT_TIMEOUT, step_limit: float | None = None) -> ProbeResult:
    """Probe `config` where `placement` says: in this process, a child, or launched ranks."""
    if placement is Placement.IN_PROCESS:
        from autofit.probe.run import run_probe

        return run_probe(spec, config, strategies, step_limit)
    return launch(spec, config, strategies, placement, timeout, step_limit)


def launch(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"], placement: Placement,
           timeout: float = DEFAULT_TIMEOUT, step_limit: float | None = None) -> ProbeResult:
    """Probe `config` in a child process (CHILD) or in `config.num_gpus` ranks (RANKS); never raises
    but for bad input."""
    ranks = placement is Placement.RANKS
    world = config.num_gpus if ranks else 1
    if ranks:
        check_ranks(spec.device, world)
    payload = pickled(spec, config, strategies, step_limit, world)
    if isinstance(payload, ProbeResult):
        return payload
    processes = _start(payload, world, ranks, timeout)
    try:
        reports = _collect(processes, config, timeout)
    finally:
        _reap(processes)
    return combine(spec, config, reports)


def pickled(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"],
            step_limit: float | None, world: int = 1) -> bytes | ProbeResult:
    """What a child process (of `world`) needs to run the probe, its parent's state included
    (`autofit.probe.handover`), or the error result saying why it does not pickle."""
    try:
        return pickle.dumps((spec, config, list(strategies), step_limit, parent_state(spec.device, world)))
    except Exception as exc:  # noqa: BLE001 - lambdas, local classes, open handles
        return ProbeResult(config, ProbeStatus.ERROR,
                           f"cannot probe in a child process: the spec does not pickle ({exc}); "
                           "define the model and batch factories at module level")


@dataclasses.dataclass
class _Process:
    process: multiprocessing.process.BaseProcess
    receiver: multiprocessing.connection.Connection


def _start(payload: bytes, world: int, ranks: bool, timeout: float) -> list[_Process]:
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    port = _free_port() if ranks else 0
    processes = []
    for rank in range(world):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_main, args=(rank, world, port if ranks else None, timeout, payload, sender),
                                  daemon=True, name=f"autofit-probe-{rank}")
        process.start()
        sender.close()
        processes.append(_Process(process, receiver))
    return processes


def _collect(processes: list[_Process], config: Config, timeout: float) -> list[ProbeResult]:
    """Each process's result; stops waiting (the caller kills the rest) at the first failure or the timeout."""
    deadline = time.monotonic() + timeout
    reports: dict[int, ProbeResult] = {}
    while len(reports) < len(processes) and time.monotonic() < deadline:
        waiting = {p.receiver: i for i, p in enumerate(processes) if i not in reports}
        for receiver in multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
            index = waiting[receiver]
            reports[index] = _receive(receiver, processes[index], config, index, len(processes))
        if any(r.status is not ProbeStatus.FIT for r in reports.values()):
            deadline = min(deadline, time.monotonic() + _GRACE)  # a failed rank's peers are stuck in collectives
    if not reports:
        what = f"probe of {len(processes)} ranks" if len(processes) > 1 else "probe"
        return [ProbeResult(config, ProbeStatus.ERROR, f"{what} timed out after {timeout:.0f} s")]
    for index in range(len(processes)):  # silent ranks: stuck behind a failed peer, or hung past the timeout
        reports.setdefault(index, ProbeResult(config, ProbeStatus.ERROR, f"rank {index} did not report: timed out"))
    return [reports[i] for i in sorted(reports)]


def _receive(receiver: multiprocessing.connection.Connection, process: _Process, config: Config, index: int,
             world: int) -> ProbeResult:
    try:
        return ProbeResult.from_dict(receiver.recv())
    except EOFError:  # the process died without reporting
        process.process.join(_GRACE)
        return died(config, process.process.exitcode, f"rank {index}" if world > 1 else "child process")


def died(config: Config, exitcode: int | None, who: str) -> ProbeResult:
    """The result of a probe process that died without reporting: SIGKILL (-9, the kernel's OOM killer
    most likely) is an OOM of the host; anything else an error."""
    if exitcode == -9:
        return ProbeResult(config, ProbeStatus.OOM, f"{who} killed (SIGKILL), likely out of host memory",
                           oom_kind="host-killed")
    return ProbeResult(config, ProbeStatus.ERROR, f"{who} died with exit code {exitcode}")


def _reap(processes: list[_Process]) -> None:
    for p in processes:
        if p.process.is_alive():
            p.process.kill()
    for p in processes:
        p.process.join()
        p.receiver.close()


def combine(spec: TrainSpec, config: Config, reports: list[ProbeResult]) -> ProbeResult:
    """One result for the candidate: the first OOM, else the first error or prune, else the fit with the
    largest peak and the slowest step (throughput over all ranks' samples)."""
    if len(reports) == 1:
        return dataclasses.replace(reports[0], config=config)
    for status in (ProbeStatus.OOM, ProbeStatus.ERROR, ProbeStatus.PRUNED):
        failed = [r for r in reports if r.status is status]
        if failed:
            return dataclasses.replace(failed[0], config=config,
                                       reason=f"{failed[0].reason} (on {len(failed)} of {len(reports)} ranks)")
    worst = max(reports, key=lambda r: (r.peak_bytes or 0))
    seconds = max(r.step_seconds for r in reports)
    samples = config.global_batch_size / seconds
    tokens = samples * spec.tokens_per_sample if spec.tokens_per_sample else None
    return dataclasses.replace(worst, config=config, step_seconds=seconds, samples_per_s=samples,
                               tokens_per_s=tokens, reason=worst.reason + " per rank")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _main(rank: int, world: int, port: int | None, timeout: float, payload: bytes,
          sender: multiprocessing.connection.Connection) -> None:
    """One process: join the process group (ranks only), run the ordinary probe, report, leave."""
    spec, config, strategies, step_limit, state = pickle.loads(payload)
    spec = adopt(state, spec, rank)  # the probe's cards, a memory baseline, the parent's TF32/cuDNN flags
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        if spec.device.type != "cuda":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise look for a GPU
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    result = _probe(spec, config, strategies, step_limit, rank, world, port, timeout)
    sender.send(result.to_dict())  # before leaving the group: leaving may wait for peers
    sender.close()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _probe(spec: TrainSpec, config: Config, strategies: list["Strategy"], step_limit: float | None, rank: int,
           world: int, port: int | None, timeout: float) -> ProbeResult:
    import torch.distributed as dist

    from autofit.probe.run import run_probe

    try:
        if port is not None:
            dist.init_process_group("nccl" if spec.device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        return run_probe(spec, config, strategies, step_limit)
    except Exception as exc:  # noqa: BLE001 - bad input found in a child still comes back as a result
        who = f"rank {rank}: " if world > 1 else ""
        return ProbeResult(config, ProbeStatus.ERROR, f"{who}{type(exc).__name__}: {exc}")


__all__ = ["DEFAULT_TIMEOUT", "check_ranks", "combine", "died", "launch", "pickled", "probe_placed"]
