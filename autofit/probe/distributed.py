"""Several ranks: a probe of `num_gpus` data-parallel ranks, each a spawned child process, as torchrun
would launch them (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), over NCCL on CUDA or gloo on the CPU.

Engine strategies (ZeRO, FSDP2, offload) also probe here on one rank, so DeepSpeed and process-group
state never enter the caller's process. Each rank runs the ordinary probe (`run_probe`) under its own
budget; the parent watches them all:
- the first rank to report a failure (OOM, error) decides the candidate: the other ranks, which may be
  waiting in a collective for it, are killed at once, so none is left hanging;
- past the timeout every rank is killed and the candidate is an error;
- children are always killed and joined, whatever happens.
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
from typing import Any, Sequence

import torch

from autofit.config import Config
from autofit.errors import UsageError
from autofit.probe.isolate import pickled
from autofit.probe.run import ProbeResult, ProbeStatus
from autofit.spec.train import TrainSpec
from autofit.strategies.base import Option, Strategy

DEFAULT_TIMEOUT = 600.0  # seconds for all ranks of one probe; it only stops a hang
_GRACE = 5.0  # seconds the other ranks get to report once one has


def needs_ranks(config: Config) -> bool:
    """Whether `config` must be probed through `run_ranks`: several ranks, or an engine strategy."""
    return config.num_gpus > 1 or config.zero_stage > 0 or config.fsdp != "none" or config.offload != "none"


def check_ranks(device: torch.device, num_ranks: int) -> None:
    """`UsageError` when `num_ranks` CUDA ranks cannot run here. On the CPU any number of ranks may run
    (that is how several GPUs are rehearsed in tests)."""
    if device.type != "cuda":
        return
    visible = torch.cuda.device_count()
    if num_ranks > visible:
        raise UsageError(f"num_gpus={num_ranks} but {visible} CUDA device(s) are visible; use num_gpus<={visible}, "
                         "make more devices visible (CUDA_VISIBLE_DEVICES), or plan for a larger machine with "
                         "autofit dry-run --num-gpus.")


def combination_problem(config: Config) -> str | None:
    """Why the engine knobs of `config` cannot run together, or None when they can."""
    if config.zero_stage and config.fsdp != "none":
        return f"zero_stage={config.zero_stage} and fsdp={config.fsdp!r} are two sharding engines; pick one"
    if config.offload != "none" and not config.zero_stage and config.fsdp == "none":
        return f"offload={config.offload!r} needs an engine: ZeRO (zero_stage 1-3) or FSDP2"
    if config.offload == "nvme" and config.fsdp != "none":
        return "FSDP2 offloads to the CPU only; NVMe offload needs DeepSpeed ZeRO"
    return None


def run_ranks(spec: TrainSpec, config: Config, strategies: Sequence[Any], timeout: float = DEFAULT_TIMEOUT,
              step_limit: float | None = None) -> ProbeResult:
    """Probe `config` on `config.num_gpus` ranks in child processes; never raises but for bad input."""
    check_ranks(spec.device, config.num_gpus)
    problem = combination_problem(config)
    if problem:
        return ProbeResult(config, ProbeStatus.ERROR, f"not a valid combination: {problem}")
    payload = pickled(spec, config, strategies, step_limit)
    if isinstance(payload, ProbeResult):
        return payload
    ranks = _start(payload, config.num_gpus, timeout)
    try:
        reports = _collect(ranks, config, timeout)
    finally:
        _reap(ranks)
    return combine(spec, config, reports)


@dataclasses.dataclass
class _Rank:
    process: Any
    receiver: Any


def _start(payload: bytes, world: int, timeout: float) -> list[_Rank]:
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    port = _free_port()
    ranks = []
    for rank in range(world):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_rank_main, args=(rank, world, port, timeout, payload, sender),
                                  daemon=True, name=f"autofit-rank-{rank}")
        process.start()
        sender.close()
        ranks.append(_Rank(process, receiver))
    return ranks


def _collect(ranks: list[_Rank], config: Config, timeout: float) -> list[ProbeResult]:
    """Each rank's result; stops waiting (the caller kills the rest) at the first failure or the timeout."""
    deadline = time.monotonic() + timeout
    reports: dict[int, ProbeResult] = {}
    while len(reports) < len(ranks) and time.monotonic() < deadline:
        waiting = {r.receiver: i for i, r in enumerate(ranks) if i not in reports}
        for receiver in multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
            index = waiting[receiver]
            reports[index] = _receive(receiver, ranks[index], config, index)
        if any(r.status is not ProbeStatus.FIT for r in reports.values()):
            deadline = min(deadline, time.monotonic() + _GRACE)  # a failed rank's peers are stuck in collectives
    if not reports:
        return [ProbeResult(config, ProbeStatus.ERROR, f"probe of {len(ranks)} ranks timed out after {timeout:.0f} s")]
    for index in range(len(ranks)):  # silent ranks: stuck behind a failed peer, or hung past the timeout
        reports.setdefault(index, ProbeResult(config, ProbeStatus.ERROR, f"rank {index} did not report: timed out"))
    return [reports[i] for i in sorted(reports)]


