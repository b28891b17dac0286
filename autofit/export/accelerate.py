"""accelerate config YAML (for `accelerate launch --config_file`) and the launch command beside it.

The YAML holds what accelerate's config file can hold: distributed type, number of processes, and what the
strategies write (`Strategy.launcher_keys(config, "accelerate")`): mixed precision, and an engine's section
(DeepSpeed's ZeRO stage, offload, accumulation, clipping; FSDP2's policies).
Gradient accumulation outside DeepSpeed has no config-file key; the launch script passes it through
`ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, which `Accelerator()` reads; under FSDP2 the script passes
`prepared.gradient_accumulation_plugin()` instead, which also reduces gradients on every micro-batch as
the plan was measured (`sync_each_batch`; accelerate's default holds them unsharded until the last
micro-batch, the whole model's per rank). The micro-batch, checkpointing, optimizer (and the other knobs
accelerate has no key for) reach the script through the plan, written beside the launch script and named
in AUTOFIT_PLAN: `autofit.prepare(os.environ["AUTOFIT_PLAN"], model, engine=False)` applies them with
the probe's code, and `prepared.micro_batch_size` sizes the DataLoader (the same AUTOFIT_* variables as
torchrun.sh are exported too). Over several machines the YAML holds their count (`num_machines`) and
accelerate_launch.sh, run on each, passes its rank and the first machine's address (NODE_RANK,
MASTER_ADDR: `autofit.export.nodes`).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autofit.export import nodes
from autofit.export.measured import comment_lines, require_fit, with_launcher_keys
from autofit.export.model_setup import setup_comments
from autofit.export.output import PLAN_FILENAME, Output, plan_output

if TYPE_CHECKING:
    from autofit.plan import Plan

FILENAME = "accelerate_config.yaml"
LAUNCH_FILENAME = "accelerate_launch.sh"


def accelerate_config(plan: "Plan") -> dict[str, Any]:
    """The accelerate ClusterConfig fields for `plan` (what the YAML file holds): the processes and where they
    run, then what the strategies say (`Strategy.launcher_keys(config, "accelerate")`: the mixed precision, an
    engine's distributed type and section)."""
    require_fit(plan)
    config = plan.config
    on_cpu = str(plan.spec.get("device", "cpu")).startswith("cpu")
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": ("MULTI_CPU" if on_cpu else "MULTI_GPU") if config.num_gpus > 1 else "NO",
        "num_processes": config.num_gpus,  # over every machine
        "num_machines": config.nodes,
        "machine_rank": 0,  # over several machines accelerate_launch.sh passes each its own (NODE_RANK)
        "mixed_precision": "no",
        "use_cpu": on_cpu,
        "gpu_ids": "all",
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "downcast_bf16": "no",
        "debug": False,
    }
    if config.nodes > 1:  # the first machine's address differs per cluster: accelerate_launch.sh passes it
        out.update({"main_process_ip": None, "main_process_port": nodes.DEFAULT_PORT})
    return with_launcher_keys(out, plan, "accelerate")


def launch_script(plan: "Plan", config_file: str = FILENAME) -> str:
    """A bash script running `accelerate launch` with the exported config, the plan's accumulation, and
    the plan itself (AUTOFIT_PLAN) for `autofit.prepare` in the training script."""
    from autofit.export.torchrun import DEEPSPEED_VARIABLE, environment

    lines = ["#!/usr/bin/env bash", *comment_lines(plan),
             "# Usage: bash accelerate_launch.sh train.py [script args]",
             "# In train.py: prepared = autofit.prepare(os.environ[\"AUTOFIT_PLAN\"], model, engine=False) applies the",
             "# micro-batch (prepared.micro_batch_size), checkpointing and optimizer; then accelerator.prepare(...).",
             *setup_comments(plan, "accelerate"),
             "set -euo pipefail", 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
             *nodes.accelerate_setup_lines(plan.config)]
    if _accumulation_variable(plan):
        lines.append(f"export ACCELERATE_GRADIENT_ACCUMULATION_STEPS={plan.config.grad_accum_steps}")
    lines += [f'export {name}="{value}"' if value.startswith("$here") else f"export {name}={shlex.quote(value)}"
              for name, value in environment(plan).items() if name != DEEPSPEED_VARIABLE]
    launch = ["accelerate", "launch", "--config_file", f"$here/{config_file}", *nodes.accelerate_arguments(plan.config)]
    lines.append(f'exec {nodes.shell_join(launch)} "$@"')
    return "\n".join(lines) + "\n"


def _accumulation_variable(plan: "Plan") -> bool:
    """Whether the launch script passes the accumulation as accelerate's variable (DeepSpeed takes it from its
    section instead)."""
    return "deepspeed_config" not in accelerate_config(plan)


def files(plan: "Plan", folder: Path) -> list[Output]:
    """accelerate_config.yaml, accelerate_launch.sh and plan.json (which the training script reads)."""
    header = "\n".join(comment_lines(plan) + setup_comments(plan, "accelerate")) + (
        f"\n# Gradient accumulation: {plan.config.grad_accum_steps} micro-batches of "
        f"{plan.config.micro_batch_size} per optimizer step (accelerate_launch.sh sets it).\n")
    return [Output(FILENAME, header + yaml.safe_dump(accelerate_config(plan), sort_keys=False)),
            Output(LAUNCH_FILENAME, launch_script(plan), executable=True), plan_output(plan)]


def launched(plan: "Plan") -> dict[str, Any]:
    """What accelerate reads without your code: the config file, and the accumulation the launch script sets
    (the rest reaches your train.py through the plan: `autofit.export.notes` names it)."""
    accumulation = plan.config.grad_accum_steps if _accumulation_variable(plan) else None
    return {"config": accelerate_config(plan), "accumulation": accumulation}
