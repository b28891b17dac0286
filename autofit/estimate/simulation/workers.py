"""Simulations spread over processes: a dry-run of a deep model with every rung needs dozens of simulated
steps, each a second or more of Python dispatch under fake tensors. Python runs one of them at a time per
process (the GIL), so they are shared between the caller and a worker process per idle CPU (`spare_cpus`).

Each worker is `python -m autofit.estimate.simulation.workers JOB RESULT`, an autofit entry point (nothing of the
user's `__main__` is imported or re-run: scripts without a main guard, notebooks and standard input
work); the spec and the strategies travel with cloudpickle, as a probe's do (`autofit.probe.payload`).
A worker builds its own `Estimator` and writes what each of its simulations found, pickled. The jobs are
not dealt out in advance: the caller takes them from the front and the workers from the back, each job
claimed by whoever first makes its claim file (`Workers.claim`), so a worker that starts late (its imports
take seconds) or a slow job leaves no one waiting on a fixed share. Whatever a worker does not deliver (it
failed, the spec cannot travel) the caller simulates itself, so spreading changes how long a dry-run takes,
never what it predicts.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from autofit.config import Config
from autofit.estimate.simulation.step import ActivationPeak
from autofit.probe.orphans import LAUNCHER_PID, leave_with_parent

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy

Job = tuple[Config, int]  # a configuration and the micro-batch to simulate it at
Found = tuple[ActivationPeak | None, str]  # what `Estimator.simulate` returns
TIMEOUT_S = 1800.0  # a worker still running after this is killed (its jobs fall back to the caller)
FOLDER_PREFIX = "autofit-sim-"  # the workers' temporary folder: their jobs and results


def spare_cpus(window: float = 0.2) -> int:
    """CPUs this process may run on (its affinity where the platform says) that were idle over the last
    `window` seconds, less the caller's own: on a busy machine more processes only queue. (The load
    average would lag: right after a dry-run it still counts that run.)"""
    import psutil

    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    busy = psutil.cpu_percent(interval=window, percpu=True)
    idle = sum(1 for cpu, percent in enumerate(busy) if percent < 50 and (allowed is None or cpu in allowed))
    return max(0, idle - 1)


@dataclasses.dataclass
class Workers:
    """Started worker processes sharing `jobs` (each claimed once: `claim`), and the files their results
    arrive in."""

    jobs: list[Job]
    processes: list[subprocess.Popen]
    results: list[Path]
    folder: tempfile.TemporaryDirectory

    def claim(self, index: int) -> bool:
        """Whether the caller now holds job `index` (False: a worker took it first)."""
        return claim(Path(self.folder.name), index)

    def mine(self) -> Iterator[Job]:
        """The jobs the caller claims, from the front, until it meets one a worker claimed (the workers
        claim from the back: every job after it is theirs)."""
        for index, job in enumerate(self.jobs):
            if not self.claim(index):
                return
            yield job

    def collect(self) -> list[tuple[Job, Found]]:
        """Wait for every worker and return what each delivered (a failed worker delivers nothing)."""
        found = []
        try:
            for process, path in zip(self.processes, self.results):
                if _finished(process) and path.exists():
                    found += [(self.jobs[index], result) for index, result in pickle.loads(path.read_bytes())]
        finally:
            self.close()
        return found

    def close(self) -> None:
        """Kill what still runs and remove the job files."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self.folder.cleanup()


def claim(folder: Path, index: int) -> bool:
    """Claim job `index` of the jobs shared in `folder`: True for the one process that first makes its
    claim file (created exclusively, never through a link), False for every other."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        os.close(os.open(folder / f"claim-{index}", flags))
    except FileExistsError:
        return False
    return True


def start(spec: "TrainSpec", strategies: Sequence["Strategy"], target: str, jobs: list[Job], count: int = 1,
          full_depth: bool = False) -> Workers | None:
    """Start `count` workers sharing `jobs` with the caller (each claims and simulates jobs for `spec` on
    `target` from the back, every block with `full_depth`; the caller takes its own from the front:
    `Workers.mine`); None when the spec cannot travel to another process (the caller then simulates
    everything itself)."""
    from autofit.errors import UsageError
    from autofit.probe.payload import payload

    try:
        data = payload(spec, strategies)
    except UsageError:
        return None
    folder = tempfile.TemporaryDirectory(prefix=FOLDER_PREFIX)
    workers = Workers(list(jobs), [], [], folder)
    for index in range(count):
        job, result = Path(folder.name) / f"job-{index}.pkl", Path(folder.name) / f"result-{index}.pkl"
        job.write_bytes(pickle.dumps({"sys_path": [p for p in sys.path if isinstance(p, str)], "payload": data,
                                      "target": target, "full_depth": full_depth,
                                      "jobs": [(c.to_dict(), mb) for c, mb in workers.jobs]}))
        workers.processes.append(subprocess.Popen(
            [sys.executable, "-m", "autofit.estimate.simulation.workers", str(job), str(result)],
            env=dict(os.environ, **{LAUNCHER_PID: str(os.getpid())}),  # a killed caller ends its workers
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        workers.results.append(result)
    return workers


def _finished(process: subprocess.Popen) -> bool:
    try:
        return process.wait(timeout=TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        return False


def main(argv: list[str] | None = None) -> int:
    """Simulate the jobs in `argv[0]` this worker claims (from the back: `claim`, in the job file's folder)
    and write what each found, with its index, to `argv[1]` (pickled: each peak keeps its replay's events,
    `ActivationPeak.replay`); exit 0 when written."""
    job_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    leave_with_parent(job_path, FOLDER_PREFIX)
    job = pickle.loads(Path(job_path).read_bytes())
    sys.path[:0] = [p for p in job["sys_path"] if p not in sys.path]
    import torch

    from autofit.estimate.estimator import Estimator

    torch.set_num_threads(1)  # fake tensors compute nothing; the caller's other workers share the CPUs
    spec, strategies = pickle.loads(job["payload"])
    estimator = Estimator(spec, target=job["target"], strategies=strategies, full_depth=job["full_depth"])
    folder, jobs = Path(job_path).parent, job["jobs"]
    found = [(index, estimator.simulate(Config.from_dict(jobs[index][0]), jobs[index][1]))
             for index in reversed(range(len(jobs))) if claim(folder, index)]
    Path(result_path).write_bytes(pickle.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
