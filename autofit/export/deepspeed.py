"""DeepSpeed JSON: the config `deepspeed.initialize` reads, as the ZeRO probes passed it
(`autofit.strategies.deepspeed_config`, the single source of that dict), plus an "autofit" section with the
measurement (DeepSpeed ignores unknown top-level keys).

Over several nodes also a hostfile (a line per node, `slots` its GPUs) and deepspeed_launch.sh, which runs
`deepspeed --hostfile` on the first node (DeepSpeed's runner starts every node's ranks over ssh) with the
config as `--deepspeed_config` (`deepspeed.add_config_arguments` reads it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.export import nodes
from autofit.export.measured import comment_lines, measured, require_fit, with_launcher_keys
from autofit.export.model_setup import setup_lines
from autofit.strategies.deepspeed_config import FILENAME, plan_config

if TYPE_CHECKING:
    from autofit.plan import Plan

__all__ = ["FILENAME", "export", "file_config"]

LAUNCH_FILENAME = "deepspeed_launch.sh"


def file_config(plan: "Plan") -> dict[str, Any]:
    """The dict written to deepspeed.json: the plan's DeepSpeed config (`plan_config`), the keys strategies add,
    and the "autofit" record (with the lines a script applies to the model that no DeepSpeed key says)."""
    require_fit(plan)
    document = with_launcher_keys(plan_config(plan.config, plan.settings, plan.spec), plan, "deepspeed")
    setup = setup_lines(plan, "deepspeed")
    return {**document, "autofit": {**measured(plan), **({"apply_in_script": setup} if setup else {})}}


def launch_script(plan: "Plan") -> str:
    """deepspeed_launch.sh for a plan over several nodes: `deepspeed --hostfile` on the first node, the
    training script and its arguments, then the config."""
    command = ["deepspeed", *nodes.deepspeed_arguments(plan.config, f"$here/{nodes.HOSTFILE}")]
    return "\n".join([
        "#!/usr/bin/env bash", *comment_lines(plan),
        f"# Usage, on the first node: bash {LAUNCH_FILENAME} train.py [script args]; train.py reads --deepspeed_config",
        f"# (deepspeed.add_config_arguments). Name your nodes in {nodes.HOSTFILE} first.",
        "set -euo pipefail", 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', *nodes.setup_lines(plan.config, every_node=False),
        f'exec {nodes.shell_join(command)} "$@" --deepspeed --deepspeed_config "$here/{FILENAME}"',
    ]) + "\n"


def export(plan: "Plan", out_dir: Path) -> list[Path]:
    """Write deepspeed.json into `out_dir`, and over several nodes the hostfile and deepspeed_launch.sh;
    returns their paths."""
    path = out_dir / FILENAME
    path.write_text(json.dumps(file_config(plan), indent=2) + "\n")
    if plan.config.nodes == 1:
        return [path]
    hosts, script = out_dir / nodes.HOSTFILE, out_dir / LAUNCH_FILENAME
    hosts.write_text(nodes.hostfile(plan.config))
    script.write_text(launch_script(plan))
    script.chmod(0o755)
    return [path, hosts, script]
