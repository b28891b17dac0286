"""Dry-run error: autofit's predicted peak (`autofit.estimate.estimator.predict_peak`) against the measured peak,
for the chosen candidate, the other fits and the rejected ones: every candidate of the exhaustive search.

A fit's measured peak comes from its probe. A candidate that ran out of memory only shows a lower
bound under the budget, so on the CPU it is measured again without one (a short run: one warm-up step,
one timed step); on CUDA the lower bound is reported as such.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from autofit.probe.run import ProbeResult, ProbeStatus, run_probe
from autofit.job.train_spec import TrainSpec


@dataclasses.dataclass(frozen=True)
class PeakRow:
    """One candidate: predicted and measured peak bytes, and the relative error (predicted / measured - 1)."""

    config: str
    role: str  # "chosen" | "fit" (fits, not chosen) | "oom" (rejected: does not fit the budget and margin)
    probed_by_autofit: bool  # autofit's search ran it (the others it decided without running)
    predicted_bytes: int | None
    measured_bytes: int | None
    predicted_fit: bool | None = None  # the prediction is under the fit limit
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
        from autofit.estimate.estimator import predict_peak
    except ImportError as exc:
        return None, f"autofit.estimate.estimator.predict_peak is not available ({exc})"
    return predict_peak, ""


def peak_rows(spec: TrainSpec, candidates: Sequence[ProbeResult], chosen: Any, autofit_probed: Any,
              strategies: Sequence[Any]) -> list[PeakRow]:
    """Predicted vs measured for every candidate the exhaustive search ran (fits and OOMs);
    `autofit_probed` holds the configs autofit's own search ran."""
    predict, why = estimator()
    rows = []
    for result in candidates:
        if result.status not in (ProbeStatus.FIT, ProbeStatus.OOM):
            continue
        role = "chosen" if result.config == chosen else ("fit" if result.fits else "oom")
        measured, lower = _measured(spec, result, strategies)
        row = dict(config=result.config.describe(), role=role, probed_by_autofit=result.config in autofit_probed,
                   measured_bytes=measured, measured_is_lower_bound=lower)
        if predict is None:
            rows.append(PeakRow(predicted_bytes=None, error=why, **row))
            continue
        try:
            predicted = int(predict(spec, result.config).peak_bytes)
        except Exception as exc:  # noqa: BLE001 - a failing estimator is a finding
            rows.append(PeakRow(predicted_bytes=None, error=f"{type(exc).__name__}: {exc}", **row))
            continue
        rows.append(PeakRow(predicted_bytes=predicted, predicted_fit=predicted <= spec.fit_limit, **row))
    return rows


def _measured(spec: TrainSpec, result: ProbeResult, strategies: Sequence[Any]) -> tuple[int | None, bool]:
    if result.fits or result.oom_kind == "margin":
        return result.peak_bytes, False
    if spec.device.type != "cpu":
        return result.peak_bytes, True
    roomy = dataclasses.replace(spec, memory_budget=16 * 2**30, safety_margin=0.0, warmup_steps=1, timed_steps=1)
    again = run_probe(roomy, result.config, strategies)
    return (again.peak_bytes, False) if again.fits else (result.peak_bytes, True)
