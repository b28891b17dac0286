"""accelerate config YAML (for `accelerate launch --config_file`) and the launch command beside it.

The YAML holds what accelerate's config file can hold: distributed type, number of processes, mixed
precision, and the DeepSpeed section (ZeRO stage, offload, accumulation, clipping) where ZeRO is used.
Gradient accumulation outside DeepSpeed has no config-file key; the launch script passes it through
`ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, which `Accelerator()` reads; under FSDP2 the script passes
`prepared.gradient_accumulation_plugin()` instead, which also reduces gradients on every micro-batch as
the plan was measured (`sync_each_batch`; accelerate's default holds them unsharded until the last
micro-batch, the whole model's per rank). The micro-batch, checkpointing, optimizer (and the other knobs
accelerate has no key for) reach the script through the plan, written beside the launch script and named
in AUTOFIT_PLAN: `autofit.prepare(os.environ["AUTOFIT_PLAN"], model, engine=False)` applies them with
the probe's code, and `prepared.micro_batch_size` sizes the DataLoader (the same AUTOFIT_* variables as
torchrun.sh are exported too).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autofit.config import Config, Engine, Offload, Precision
from autofit.strategies.deepspeed_config import DEFAULT_GRADIENT_CLIPPING, OFFLOAD
from autofit.export.measured import comment_lines, require_fit, with_plugin_keys
from autofit.export.model_setup import setup_comments

if TYPE_CHECKING:
    from autofit.plan import Plan

FILENAME = "accelerate_config.yaml"
LAUNCH_FILENAME = "accelerate_launch.sh"
PLAN_FILENAME = "plan.json"  # read by autofit.prepare in the training script (AUTOFIT_PLAN)

MIXED_PRECISION = {Precision.FP32.value: "no", Precision.BF16.value: "bf16", Precision.FP16.value: "fp16"}


def applies(plan: "Plan") -> str | None:
    """Why accelerate cannot run `plan` (the optimizer step in backward), or None."""
    if plan.config.steps_in_backward:
        return ("accelerate's optimizer wrapper and clip_grad_norm_ expect whole-model gradients after backward; "
                "the plan steps each parameter inside backward: export torchrun instead")
    return None


def accelerate_config(plan: "Plan") -> dict[str, Any]:
    """The accelerate ClusterConfig fields for `plan` (what the YAML file holds)."""
    require_fit(plan)
    config = plan.config
    on_cpu = str(plan.spec.get("device", "cpu")).startswith("cpu")
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": _distributed_type(config, on_cpu),
        "num_processes": config.num_gpus,
        "num_machines": 1,
        "machine_rank": 0,
        "mixed_precision": MIXED_PRECISION.get(config.precision, "no"),  # pure bf16: cast in the script
        "use_cpu": on_cpu,
        "gpu_ids": "all",
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "downcast_bf16": "no",
        "debug": False,
    }
    if config.zero_stage:
        out["deepspeed_config"] = _deepspeed_section(plan)
    if config.engine is Engine.FSDP:
        out["fsdp_config"] = fsdp_section(config)
    return with_plugin_keys(out, config, "accelerate")


def fsdp_section(config: "Config") -> dict[str, Any]:
    """accelerate's FSDP2 keys: full_shard reshards parameters after forward (~ZeRO-3), shard_grad_op
    keeps them gathered until backward (~ZeRO-2); offload="cpu" is FSDP2's CPUOffloadPolicy."""
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": config.shards_parameters,
        "fsdp_offload_params": config.offload is Offload.CPU,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # the model's repeated blocks, as probed
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
    }


def _distributed_type(config: "Config", on_cpu: bool) -> str:
    if config.zero_stage:
        return "DEEPSPEED"
    if config.engine is Engine.FSDP:
        return "FSDP"
    if config.num_gpus > 1:
        return "MULTI_CPU" if on_cpu else "MULTI_GPU"
    return "NO"


def _deepspeed_section(plan: "Plan") -> dict[str, Any]:
    """accelerate's flat DeepSpeed keys (it maps them to DeepSpeed's nested ones itself)."""
    config = plan.config
    device = OFFLOAD.get(config.offload) or "none"
    section: dict[str, Any] = {
        "zero_stage": config.zero_stage,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "gradient_clipping": DEFAULT_GRADIENT_CLIPPING,
        "offload_optimizer_device": device,
        "offload_param_device": device if config.zero_stage == 3 else "none",
        "zero3_init_flag": config.zero_stage == 3,
    }
    nvme_path = plan.spec.get("nvme_path") or getattr(config, "nvme_path", None)
    if device == "nvme" and nvme_path:
        section["offload_optimizer_nvme_path"] = str(nvme_path)
        if config.zero_stage == 3:
            section["offload_param_nvme_path"] = str(nvme_path)
    if config.zero_stage == 3:
        section["zero3_save_16bit_model"] = True
    return section


def launch_script(plan: "Plan", config_file: str = FILENAME) -> str:
    """A bash script running `accelerate launch` with the exported config, the plan's accumulation, and
    the plan itself (AUTOFIT_PLAN) for `autofit.prepare` in the training script."""
    from autofit.export.torchrun import environment

    lines = ["#!/usr/bin/env bash", *comment_lines(plan),
             "# Usage: bash accelerate_launch.sh train.py [script args]",
             "# In train.py: prepared = autofit.prepare(os.environ[\"AUTOFIT_PLAN\"], model, engine=False) applies the",
             "# micro-batch (prepared.micro_batch_size), checkpointing and optimizer; then accelerator.prepare(...).",
             *_sync_lines(plan.config),
             "set -euo pipefail", 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"']
    if not plan.config.zero_stage:  # DeepSpeed takes accumulation from its section instead
        lines.append(f"export ACCELERATE_GRADIENT_ACCUMULATION_STEPS={plan.config.grad_accum_steps}")
    lines += [f'export {name}="{value}"' if value.startswith("$here") else f"export {name}={shlex.quote(value)}"
              for name, value in environment(plan).items() if name != "AUTOFIT_DEEPSPEED_CONFIG"]
    lines.append(f'exec accelerate launch --config_file "$here/{config_file}" "$@"')
    return "\n".join(lines) + "\n"


def _sync_lines(config: "Config") -> list[str]:
    """What the training script must pass so that accelerate reduces gradients as the plan measured."""
    if not config.needs_sync_each_micro_batch:
        return []
    return ["# FSDP2 with accumulation, measured reducing gradients on every micro-batch: build the accelerator",
            "# with Accelerator(gradient_accumulation_plugin=prepared.gradient_accumulation_plugin()); a plain",
            "# Accelerator() defers the reduce to the last micro-batch and holds every gradient unsharded until then."]


def export(plan: "Plan", out_dir: Path) -> list[Path]:
    """Write accelerate_config.yaml, accelerate_launch.sh and plan.json into `out_dir`."""
    data = accelerate_config(plan)
    header = "\n".join(comment_lines(plan) + setup_comments(plan.config)) + (
        f"\n# Gradient accumulation: {plan.config.grad_accum_steps} micro-batches of "
        f"{plan.config.micro_batch_size} per optimizer step (accelerate_launch.sh sets it).\n")
    config_path = out_dir / FILENAME
    config_path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    script_path = out_dir / LAUNCH_FILENAME
    script_path.write_text(launch_script(plan))
    script_path.chmod(0o755)
    return [config_path, script_path, plan.save(out_dir / PLAN_FILENAME)]
