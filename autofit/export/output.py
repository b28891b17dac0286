"""A launcher file before it is written: its name, its text, and how it may land (`autofit.files`).

Every exporter returns its files as `Output`s; `autofit.export.export` checks that none would replace a file
autofit did not write before writing any of them, so an export is complete or refused, never half-written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from autofit.files import write_file

if TYPE_CHECKING:
    from autofit.plan import Plan

PLAN_FILENAME = "plan.json"  # the plan beside the launchers, read by autofit.prepare in the training script


@dataclasses.dataclass(frozen=True)
class Output:
    """One file of an export: `name` in the export folder, its `text`, whether it is `executable`, and
    `ours(bytes)`: whether an existing file of that name is one of its own kind (a plan) it may replace."""

    name: str
    text: str
    executable: bool = False
    ours: Callable[[bytes], bool] | None = None

    def write(self, folder: Path, force: bool = False) -> Path:
        """Write this file into `folder` (atomically, never through a link: `autofit.files.write_file`)."""
        return write_file(folder / self.name, self.text, executable=self.executable, force=force, ours=self.ours)


def plan_output(plan: "Plan") -> Output:
    """plan.json as `Plan.save` writes it (an existing plan there may be replaced)."""
    from autofit.plan import is_plan_json

    return Output(PLAN_FILENAME, json.dumps(plan.to_dict(), indent=2) + "\n", ours=is_plan_json)
