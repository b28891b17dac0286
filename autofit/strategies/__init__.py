"""The decision tree's techniques, one module each, in DESIGN.md's rung order."""

from autofit.strategies.attention import Attention
from autofit.strategies.base import Option, Strategy
from autofit.strategies.checkpointing import Checkpointing
from autofit.strategies.fsdp import Fsdp
from autofit.strategies.lora import Lora
from autofit.strategies.micro_batch import MicroBatch
from autofit.strategies.offload import Offload
from autofit.strategies.optimizer import OptimizerStates
from autofit.strategies.precision import Precision
from autofit.strategies.quantization import Quantization
from autofit.strategies.zero import Zero, installed_version


def default_strategies(engine: str = "auto") -> list[Strategy]:
    """One instance of every strategy, in rung order. `engine` picks the sharding rung: "deepspeed"
    (ZeRO), "fsdp" (FSDP2), or "auto" = DeepSpeed when it is installed, else FSDP2."""
    if engine not in ("auto", "deepspeed", "fsdp"):
        from autofit.errors import UsageError

        raise UsageError(f"engine={engine!r} is not known; use 'auto', 'deepspeed' or 'fsdp'.")
    use_zero = engine == "deepspeed" or (engine == "auto" and installed_version() is not None)
    # Quantization before Lora (same rung): the adapters go on the quantized layers.
    return sorted([Precision(), Attention(), Checkpointing(), MicroBatch(), OptimizerStates(),
                   Zero() if use_zero else Fsdp(), Quantization(), Lora(), Offload()], key=lambda s: s.rung)


__all__ = ["Attention", "Checkpointing", "Fsdp", "Lora", "MicroBatch", "Offload", "Option", "OptimizerStates",
           "Precision", "Quantization", "Strategy", "Zero", "default_strategies"]
