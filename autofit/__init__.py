"""autofit: find the fastest way to train a PyTorch model on given hardware without running out of memory.

    plan = autofit.autofit(make_model, make_batch, global_batch_size=32, memory_budget="6GiB")
    plan.fits, plan.config, plan.throughput, plan.peak_memory, plan.probes

The flow (docs/design.md), bottom to top: `devices`, `models`, `batches` and `job` (what the user asked, the
Target) -> `strategies` (one file per technique, the `TrainRun` they change) -> `probe` (real steps,
outcomes, the launcher) -> `estimate` (predicted peaks) -> `search` (space, rules, walk, confirmation,
decision, trials) -> `pipelines` (`tune`, `dry_run`) with `plan`, `export`, `report`, `prepare` and `guard`
(keeps a running job alive) -> `cli`.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from autofit.config import (ActivationOffload, Attention, Checkpointing, Config, Engine, Loss, Offload, Optimizer,
                            OptimizerStep, Precision, Quantization, Sharding)
from autofit.errors import AutofitError, MissingExtraError, UsageError
from autofit.prepare import Prepared, prepare
from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, Source
from autofit.job.target import Target
from autofit.job.train_spec import TrainSpec, make_spec
from autofit.units import format_size, parse_size
from autofit.version import __version__

if _TYPE_CHECKING:
    from autofit.guard import GuardGaveUp, OomGuard
    from autofit.pipelines.dry_run import DryRunReport, dry_run
    from autofit.pipelines.tune import autofit
    from autofit.plan import Plan
    from autofit.search.options import SearchOptions

# Imported on first use: a probe process (`python -m autofit.probe.child`, one per probe and rank) and the CLI
# start without the estimator, the search, optuna and the guard, which they do not run.
_LAZY = {"DryRunReport": "autofit.pipelines.dry_run", "dry_run": "autofit.pipelines.dry_run",
         "GuardGaveUp": "autofit.guard", "OomGuard": "autofit.guard", "Plan": "autofit.plan",
         "autofit": "autofit.pipelines.tune", "SearchOptions": "autofit.search.options"}


def __getattr__(name: str) -> object:
    """The public names of `_LAZY`, imported from their module on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'autofit' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = ["ActivationOffload", "Attention", "AutofitError", "Checkpointing", "Config", "DryRunReport", "Engine", "GuardGaveUp",
           "Loss", "MissingExtraError", "Offload", "OomGuard", "Optimizer", "OptimizerStep", "Plan", "Precision", "Prepared", "ProbeResult", "ProbeStatus",
           "Quantization", "SearchOptions", "Sharding", "Skip", "Source", "Target", "TrainSpec", "UsageError", "__version__",
           "autofit", "dry_run", "format_size", "make_spec", "parse_size", "prepare"]
