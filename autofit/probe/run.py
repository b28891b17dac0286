"""Probe: run a few real training steps of one candidate and record what happened.

Every outcome is a `ProbeResult`: a fit with its measured peak and throughput, an OOM of any kind
(classified), or an error with its message. Nothing but bad user input escapes. Memory held by a failed
attempt is released before the next probe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from typing import Any, Sequence

import torch

from autofit.spec.batch import to_device
from autofit.config import Config
from autofit.errors import UsageError
from autofit.probe.memory import DeadlinePassed, budget_for
from autofit.probe.oom import classify_oom, first_line, release_memory
from autofit.spec.train import TrainSpec
from autofit.probe.step import build_run
from autofit.units import format_size


MIN_ALLOWANCE = 5.0  # seconds a probe may always take before its deadline stops it
STEADY_STEPS = 2  # optimizer steps after which every step allocates the same (see _train)


class ProbeStatus(str, enum.Enum):
    """How a probe ended."""

    FIT = "fit"  # finished its steps with peak under budget minus the safety margin
    OOM = "oom"  # ran out of memory (any kind), or peaked inside the safety margin
    ERROR = "error"  # any other exception
    SKIPPED = "skipped"  # not run: certain to fail, cannot win, or unavailable; the reason says which


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """One probe's outcome. Bytes for memory, seconds for time, samples/s and tokens/s for throughput."""

    config: Config
    status: ProbeStatus
    reason: str  # one line: why it fit, what ran out, the error, or why it was skipped
    peak_bytes: int | None = None
    step_seconds: float | None = None  # mean wall time of one optimizer step (all micro-batches)
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    oom_kind: str | None = None  # "cuda-allocator", "cpu-budget", "cublas", "margin", ...
    too_slow: bool = False  # stopped at its deadline: slower than half the best throughput found so far
    source: str = "probed"  # "probed" now, "stored" (reused from the trial storage), "search" (decided unrun)

    @property
    def fits(self) -> bool:
        """Whether this probe is a fit."""
        return self.status is ProbeStatus.FIT

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        data = dataclasses.asdict(self)
        data["config"] = self.config.to_dict()
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProbeResult":
        """Inverse of `to_dict`."""
        fields = dict(data)
        fields["config"] = Config.from_dict(fields["config"])
        fields["status"] = ProbeStatus(fields["status"])
        return cls(**fields)


def skipped(config: Config, reason: str) -> ProbeResult:
    """A candidate that was not run, with the reason."""
    return ProbeResult(config, ProbeStatus.SKIPPED, reason, source="search")


def run_probe(spec: TrainSpec, config: Config, strategies: Sequence[Any],
              step_limit: float | None = None) -> ProbeResult:
    """Train `config` for `spec.warmup_steps + spec.timed_steps` steps under the budget; never raises
    except for bad user input (`UsageError`).

    `step_limit` (seconds per optimizer step) stops a probe that cannot win: it may take the steps it
    runs plus two more (model build, first-step warm-up) at that pace, and at least MIN_ALLOWANCE
    seconds (timing noise dominates shorter probes), then it is recorded as too slow.
    """
    budget = budget_for(spec.device, spec.memory_budget)
    if step_limit is not None:
        allowance = max((spec.warmup_steps + spec.timed_steps + 2) * step_limit, MIN_ALLOWANCE)
        budget.deadline = time.perf_counter() + allowance
    try:
        with budget:
            step_seconds = _train(spec, config, strategies, budget)
    except UsageError:
        raise
    except DeadlinePassed:
        result = ProbeResult(config, ProbeStatus.SKIPPED,
                             f"too slow to win: stopped after {allowance:.1f} s, when a config at half the best "
                             f"throughput so far ({step_limit:.2f} s/step) would have finished", budget.peak or None, too_slow=True)
    except Exception as exc:  # noqa: BLE001 - every failure is a result
        kind = classify_oom(exc)
        status = ProbeStatus.ERROR if kind is None else ProbeStatus.OOM
        result = ProbeResult(config, status, first_line(exc), budget.peak or None, oom_kind=kind)
    else:
        result = _measured(spec, config, budget.peak, step_seconds)
    release_memory()
    return result


def _train(spec: TrainSpec, config: Config, strategies: Sequence[Any], budget: Any) -> float:
    """Build the run, take the warm-up steps, return the mean seconds of the timed steps."""
    run = build_run(spec, config, strategies)
    micro_batch = to_device(spec.batch_factory(config.micro_batch_size), spec.device)
    micro_batches = [micro_batch] * config.grad_accum_steps  # the loader's worst case, every micro-step
    for _ in range(spec.warmup_steps):
        run.step(micro_batches)
        budget.check_deadline()
    _sync(spec.device)
    # Two steps reach the steady-state peak: the first ends by creating the optimizer states, the
    # second holds them through its backward. When the warm-up steps counted both, the timed steps
    # repeat the second and run as plain training does.
    with budget.timing() if spec.warmup_steps >= STEADY_STEPS else contextlib.nullcontext():
        start = time.perf_counter()
        for _ in range(spec.timed_steps):
            run.step(micro_batches)
            budget.check_deadline()
        _sync(spec.device)
        return (time.perf_counter() - start) / spec.timed_steps


def _measured(spec: TrainSpec, config: Config, peak: int, step_seconds: float) -> ProbeResult:
    samples = config.global_batch_size / step_seconds
    tokens = samples * spec.tokens_per_sample if spec.tokens_per_sample else None
    share = f"{format_size(peak)} of {format_size(spec.memory_budget)} ({peak / spec.memory_budget:.0%})"
    if peak > spec.fit_limit:
        return ProbeResult(config, ProbeStatus.OOM,
                           f"peak {share} is inside the {spec.safety_margin:.0%} safety margin",
                           peak, step_seconds, samples, tokens, oom_kind="margin")
    return ProbeResult(config, ProbeStatus.FIT, f"fits: peak {share}", peak, step_seconds, samples, tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
