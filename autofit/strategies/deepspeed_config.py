"""DeepSpeed's config dict: what `deepspeed.initialize(config=...)` reads for a configuration.

`deepspeed_config(config, buffers=...)` is the single source of that dict: the ZeRO probe trains with it,
the export writes it and the estimator counts its buffers, so the launched job runs what was measured.
The buffers are sized for the model and the budget (`Buffers`), the way the Hugging Face integration
fills its "auto" values; DeepSpeed's own defaults (5e8-element buckets, 2 GB at fp32) are sized for
billions of parameters and would dwarf a small model's states.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from autofit.config import Config, Optimizer, Precision
from autofit.errors import UsageError
from autofit.strategies.base import set_nested
from autofit.strategies.optimizer import DEFAULTS, torch_name
from autofit.strategies.run import DEFAULT_GRADIENT_CLIPPING

FILENAME = "deepspeed.json"  # the file the exports write this config to, beside their own

# autofit's flat names -> DeepSpeed's nested keys, in one table (accelerate's DeepSpeedPlugin does the same).
KEYS = {
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "grad_accum_steps": "gradient_accumulation_steps",
    "global_batch_size": "train_batch_size",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer": "zero_optimization.offload_optimizer",
    "offload_param": "zero_optimization.offload_param",
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
                live = min(live, int(LIVE_SHARE * self.memory_budget) // (2 if config.half_precision else 4))
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


def buffers_for(summary: dict[str, Any]) -> Buffers | None:
    """The `Buffers` of a spec summary (a plan's `spec`): None for plans that predate them (no hidden size)."""
    hidden = summary.get("hidden_size")
    return Buffers(int(hidden), summary.get("memory_budget")) if hidden else None


def _even(elements: int) -> int:
    """DeepSpeed asserts the all-gather bucket is a multiple of its NCCL alignment factor (2)."""
    return max(2, elements + elements % 2)


# precision -> DeepSpeed's section. fp16 uses dynamic loss scaling (loss_scale 0), as GradScaler does.
PRECISION = {
    Precision.FP32.value: {},
    Precision.BF16.value: {"bf16": {"enabled": True}},
    Precision.FP16.value: {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}},
}

# The optimizers DeepSpeed builds itself from its config (with ZeRO-Offload it swaps in its CPU Adam), with
# the hyperparameters the probe used (`hyperparameters`: the user's, else torch's defaults). A type
# DeepSpeed does not know by name is looked up in torch.optim (deepspeed/runtime/engine.py,
# _configure_basic_optimizer: `getattr(torch.optim, self.optimizer_name())`), which is how Adafactor is named. bitsandbytes' 8-bit optimizers have no name
# there: the `deepspeed` format refuses them (`OptimizerStates.refuses`); a user's own optimizer is passed to
# deepspeed.initialize(optimizer=...) by the script.
DEEPSPEED_OPTIMIZERS = {
    # torch_adam: torch's AdamW, not DeepSpeed's FusedAdam, which is compiled with nvcc on first use
    # (deepspeed/runtime/engine.py, get_optimizer_configuration: `torch_adam` is read before the offload
    # check, so it is only set without offload, where DeepSpeed's CPU Adam steps on the host).
    Optimizer.ADAMW.value: "AdamW",
    Optimizer.ADAFACTOR.value: "Adafactor",  # torch.optim.Adafactor
}

# torch optimizers a plan tuned with your own may name: DeepSpeed looks a type it does not know up in
# torch.optim (see above); Adagrad is left out, as DeepSpeed reads "adagrad" as its own CPU Adagrad.
TORCH_BY_NAME = ("SGD", "RMSprop")

# offload value -> where (optimizer states, parameters) go. Parameters can only leave the GPU at ZeRO-3.
OFFLOAD = {"none": None, "cpu": "cpu", "nvme": "nvme"}



