"""What a strategy's `memory` hook reads and returns: a candidate's predicted bytes per device, by what
holds them (the estimator's `Estimate.breakdown`)."""

from __future__ import annotations

import dataclasses

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
