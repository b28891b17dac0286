"""torchrun: the command line and the environment it needs, as a bash script.

The plan's knobs travel as AUTOFIT_* environment variables that the training script reads (see
docs/launchers.md); with ZeRO the DeepSpeed config is written beside it and named in
AUTOFIT_DEEPSPEED_CONFIG for the script's `deepspeed.initialize(config=...)`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from autofit.export.deepspeed import FILENAME as DEEPSPEED_FILENAME
from autofit.export.deepspeed import file_config as deepspeed_file_config
from autofit.export.measured import comment_lines, require_fit
from autofit.export.model_setup import setup_comments

FILENAME = "torchrun.sh"

if TYPE_CHECKING:
    from autofit.plan import Plan



def environment(plan: "Plan") -> dict[str, str]:
    """The environment variables the launched job needs (names -> values): every knob of the plan,
    plug-in strategies' included, as AUTOFIT_<KNOB>, the global batch, and the DeepSpeed config path."""
    require_fit(plan)
    config = plan.config
    env = {f"AUTOFIT_{name.upper()}": str(value) for name, value in config.to_dict().items()}
    env["AUTOFIT_GLOBAL_BATCH_SIZE"] = str(config.global_batch_size)
    if config.zero_stage:
        env["AUTOFIT_DEEPSPEED_CONFIG"] = '$here/' + DEEPSPEED_FILENAME
    return env


def command(plan: "Plan") -> list[str]:
    """The torchrun command line (the training script and its arguments follow it)."""
    require_fit(plan)
    return ["torchrun", "--standalone", "--nnodes", "1", "--nproc_per_node", str(plan.config.num_gpus)]


def script(plan: "Plan") -> str:
    """torchrun.sh: comments with the measurement, the exports, then torchrun on the given script."""
    exports = [f'export {name}="{value}"' if value.startswith("$here") else f"export {name}={shlex.quote(value)}"
               for name, value in environment(plan).items()]
    return "\n".join([
        "#!/usr/bin/env bash", *comment_lines(plan), *setup_comments(plan.config),
        "# Usage: bash torchrun.sh train.py [script args]", "set -euo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', *exports,
        f'exec {shlex.join(command(plan))} "$@"',
    ]) + "\n"


def export(plan: "Plan", out_dir: Path) -> list[Path]:
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
