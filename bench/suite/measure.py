"""Training a configuration outside the search: interleaved throughput re-measurement, and the
robustness run (many steps at the worst-case shape under the budget).

Throughput measured minutes apart on a shared machine is noisy, so configurations compared in a ratio
are re-measured back to back: each repetition trains every configuration in turn (the order rotates
between repetitions), and the median over repetitions is kept. On the CPU the re-measurement runs
without the CPU budget (it counts every storage from Python, which slows small models): what is
measured is the speed the user gets; `accounting=True` measures under the probes' conditions instead
(the budget's bookkeeping on, no limit). On CUDA the budget (a per-process memory fraction) costs
nothing and stays on in both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Sequence

import torch

from autofit.batches.batch import to_device
from autofit.config import Config
from autofit.devices.memory import CpuBudget, CudaBudget, budget_for
from autofit.probe.oom import classify_oom, first_line, release_memory
from autofit.job.train_spec import TrainSpec
from autofit.strategies.run import build_run


@dataclasses.dataclass(frozen=True)
class Remeasured:
    """Samples/s of one configuration in each repetition, and their median."""

    config: Config
    samples_per_s: tuple[float, ...]

    @property
    def median(self) -> float:
        """Median samples/s over the repetitions."""
        return statistics.median(self.samples_per_s)


def remeasure(spec: TrainSpec, configs: Sequence[Config], strategies: Sequence[Any], repetitions: int = 5,
              steps: int = 3, warmup: int = 1, accounting: bool = False) -> list[Remeasured]:
    """Median samples/s of each distinct config in `configs`, measured interleaved (see the module doc).

    `accounting=True` trains under the probes' conditions: on the CPU, every storage counted by a
    `CpuBudget` (with no limit, so nothing can fail); on CUDA it changes nothing.
    """
    distinct = list(dict.fromkeys(configs))
    samples: dict[Config, list[float]] = {c: [] for c in distinct}
    for rep in range(repetitions):
        shift = rep % len(distinct)
        for config in distinct[shift:] + distinct[:shift]:
            samples[config].append(_samples_per_s(spec, config, strategies, steps, warmup, accounting))
    return [Remeasured(c, tuple(samples[c])) for c in distinct]


def paired(spec: TrainSpec, configs: Sequence[Config], strategies: Sequence[Any], rounds: int = 21,
           warmup: int = 2) -> list[Remeasured]:
    """Samples/s of each distinct config in `configs`, side by side: every run built once (outside the CPU
    budget, as a user trains) and warmed up, then `rounds` rounds of one optimizer step each, the order
    rotating. Every round measures all of them within the same seconds, so a ratio taken round by round
    (`paired_ratio`) cancels a load that comes and goes; on a busy machine separate builds minutes apart do
    not. Many runs of a larger model may not fit in host memory together: that is the caller's to check."""
    from autofit.probe.run import fresh_run, timed_step

    distinct = list(dict.fromkeys(configs))
    runs = {}
    try:
        for config in distinct:
            run, batches = fresh_run(dataclasses.replace(spec, global_batch_size=config.global_batch_size)
                                     if config.global_batch_size != spec.global_batch_size else spec,
                                     config, strategies)
            for _ in range(warmup):
                run.step(batches)
            runs[config] = (run, batches)
        samples: dict[Config, list[float]] = {c: [] for c in distinct}
        for index in range(rounds):
            shift = index % len(distinct)
            for config in distinct[shift:] + distinct[:shift]:
                samples[config].append(config.global_batch_size / timed_step(*runs[config], spec.device))
        return [Remeasured(c, tuple(samples[c])) for c in distinct]
    finally:
        runs.clear()
        release_memory()


def paired_ratio(a: Remeasured, b: Remeasured) -> float:
    """The median over the rounds of `a`'s samples/s over `b`'s in the same round (`paired`)."""
    return statistics.median(x / y for x, y in zip(a.samples_per_s, b.samples_per_s))


def _guard(spec: TrainSpec, accounting: bool) -> Any:
    if spec.device.type == "cuda":
        return CudaBudget(spec.memory_budget, spec.device)
    return CpuBudget(None) if accounting else contextlib.nullcontext()


def _samples_per_s(spec: TrainSpec, config: Config, strategies: Sequence[Any], steps: int, warmup: int,
                   accounting: bool) -> float:
    if config.global_batch_size != spec.global_batch_size:  # a tool's end configuration may change it
        spec = dataclasses.replace(spec, global_batch_size=config.global_batch_size)
    with _guard(spec, accounting):
        run = build_run(spec, config, strategies)
        micro = to_device(spec.batch_factory(config.micro_batch_size), spec.device)
        batches = [micro] * config.grad_accum_steps
        for _ in range(warmup):
            run.step(batches)
        _sync(spec.device)
        start = time.perf_counter()
        for _ in range(steps):
            run.step(batches)
        _sync(spec.device)
        elapsed = time.perf_counter() - start
    del run, micro, batches
    release_memory()
    return config.global_batch_size * steps / elapsed


@dataclasses.dataclass(frozen=True)
class Robustness:
    """Outcome of training `steps` optimizer steps at the worst-case shape under the budget."""

    steps_asked: int
    steps_done: int
    ok: bool  # every step ran without an out-of-memory error
    peak_bytes: int  # most bytes live at once over the whole run
    within_fit_limit: bool  # the peak stayed under budget x (1 - safety margin), as the probe promised
    wall_s: float
    error: str | None = None


def robustness(spec: TrainSpec, config: Config, strategies: Sequence[Any], steps: int = 200) -> Robustness:
    """Train `config` for `steps` steps, every micro-batch at the largest shape, under the budget."""
    budget = budget_for(spec.device, spec.memory_budget)
    done, error = 0, None
    start = time.perf_counter()
    try:
        with budget:
            run = build_run(spec, config, strategies)
            micro = to_device(spec.batch_factory(config.micro_batch_size), spec.device)
            batches = [micro] * config.grad_accum_steps
            for _ in range(steps):
                run.step(batches)
                done += 1
            del run, micro, batches
    except Exception as exc:  # noqa: BLE001 - an OOM here is the finding
        kind = classify_oom(exc)
        error = f"{'OOM' if kind else 'error'} after {done} steps: {first_line(exc)}"
    wall = time.perf_counter() - start
    release_memory()
    peak = int(budget.peak)
    return Robustness(steps, done, error is None, peak, peak <= spec.fit_limit, wall, error)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
