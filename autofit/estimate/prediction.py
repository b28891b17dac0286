"""What a prediction says (`autofit.estimate.estimator.Estimator.predict`): a candidate's peak bytes per
device, its parts by what holds them, and how it was made (simulated or by formula, with its error bound).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from autofit.strategies.memory import Breakdown


class Memory(str, enum.Enum):
    """Which memory a predicted peak is: what decides an out-of-memory error on the target."""

    # the CUDA caching allocator's reserved peak (its segments, the allocated bytes and what its cache holds
    # beside them) plus the CUDA context and cuBLAS workspaces: what nvidia-smi shows for the process
    RESERVED_CONTEXT = "reserved + context"
    ALLOCATED = "allocated"  # bytes of live tensors (the CPU budget counts these)


class Fit(str, enum.Enum):
    """A predicted peak against a limit, at its error bound (`Estimate.fit_under`)."""

    FITS = "fits"  # fits at its error bound
    NEAR_LIMIT = "near the limit"  # fits as predicted, not at its error bound: a probe decides
    OVER = "over"  # over the limit as predicted
    UNKNOWN = "unknown"  # the peak has no bound: no verdict


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A predicted peak per device (bytes), its parts, host RAM needed (bytes, all ranks), and how it was made."""

    breakdown: Breakdown
    peak_bytes: int  # the parts are not all live at the peak moment: peak <= breakdown.total
    cpu_bytes: int  # host RAM for offloaded states (all ranks on one node) and offloaded activations; 0 without
    method: str  # how the activations were obtained (one phrase: simulated under fake tensors, or by formula)
    notes: tuple[str, ...] = ()  # one phrase each: what else shaped the peak (formula-only parts, offload, ...)
    terms: tuple[tuple[str, int], ...] = ()  # the overhead, term by term
    simulated: bool = True  # False: the step could not be simulated and activations come from a formula
    # relative error the peak may carry upwards: on a CUDA target the calibration's bound for the model's
    # family and kernel (`tolerance.bound_for`; at least the formula's where the activations come from it),
    # on the CPU the formula's measured bound (0 when simulated); None where the formula does not cover the
    # model (`formula_covers`): the peak has no bound
    error_bound: float | None = 0.0
    offloaded_activations: int = 0  # bytes of saved activations copied to the host and back per micro-step
    kernels: int = 0  # kernels one micro-step's forward + backward launches (simulated; 0 from a formula)
    # CUDA: bytes of the peak that the caching allocator holds in cached segments on a roomy card and
    # releases under a tighter limit before it would fail (`training_replay.least_reserve`)
    release_slack: int = 0
    memory: Memory = Memory.ALLOCATED  # which memory `peak_bytes` is
    bound_basis: str = ""  # what `error_bound` rests on: "decoder/fused: 54 calibration rows" (`tolerance.Bound`)
    # bytes of the need that `error_bound` does not multiply: on CUDA the context, which the calibration's
    # errors leave out (its figures are the allocator's, taken without the context: bench/calibration/)
    unbounded_bytes: int = 0

    @property
    def reason(self) -> str:
        """One line for people: how the activations were obtained, then the notes."""
        return "; ".join((self.method, *self.notes))

    @property
    def need_bytes(self) -> int:
        """The fewest bytes the step trains in (the peak less `release_slack`): what a fit needs."""
        return self.peak_bytes - self.release_slack

    @property
    def upper_bytes(self) -> int | None:
        """What it needs at its error bound (bytes): what a verdict, one resting on a formula too, must fit;
        the bound multiplies the need less `unbounded_bytes` (the part the calibration measured). None where
        the peak has no bound (no verdict can rest on it)."""
        if self.error_bound is None:
            return None
        return self.need_bytes + int(max(self.need_bytes - self.unbounded_bytes, 0) * self.error_bound)

    def fit_under(self, limit: int) -> Fit:
        """Fits under `limit` (bytes) at the error bound, fits only as predicted (near the limit), is over,
        or has no bound."""
        if self.upper_bytes is None:
            return Fit.UNKNOWN
        if self.upper_bytes <= limit:
            return Fit.FITS
        return Fit.NEAR_LIMIT if self.need_bytes <= limit else Fit.OVER

    def peak_under(self, limit: int) -> int:
        """The peak under `limit`: a roomy card's, or the limit where the allocator fills it and then
        releases its cache to fit (`need_bytes` within it)."""
        return min(self.peak_bytes, max(self.need_bytes, limit))

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"peak_bytes": self.peak_bytes, "need_bytes": self.need_bytes, "cpu_bytes": self.cpu_bytes,
                "reason": self.reason, "method": self.method, "notes": list(self.notes),
                "breakdown": self.breakdown.to_dict(), "overhead_terms": dict(self.terms),
                "activations": "simulated" if self.simulated else "formula", "error_bound": self.error_bound,
                "memory": self.memory.value, "bound_basis": self.bound_basis}
