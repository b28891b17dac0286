"""DeepSpeed JSON: the config `deepspeed.initialize` reads, as the ZeRO probes passed it (the engine
strategy's file, `Strategy.launcher_files`: the single source of that dict), plus an "autofit" section with
the measurement (DeepSpeed ignores unknown top-level keys).

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
from autofit.export.model_setup import left_out, setup_lines, strategies_of
from autofit.export.output import Output

if TYPE_CHECKING:
    from autofit.plan import Plan

__all__ = ["engine_file", "file_config", "files", "launched"]
SECTION = "autofit"  # the measurement and what your script applies: DeepSpeed ignores unknown top-level keys

LAUNCH_FILENAME = "deepspeed_launch.sh"


def file_config(plan: "Plan") -> dict[str, Any]:
    """The dict written to deepspeed.json: the plan's DeepSpeed config (`engine_file`), the keys strategies add,
    and the "autofit" record: the measurement, the lines a script applies to the model that no DeepSpeed key
    says, and the knobs no DeepSpeed key says (`left_to_your_script`), which your train.py applies (the lines,
    or `autofit.prepare(plan, model, engine=False)` with the plan this file came from)."""
    require_fit(plan)
    setup = setup_lines(plan, "deepspeed")
    left = left_out(plan, launched)
    record = {**measured(plan), **({"apply_in_script": setup} if setup else {}),
              **({"left_to_your_script": left} if left else {})}
    return {**launched(plan), SECTION: record}


def engine_file(plan: "Plan") -> tuple[str, dict[str, Any]]:
    """The DeepSpeed config file of `plan` (its name, its dict) as the engine strategy builds it from the
    plan's strategies (`Strategy.launcher_files`): what its ZeRO probes passed to `deepspeed.initialize`."""
    strategies = strategies_of(plan)
    found = {name: document for s in strategies for name, document in
             s.launcher_files(plan.config, "deepspeed", strategies).items()}
    if len(found) != 1:
        raise RuntimeError(f"the deepspeed format writes one engine file; the strategies gave {sorted(found)}")
    return next(iter(found.items()))


def launched(plan: "Plan") -> dict[str, Any]:
    """What DeepSpeed reads of deepspeed.json: the plan's DeepSpeed config and the keys strategies add (the
    file without its "autofit" record)."""
    require_fit(plan)
    return with_launcher_keys(engine_file(plan)[1], plan, "deepspeed")


def launch_script(plan: "Plan", filename: str) -> str:
    """deepspeed_launch.sh for a plan over several nodes: `deepspeed --hostfile` on the first node, the
    training script and its arguments, then the config."""
    command = ["deepspeed", *nodes.deepspeed_arguments(plan.config, f"$here/{nodes.HOSTFILE}")]
    return "\n".join([
        "#!/usr/bin/env bash", *comment_lines(plan),
        f"# Usage, on the first node: bash {LAUNCH_FILENAME} train.py [script args]; train.py reads --deepspeed_config",
        f"# (deepspeed.add_config_arguments). Name your nodes in {nodes.HOSTFILE} first.",
        "set -euo pipefail", 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        *nodes.setup_lines(plan.config, every_node=False),
        f'exec {nodes.shell_join(command)} "$@" --deepspeed --deepspeed_config "$here/{filename}"',
    ]) + "\n"


def files(plan: "Plan", folder: Path) -> list[Output]:
    """deepspeed.json, and over several nodes the hostfile and deepspeed_launch.sh."""
    filename = engine_file(plan)[0]
    out = [Output(filename, json.dumps(file_config(plan), indent=2) + "\n")]
    if plan.config.nodes > 1:
        out += [Output(nodes.HOSTFILE, nodes.hostfile(plan.config)),
                Output(LAUNCH_FILENAME, launch_script(plan, filename), executable=True)]
    return out
