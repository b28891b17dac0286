"""Simulations spread over processes: a dry-run of a deep model with every rung needs dozens of simulated steps,
each a second or more of Python dispatch under fake tensors. Python runs one of them at a time per process (the
GIL), so they are shared between the caller and a worker process per idle CPU (`spare_cpus`).

Each worker is `python -m autofit.estimate.simulation.workers FOLDER INDEX`, an autofit entry point (nothing of
the user's `__main__` is imported or re-run: scripts without a main guard, notebooks and standard input work). Its
job comes on its standard input, never through a file, signed with the secret the caller put in its environment
alone, as a probe's does (`autofit.probe.payload.framed`; a job anyone else wrote is refused unread): the caller's
settings as JSON, checked first (`_settings`; a job that does not check out ends the worker unread), then
the spec and the strategies serialised with cloudpickle, the user's code. A worker builds its own `Estimator`
once, then simulates batch after batch of jobs as the caller shares them (`Workers.share`: a dry-run's waves of
levels, each a batch, pay the worker's imports once) and writes what each of its simulations found. Batches and
results are files of data (`entry_file`: JSON and arrays of integers, each simulated step as the disk cache writes
it, `memo.encode_peak`), checked field by field where they are read: never a pickle. Between waves the caller
plans the levels it simulated (`Estimator.planned`): then a batch holds levels (`Workers.share_plans`), and a
worker bisects them as the caller would, with the steps the caller holds, and sends back the allocator's reserves
it replayed, for the caller to find made. The jobs are not dealt out in advance: the caller takes them from the
front and the workers from the back, each job claimed by whoever first makes its claim file (`Batch.claim`), so a
worker that starts late (its imports take seconds) or a slow job leaves no one waiting on a fixed share. Whatever
a worker does not deliver (it failed, the spec cannot travel) the caller simulates itself, so spreading changes
how long a dry-run takes, never what it predicts.
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
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from autofit.config import Config
from autofit.errors import UsageError
from autofit.estimate.simulation import entry_file
from autofit.estimate.simulation.disk_cache import RESERVES
from autofit.estimate.simulation.memo import decode_peak, encode_peak
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
Held = tuple[Config, int, Found]  # a simulated step, with the configuration and micro-batch that asked for it
TIMEOUT_S = 1800.0  # a batch's result not delivered after this is waited for no longer (its jobs fall back to the caller)
FOLDER_PREFIX = "autofit-sim-"  # the workers' temporary folder: their jobs and results
POLL_S = 0.02  # how often a waiting worker looks for the next batch, and the caller for a result


def spare_cpus(window: float = 0.2) -> int:
    """CPUs idle over the last `window` seconds (`autofit.devices.device.idle_cpus`), less the caller's own: on a
    busy machine more processes only queue."""
    from autofit.devices.device import idle_cpus

    return max(0, idle_cpus(window) - 1)


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
        return self._shared({"jobs": [[c.to_dict(), mb] for c, mb in jobs]}, {}, list(jobs))

    def share_plans(self, levels: Sequence[Level], held: Iterable[Held]) -> "Batch":
        """Share `levels` to bisect (`Estimator.best_fit`), claimed as `share`'s jobs are, with the simulated
        steps the workers may not hold yet (`held`: `Estimator.adopt`); a step that cannot be written as data
        stays behind (a worker that needs it simulates it)."""
        arrays: dict[str, Any] = {}
        steps: list[dict[str, Any]] = []
        for config, mb, found in held:  # each step's arrays named by its place in `steps`, as `_batch` reads them
            if (meta := _encoded(found, f"held.{len(steps)}.", arrays)) is not None:
                steps.append({"config": config.to_dict(), "mb": mb, "found": meta})
        return self._shared({"levels": [[c.to_dict() for c in level] for level in levels], "held": steps}, arrays,
                            list(levels))

    def _shared(self, meta: dict[str, Any], arrays: dict[str, Any], jobs: list) -> "Batch":
        number, self.batches = self.batches, self.batches + 1
        _write(Path(self.folder.name), f"batch-{number}", meta, arrays)  # whole: a worker polling never reads half
        return Batch(self, number, jobs)

    def alive(self) -> bool:
        """Whether any worker still runs (none: a batch shared would be the caller's alone)."""
        return any(process.poll() is None for process in self.processes)

    def close(self) -> None:
        """Kill what still runs and remove the folder shared with them."""
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
        """What each worker wrote of this batch (`_result`): none where the caller claimed every job, else each
        worker's once it is written (one that failed, or ran past `TIMEOUT_S`, delivers nothing)."""
        if self._results is not None:
            return self._results
        folder, self._results = Path(self.workers.folder.name), []
        if all(index in self.claimed for index in range(len(self.jobs))):
            return self._results
        deadline = time.monotonic() + TIMEOUT_S
        for index, process in enumerate(self.workers.processes):
            name = f"result-{self.number}-{index}"
            while not _path(folder, name).exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(POLL_S)
            self._results.append(_result(_read(folder, name), len(self.jobs)))
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


def _path(folder: Path, name: str) -> Path:
    return folder / (name + entry_file.SUFFIX)


def _write(folder: Path, name: str, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
    """File `name` of the shared folder, as data (`entry_file.encode`), written whole (`autofit.files.write_file`)."""
    write_file(_path(folder, name), entry_file.encode(name, meta, arrays), record=False)


def _read(folder: Path, name: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """File `name` of the shared folder as (JSON values, arrays), not through a link; None where it is absent or
    is not one `_write` makes."""
    opened = entry_file.open_folder(folder, create=False)
    if opened is None:
        return None
    try:
        data = entry_file.read(opened, name)
    finally:
        os.close(opened)
    return entry_file.decode(name, data) if data is not None else None


def _encoded(found: Found, prefix: str, arrays: dict[str, Any]) -> dict[str, Any] | None:
    """A simulation's result as JSON values, its arrays added to `arrays` under `prefix` (`memo.encode_peak`); a
    failed one as its reason. None where its peak is not one the disk cache writes."""
    peak, how = found
    if peak is None:
        return {"failed": how}
    encoded = encode_peak(peak, how)
    if encoded is None:
        return None
    arrays.update({prefix + name: values for name, values in encoded[1].items()})
    return encoded[0]


def _decoded(meta: Any, prefix: str, arrays: dict[str, Any]) -> Found | None:
    """`_encoded`'s result back, or None where it does not check out (`memo.decode_peak`)."""
    if isinstance(meta, dict) and set(meta) == {"failed"}:
        return (None, meta["failed"]) if isinstance(meta["failed"], str) else None
    own = {name[len(prefix):]: values for name, values in arrays.items() if name.startswith(prefix)}
    return decode_peak(meta, own) if isinstance(meta, dict) else None


def _result(read: tuple[dict[str, Any], dict[str, Any]] | None, jobs: int) -> dict[str, Any]:
    """A worker's result file as the caller takes it: each simulation found that checks out, with the index of its
    job (of `jobs`), and each reserve that does (`disk_cache.Reserves.decode`); nothing of a file that does not."""
    found: list[tuple[int, Found]] = []
    reserves: dict[str, dict] = {}
    meta, arrays = read or ({}, {})
    for position, item in enumerate(meta.get("found") if isinstance(meta.get("found"), list) else []):
        index = item.get("index") if isinstance(item, dict) else None
        peak = _decoded(item.get("found"), f"found.{position}.", arrays) if type(index) is int else None
        if peak is not None and 0 <= index < jobs:
            found.append((index, peak))
    for digest, value in (meta.get("reserves") if isinstance(meta.get("reserves"), dict) else {}).items():
        if (kept := RESERVES.decode({"reserve": value}, {})) is not None and entry_file.NAME.fullmatch(digest):
            reserves[digest] = kept
    return {"found": found, "reserves": reserves}


def start(spec: "TrainSpec", strategies: Sequence["Strategy"], settings: dict[str, Any], count: int = 1) -> Workers | None:
    """Start `count` workers simulating for `spec`, each with an `Estimator` made with the caller's `settings` (its
    keyword arguments: the target, and how it extrapolates), waiting for the batches the caller shares
    (`Workers.share`); None when the spec cannot travel to another process (the caller then simulates
    everything itself). The spec goes to each on its standard input (`autofit.probe.payload.send`), never through
    a file."""
    from autofit.probe.payload import JOB_KEY, framed, new_key, payload, send

    try:
        data = payload(spec, strategies)
    except UsageError:
        return None
    folder = tempfile.TemporaryDirectory(prefix=FOLDER_PREFIX)
    key = new_key()
    job = framed({"settings": settings}, data, key)
    processes = []
    for index in range(count):  # each reads its job once it has imported torch: the caller goes on meanwhile
        job_in, job_out = os.pipe()
        try:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "autofit.estimate.simulation.workers", folder.name, str(index)],
                # a killed caller ends its workers; the job's secret is theirs alone
                env=dict(os.environ, **{LAUNCHER_PID: str(os.getpid()), JOB_KEY: key}),
                stdin=job_in, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except BaseException:
            os.close(job_out)
            raise
        finally:
            os.close(job_in)
        send(job_out, job)
    return Workers(processes, folder)


def main(argv: list[str] | None = None) -> int:
    """Worker `argv[1]` of the caller's folder `argv[0]`, its job on standard input (`start`): for each batch shared
    in the folder, in turn, simulate the jobs it claims (from the back: `claim`), or bisect the levels it claims
    (`_plan`), and write what it found (`_write`: each peak with its replay's events, `ActivationPeak.replay`);
    until the caller kills it, or is gone. A batch that does not check out ends it (the caller does its share)."""
    where, me = (argv if argv is not None else sys.argv[1:])[:2]
    folder = Path(where)
    leave_with_parent(str(folder / "job"), FOLDER_PREFIX)  # a name in the folder: the folder goes with the caller
    from autofit.probe.payload import job_key, piped, unframed

    try:
        job, data = unframed(piped(sys.stdin.buffer), job_key())  # the caller's (`start`), through a pipe, signed
        settings = _settings(job.get("settings"))
    except ValueError:
        return 1  # the caller simulates what this worker would have
    import torch

    from autofit.estimate.estimator import Estimator

    torch.set_num_threads(1)  # fake tensors compute nothing; the caller's other workers share the CPUs
    spec, strategies = pickle.loads(data)  # the user's code (`autofit.probe.payload`), as a probe's
    estimator = Estimator(spec, strategies=strategies, **settings)
    for number in itertools.count():
        name = f"batch-{number}"
        while not _path(folder, name).exists():
            if not folder.exists():
                return 0
            time.sleep(POLL_S)
        shared = _batch(_read(folder, name))
        if shared is None:
            return 1
        meta, arrays = {"found": [], "reserves": {}}, {}
        if "levels" in shared:
            meta["reserves"] = _plan(estimator, shared, folder, number)
        jobs = shared.get("jobs", [])
        for index in reversed(range(len(jobs))):
            if claim(folder, f"{number}-{index}"):
                found = _encoded(estimator.simulate(*jobs[index]), f"found.{len(meta['found'])}.", arrays)
                meta["found"] += [{"index": index, "found": found}] if found is not None else []
        _write(folder, f"result-{number}-{me}", meta, arrays)
    return 0


def _settings(found: Any) -> dict[str, Any]:
    """The caller's `Estimator` settings as `start` sends them (`Estimator._settings`: the target, and how it
    extrapolates; one left out takes its default); `ValueError` where they are anything else."""
    switches = {"extrapolate_batch", "deferred_sync", "full_depth"}
    if not (isinstance(found, dict) and set(found) <= switches | {"target"}
            and found.get("target", "cpu") in ("cuda", "cpu")
            and all(type(found[key]) is bool for key in switches & set(found))):
        raise ValueError(f"settings {found!r} are not an estimator's")
    return found


def _batch(read: tuple[dict[str, Any], dict[str, Any]] | None) -> dict[str, Any] | None:
    """A batch file as the worker takes it: {"jobs": [(Config, mb)]} or {"levels": [[Config]], "held": [`Held`]};
    None where anything does not check out (a configuration `Config.from_dict` refuses, a step `_decoded` does)."""
    if read is None:
        return None
    meta, arrays = read
    try:
        if set(meta) == {"jobs"}:
            return {"jobs": [(Config.from_dict(config), _count(mb)) for config, mb in meta["jobs"]]}
        if set(meta) == {"levels", "held"}:
            levels = [[Config.from_dict(config) for config in level] for level in meta["levels"]]
            held = [(Config.from_dict(step["config"]), _count(step["mb"]), _decoded(step["found"], f"held.{index}.", arrays))
                    for index, step in enumerate(meta["held"])]
            return None if any(found is None for *_, found in held) else {"levels": levels, "held": held}
    except (TypeError, ValueError, KeyError, UsageError):
        return None
    return None


def _count(value: Any) -> int:
    """`value` where it is a micro-batch (an int of at least 1); a ValueError elsewhere."""
    if type(value) is not int or value < 1:
        raise ValueError(f"micro-batch {value!r}")
    return value


def _plan(estimator: "Estimator", shared: dict[str, Any], folder: Path, number: int) -> dict[str, dict]:
    """Bisect the levels of batch `number` this worker claims (from the back), as the caller's `best_fit` and
    its candidates predict them, with the steps the caller sent (`Estimator.adopt`); the allocator's reserves
    replayed meanwhile (`disk_cache.RESERVES`), by digest."""
    estimator.adopt(shared["held"])
    before = set(RESERVES.kept)
    levels = shared["levels"]
    with estimator.steady():
        for index in reversed(range(len(levels))):
            if claim(folder, f"{number}-{index}"):
                sizes = levels[index]
                best, above = estimator.best_fit(sizes)
                for config in (sizes[best], above):  # the candidates the caller predicts
                    if config is not None:
                        estimator.predict(config)
    return {digest: found for digest, found in RESERVES.kept.items() if digest not in before}


if __name__ == "__main__":
    sys.exit(main())
