"""Export: a plan becomes the files its launcher reads, one module per launcher.

    paths = export(plan, "deepspeed", "runs/x")   # or plan.export("deepspeed", "runs/x")

Formats: "deepspeed" (deepspeed.json), "accelerate" (accelerate_config.yaml + accelerate_launch.sh),
"trainer" (trainer_args.json + train_with_trainer.py), "torchrun" (torchrun.sh). Every file carries the
measurement where its format allows. A plan that does not fit refuses to export (`UsageError`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autofit.errors import UsageError
from autofit.export import accelerate, deepspeed, torchrun, trainer
from autofit.strategies.deepspeed_config import deepspeed_config
from autofit.export.measured import require_fit

if TYPE_CHECKING:
    from autofit.plan import Plan

FORMATS = {"accelerate": accelerate, "deepspeed": deepspeed, "trainer": trainer, "torchrun": torchrun}


def export(plan: "Plan", fmt: str, out_dir: str | Path) -> list[Path]:
    """Write the launcher files of format `fmt` (any case) for `plan` into `out_dir` (created); returns their paths."""
    fmt = fmt.lower() if isinstance(fmt, str) else fmt
    if fmt not in FORMATS:
        raise UsageError(f"format {fmt!r} is not known; use one of {sorted(FORMATS)}.")
    require_fit(plan)
    why_not = getattr(FORMATS[fmt], "applies", lambda _: None)(plan)
    if why_not:
        raise UsageError(f"Cannot export {fmt!r}: {why_not}.")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"The export folder {str(out)!r} is a file; give a folder (created when missing).")
    out.mkdir(parents=True, exist_ok=True)
    return FORMATS[fmt].export(plan, out)


def applicable(plan: "Plan") -> list[str]:
    """The formats that apply to `plan` (DeepSpeed does not, for a plan sharded with FSDP2)."""
    return [fmt for fmt, module in FORMATS.items() if not getattr(module, "applies", lambda _: None)(plan)]


def export_all(plan: "Plan", out_dir: str | Path) -> list[Path]:
    """Every format that applies into `out_dir`; the paths, each once."""
    paths: list[Path] = []
    for fmt in applicable(plan):
        paths += [p for p in export(plan, fmt, out_dir) if p not in paths]
    return paths


__all__ = ["FORMATS", "applicable", "deepspeed_config", "export", "export_all"]
