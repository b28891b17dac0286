"""Rung 4, smaller micro-batch with gradient accumulation: the global batch is kept exactly.

Buys activation memory in proportion to the micro-batch; costs GPU utilisation (tier 0: the gradient
is the same mean over the same samples; tier 1 for a model with batch norm, whose statistics are then
taken over fewer samples, and for a loss that couples samples, such as a contrastive loss's negatives:
`autofit.batches.coupling`). A model with batch norm is offered 2 samples at least. With no global batch
given, sizes are powers of two and the search looks for the fastest micro-batch at accumulation 1, as
batch-size finders do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autofit.config import Config
from autofit.strategies.base import Option, Strategy

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.run import TrainRun


class MicroBatch(Strategy):
    """Micro-batch sizes that divide the per-rank batch, largest first."""

    field = "micro_batch_size"
    rung = 4
    order = 0
    activation_knobs = ("micro_batch_size", "grad_accum_steps")

    @classmethod
    def required(cls) -> "MicroBatch":
        """Every run has a micro-batch size."""
        return cls()

    def options(self, spec: "TrainSpec") -> list[Option]:
        """Sizes from the largest down to the model's least (`ModelInfo.smallest_micro_batch`: 2 with batch
        norm), or the per-rank batch alone where it is smaller."""
        least = spec.model.smallest_micro_batch
        if spec.global_batch_size is None:
            sizes = [2**i for i in range(spec.max_micro_batch.bit_length()) if 2**i <= spec.max_micro_batch]
            return [Option(m, 0, f"micro-batch {m}, accumulation 1") for m in reversed(sizes)
                    if m >= min(least, spec.max_micro_batch)]
        per_rank = spec.global_batch_size // spec.num_gpus
        return [self._accumulated(spec, m, per_rank) for m in range(per_rank, 0, -1)
                if per_rank % m == 0 and m >= min(least, per_rank)]

    @staticmethod
    def _accumulated(spec: "TrainSpec", m: int, per_rank: int) -> Option:
        """Micro-batch `m` accumulated to the rank's batch: a numerics change (tier 1) where batch norm then
        takes its statistics over fewer samples than the rank's, or the loss couples samples (a contrastive
        loss's negatives: `TrainSpec.sample_coupling`)."""
        reason = f"{m} x {per_rank // m} accumulation steps = {per_rank} per rank"
        samples = f"over {m} sample{'s' * (m > 1)}, not {per_rank}"
        changes = [f"batch norm's statistics {samples}"] if spec.model.batch_norm else []
        changes += [f"the loss {samples}: {spec.sample_coupling}"] if spec.sample_coupling else []
        if changes and m < per_rank:
            return Option(m, 1, "; ".join([reason, *changes]))
        return Option(m, 0, reason)

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return a.micro_batch_size <= b.micro_batch_size

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        return {}  # the estimator simulates each micro-batch it needs, whatever the config's

    def apply(self, run: "TrainRun") -> None:
        # The probe slices micro-batches of this size (the estimator simulates each size it needs; the guard
        # slices its own); the identity below is the rung's promise.
        if run.simulated or run.live:
            return
        config = run.config
        expected = run.spec.global_batch_size or config.micro_batch_size * config.num_gpus
        if config.global_batch_size != expected:
            raise ValueError(f"{config.describe()} does not multiply out to the global batch {expected}")
