"""DeepSpeed's config dict: what `deepspeed.initialize(config=...)` reads for a configuration.

`deepspeed_config(config, buffers=...)` is the single source of that dict: the ZeRO probe trains with it,
the export writes it and the estimator counts its buffers, so the launched job runs what was measured.
It writes the skeleton (batch sizes, ZeRO stage, clipping, buffers) and merges the sections each strategy
owns (`Strategy.deepspeed_keys`: the precision's bf16/fp16, the optimizer's, the offload targets), naming
no technique of its own.
The buffers are sized for the model and the budget (`Buffers`), the way the Hugging Face integration
fills its "auto" values; DeepSpeed's own defaults (5e8-element buckets, 2 GB at fp32) are sized for
billions of parameters and would dwarf a small model's states.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from autofit.config import Config
from autofit.strategies.base import EngineInputs, Strategy, set_nested
from autofit.strategies.run import DEFAULT_GRADIENT_CLIPPING

FILENAME = "deepspeed.json"  # the file the exports write this config to, beside their own

# autofit's flat names -> DeepSpeed's nested keys, in one table (accelerate's DeepSpeedPlugin does the same).
KEYS = {
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "grad_accum_steps": "gradient_accumulation_steps",
    "global_batch_size": "train_batch_size",
    "zero_stage": "zero_optimization.stage",
    "gradient_clipping": "gradient_clipping",
    "reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "allgather_bucket_size": "zero_optimization.allgather_bucket_size",
    "prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
}

# DeepSpeed 0.19.8's defaults, in elements (deepspeed/runtime/zero/config.py: reduce_bucket_size l.113,
# allgather_bucket_size l.132, prefetch_bucket_size l.222, param_persistence_threshold l.228,
# max_live_parameters l.245). What a config without `Buffers` gets.
DEEPSPEED_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                      "prefetch_bucket_size": 50_000_000, "param_persistence_threshold": 100_000,
                      "max_live_parameters": 1_000_000_000, "max_reuse_distance": 1_000_000_000}
LIVE_SHARE = 0.1  # ZeRO-3 keeps at most this share of the budget in gathered parameters (see `Buffers`)
STAGE3_ONLY = ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance")


@dataclasses.dataclass(frozen=True)
class Buffers:
    """DeepSpeed's communication buffers sized for one model and budget, as the Hugging Face integration's
    "auto" values are (transformers/integrations/deepspeed.py, `trainer_config_finalize`): reduce and
    all-gather buckets of hidden^2 elements, a ZeRO-3 prefetch bucket of 0.9 hidden^2, parameters under
    10 hidden elements kept whole on every rank, and at most `LIVE_SHARE` of the budget in gathered
    ZeRO-3 parameters; a gathered parameter is kept for reuse only within one prefetch bucket (DeepSpeed's
    default reuse distance, 1e9, keeps every parameter gathered from forward to backward: ZeRO-3 would
    then hold the whole model again). None of it changes the math (tier 0)."""

    hidden_size: int  # the model's width (elements)
    memory_budget: int | None = None  # bytes per device; None leaves DeepSpeed's live-parameter bound

    def elements(self, config: Config) -> dict[str, int]:
        """Flat name (a `KEYS` entry) -> elements, for `config`'s ZeRO stage (empty without ZeRO)."""
        if not config.zero_stage:
            return {}
        square = _even(self.hidden_size * self.hidden_size)
        out = {"reduce_bucket_size": square, "allgather_bucket_size": square}
        if config.zero_stage == 3:
            live = DEEPSPEED_DEFAULTS["max_live_parameters"]
            if self.memory_budget:
                live = min(live, int(LIVE_SHARE * self.memory_budget) // half_bytes(config))
            prefetch = _even(int(0.9 * square))
            out.update(prefetch_bucket_size=prefetch, param_persistence_threshold=10 * self.hidden_size,
                       max_live_parameters=live, max_reuse_distance=prefetch)
        return out


def deepspeed_elements(config: Config, buffers: Buffers | None) -> dict[str, int]:
    """The buffer sizes (elements, by flat name) DeepSpeed runs `config` with: `buffers`' or its defaults."""
    if not config.zero_stage:
        return {}
    sized = buffers.elements(config) if buffers is not None else {}
    keys = [k for k in DEEPSPEED_DEFAULTS if config.zero_stage == 3 or k not in STAGE3_ONLY]
    return {k: sized.get(k, DEEPSPEED_DEFAULTS[k]) for k in keys}


def half_bytes(config: Config) -> int:
    """Bytes of a parameter as DeepSpeed trains it: 2 where a strategy makes the step compute in a 16-bit
    dtype (`Strategy.compute_dtype`: DeepSpeed's bf16/fp16 mode), else 4 (fp32)."""
    from autofit.strategies import compute_dtype

    return 4 if compute_dtype(config) is None else 2


def buffers_for(summary: dict[str, Any]) -> Buffers | None:
    """The `Buffers` of a spec summary (a plan's `spec`): None for plans that predate them (no hidden size)."""
    hidden = summary.get("hidden_size")
    return Buffers(int(hidden), summary.get("memory_budget")) if hidden else None


def _even(elements: int) -> int:
    """DeepSpeed asserts the all-gather bucket is a multiple of its NCCL alignment factor (2)."""
    return max(2, elements + elements % 2)


def deepspeed_config(config: Config, *, nvme_path: str | None = None, buffers: Buffers | None = None,
                     gradient_clipping: float = DEFAULT_GRADIENT_CLIPPING,
                     hyperparameters: dict[str, Any] | None = None,
                     strategies: Sequence[Strategy] | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict for `config` (what `deepspeed.initialize(config=...)` takes): the skeleton
    (batch sizes, ZeRO stage, clipping, buffers) with every strategy's sections merged in, in rung order
    (`Strategy.deepspeed_keys`: the precision's, the optimizer's, the offload targets).

    Args:
        config: the autofit configuration (micro-batch, accumulation, precision, ZeRO stage, offload).
        nvme_path: folder for NVMe offload; required when `config` offloads to NVMe.
        buffers: bucket sizes for the model and budget; None leaves DeepSpeed's defaults.
        gradient_clipping: max global gradient norm (0 disables clipping).
        hyperparameters: the optimizer's (lr, betas, eps, weight_decay); None: the plan's (`strategies`) or
            the optimizer's defaults.
        strategies: the strategies whose keys are merged, a saved plan's as it recorded them (`for_plan`);
            None: every built-in and plug-in one (`completed`).
    """
    from autofit.strategies import completed

    flat: dict[str, Any] = {
        "micro_batch_size": config.micro_batch_size,
        "grad_accum_steps": config.grad_accum_steps,
        "global_batch_size": config.global_batch_size,
        "zero_stage": config.zero_stage,
        "gradient_clipping": gradient_clipping,
    }
    out: dict[str, Any] = {}
    for name, value in flat.items():
        set_nested(out, KEYS[name], value)
    inputs = EngineInputs(nvme_path, hyperparameters)
    for strategy in completed() if strategies is None else strategies:
        for dotted, value in strategy.deepspeed_keys(config, inputs).items():
            set_nested(out, dotted, value)
    for name, value in (buffers.elements(config) if buffers is not None else {}).items():
        set_nested(out, KEYS[name], value)
    return out
