"""What a strategy's memory hooks read and return: a candidate's predicted bytes per device, by what holds
them (`memory`, the estimator's `Estimate.breakdown`), and an engine's own bytes by phase (`engine_memory`)."""

from __future__ import annotations

import dataclasses
from typing import Any

# The simulated fact (`Strategy.simulated_as`, left out of the simulation's key by its "_") naming how the CUDA
# caching allocator takes segments, which the estimator replays the step's events through: "expandable"
# (expandable segments) or absent (PyTorch's default fixed segments).
SEGMENTS_FACT = "_segments"


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Bytes per device, by what holds them."""

    params: int  # the partitioned (or whole) weights and the buffers: with grads and optimizer, the model states
    grads: int
    optimizer: int  # states and the optimizer step's temporaries
    activations: int
    overhead: int
    gathered: int = 0  # ZeRO-3 / FSDP2: full weights gathered for the blocks in use (and their unsharded grads)

    @property
    def total(self) -> int:
        """Sum of the parts (bytes)."""
        return self.params + self.grads + self.optimizer + self.activations + self.overhead + self.gathered

    def to_dict(self) -> dict[str, int]:
        """JSON form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """Bytes per rank an engine adds to the model states, by when they are live (`Strategy.engine_memory`;
    `autofit.estimate.engines`)."""

    held: int = 0  # from the engine's construction on
    backward: int = 0  # while gradients are made
    step: int = 0  # in the optimizer step
    epilogue: int = 0  # after the last backward, before the step: no activations left, no optimizer temporaries yet
    grads_held: bool = False  # the gradients live from the start (DDP's bucket views), not made in the backward
    terms: tuple[tuple[str, int], ...] = ()  # named parts (bytes), for the estimate's breakdown
    note: str = ""


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What an engine's memory hook (`Strategy.engine_memory`) reads, as the estimator found it."""

    facts: Any  # the model's parameter counts by role (`autofit.estimate.facts.ModelFacts`), elements
    summary: dict[str, Any]  # the spec's summary (`TrainSpec.summary`): the hidden size an engine sizes buffers by
    state_grads: int  # bytes of the gradients the model-state formulas count per rank (`autofit.estimate.states`)
    recomputes: bool = False  # the backward recomputes checkpointed blocks (`Strategy.recomputed_blocks`)

    def tied_grad(self, nbytes: int) -> int:
        """A tied weight's first gradient (GPT-2's head, made first in the backward), whole, while the backward
        recomputes checkpointed blocks: it is only reduced once the embedding's gradient has arrived, at the
        end. Without checkpointing the peak comes before it is made. (Measured on CPU ranks; the simulation
        drops weight gradients as they are made, so it cannot see this one.)"""
        return nbytes * self.facts.tied_params if self.recomputes else 0
