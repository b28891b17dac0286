"""The outcome of one candidate: a self-checking record with one status that carries the whole outcome.

Every candidate ends as one `ProbeResult`: FIT (with its measured peak and throughput), OOM (with its
kind), ERROR (with its message), PRUNED (stopped at its deadline: it cannot win), or SKIPPED with a
`Skip` saying why it was not run (implied by a measured result, predicted not to fit, excluded by a rule
or an unavailable option, or the probe budget was spent). `Source` says where the record comes from.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from autofit.config import Config, Knob


class ProbeStatus(str, enum.Enum):
    """How a candidate ended."""

    FIT = "fit"  # finished its steps with its peak under the budget less the safety margin
    OOM = "oom"  # ran out of memory (any kind), or peaked inside the safety margin
    ERROR = "error"  # any other exception
    PRUNED = "pruned"  # stopped at its deadline: slower than the best fit so far allows to win
    SKIPPED = "skipped"  # not run; `skip` says why


class Skip(str, enum.Enum):
    """Why a candidate was not run."""

    IMPLIED = "implied"  # a measured result decides it: fits but cannot be faster, certain to fail, or too slow
    PREDICTED = "predicted"  # the estimator predicts it over the fit limit by more than its error
    EXCLUDED = "excluded"  # a rule between knobs, an unavailable option, or a tier not allowed
    BUDGET = "budget"  # the probe budget (max_probes) was spent


class Phase(Knob):
    """Where in a probe a failure struck. BUILD (the model and engine) and STEP (the optimizer step,
    activations freed) hold no activations: memory there does not depend on the micro-batch."""

    BUILD = "build"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


PHASES = tuple(Phase)
FIXED_PHASES = (Phase.BUILD, Phase.STEP)


class OomKind(Knob):
    """What ran out of memory (`autofit.probe.oom.classify_oom`), or why a run that finished counts as one."""

    CUDA_ALLOCATOR = "cuda-allocator"  # torch.OutOfMemoryError from the CUDA caching allocator
    CPU_BUDGET = "cpu-budget"  # the CPU budget autofit enforces (`autofit.devices.memory`)
    CPU_ALLOCATOR = "cpu-allocator"  # the host allocator refused (DefaultCPUAllocator)
    HOST = "host"  # Python's MemoryError
    HOST_PINNED = "host-pinned"  # pinned host memory, in a DataLoader's pin-memory thread
    HOST_KILLED = "host-killed"  # a probe process killed by SIGKILL: the kernel's OOM killer, most likely
    CUDA_RUNTIME = "cuda-runtime"  # "CUDA error: out of memory" (a CUDA runtime call, or pinned host memory)
    CUDA_DRIVER = "cuda-driver"  # "CUDA driver error: out of memory" (cuMemCreate, cuMemHostAlloc)
    CUBLAS = "cublas"  # cuBLAS could not allocate its handle or workspace
    CUDNN = "cudnn"  # cuDNN could not allocate (device memory or workspace)
    CUDNN_HOST = "cudnn-host"  # cuDNN could not allocate host memory
    NCCL = "nccl"  # NCCL could not allocate
    MARGIN = "margin"  # finished its steps, but its peak is inside the safety margin


class Source(str, enum.Enum):
    """Where a record comes from."""

    PROBED = "probed"  # measured in this search
    STORED = "stored"  # measured in an earlier session, read from the trial store
    DECIDED = "decided"  # decided without running (every SKIPPED record)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """One candidate's outcome. Bytes for memory, seconds for time, samples/s, tokens/s and images/s for
    throughput.

    The record checks itself: a fit carries its peak and throughput, an OOM its kind, a skip its why
    (and only a skip is decided without running)."""

    config: Config
    status: ProbeStatus
    reason: str  # one line: why it fit, what ran out, the error, or why it was not run
    peak_bytes: int | None = None
    step_seconds: float | None = None  # mean wall time of one optimizer step (all micro-batches)
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    oom_kind: OomKind | None = None  # what ran out (OOM only)
    skip: Skip | None = None  # why it was not run (SKIPPED only)
    source: Source = Source.PROBED
    rank_peaks: tuple[int | None, ...] = ()  # each rank's peak (bytes; None: it did not report), several ranks only
    phase: Phase | None = None  # where an OOM or error struck
    step_spread: float | None = None  # (slowest - fastest) / median of the timed steps' seconds
    alloc_retries: int | None = None  # CUDA caching-allocator retries (cudaMalloc failed, cache flushed) while timed
    fragmentation: float | None = None  # CUDA: inactive split bytes / reserved bytes after the timed steps
    left_behind: int | None = None  # CUDA: bytes still allocated in this process once the probe released all it held
    # An error's identity across configurations (ERROR only): the exception's type name, and where it was
    # raised in code that is neither torch's nor autofit's ("model.py:12 in forward"; None: no such frame).
    # Both None where no exception was caught (a timeout, a probe process that died): its reason is its identity.
    error_type: str | None = None
    error_site: str | None = None
    images_per_s: float | None = None  # where the batch holds images (a video's frames count each)
    # optimizer steps the probe started (settling, warm-up, timed; one that ran out or was stopped counts), a
    # rank's where several ran (they step together); None where nothing ran (a decision), none was counted (older
    # records), or the probe process died before it could report
    steps: int | None = None

    @property
    def near_limit(self) -> bool:
        """Whether the allocator had to flush its cache and retry during the timed steps: a fit that thrashes
        near the memory limit (slower than it should be, and at risk over a long run)."""
        return bool(self.alloc_retries)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", ProbeStatus(self.status))
        object.__setattr__(self, "rank_peaks", tuple(self.rank_peaks))
        object.__setattr__(self, "source", Source(self.source))
        if self.skip is not None:
            object.__setattr__(self, "skip", Skip(self.skip))
        if self.oom_kind is not None:
            object.__setattr__(self, "oom_kind", OomKind.parse(self.oom_kind, "oom_kind"))
        if self.phase is not None:
            object.__setattr__(self, "phase", Phase.parse(self.phase, "phase"))
        problem = self._problem()
        if problem:
            raise ValueError(f"inconsistent probe result ({problem}): {self.config.describe()}, {self.status.value}")

    def _problem(self) -> str | None:
        if self.status is ProbeStatus.FIT and (self.peak_bytes is None or self.samples_per_s is None):
            return "a fit needs its peak and throughput"
        if self.status is ProbeStatus.OOM and not self.oom_kind:
            return "an OOM needs its kind"
        if (self.status is ProbeStatus.SKIPPED) != (self.skip is not None):
            return "a skip, and only a skip, says why it was not run"
        if (self.status is ProbeStatus.SKIPPED) != (self.source is Source.DECIDED):
            return "a skip, and only a skip, is decided without running"
        if self.status is not ProbeStatus.ERROR and (self.error_type or self.error_site):
            return "only an error has an error's type and site"
        if self.steps is not None and (type(self.steps) is not int or self.steps < 0 or self.source is Source.DECIDED):
            return "steps are a count (>= 0) of a probe that ran"
        return None

    @property
    def fits(self) -> bool:
        """Whether this candidate is a fit."""
        return self.status is ProbeStatus.FIT

    @property
    def fixed_cost(self) -> bool:
        """Whether this is an OOM where no activation was live (building the model and engine, or the
        optimizer step): it does not depend on the micro-batch, checkpointing or attention."""
        return self.status is ProbeStatus.OOM and self.phase in FIXED_PHASES

    @property
    def peak_rank(self) -> int | None:
        """The rank that set the peak (the largest of `rank_peaks`), or None for a single process."""
        known = [(peak, rank) for rank, peak in enumerate(self.rank_peaks) if peak is not None]
        return max(known, key=lambda pair: (pair[0], -pair[1]))[1] if known else None

    @property
    def measured(self) -> bool:
        """Whether this record comes from running the candidate (now or in an earlier session)."""
        return self.source is not Source.DECIDED

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        data = dataclasses.asdict(self)
        data["config"] = self.config.to_dict()
        data.update(status=self.status.value, source=self.source.value, skip=self.skip.value if self.skip else None,
                    oom_kind=self.oom_kind.value if self.oom_kind else None,
                    phase=self.phase.value if self.phase else None)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProbeResult":
        """Inverse of `to_dict`; reads records written by autofit 0.1 too (`too_slow`, "search" source) and
        those written before errors kept their type and site (`error_type`, `error_site` left None)."""
        fields = _upgraded(dict(data))
        fields["config"] = Config.from_dict(fields["config"])
        return cls(**fields)


def decided(config: Config, skip: Skip, reason: str) -> ProbeResult:
    """A candidate that was not run, why, and the one-line reason."""
    return ProbeResult(config, ProbeStatus.SKIPPED, reason, skip=skip, source=Source.DECIDED)


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """Map an autofit 0.1 record (too_slow flag, "search"/"predicted" sources, oom_kind "predicted")
    onto today's status, skip and source; today's records pass unchanged."""
    too_slow = data.pop("too_slow", False)
    if too_slow:
        data["status"] = ProbeStatus.PRUNED.value
    if data.get("source") in ("search", "predicted"):
        predicted = data.get("source") == "predicted" or data.get("oom_kind") == "predicted"
        budget = "probe budget" in data.get("reason", "")
        data["skip"] = Skip.PREDICTED if predicted else Skip.BUDGET if budget else Skip.IMPLIED
        data["source"] = Source.DECIDED.value
        data["oom_kind"] = None
    return data
