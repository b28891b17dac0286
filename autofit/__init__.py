"""autofit: find the fastest way to train a PyTorch model on given hardware without running out of memory.

    plan = autofit.autofit(make_model, make_batch, global_batch_size=32, memory_budget="6GiB")
    plan.fits, plan.config, plan.throughput, plan.peak_memory, plan.probes
"""

from autofit.config import Config, Optimizer, Precision
from autofit.estimate.dry_run import DryRunReport, dry_run
from autofit.errors import AutofitError, MissingExtraError, UsageError
from autofit.guard.core import GuardGaveUp, OomGuard
from autofit.plan import Plan
from autofit.probe.run import ProbeResult, ProbeStatus
from autofit.spec.train import TrainSpec, make_spec
from autofit.search.tuner import autofit
from autofit.units import format_size, parse_size

__version__ = "0.1.0"

__all__ = ["AutofitError", "Config", "DryRunReport", "dry_run", "GuardGaveUp", "MissingExtraError", "OomGuard", "Optimizer", "Plan", "Precision", "ProbeResult",
           "ProbeStatus", "TrainSpec", "UsageError", "__version__", "autofit", "format_size", "make_spec",
           "parse_size"]
