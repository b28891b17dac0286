"""Every probe is a trial in an optuna study, so a search resumed with the same spec and storage
re-probes nothing already measured.

One study per spec (its name hashes the spec summary); storage is in memory by default, or any optuna
storage URL (the CLI uses a SQLite file in the run directory). A fit is a COMPLETE trial whose value is
samples/s; an OOM or error is a FAIL trial. The full result rides in the trial's user attributes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from typing import Any

import optuna

from autofit.config import Config
from autofit.probe.outcome import ProbeResult, ProbeStatus, Source
from autofit.search.space import Space

RESULT_ATTR = "autofit_result"


class TrialStore:
    """Probe results kept as optuna trials, looked up by configuration."""

    def __init__(self, space: Space, storage: Any = None):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        summary = space.spec.summary()
        self.study = optuna.create_study(storage=storage, study_name=study_name(summary),
                                         direction="maximize", load_if_exists=True)
        self.study.set_user_attr("spec", summary)
        self._distributions = {name: optuna.distributions.CategoricalDistribution([_plain(v) for v in values])
                               for name, values in space.values().items()}
        self._results: dict[Config, ProbeResult] = {}
        for trial in self.study.get_trials(deepcopy=False):
            if RESULT_ATTR in trial.user_attrs:
                result = ProbeResult.from_dict(trial.user_attrs[RESULT_ATTR])
                self._results[result.config] = result

    def lookup(self, config: Config) -> ProbeResult | None:
        """The stored result of `config`, marked as stored, or None."""
        result = self._results.get(config)
        if result is None:
            return None
        return dataclasses.replace(result, source=Source.STORED)

    def record(self, result: ProbeResult) -> None:
        """Store a probed result as a trial."""
        self._results[result.config] = result
        params = {name: _plain(result.config.knob(name)) for name in self._distributions}
        fit = result.status is ProbeStatus.FIT
        trial = optuna.trial.create_trial(
            params=params, distributions=self._distributions,
            value=result.samples_per_s if fit else None,
            state=optuna.trial.TrialState.COMPLETE if fit else optuna.trial.TrialState.FAIL,
            user_attrs={RESULT_ATTR: result.to_dict()},
        )
        self.study.add_trial(trial)

    def __len__(self) -> int:
        return len(self._results)


def study_name(summary: dict[str, Any]) -> str:
    """A stable study name for a spec summary."""
    digest = hashlib.sha256(json.dumps(summary, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"autofit-{summary.get('model', 'model')}-{digest}"


def _plain(value: Any) -> Any:
    """A knob's value as optuna stores it (str-enums as their strings)."""
    return value.value if isinstance(value, enum.Enum) else value
