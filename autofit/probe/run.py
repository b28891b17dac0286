"""Probe: run a few real training steps of one candidate and record what happened.

Every outcome is a `ProbeResult`: a fit with its measured peak and throughput, an OOM of any kind
(classified), or an error with its message. Nothing but bad user input escapes. Memory held by a failed
attempt is released before the next probe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import signal
import statistics
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from autofit.config import Config
from autofit.errors import CudaContextBroken, UsageError
from autofit.devices.memory import Budget, DeadlinePassed, budget_for, note_left_behind
from autofit.probe.oom import (classify_oom, collecting_new_objects, error_site, first_line, release_memory,
                               sticky_error)
from autofit.probe.outcome import OomKind, Phase, ProbeResult, ProbeStatus
from autofit.strategies.run import TrainRun, build_run
from autofit.batches.batch import made, to_device
from autofit.job.train_spec import TrainSpec
from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.strategies.base import Strategy


MIN_ALLOWANCE = 5.0  # seconds a probe may always take before its deadline stops it
STEADY_STEPS = 2  # optimizer steps after which every step allocates the same (see _train)
MAX_SKIPPED_STEPS = 24  # fp16 warm-up steps beyond the asked ones: 24 halvings take the scale from 2**16 to 2**-8
SETTLED_WITHIN = 0.15  # the first probe of a process warms up until two steps agree this closely...
MAX_SETTLE_STEPS = 6  # ... or for at most this many extra untimed steps


def run_probe(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"],
              step_limit: float | None = None, timeout: float | None = None) -> ProbeResult:
    """Train `config` for `spec.warmup_steps + spec.timed_steps` steps under the budget; never raises
    except for bad user input (`UsageError`).

    `step_limit` (seconds per optimizer step) stops a probe that cannot win: once its first step is
    done (setup included), it may take the steps it runs plus two more at that pace, and at least
    MIN_ALLOWANCE seconds (timing noise dominates shorter probes), then it is recorded as too slow.
    `timeout` (wall seconds, setup included) stops a probe that hangs, even inside a forward that blocks: it is
    recorded as an error (`wall_clock_limit`; on the main thread, where Python delivers the alarm).
    """
    with collecting_new_objects():
        return _probe(spec, config, strategies, step_limit, timeout)


class ProbeTimedOut(BaseException):
    """An in-process probe ran past its wall-clock limit (`run_probe(timeout=...)`, `--probe-timeout`). A
    `BaseException`, as KeyboardInterrupt is: a broad `except Exception` in the user's step does not swallow it."""


class NonFiniteLoss(RuntimeError):
    """A probe's step returned a loss that is NaN or infinite: the configuration diverges; it is no fit."""


