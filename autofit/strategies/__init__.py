"""Step 2 of the flow (DESIGN.md): the decision tree's techniques, one module each, in rung order.

Each offers its options for a spec's `Target`; `autofit.search.space` lays them out as candidates.
"""

from autofit.errors import UsageError
from autofit.strategies.activation_offload import ActivationOffload
from autofit.strategies.attention import Attention
from autofit.strategies.base import Option, Placement, Strategy, plugins
from autofit.strategies.checkpointing import Checkpointing
from autofit.strategies.chunked_loss import ChunkedLoss
from autofit.strategies.data_parallel import DataParallel
from autofit.strategies.fsdp import Fsdp
from autofit.strategies.lora import Lora
from autofit.strategies.micro_batch import MicroBatch
from autofit.strategies.offload import Offload
from autofit.strategies.optimizer import OptimizerStates
from autofit.strategies.optimizer_in_backward import OptimizerInBackward
from autofit.strategies.precision import Precision
from autofit.strategies.pure_bf16 import PureBf16
from autofit.strategies.quantization import Quantization
from autofit.strategies.zero import Zero

ENGINES = ("auto", "deepspeed", "fsdp")


def default_strategies(engine: str = "auto") -> list[Strategy]:
    """One instance of every strategy, in rung order. `engine` pins the sharding rung: "deepspeed"
    (ZeRO), "fsdp" (FSDP2), or "auto" = both searched (ZeRO offered where DeepSpeed is installed)."""
    if engine not in ENGINES:
        raise UsageError(f"engine={engine!r} is not known; use one of {', '.join(map(repr, ENGINES))}.")
    engines = [Zero()] * (engine != "fsdp") + [Fsdp()] * (engine != "deepspeed")
    # Quantization before Lora (same rung): the adapters go on the quantized layers. OptimizerInBackward
    # after OptimizerStates (same rung): it runs the chosen optimizer per parameter.
    return sorted([Precision(), PureBf16(), Attention(), ChunkedLoss(), Checkpointing(), ActivationOffload(), MicroBatch(), OptimizerStates(), OptimizerInBackward(), *engines,
                   DataParallel(), Quantization(), Lora(), Offload()], key=lambda s: s.rung)


__all__ = ["ActivationOffload", "Attention", "Checkpointing", "ChunkedLoss", "DataParallel", "Fsdp", "Lora", "MicroBatch", "Offload", "Option",
           "OptimizerInBackward", "OptimizerStates", "Placement", "Precision", "PureBf16", "Quantization", "Strategy", "Zero", "default_strategies",
           "plugins"]
