"""Simulations spread over processes: a dry-run of a deep model with every rung needs dozens of simulated steps,
each a second or more of Python dispatch under fake tensors. Python runs one of them at a time per process (the
GIL), so they are shared between the caller and a worker process per idle CPU (`spare_cpus`).

Each worker is `python -m autofit.estimate.simulation.workers JOB INDEX`, an autofit entry point (nothing of the
user's `__main__` is imported or re-run: scripts without a main guard, notebooks and standard input work); the
spec and the strategies travel with cloudpickle, as a probe's do (`autofit.probe.payload`). A worker builds its
own `Estimator` once, then simulates batch after batch of jobs as the caller shares them (`Workers.share`: a
dry-run's waves of levels, each a batch, pay the worker's imports once) and writes what each of its simulations
found, pickled. Between waves the caller plans the levels it simulated (`Estimator.planned`): then a batch holds
levels (`Workers.share_plans`), and a worker bisects them as the caller would, with the steps the caller holds,
and sends back the allocator's reserves it replayed, for the caller to find made. The jobs are not dealt out in
advance: the caller takes them from the front and the workers from the back, each job claimed by whoever first
makes its claim file (`Batch.claim`), so a worker that starts late (its imports take seconds) or a slow job
leaves no one waiting on a fixed share. Whatever a worker does not deliver (it failed, the spec cannot travel)
the caller simulates itself, so spreading changes how long a dry-run takes, never what it predicts.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from autofit.config import Config
from autofit.estimate.simulation.step import ActivationPeak
from autofit.files import write_file
from autofit.probe.orphans import LAUNCHER_PID, leave_with_parent

if TYPE_CHECKING:
    from autofit.estimate.estimator import Estimator
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy

Job = tuple[Config, int]  # a configuration and the micro-batch to simulate it at
Level = Sequence[Config]  # one level's configurations, as `Estimator.best_fit` takes them
Found = tuple[ActivationPeak | None, str]  # what `Estimator.simulate` returns
TIMEOUT_S = 1800.0  # a batch's result not delivered after this is waited for no longer (its jobs fall back to the caller)
FOLDER_PREFIX = "autofit-sim-"  # the workers' temporary folder: their jobs and results
POLL_S = 0.02  # how often a waiting worker looks for the next batch, and the caller for a result


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
    """Started worker processes (each told its index) and the folder they share with the caller: the spec they
    simulate for, then each batch of jobs shared out (`share`) and what the workers found of it. Kept open for as
    long as the caller has jobs (a dry-run's waves of levels: `Estimator.steady`), so the workers' imports are paid
    once; `close` ends them."""

    processes: list[subprocess.Popen]
    folder: tempfile.TemporaryDirectory
    batches: int = 0  # batches shared so far: the next one's number
    sent: set[tuple] = dataclasses.field(default_factory=set)  # the simulated steps sent with levels (`share_plans`)

    def share(self, jobs: list[Job]) -> "Batch":
        """Share `jobs` with the workers (each claims from the back once it is done with what it holds); the
        caller claims from the front (`Batch.mine`)."""
        return self._shared({"jobs": [(c.to_dict(), mb) for c, mb in jobs]}, list(jobs))

    def share_plans(self, levels: Sequence[Level], held: dict[tuple, Found], failed: set[tuple]) -> "Batch":
        """Share `levels` to bisect (`Estimator.best_fit`), claimed as `share`'s jobs are, with the simulated
        steps the workers may not hold yet (`held`, and the keys whose simulation `failed`: `Estimator.adopt`)."""
        shared = {"levels": [[c.to_dict() for c in level] for level in levels], "held": held, "failed": set(failed)}
        return self._shared(shared, list(levels))

    def _shared(self, shared: dict, jobs: list) -> "Batch":
        number, self.batches = self.batches, self.batches + 1
        write_file(Path(self.folder.name) / f"batch-{number}.pkl", pickle.dumps(shared),
                   record=False)  # whole or not at all: a worker polling for it never reads half
        return Batch(self, number, jobs)

    def alive(self) -> bool:
        """Whether any worker still runs (none: a batch shared would be the caller's alone)."""
        return any(process.poll() is None for process in self.processes)

    def close(self) -> None:
        """Kill what still runs and remove the job files."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self.folder.cleanup()


@dataclasses.dataclass
class Batch:
    """One batch of jobs shared with `workers` (its `number`): each job claimed once (`claim`)."""

    workers: Workers
    number: int
    jobs: list  # `Job`s, or levels (`Workers.share_plans`)
    claimed: set[int] = dataclasses.field(default_factory=set)  # the jobs the caller holds
    _results: list[dict] | None = None  # what the workers wrote (`_delivered`)

    def claim(self, index: int) -> bool:
        """Whether the caller now holds job `index` (False: a worker took it first)."""
        if claim(Path(self.workers.folder.name), f"{self.number}-{index}"):
            self.claimed.add(index)
            return True
        return False

    def mine(self) -> Iterator[Job]:
        """The jobs the caller claims, from the front, until it meets one a worker claimed (the workers
        claim from the back: every job after it is theirs)."""
        for index, job in enumerate(self.jobs):
            if not self.claim(index):
                return
            yield job

    def collect(self) -> list[tuple[Job, Found]]:
        """What the workers' simulations of this batch found (`_delivered`)."""
        return [(self.jobs[index], found) for result in self._delivered() for index, found in result["found"]]

    def reserves(self) -> dict[str, dict]:
        """The allocator's reserves the workers replayed planning this batch's levels, by `Replay.digest`
        (`_delivered`)."""
        return {digest: found for result in self._delivered() for digest, found in result["reserves"].items()}

    def _delivered(self) -> list[dict]:
        """What each worker wrote of this batch: none where the caller claimed every job, else each worker's
        once it is written (one that failed, or ran past `TIMEOUT_S`, delivers nothing)."""
        if self._results is not None:
            return self._results
        folder, self._results = Path(self.workers.folder.name), []
        if all(index in self.claimed for index in range(len(self.jobs))):
            return self._results
        deadline = time.monotonic() + TIMEOUT_S
        for index, process in enumerate(self.workers.processes):
            result = folder / f"result-{self.number}-{index}.pkl"
            while not result.exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if result.exists():
                self._results.append(pickle.loads(result.read_bytes()))
        return self._results


def claim(folder: Path, name: str) -> bool:
    """Claim job `name` ("BATCH-INDEX") of the jobs shared in `folder`: True for the one process that first
    makes its claim file (created exclusively, never through a link), False for every other."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        os.close(os.open(folder / f"claim-{name}", flags))
    except FileExistsError:
        return False
    return True


def start(spec: "TrainSpec", strategies: Sequence["Strategy"], settings: dict[str, Any], count: int = 1) -> Workers | None:
    """Start `count` workers simulating for `spec`, each with an `Estimator` made with the caller's `settings` (its
    keyword arguments: the target, and how it extrapolates), waiting for the batches the caller shares
    (`Workers.share`); None when the spec cannot travel to another process (the caller then simulates
    everything itself)."""
    from autofit.errors import UsageError
    from autofit.probe.payload import payload

    try:
        data = payload(spec, strategies)
    except UsageError:
        return None
    folder = tempfile.TemporaryDirectory(prefix=FOLDER_PREFIX)
    job = Path(folder.name) / "job.pkl"
    job.write_bytes(pickle.dumps({"sys_path": [p for p in sys.path if isinstance(p, str)], "payload": data,
                                  "settings": settings}))
    processes = [subprocess.Popen(
        [sys.executable, "-m", "autofit.estimate.simulation.workers", str(job), str(index)],
        env=dict(os.environ, **{LAUNCHER_PID: str(os.getpid())}),  # a killed caller ends its workers
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for index in range(count)]
    return Workers(processes, folder)


def main(argv: list[str] | None = None) -> int:
    """Worker `argv[1]` of the job in `argv[0]`: for each batch shared in the job file's folder, in turn, simulate
    the jobs it claims (from the back: `claim`), or bisect the levels it claims (`_plan`), and write what it
    found (pickled: each peak keeps its replay's events, `ActivationPeak.replay`); until the caller kills it,
    or is gone."""
    job_path, me = (argv if argv is not None else sys.argv[1:])[:2]
    leave_with_parent(job_path, FOLDER_PREFIX)
    job = pickle.loads(Path(job_path).read_bytes())
    sys.path[:0] = [p for p in job["sys_path"] if p not in sys.path]
    import torch

    from autofit.estimate.estimator import Estimator

    torch.set_num_threads(1)  # fake tensors compute nothing; the caller's other workers share the CPUs
    spec, strategies = pickle.loads(job["payload"])
    estimator = Estimator(spec, strategies=strategies, **job["settings"])
    folder = Path(job_path).parent
    for number in itertools.count():
        batch = folder / f"batch-{number}.pkl"
        while not batch.exists():
            if not folder.exists():
                return 0
            time.sleep(POLL_S)
        shared = pickle.loads(batch.read_bytes())
        if "levels" in shared:
            found = {"found": [], "reserves": _plan(estimator, shared, folder, number)}
        else:
            jobs = shared["jobs"]
            found = {"found": [(index, estimator.simulate(Config.from_dict(jobs[index][0]), jobs[index][1]))
                               for index in reversed(range(len(jobs))) if claim(folder, f"{number}-{index}")],
                     "reserves": {}}
        write_file(folder / f"result-{number}-{me}.pkl", pickle.dumps(found), record=False)
    return 0


def _plan(estimator: "Estimator", shared: dict, folder: Path, number: int) -> dict[str, dict]:
    """Bisect the levels of batch `number` this worker claims (from the back), as the caller's `best_fit` and
    its candidates predict them, with the steps the caller sent (`Estimator.adopt`); the allocator's reserves
    replayed meanwhile (`disk_cache.RESERVES`), by digest."""
    from autofit.estimate.simulation.disk_cache import RESERVES

    estimator.adopt(shared["held"], shared["failed"])
    before = set(RESERVES.kept)
    levels = shared["levels"]
    with estimator.steady():
        for index in reversed(range(len(levels))):
            if claim(folder, f"{number}-{index}"):
                sizes = [Config.from_dict(config) for config in levels[index]]
                best, above = estimator.best_fit(sizes)
                for config in (sizes[best], above):  # the candidates the caller predicts
                    if config is not None:
                        estimator.predict(config)
    return {digest: found for digest, found in RESERVES.kept.items() if digest not in before}


if __name__ == "__main__":
    sys.exit(main())
