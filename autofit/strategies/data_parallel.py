"""Plain data parallelism (torch DDP): every rank holds the whole model; gradients are all-reduced.

The `num_gpus` knob has one value, the spec's rank count; this strategy wraps the model in
`DistributedDataParallel` when there are several ranks and no sharding engine. Buys throughput, not
memory; same math (tier 0). Over several nodes its option sets `nodes` too, which hierarchical sharding
reads (`Config.shard_ranks`).

DDP all-reduces gradients through flat buckets; by default they are a second copy of every gradient.
With `gradient_as_bucket_view=True` the gradients are views into the buckets, so that copy is gone at
no cost (torch's DDP docs: "saves a memory size equal to the total gradients size"); the buckets then
hold the gradients from the wrap on, even between steps (`zero_grad(set_to_none=True)` drops the views,
not the buckets). The probe wraps that way, the estimator models it so, and the exports say so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autofit.config import Config
from autofit.strategies.base import Option, Placement, Strategy

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.run import TrainRun


class DataParallel(Strategy):
    """num_gpus data-parallel ranks."""

    field = "num_gpus"
    rung = 6
    order = 2

    @classmethod
    def required(cls) -> "DataParallel":
        """Every run has a rank count."""
        return cls()

    def options(self, spec: "TrainSpec") -> list[Option]:
        count, nodes = spec.target.count, spec.target.nodes
        if nodes > 1:  # the node count travels with the rank count: hierarchical sharding reads it
            return [Option(count, 0, f"{count} data-parallel ranks on {nodes} nodes of {spec.target.per_node}",
                           also=(("nodes", nodes),))]
        return [Option(count, 0, f"{count} data-parallel ranks" if count > 1 else "one device")]

    def placement(self, config: Config) -> Placement:
        """Several ranks run as launched ranks with a process group."""
        return Placement.RANKS if config.num_gpus > 1 else Placement.IN_PROCESS

    def apply(self, run: "TrainRun") -> None:
        if run.config.num_gpus < 2 or run.live:  # the guard runs DDP steps itself
            return
        if run.simulated:
            run.tie_weights = False  # each rank's step, as DDP's buckets and the engines hold a tied weight
        elif run.engine_factory is None:  # no sharding engine applied before this rung's last strategy
            run.engine_factory = wrap  # last, once every strategy has shaped the model (LoRA adapters)

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        return {"_untied": True} if config.num_gpus > 1 else {}


def wrap(run: "TrainRun") -> None:
    """Place the model and wrap it in DDP; training stays torch's backward and optimizer step."""
    from torch.nn.parallel import DistributedDataParallel

    run.model.to(run.device)
    run.placed = True
    ids = [run.device.index] if run.device.type == "cuda" else None
    run.model = DistributedDataParallel(run.model, device_ids=ids, **DDP_KWARGS)


DDP_KWARGS = {"gradient_as_bucket_view": True}  # gradients live in the all-reduce buckets: no second copy

