"""The decision tree's techniques, one module each, in DESIGN.md's rung order."""

from autofit.strategies.attention import Attention
from autofit.strategies.base import Option, Strategy
from autofit.strategies.checkpointing import Checkpointing
from autofit.strategies.lora import Lora
from autofit.strategies.micro_batch import MicroBatch
from autofit.strategies.optimizer import OptimizerStates
from autofit.strategies.precision import Precision
from autofit.strategies.quantization import Quantization


def default_strategies() -> list[Strategy]:
    """One instance of every strategy, in rung order."""
    # Quantization before Lora (same rung): the adapters go on the quantized layers.
    return sorted([Precision(), Attention(), Checkpointing(), MicroBatch(), OptimizerStates(),
                   Quantization(), Lora()], key=lambda s: s.rung)


__all__ = ["Attention", "Checkpointing", "Lora", "MicroBatch", "Option", "OptimizerStates", "Precision",
           "Quantization", "Strategy", "default_strategies"]
