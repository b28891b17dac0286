"""Every probe is a trial in an optuna study, so a search resumed with the same spec and storage
re-probes nothing already measured.

One study per spec (its name hashes the spec summary); storage is in memory by default, or any optuna
storage URL (the CLI uses a SQLite file in the run directory). A fit is a COMPLETE trial whose value is
samples/s; an OOM or error is a FAIL trial. The full result rides in the trial's user attributes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import optuna

from autofit.config import Config
from autofit.errors import UsageError
from autofit.probe.oom import first_line
from autofit.probe.outcome import ProbeResult, ProbeStatus, Source
from autofit.search.space import Space

RESULT_ATTR = "autofit_result"


class TrialStore:
    """Probe results kept as optuna trials, looked up by configuration."""

    def __init__(self, space: Space, storage: Any = None):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        summary = space.spec.summary()
        self._distributions = {name: optuna.distributions.CategoricalDistribution([_plain(v) for v in values])
                               for name, values in space.values().items()}
        self._results: dict[Config, ProbeResult] = {}
        try:
            self.study = optuna.create_study(storage=storage, study_name=study_name(summary),
                                             direction="maximize", load_if_exists=True)
            self.study.set_user_attr("spec", summary)
            trials = self.study.get_trials(deepcopy=False)
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy's and optuna's errors: one line, not a dump
            raise UsageError(f"Cannot use the trial store {_shown(storage)}: {first_line(exc)}. It is not a store "
                             "autofit can read (corrupt, or another program's); move it away, or choose another "
                             "storage (autofit tune: another --out, or --force to start a fresh one).") from None
        for trial in trials:  # data: a stored result that does not read back is re-probed, not trusted
            try:
                result = ProbeResult.from_dict(trial.user_attrs[RESULT_ATTR])
            except (KeyError, TypeError, ValueError, AttributeError, UsageError):
                continue
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


SQLITE_HEADER = b"SQLite format 3\x00"


def check_resumable(path: str | os.PathLike) -> None:
    """`UsageError` naming `path` and what is wrong unless it is a trial store autofit wrote: a SQLite file
    (not empty, not a link) holding an optuna study of autofit's. Read as data: opened read-only, only its
    table of studies is queried."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        problem = "it is a link or not a file"
    elif path.stat().st_size == 0:
        problem = "it is empty (0 bytes): no probe was ever recorded in it"
    else:
        with path.open("rb") as handle:
            header = handle.read(len(SQLITE_HEADER))
        problem = None if header == SQLITE_HEADER else "it is not a SQLite database"
    if problem is None:
        try:
            with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
                names = [row[0] for row in db.execute("SELECT study_name FROM studies")]
        except sqlite3.Error as exc:
            names, problem = [], f"it holds no optuna studies ({exc})"
        if problem is None and not any(str(name).startswith("autofit-") for name in names):
            problem = "it holds no study of autofit's"
    if problem:
        raise UsageError(f"--resume: {str(path)!r} is not a trial store autofit wrote: {problem}. Nothing can be "
                         "resumed from it; run with --force to start afresh (it is replaced), or choose another --out.")


def _shown(storage: Any) -> str:
    return repr(str(storage)) if storage is not None else "(in memory)"


def study_name(summary: dict[str, Any]) -> str:
    """A stable study name for a spec summary."""
    digest = hashlib.sha256(json.dumps(summary, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"autofit-{summary.get('model', 'model')}-{digest}"


def _plain(value: Any) -> Any:
    """A knob's value as optuna stores it (str-enums as their strings)."""
    return value.value if isinstance(value, enum.Enum) else value
