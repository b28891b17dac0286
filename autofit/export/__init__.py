"""Export: a plan becomes the files its launcher reads, one module per launcher.

    paths = export(plan, "deepspeed", "runs/x")   # or plan.export("deepspeed", "runs/x")

Formats: "deepspeed" (deepspeed.json), "accelerate" (accelerate_config.yaml + accelerate_launch.sh),
"trainer" (trainer_args.json + train_with_trainer.py), "torchrun" (torchrun.sh). Every file carries the
measurement where its format allows. A plan that does not fit refuses to export (`UsageError`), and so does
a format that cannot run one of its knobs (`Strategy.refuses` names the knob and the format that can).
Each exporter writes its format's own structure and loops over the strategies for the rest
(`autofit.export.model_setup`): their keys, the lines a script runs on the model, their refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autofit.errors import UsageError
from autofit.export import accelerate, deepspeed, torchrun, trainer
from autofit.export.measured import require_fit
from autofit.export.model_setup import refusal
from autofit.strategies.deepspeed_config import deepspeed_config

if TYPE_CHECKING:
    from autofit.plan import Plan

FORMATS = {"accelerate": accelerate, "deepspeed": deepspeed, "trainer": trainer, "torchrun": torchrun}


def export(plan: "Plan", fmt: str, out_dir: str | Path) -> list[Path]:
    """Write the launcher files of format `fmt` (any case) for `plan` into `out_dir` (created); returns their paths."""
    fmt = fmt.lower() if isinstance(fmt, str) else fmt
    if fmt not in FORMATS:
        raise UsageError(f"format {fmt!r} is not known; use one of {sorted(FORMATS)}.")
    require_fit(plan)
    why_not = refusal(plan, fmt)
    if why_not:
        raise UsageError(f"Cannot export {fmt!r}: {why_not}.")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"The export folder {str(out)!r} is a file; give a folder (created when missing).")
    out.mkdir(parents=True, exist_ok=True)
    return FORMATS[fmt].export(plan, out)


def applicable(plan: "Plan") -> list[str]:
    """The formats that apply to `plan` (DeepSpeed does not, for a plan sharded with FSDP2)."""
    return [fmt for fmt in FORMATS if not refusal(plan, fmt)]


def export_all(plan: "Plan", out_dir: str | Path) -> list[Path]:
    """Every format that applies into `out_dir`; the paths, each once."""
    paths: list[Path] = []
    for fmt in applicable(plan):
        paths += [p for p in export(plan, fmt, out_dir) if p not in paths]
    return paths


__all__ = ["FORMATS", "applicable", "deepspeed_config", "export", "export_all"]
