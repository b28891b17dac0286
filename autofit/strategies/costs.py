"""What a strategy's step-time hooks read (`Strategy.collective_seconds`, `offload_seconds`, `host_ops`,
`step_ops`, `extra_flops`): the links a collective may cross and one step's figures, as the dry-run's cost
model (`autofit.estimate.cost_model`) hands them over. A record of facts in the strategies' layer, so that a
strategy contributes its term of the step time with nothing imported from the estimator above it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable


@dataclasses.dataclass(frozen=True)
class Links:
    """What a collective may cross, in B/s each GPU sends: its interconnect within a node, and its share of
    the network across nodes (None on one node)."""

    within: float
    across: float | None
    nodes: int = 1

    def ring(self, ranks: int, nbytes: float, spans_nodes: bool) -> tuple[float, float]:
        """(within-node, across-node) seconds of one ring all-gather or reduce-scatter of `nbytes` over
        `ranks` GPUs: each sends (ranks - 1) / ranks of it, at the slowest link the ring crosses."""
        if ranks < 2:
            return 0.0, 0.0
        share = (ranks - 1) / ranks * nbytes
        if spans_nodes and self.nodes > 1:
            return 0.0, share / min(self.within, self.across or self.within)
        return share / self.within, 0.0


def times(count: float, seconds: tuple[float, float]) -> tuple[float, float]:
    """(within, across) `seconds` of one collective, `count` times."""
    return count * seconds[0], count * seconds[1]


def summed(collectives: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(within, across) seconds of `collectives` in sequence (0 each for none)."""
    collectives = list(collectives)
    return sum(w for w, _ in collectives), sum(a for _, a in collectives)


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """One optimizer step's figures as the cost model found them, for the strategies' step-time hooks."""

    facts: Any  # the model's parameter counts by role (`autofit.estimate.facts.ModelFacts`), elements
    links: Links  # what the step's collectives cross
    pcie: float  # B/s between the host and one GPU, each way
    half: int  # bytes of a parameter in the compute dtype: 2 in bf16/fp16, 4 in fp32
    trained: float  # parameters that train (elements): the model's trainable ones, or what `Strategy.trains` says
    tensors: int  # parameter tensors that train (an engine's or an optimizer's per-tensor work runs for each)
    grad_bytes: float  # bytes of the gradients the step reduces
    weight_bytes: float  # bytes of the whole model's weights in the compute dtype (what a gather moves)
    hf: Any = None  # the model's Hugging Face config; None for a model of your own
    tokens: int = 1  # positions of the loss per sample (1 without a sequence axis)
