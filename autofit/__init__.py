"""autofit: find the fastest way to train a PyTorch model on given hardware without running out of memory.

    plan = autofit.autofit(make_model, make_batch, global_batch_size=32, memory_budget="6GiB")
    plan.fits, plan.config, plan.throughput, plan.peak_memory, plan.probes

The flow (DESIGN.md), one package per step: `spec` (what the user asked, the Target) -> `strategies` ->
`search` (space, rules, walk, trials) with `estimate` (predicted peaks, dry-run) -> `probe` (real
steps, outcomes, the launcher) -> `plan` -> `export` / `report`; `guard` keeps a running job alive.
"""

from autofit.config import (ActivationOffload, Attention, Checkpointing, Config, Engine, Loss, Offload, Optimizer,
                            OptimizerStep, Precision, Quantization, Sharding)
from autofit.errors import AutofitError, MissingExtraError, UsageError
from autofit.estimate.dry_run import DryRunReport, dry_run
from autofit.guard import GuardGaveUp, OomGuard
from autofit.plan import Plan
from autofit.prepare import Prepared, prepare
from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, Source
from autofit.search.tuner import autofit
from autofit.spec.target import Target
from autofit.spec.train import TrainSpec, make_spec
from autofit.units import format_size, parse_size

__version__ = "0.1.0"

__all__ = ["ActivationOffload", "Attention", "AutofitError", "Checkpointing", "Config", "DryRunReport", "Engine", "GuardGaveUp",
           "Loss", "MissingExtraError", "Offload", "OomGuard", "Optimizer", "OptimizerStep", "Plan", "Precision", "Prepared", "ProbeResult", "ProbeStatus",
           "Quantization", "Sharding", "Skip", "Source", "Target", "TrainSpec", "UsageError", "__version__",
           "autofit", "dry_run", "format_size", "make_spec", "parse_size", "prepare"]
