"""The decision tree's techniques, one module each, in DESIGN.md's rung order."""

from autofit.strategies.attention import Attention
from autofit.strategies.base import Option, Strategy
from autofit.strategies.checkpointing import Checkpointing
from autofit.strategies.micro_batch import MicroBatch
from autofit.strategies.optimizer import OptimizerStates
from autofit.strategies.precision import Precision


def default_strategies() -> list[Strategy]:
    """One instance of every strategy, in rung order."""
    return sorted([Precision(), Attention(), Checkpointing(), MicroBatch(), OptimizerStates()],
                  key=lambda s: s.rung)


__all__ = ["Attention", "Checkpointing", "MicroBatch", "Option", "OptimizerStates", "Precision", "Strategy",
           "default_strategies"]