@contextlib.contextmanager
def wall_clock_limit(seconds: float | None):
    """Raise `ProbeTimedOut` in this thread once `seconds` of wall time have passed inside the block (SIGALRM,
    which also interrupts a blocking sleep or wait); nothing where `seconds` is None or off the main thread."""
    if seconds is None or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def _expired(signum, frame):
        raise ProbeTimedOut(f"timed out: the probe ran past its limit of {seconds:g} s (probe_timeout; "
                            "autofit tune --probe-timeout) and was stopped; something in its step blocks or runs "
                            "far slower than a training step should; raise the limit if it is only slow")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def finite_loss(loss: torch.Tensor, step: int) -> None:
    """`NonFiniteLoss` naming `step` (1 = the probe's first) where `loss` is NaN or infinite."""
    value = float(loss.detach().float().sum()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        raise NonFiniteLoss(f"the loss was {value} at step {step} of the probe: the configuration diverges "
                            "(a NaN or infinite loss trains nothing), so it is no fit; check the learning rate, "
                            "the model's numerics at this precision, or the data")


def _probe(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"],
           step_limit: float | None, timeout: float | None = None) -> ProbeResult:
    held = _allocated(spec.device)
    budget = budget_for(spec.device, spec.memory_budget, spec.resident_bytes)
    if step_limit is not None:
        allowance = max((spec.warmup_steps + spec.timed_steps + 2) * step_limit, MIN_ALLOWANCE)
        budget.allowance = allowance
    built: list[TrainRun] = []
    try:
        with wall_clock_limit(timeout), budget:
            timed = _train(spec, config, strategies, budget, built)
    except UsageError:
        raise
    except DeadlinePassed as exc:
        result = ProbeResult(config, ProbeStatus.PRUNED, _too_slow(exc, allowance, step_limit), budget.peak or None)
    except ProbeTimedOut as exc:
        result = failed(config, exc, strategies, budget.peak or None)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - every failure is a result
        _stop_if_broken(exc, config)
        result = failed(config, exc, strategies, budget.peak or None)
    else:
        result = _measured(spec, config, budget.peak, timed)
    steps = built[0].steps_taken if built else 0
    built.clear()  # the run goes now, as when it was the training's alone: memory is released below
    result = dataclasses.replace(result, steps=steps)
    try:
        release_memory()
    except Exception as exc:  # noqa: BLE001 - a sticky error surfaces at the next synchronize
        _stop_if_broken(exc, config)
        raise
    return _left_behind(result, spec.device, held)


def _too_slow(stopped: DeadlinePassed, allowance: float, step_limit: float) -> str:
    """A pruned probe's reason: stopped at its deadline, or before it where its pace could not meet it (`_Pace`)."""
    finished = f"a config at half the best throughput so far ({step_limit:.2f} s/step) would have finished"
    if isinstance(stopped, OutPaced):
        return (f"too slow to win: stopped before its deadline ({allowance:.1f} s after its first step): at "
                f"{stopped.step:.2f} s a step, its {stopped.left} steps left would end {stopped.over:.1f} s past it, "
                f"by when {finished}")
    return f"too slow to win: stopped {allowance:.1f} s after its first step, when {finished}"


def failed(config: Config, exc: Exception, strategies: Sequence["Strategy"] = (), peak: int | None = None,
           who: str = "") -> ProbeResult:
    """The result of a probe that raised `exc`: an OOM of its kind, or an error with its type and the site it
    was raised at (its identity across configurations: `autofit.search.walk.failure`) and what each strategy
    says of it; `who` ("rank 1: ") heads the reason. Both carry the phase the exception struck in."""
    phase = getattr(exc, "autofit_phase", None)
    kind = classify_oom(exc)
    if kind is not None:
        return ProbeResult(config, ProbeStatus.OOM, who + first_line(exc), peak, oom_kind=kind, phase=phase)
    site = error_site(exc)
    where = (f" (at {site})" if site else "") + "".join(s.explain(config, exc) for s in strategies)
    return ProbeResult(config, ProbeStatus.ERROR, who + first_line(exc) + where, peak, phase=phase,
                       error_type=type(exc).__name__, error_site=site)


# -- memory a probe leaves behind ----------------------------------------------------------------------
# An OOM in the backward on CUDA can leave the step's intermediate tensors allocated after every
# reference is dropped and cycles are collected (pytorch/pytorch#82218, open). Seen on an H100 with torch
# 2.11 (bench/README.md#probe-residue): after one, four of the next five in-process probes ran
# out of memory in their forward with ~180 MiB more allocated than the same configuration needs alone (what stayed
# was not measured directly then: this check is what measures it). Such a process no longer measures what
# a fresh one would, so the probes after it run in child processes (`autofit.probe.launch.probe_placed`).
LEFT_BEHIND_SLACK = 8 * 2**20  # below this, bookkeeping noise (a library's small global buffers)


def _allocated(device: torch.device) -> int | None:
    """Bytes the caching allocator has handed out on `device` (None off CUDA: the CPU budget counts only
    what each probe makes)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _left_behind(result: ProbeResult, device: torch.device, held: int | None) -> ProbeResult:
    """`result`, noting the bytes still allocated on `device` beyond `held` (before the probe) now that the
    probe released its memory; such bytes are remembered for this process (`memory.note_left_behind`)."""
    if held is None:
        return result
    left = torch.cuda.memory_allocated(device) - held
    if left <= LEFT_BEHIND_SLACK:
        return result
    note_left_behind(device, left)
    note = (f"; it left {format_size(left)} allocated in this process after releasing its memory (an OOM in the "
            "backward can: pytorch/pytorch#82218), so later probes run in fresh child processes")
    return dataclasses.replace(result, reason=result.reason + note, left_behind=left)


def _stop_if_broken(exc: BaseException, config: Config) -> None:
    """Raise `CudaContextBroken` when `exc` is a sticky CUDA error: no later probe could run here."""
    cause = sticky_error(exc)
    if cause is not None:
        raise CudaContextBroken(config.describe(), cause) from exc


def _train(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"], budget: Budget,
           built: list[TrainRun]) -> "Timed":
    """Build the run (into `built`: the caller reads the steps it took), take the warm-up steps (more on the
    first probe of the process: `settle`), then time each timed step. An exception leaves carrying the phase
    it struck in (`autofit_phase`)."""
    try:
        return _steps(spec, config, strategies, budget, built)
    except BaseException as exc:
        exc.autofit_phase = built[0].phase if built else Phase.BUILD  # type: ignore[attr-defined]
        raise


def _steps(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"], budget: Budget,
           built: list[TrainRun]) -> "Timed":
    run, micro_batches = fresh_run(spec, config, strategies)
    built.append(run)
    pace = _Pace(budget, spec.warmup_steps + spec.timed_steps)
    _warm_up(run, micro_batches, spec.warmup_steps, pace)
    # Two steps reach the steady-state peak: the first ends by creating the optimizer states, the
    # second holds them through its backward. When the warm-up steps counted both, the timed steps
    # repeat the second and run as plain training does.
    with budget.timing() if spec.warmup_steps >= STEADY_STEPS else contextlib.nullcontext():
        steps = itertools.count(spec.warmup_steps + 1)  # numbered after the warm-up's (as a message names them)
        settle(spec.device, lambda: timed_step(run, micro_batches, spec.device, next(steps)), pace.clocked)
        watch = AllocatorWatch(spec.device)
        seconds = []
        for _ in range(spec.timed_steps):
            seconds.append(timed_step(run, micro_batches, spec.device, next(steps)))
            pace.clocked()
    return Timed(tuple(seconds), *watch.stop())


class OutPaced(DeadlinePassed):
    """A probe stopped before its deadline: its steps left, each as long as its last, would end past it."""

    def __init__(self, step: float, left: int, over: float):
        super().__init__(f"at {step:.2f} s a step, its {left} steps left end {over:.1f} s past the deadline")
        self.step, self.left, self.over = step, left, over  # seconds, steps, seconds


@dataclasses.dataclass
class _Pace:
    """A probe's steps against its deadline (`Budget.allowance`, counted from the end of its first step).
    After a step: the budget re-reads the process (`after_step`); the clock starts after the first step
    (setup excluded); and the probe stops once the deadline has passed, or once the steps `left`, each as
    long as the last, would end past it: a probe that cannot finish in time is stopped at once, not when
    its time is up."""

    budget: Budget
    left: int  # steps still to take: the warm-up and timed ones (settling steps only add to them)
    last: float | None = None  # when the last step ended (perf_counter seconds)

    def clocked(self) -> None:
        self.budget.after_step()
        self.budget.start_clock()
        self.budget.check_deadline()
        now, self.left = time.perf_counter(), self.left - 1
        deadline = self.budget.deadline
        if self.last is not None and deadline is not None and now + (now - self.last) * self.left > deadline:
            raise OutPaced(now - self.last, self.left, now + (now - self.last) * self.left - deadline)
        self.last = now


def _warm_up(run: "TrainRun", micro_batches: list, steps: int, pace: _Pace) -> None:
    """Take `steps` untimed steps; the deadline's clock starts after the first (`pace`).

    With a GradScaler (fp16) a step whose gradients overflow skips `optimizer.step()`
    (torch/amp/grad_scaler.py `_maybe_opt_step`), so the optimizer states may not exist yet; the first
    steps often overflow (init_scale 2**16). Warm-up goes on until a whole step has run holding states,
    as every later step does, at most MAX_SKIPPED_STEPS steps more.
    """
    scaled = run.scaler is not None and run.engine is None
    stepped = held = False  # an optimizer step has applied (states exist); a step has run holding them
    taken = 0
    while taken < steps or (scaled and steps and not held):
        if taken >= steps + MAX_SKIPPED_STEPS and not stepped:
            raise RuntimeError(f"fp16: GradScaler skipped optimizer.step() in all {taken} steps (the gradients "
                               f"overflowed down to a loss scale of {run.scaler.get_scale():g}), so the optimizer "
                               "states never existed; bf16 or fp32 may train this model")
        held = held or stepped
        before = run.scaler.get_scale() if scaled else 0.0
        if scaled:  # an overflowing step is the GradScaler's to skip; overflow on every step is said above
            run.step(micro_batches)
        else:
            finite_loss(run.step(micro_batches), taken + 1)  # the loss is not held into the next step
        stepped = stepped or not scaled or run.scaler.get_scale() >= before  # a skipped step halves the scale
        taken += 1
        pace.clocked()


def fresh_run(spec: TrainSpec, config: Config, strategies: Sequence["Strategy"]) -> tuple[TrainRun, list[Any]]:
    """A fresh run of `config` and its micro-batches at the worst-case shape (the same one every micro-step,
    the loader's worst case)."""
    run = build_run(spec, config, strategies)
    micro_batch = to_device(made(spec.batch_factory, config.micro_batch_size), spec.device)
    return run, [micro_batch] * config.grad_accum_steps


def timed_step(run: TrainRun, micro_batches: Sequence[Any], device: torch.device, step: int | None = None) -> float:
    """Wall seconds of one optimizer step, the device synchronised on both sides; with `step` (its number in
    the probe), `NonFiniteLoss` where its loss is NaN or infinite (checked after the clock stops)."""
    _sync(device)
    start = time.perf_counter()
    loss = run.step(micro_batches)
    _sync(device)
    seconds = time.perf_counter() - start
    if step is not None:
        finite_loss(loss, step)
    return seconds


_SETTLED: set[str] = set()  # devices whose one-time process costs this process has paid


def settle(device: torch.device, step: Callable[[], float], check: Callable[[], None] = lambda: None) -> int:
    """On the first probe of `device` in this process, take untimed steps until two in a row agree within
    SETTLED_WITHIN (at most MAX_SETTLE_STEPS): thread pools start, kernels are selected and autotuned
    (oneDNN primitives, cuBLAS/cuDNN heuristics), the allocator grows, lazy imports run. Later probes
    find all of that done. Ranks stop together, once every one has settled. Returns the steps taken."""
    if str(device) in _SETTLED:
        return 0
    previous, taken = None, 0
    while taken < MAX_SETTLE_STEPS:
        seconds = step()
        taken += 1
        check()
        settled = previous is not None and abs(seconds - previous) <= SETTLED_WITHIN * min(seconds, previous)
        if _all_ranks(settled, device):
            break
        previous = seconds
    _SETTLED.add(str(device))
    return taken


def _all_ranks(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on every rank of the process group (this process's alone outside one): ranks
    must take the same steps, or one leaves while its peers wait in a collective."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    agreed = torch.tensor([int(flag)], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


@dataclasses.dataclass(frozen=True)
class Timed:
    """What the timed steps measured: seconds per step, and the CUDA allocator's behaviour meanwhile."""

    seconds: tuple[float, ...]  # wall seconds of each timed optimizer step
    alloc_retries: int | None = None  # None off CUDA
    fragmentation: float | None = None

    @property
    def median(self) -> float:
        """Median seconds per step: robust to one step disturbed by another process."""
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median: how much the steps disagreed."""
        return (max(self.seconds) - min(self.seconds)) / self.median


class AllocatorWatch:
    """Counts the CUDA caching allocator's retries from construction to `stop()`, and reads its
    fragmentation then (`torch.cuda.memory_stats`: "num_alloc_retries" counts failed cudaMalloc calls
    that flushed the cache and retried; "inactive_split_bytes" is reserved memory split and unusable for
    larger blocks). A retry during timed steps means the micro-batch runs at the allocator's limit: it
    pays cudaFree/cudaMalloc and synchronisations every step. Off CUDA it records nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.start = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if self.cuda else 0

    def stop(self) -> tuple[int | None, float | None]:
        """(retries since construction, inactive split bytes / reserved bytes), or (None, None) off CUDA."""
        if not self.cuda:
            return None, None
        stats = torch.cuda.memory_stats(self.device)
        reserved = stats.get("reserved_bytes.all.current", 0)
        split = stats.get("inactive_split_bytes.all.current", 0)
        return stats.get("num_alloc_retries", 0) - self.start, (split / reserved if reserved else 0.0)


def _measured(spec: TrainSpec, config: Config, peak: int, timed: Timed) -> ProbeResult:
    step_seconds = timed.median
    samples = config.global_batch_size / step_seconds
    tokens = samples * spec.tokens_per_sample if spec.tokens_per_sample else None
    images = samples * spec.images_per_sample if spec.images_per_sample else None
    share = f"{format_size(peak)} of {format_size(spec.memory_budget)} ({peak / spec.memory_budget:.0%})"
    figures = dict(images_per_s=images, step_spread=timed.spread, alloc_retries=timed.alloc_retries, fragmentation=timed.fragmentation)
    if peak > spec.fit_limit:
        return ProbeResult(config, ProbeStatus.OOM,
                           f"peak {share} is inside the {spec.safety_margin:.0%} safety margin",
                           peak, step_seconds, samples, tokens, oom_kind=OomKind.MARGIN, **figures)
    thrash = f"; {timed.alloc_retries} allocator retries while timed: near the limit" if timed.alloc_retries else ""
    return ProbeResult(config, ProbeStatus.FIT, f"fits: peak {share}{thrash}", peak, step_seconds, samples, tokens,
                       **figures)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
