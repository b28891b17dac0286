"""torchrun: the command line and the environment it needs, as a bash script.

The plan's knobs travel as AUTOFIT_* environment variables that the training script reads (see
docs/launchers.md); with ZeRO the DeepSpeed config is written beside it and named in
AUTOFIT_DEEPSPEED_CONFIG for the script's `deepspeed.initialize(config=...)`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from autofit.export.deepspeed import FILENAME as DEEPSPEED_FILENAME
from autofit.export.deepspeed import file_config as deepspeed_file_config
from autofit.export.measured import comment_lines, require_fit

FILENAME = "torchrun.sh"

# Config field -> environment variable the training script reads.
ENV = {
    "micro_batch_size": "AUTOFIT_MICRO_BATCH_SIZE",
    "grad_accum_steps": "AUTOFIT_GRAD_ACCUM_STEPS",
    "precision": "AUTOFIT_PRECISION",
    "attention": "AUTOFIT_ATTENTION",
    "checkpointing": "AUTOFIT_CHECKPOINTING",
    "optimizer": "AUTOFIT_OPTIMIZER",
    "zero_stage": "AUTOFIT_ZERO_STAGE",
    "fsdp": "AUTOFIT_FSDP",
    "offload": "AUTOFIT_OFFLOAD",
    "quantization": "AUTOFIT_QUANTIZATION",
    "lora": "AUTOFIT_LORA_RANK",
}


def environment(plan: Any) -> dict[str, str]:
    """The environment variables the launched job needs (names -> values)."""
    require_fit(plan)
    config = plan.config
    env = {name: str(getattr(config, field)) for field, name in ENV.items()}
    env["AUTOFIT_GLOBAL_BATCH_SIZE"] = str(config.global_batch_size)
    if config.zero_stage:
        env["AUTOFIT_DEEPSPEED_CONFIG"] = '$here/' + DEEPSPEED_FILENAME
    return env


def command(plan: Any) -> list[str]:
    """The torchrun command line (the training script and its arguments follow it)."""
    require_fit(plan)
    return ["torchrun", "--standalone", "--nnodes", "1", "--nproc_per_node", str(plan.config.num_gpus)]


def script(plan: Any) -> str:
    """torchrun.sh: comments with the measurement, the exports, then torchrun on the given script."""
    exports = [f'export {name}="{value}"' if value.startswith("$here") else f"export {name}={shlex.quote(value)}"
               for name, value in environment(plan).items()]
    return "\n".join([
        "#!/usr/bin/env bash", *comment_lines(plan),
        "# Usage: bash torchrun.sh train.py [script args]", "set -euo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', *exports,
        f'exec {shlex.join(command(plan))} "$@"',
    ]) + "\n"


def export(plan: Any, out_dir: Path) -> list[Path]:
    """Write torchrun.sh (and deepspeed.json when ZeRO is used) into `out_dir`."""
    path = out_dir / FILENAME
    path.write_text(script(plan))
    path.chmod(0o755)
    paths = [path]
    if plan.config.zero_stage:
        ds = out_dir / DEEPSPEED_FILENAME
        ds.write_text(json.dumps(deepspeed_file_config(plan), indent=2) + "\n")
        paths.append(ds)
    return paths
