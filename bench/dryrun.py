"""Dry-run error: autofit's predicted peak (`autofit.estimate.predict_peak`) against the measured peak,
for the chosen candidate and the ones the search rejected.

A fit's measured peak comes from its probe. A candidate that ran out of memory only shows a lower
bound under the budget, so on the CPU it is measured again without one (a short run: one warm-up step,
one timed step); on CUDA the lower bound is reported as such.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from autofit.probe import ProbeResult, ProbeStatus, run_probe
from autofit.spec import TrainSpec


@dataclasses.dataclass(frozen=True)
class PeakRow:
    """One candidate: predicted and measured peak bytes, and the relative error (predicted / measured - 1)."""

    config: str
    role: str  # "chosen" | "fit" | "oom"
    predicted_bytes: int | None
    measured_bytes: int | None
    measured_is_lower_bound: bool = False
    error: str | None = None  # why there is no prediction

    @property
    def relative_error(self) -> float | None:
        """predicted / measured - 1 (positive: over-predicted)."""
        if self.predicted_bytes is None or not self.measured_bytes or self.measured_is_lower_bound:
            return None
        return self.predicted_bytes / self.measured_bytes - 1

    def to_dict(self) -> dict[str, Any]:
        """JSON form with the relative error."""
        return {**dataclasses.asdict(self), "relative_error": self.relative_error}


def estimator() -> tuple[Any, str]:
    """`predict_peak`, or None and why it is not available."""
    try:
        from autofit.estimate import predict_peak
    except ImportError as exc:
        return None, f"autofit.estimate.predict_peak is not available ({exc})"
    return predict_peak, ""


def peak_rows(spec: TrainSpec, probes: Sequence[ProbeResult], chosen: Any, strategies: Sequence[Any],
              limit: int = 12) -> list[PeakRow]:
    """Predicted vs measured for autofit's probed candidates (fits and OOMs), at most `limit` of them."""
    predict, why = estimator()
    probed = [p for p in probes if p.source == "probed" and p.status in (ProbeStatus.FIT, ProbeStatus.OOM)]
    rows = []
    for result in probed[:limit]:
        role = "chosen" if result.config == chosen else ("fit" if result.fits else "oom")
        measured, lower = _measured(spec, result, strategies)
        if predict is None:
            rows.append(PeakRow(result.config.describe(), role, None, measured, lower, why))
            continue
        try:
            predicted = int(predict(spec, result.config).peak_bytes)
        except Exception as exc:  # noqa: BLE001 - a failing estimator is a finding
            rows.append(PeakRow(result.config.describe(), role, None, measured, lower, f"{type(exc).__name__}: {exc}"))
            continue
        rows.append(PeakRow(result.config.describe(), role, predicted, measured, lower))
    return rows


def _measured(spec: TrainSpec, result: ProbeResult, strategies: Sequence[Any]) -> tuple[int | None, bool]:
    if result.fits or result.oom_kind == "margin":
        return result.peak_bytes, False
    if spec.device.type != "cpu":
        return result.peak_bytes, True
    roomy = dataclasses.replace(spec, memory_budget=16 * 2**30, safety_margin=0.0, warmup_steps=1, timed_steps=1)
    again = run_probe(roomy, result.config, strategies)
    return (again.peak_bytes, False) if again.fits else (result.peak_bytes, True)
