"""DeepSpeed JSON: the config `deepspeed.initialize` reads, as the ZeRO probes passed it
(`autofit.strategies.deepspeed_config`, the single source of that dict), plus an "autofit" section with the
measurement (DeepSpeed ignores unknown top-level keys).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.config import Config, Engine, Optimizer, Precision
from autofit.errors import UsageError
from autofit.export.measured import measured, require_fit, with_plugin_keys
from autofit.export.model_setup import setup_lines
from autofit.strategies.deepspeed_config import TORCH_BY_NAME, buffers_for, deepspeed_config
from autofit.strategies.optimizer import torch_name

if TYPE_CHECKING:
    from autofit.plan import Plan

FILENAME = "deepspeed.json"

def applies(plan: "Plan") -> str | None:
    """Why a DeepSpeed file does not apply to `plan` (it shards with FSDP2, trains pure bf16 weights or
    steps in backward, which DeepSpeed's engine does not, or its optimizer is one DeepSpeed's config
    cannot build), or None."""
    config = plan.config
    if config.optimizer.eight_bit:
        return (f"the plan's optimizer is bitsandbytes' {config.optimizer.value}, which a DeepSpeed config "
                "cannot name (its types are DeepSpeed's own and torch.optim's); export torchrun (its script builds "
                "the optimizer with autofit.prepare and hands it to deepspeed.initialize) or trainer "
                "(TrainingArguments.optim) instead")
    if config.engine is Engine.FSDP:
        return (f"the plan shards with FSDP2 ({config.sharding.value}), not DeepSpeed; export accelerate, "
                "trainer or torchrun instead")
    if config.pure_bf16:
        return ("DeepSpeed's bf16 mode keeps fp32 master weights; the plan trains pure bf16 weights with torch's "
                "optimizer: export trainer or torchrun instead")
    if config.steps_in_backward:
        return ("DeepSpeed's engine steps the optimizer after backward; the plan steps each parameter inside "
                "backward: export torchrun instead")
    return None


def file_config(plan: "Plan") -> dict[str, Any]:
    """The dict written to deepspeed.json: `deepspeed_config` of the plan plus the "autofit" record."""
    require_fit(plan)
    nvme_path = plan.spec.get("nvme_path")
    recorded = plan.settings.get("optimizer", {})
    config = deepspeed_config(plan.config, nvme_path=nvme_path, buffers=buffers_for(plan.spec),
                              hyperparameters=recorded.get("kwargs"))
    if torch_name(recorded) in TORCH_BY_NAME:  # your own torch optimizer, which DeepSpeed builds by name
        config["optimizer"] = {"type": torch_name(recorded), "params": dict(recorded["kwargs"])}
    document = with_plugin_keys(config, plan.config, "deepspeed")
    setup = setup_lines(plan.config)
    return {**document, "autofit": {**measured(plan), **({"apply_in_script": setup} if setup else {})}}


def export(plan: "Plan", out_dir: Path) -> list[Path]:
    """Write deepspeed.json into `out_dir`; returns its path."""
    path = out_dir / FILENAME
    path.write_text(json.dumps(file_config(plan), indent=2) + "\n")
    return [path]
