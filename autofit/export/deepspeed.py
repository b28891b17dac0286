"""DeepSpeed JSON: the config `deepspeed.initialize` reads, as the ZeRO probes passed it
(`autofit.strategies.deepspeed_config`, the single source of that dict), plus an "autofit" section with the
measurement (DeepSpeed ignores unknown top-level keys).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.export.measured import measured, require_fit, with_launcher_keys
from autofit.export.model_setup import setup_lines
from autofit.strategies.deepspeed_config import FILENAME, plan_config

if TYPE_CHECKING:
    from autofit.plan import Plan

__all__ = ["FILENAME", "export", "file_config"]


def file_config(plan: "Plan") -> dict[str, Any]:
    """The dict written to deepspeed.json: the plan's DeepSpeed config (`plan_config`), the keys strategies add,
    and the "autofit" record (with the lines a script applies to the model that no DeepSpeed key says)."""
    require_fit(plan)
    document = with_launcher_keys(plan_config(plan.config, plan.settings, plan.spec), plan, "deepspeed")
    setup = setup_lines(plan, "deepspeed")
    return {**document, "autofit": {**measured(plan), **({"apply_in_script": setup} if setup else {})}}


def export(plan: "Plan", out_dir: Path) -> list[Path]:
    """Write deepspeed.json into `out_dir`; returns its path."""
    path = out_dir / FILENAME
    path.write_text(json.dumps(file_config(plan), indent=2) + "\n")
    return [path]