def deepspeed_config(config: Config, *, nvme_path: str | None = None, buffers: Buffers | None = None,
                     gradient_clipping: float = DEFAULT_GRADIENT_CLIPPING,
                     hyperparameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict for `config` (what `deepspeed.initialize(config=...)` takes).

    Args:
        config: the autofit configuration (micro-batch, accumulation, precision, ZeRO stage, offload).
        nvme_path: folder for NVMe offload; required when `config.offload == "nvme"`.
        buffers: bucket sizes for the model and budget; None leaves DeepSpeed's defaults.
        gradient_clipping: max global gradient norm (0 disables clipping).
        hyperparameters: the optimizer's (lr, betas, eps, weight_decay); None: the optimizer's defaults.
    """
    flat: dict[str, Any] = {
        "micro_batch_size": config.micro_batch_size,
        "grad_accum_steps": config.grad_accum_steps,
        "global_batch_size": config.global_batch_size,
        "zero_stage": config.zero_stage,
        "gradient_clipping": gradient_clipping,
        **_offload(config, nvme_path),
        **(buffers.elements(config) if buffers is not None else {}),
    }
    out: dict[str, Any] = {}
    for name, value in flat.items():
        set_nested(out, KEYS[name], value)
    out.update(PRECISION[config.precision])
    name = DEEPSPEED_OPTIMIZERS.get(config.optimizer)
    if name is not None:
        params = {**DEFAULTS[config.optimizer], **(hyperparameters or {})}
        out["optimizer"] = {"type": name, "params": json.loads(json.dumps(params))}  # a copy: callers may edit theirs
        if config.optimizer is Optimizer.ADAMW and not config.offloads:
            # torch's fused AdamW: one kernel over the flat fp32 partition, no temporaries (the
            # single-tensor path makes two of the partition's size, the foreach path one); the
            # keys DeepSpeed does not read go to the constructor (engine.py, _configure_basic_optimizer)
            out["optimizer"]["params"].update(torch_adam=True, fused=True)
    if config.zero_stage and config.optimizer is not Optimizer.ADAMW:
        out["zero_allow_untested_optimizer"] = True  # ZeRO tests its own Adam types; others run as they are
    return out


def _offload(config: Config, nvme_path: str | None) -> dict[str, Any]:
    device = OFFLOAD[config.offload]
    if device is None:
        return {}
    if config.zero_stage == 0:
        raise UsageError(f"offload={config.offload!r} needs ZeRO (zero_stage 1-3) but zero_stage is 0; "
                         "set zero_stage, e.g. 2 for optimizer offload or 3 to offload parameters too.")
    target: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        if not nvme_path:
            raise UsageError("offload='nvme' needs a folder on a fast local disk: pass nvme_path=... "
                             "(autofit.autofit(nvme_path=...), autofit tune --nvme-path DIR).")
        target["nvme_path"] = str(nvme_path)
    flat = {"offload_optimizer": dict(target)}
    if config.zero_stage == 3:
        flat["offload_param"] = dict(target)
    return flat




def plan_config(config: Config, settings: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """`deepspeed_config` of a saved plan: its NVMe folder and buffers from its spec `summary` (`Plan.spec`),
    the hyperparameters its probes' optimizer was built with from its `settings` (`Plan.settings`), and your
    own torch optimizer by name where DeepSpeed builds it so (`TORCH_BY_NAME`)."""
    recorded = settings.get("optimizer", {})
    out = deepspeed_config(config, nvme_path=summary.get("nvme_path"), buffers=buffers_for(summary),
                           hyperparameters=recorded.get("kwargs"))
    if torch_name(recorded) in TORCH_BY_NAME:  # your own torch optimizer, which DeepSpeed builds by name
        out["optimizer"] = {"type": torch_name(recorded), "params": dict(recorded["kwargs"])}
    return out


def accelerate_section(config: Config, nvme_path: str | None) -> dict[str, Any]:
    """accelerate's flat DeepSpeed keys for `config` (it maps them to DeepSpeed's nested ones itself)."""
    device = OFFLOAD.get(config.offload) or "none"
    section: dict[str, Any] = {
        "zero_stage": config.zero_stage,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "gradient_clipping": DEFAULT_GRADIENT_CLIPPING,
        "offload_optimizer_device": device,
        "offload_param_device": device if config.zero_stage == 3 else "none",
        "zero3_init_flag": config.zero_stage == 3,
    }
    if device == "nvme" and nvme_path:
        section["offload_optimizer_nvme_path"] = str(nvme_path)
        if config.zero_stage == 3:
            section["offload_param_nvme_path"] = str(nvme_path)
    if config.zero_stage == 3:
        section["zero3_save_16bit_model"] = True
    return section
