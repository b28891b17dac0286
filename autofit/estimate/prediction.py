"""What a prediction says (`autofit.estimate.estimator.Estimator.predict`): a candidate's peak bytes per
device, its parts by what holds them, and how it was made (simulated or by formula, with its error bound).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autofit.strategies.memory import Breakdown


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
    # relative error the peak may carry upwards: the formula's measured bound (0 when simulated); None where
    # the formula does not cover the model (`formula_covers`): the peak has no bound
    error_bound: float | None = 0.0
    offloaded_activations: int = 0  # bytes of saved activations copied to the host and back per micro-step
    kernels: int = 0  # kernels one micro-step's forward + backward launches (simulated; 0 from a formula)
    # CUDA: bytes of the peak that the caching allocator holds in cached segments on a roomy card and
    # releases under a tighter limit before it would fail (`training_replay.least_reserve`)
    release_slack: int = 0

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
        None where the peak has no bound (no verdict can rest on it)."""
        return None if self.error_bound is None else int(self.need_bytes * (1 + self.error_bound))

    def peak_under(self, limit: int) -> int:
        """The peak under `limit`: a roomy card's, or the limit where the allocator fills it and then
        releases its cache to fit (`need_bytes` within it)."""
        return min(self.peak_bytes, max(self.need_bytes, limit))

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"peak_bytes": self.peak_bytes, "need_bytes": self.need_bytes, "cpu_bytes": self.cpu_bytes,
                "reason": self.reason, "method": self.method, "notes": list(self.notes),
                "breakdown": self.breakdown.to_dict(), "overhead_terms": dict(self.terms),
                "activations": "simulated" if self.simulated else "formula", "error_bound": self.error_bound}