def _receive(receiver: Any, rank: _Rank, config: Config, index: int) -> ProbeResult:
    try:
        return ProbeResult.from_dict(receiver.recv())
    except EOFError:  # the rank died without reporting
        rank.process.join(_GRACE)
        code = rank.process.exitcode
        if code == -9:
            return ProbeResult(config, ProbeStatus.OOM, f"rank {index} killed (SIGKILL), likely out of host memory",
                               oom_kind="host-killed")
        return ProbeResult(config, ProbeStatus.ERROR, f"rank {index} died with exit code {code}")


def _reap(ranks: list[_Rank]) -> None:
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.kill()
    for rank in ranks:
        rank.process.join()
        rank.receiver.close()


def combine(spec: TrainSpec, config: Config, reports: list[ProbeResult]) -> ProbeResult:
    """One result for the candidate: the first OOM, else the first error or skip, else the fit with the
    largest peak and the slowest step (throughput over all ranks' samples)."""
    for status in (ProbeStatus.OOM, ProbeStatus.ERROR, ProbeStatus.SKIPPED):
        failed = [r for r in reports if r.status is status]
        if failed:
            return dataclasses.replace(failed[0], config=config, reason=f"{failed[0].reason} (on {len(failed)} of "
                                       f"{config.num_gpus} ranks)" if config.num_gpus > 1 else failed[0].reason)
    peak = max(r.peak_bytes or 0 for r in reports)
    worst = max(reports, key=lambda r: (r.peak_bytes or 0))
    seconds = max(r.step_seconds for r in reports)
    samples = config.global_batch_size / seconds
    tokens = samples * spec.tokens_per_sample if spec.tokens_per_sample else None
    per_rank = " per rank" if config.num_gpus > 1 else ""
    return dataclasses.replace(worst, config=config, peak_bytes=peak, step_seconds=seconds, samples_per_s=samples,
                               tokens_per_s=tokens, reason=worst.reason + per_rank)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, timeout: float, payload: bytes, sender: Any) -> None:
    """One rank: join the process group, run the ordinary probe, report, leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    spec, config, strategies, step_limit = pickle.loads(payload)
    if spec.device.type == "cuda":
        torch.cuda.set_device(rank)
        spec = dataclasses.replace(spec, device=torch.device("cuda", rank))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise look for a GPU
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    result = _probe_rank(spec, config, strategies, step_limit, rank, world, timeout)
    sender.send(result.to_dict())  # before leaving the group: leaving may wait for peers
    sender.close()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _probe_rank(spec: TrainSpec, config: Config, strategies: list, step_limit: float | None, rank: int,
                world: int, timeout: float) -> ProbeResult:
    import torch.distributed as dist

    from autofit.probe.run import run_probe

    try:
        dist.init_process_group("nccl" if spec.device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        return run_probe(spec, config, strategies + [DataParallel()], step_limit)
    except Exception as exc:  # noqa: BLE001 - bad input found in a rank still comes back as a result
        return ProbeResult(config, ProbeStatus.ERROR, f"rank {rank}: {type(exc).__name__}: {exc}")


class DataParallel(Strategy):
    """Plain data parallelism (torch DDP) for configs with several ranks and no sharding engine: every
    rank holds the whole model and gradients are all-reduced. Added by each rank, not searched."""

    field = "num_gpus"
    rung = 9  # last: wraps whatever the other strategies built

    def options(self, spec) -> list[Option]:
        return [Option(spec.num_gpus, 0, f"{spec.num_gpus} data-parallel ranks")]

    def apply(self, run, value: Any) -> None:
        config = run.config
        if value <= 1 or config.zero_stage or config.fsdp != "none":
            return
        from torch.nn.parallel import DistributedDataParallel

        run.model.to(run.device)
        run.placed = True
        ids = [run.device.index] if run.device.type == "cuda" else None
        run.model = DistributedDataParallel(run.model, device_ids=ids)
