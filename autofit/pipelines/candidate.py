"""A dry-run's candidate: one configuration, its predicted peak, fit and speed (`autofit.pipelines.dry_run`),
and candidates predicted alike grouped as one row of a table (`twins`)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from autofit.config import Config
from autofit.estimate.cost_model import StepCost
from autofit.estimate.prediction import Estimate, Fit
from autofit.search.decision import Standing
from autofit.units import format_size


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One planned configuration: its predicted peak per GPU, whether it fits, and its predicted speed."""

    config: Config
    estimate: Estimate
    fits: bool
    verdict: str  # one phrase: the fit (or the shortfall) in bytes, and the speed
    tier: int  # exactness tier (0 same math, 1 numerics, 2 trains adapters)
    step_seconds: float  # predicted seconds per optimizer step
    samples_per_s: float  # predicted global samples per second
    limit: int = 0  # the bytes per GPU it was planned under (0: none)
    numerics: tuple[str, ...] = ()  # its numerics changes, "knob=value" (`Space.numerics`)
    cost: StepCost | None = None  # `step_seconds` by part: compute, collectives within and across nodes, ...

    @property
    def standing(self) -> Standing:
        """What sets the margin it must clear against another fit (`margin_between`)."""
        return Standing(self.tier, self.numerics, micro_batch=self.config.micro_batch_size)

    @property
    def reason(self) -> str:
        """One line: the verdict and speed, then how the peak was predicted (`Estimate.reason`)."""
        return f"{self.verdict}; {self.estimate.reason}"

    @property
    def fit(self) -> Fit:
        """Against the limit at the error bound: fits, near the limit (fits only as predicted: a probe
        decides; `fits` is False), over, or unknown (`Estimate.fit_under`)."""
        return self.estimate.fit_under(self.limit)

    @property
    def near_limit(self) -> bool:
        """Whether the peak fits as predicted but not at its error bound (within its bound of the limit)."""
        return self.fit is Fit.NEAR_LIMIT

    @property
    def peak_bytes(self) -> int:
        """Predicted peak per GPU (bytes) under the limit (`Estimate.peak_under`)."""
        return self.estimate.peak_under(self.limit) if self.limit else self.estimate.peak_bytes

    def __repr__(self) -> str:
        """One line: the knobs, the peak, the verdict and the speed (the dataclass's spelled out the whole
        estimate; `reason` and `estimate` hold it)."""
        verdict = "fits" if self.fits else "near the limit" if self.near_limit else "does not fit"
        return (f"Candidate({self.config.describe()}: peak {format_size(self.peak_bytes)}/GPU, {verdict}, "
                f"~{self.samples_per_s:,.1f} samples/s)")

    def to_dict(self) -> dict[str, Any]:
        """JSON form: config, peak_bytes, fits, reason, breakdown (bytes), cpu_bytes, speed."""
        return {"config": self.config.to_dict(), "peak_bytes": self.peak_bytes,
                "need_bytes": self.estimate.need_bytes, "fits": self.fits,
                "reason": self.reason, "breakdown": self.estimate.breakdown.to_dict(),
                "overhead_terms": dict(self.estimate.terms), "cpu_bytes": self.estimate.cpu_bytes,
                "activations": "simulated" if self.estimate.simulated else "formula",
                "error_bound": self.estimate.error_bound, "bound_basis": self.estimate.bound_basis,
                "memory": self.estimate.memory.value, "fit": self.fit.value, "near_limit": self.near_limit,
                "tier": self.tier, "step_seconds": self.step_seconds, "samples_per_s": self.samples_per_s,
                "step_cost": dataclasses.asdict(self.cost) if self.cost else None}


def twins(candidates: Sequence[Candidate]) -> tuple[tuple[Candidate, ...], ...]:
    """`candidates` grouped where every figure of their predictions is the same (peak and need per GPU, its
    parts, host bytes, fit, speed, tier: SDPA and flash-attention levels, most often), each group at its first
    member's place: one row of a table, naming the rest as alternatives (`alternative`)."""
    groups: dict[tuple, list[Candidate]] = {}
    for candidate in candidates:
        groups.setdefault(_figures(candidate), []).append(candidate)
    return tuple(tuple(group) for group in groups.values())


def _figures(candidate: Candidate) -> tuple:
    estimate = candidate.estimate
    return (candidate.fits, candidate.peak_bytes, estimate.need_bytes, estimate.upper_bytes, estimate.simulated,
            tuple(estimate.breakdown.to_dict().items()), estimate.cpu_bytes, candidate.tier,
            candidate.step_seconds, candidate.samples_per_s)


def alternative(head: Candidate, twin: Candidate) -> str:
    """What `twin` changes from `head` in `Config.describe`'s words ("attn=flash"): how a row names a twin."""
    own = set(head.config.describe().split(", "))
    return ", ".join(part for part in twin.config.describe().split(", ") if part not in own) or twin.config.describe()


def also(head: Candidate, others: Sequence[Candidate]) -> str:
    """How a row names its twins after `head`'s own words: "; also attn=flash_attention_2" for each; where they
    are every combination of a few changes of a knob each (attn=flash_attention_2, opt=paged_adamw8bit and the
    two together), those changes once: "; also attn=flash_attention_2 and/or opt=paged_adamw8bit"."""
    changes = [alternative(head, other) for other in others]
    singles = [change for change in changes if ", " not in change]
    combined = {frozenset(combo) for size in range(1, len(singles) + 1)
                for combo in itertools.combinations(singles, size)}
    if len(singles) >= 2 and len({single.split("=")[0] for single in singles}) == len(singles) and \
            len(changes) == len(combined) == len({frozenset(change.split(", ")) for change in changes} & combined):
        return "; also " + " and/or ".join(singles)
    return "".join(f"; also {change}" for change in changes)
