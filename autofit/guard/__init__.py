"""Keeping a running job alive: the OOM guard steps down on an out-of-memory error inside the step and
goes on, losing no samples (`core`); integrations for accelerate and the Hugging Face Trainer.
"""

from autofit.guard.core import GuardGaveUp, OomGuard, Recovery, RecoveryAction, StepReport

__all__ = ["GuardGaveUp", "OomGuard", "Recovery", "RecoveryAction", "StepReport"]
