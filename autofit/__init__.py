"""autofit: find the fastest way to train a PyTorch model on given hardware without running out of memory.

    plan = autofit.autofit(make_model, make_batch, global_batch_size=32, memory_budget="6GiB")
    plan.fits, plan.config, plan.throughput, plan.peak_memory, plan.probes

The flow (docs/design.md), bottom to top: `devices`, `models`, `batches` and `job` (what the user asked, the
Target) -> `strategies` (one file per technique, the `TrainRun` they change) -> `probe` (real steps,
outcomes, the launcher) -> `estimate` (predicted peaks) -> `search` (space, rules, walk, confirmation,
decision, trials) -> `pipelines` (`tune`, `dry_run`) with `plan`, `export`, `report`, `prepare` and `guard`
(keeps a running job alive) -> `cli`.
"""

from autofit.config import (ActivationOffload, Attention, Checkpointing, Config, Engine, Loss, Offload, Optimizer,
                            OptimizerStep, Precision, Quantization, Sharding)
from autofit.errors import AutofitError, MissingExtraError, UsageError
from autofit.pipelines.dry_run import DryRunReport, dry_run
from autofit.guard import GuardGaveUp, OomGuard
from autofit.plan import Plan
from autofit.prepare import Prepared, prepare
from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, Source
from autofit.pipelines.tune import autofit
from autofit.search.options import SearchOptions
from autofit.job.target import Target
from autofit.job.train_spec import TrainSpec, make_spec
from autofit.units import format_size, parse_size
from autofit.version import __version__


__all__ = ["ActivationOffload", "Attention", "AutofitError", "Checkpointing", "Config", "DryRunReport", "Engine", "GuardGaveUp",
           "Loss", "MissingExtraError", "Offload", "OomGuard", "Optimizer", "OptimizerStep", "Plan", "Precision", "Prepared", "ProbeResult", "ProbeStatus",
           "Quantization", "SearchOptions", "Sharding", "Skip", "Source", "Target", "TrainSpec", "UsageError", "__version__",
           "autofit", "dry_run", "format_size", "make_spec", "parse_size", "prepare"]
