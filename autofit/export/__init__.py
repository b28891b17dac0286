"""Export: a plan becomes the files its launcher reads, one module per launcher.

    paths = export(plan, "deepspeed", "runs/x")   # or plan.export("deepspeed", "runs/x")

Formats: "deepspeed" (deepspeed.json), "accelerate" (accelerate_config.yaml + accelerate_launch.sh),
"trainer" (trainer_args.json + train_with_trainer.py), "torchrun" (torchrun.sh). Every file carries the
measurement where its format allows. A plan that does not fit refuses to export (`UsageError`), and so does
a format that cannot run one of its knobs (`Strategy.refuses` names the knob and the format that can). Every
knob of a plan is either said by the format's files (a key its launcher reads, a line its own script runs) or
named in a note (`notes`, an `ExportWarning`) with how your script applies it and the format that does: none
is dropped silently. Files land through `autofit.files` (atomic, never through a link, never over a file
autofit did not write).
Each exporter writes its format's own structure and loops over the strategies for the rest
(`autofit.export.model_setup`): their keys, the lines a script runs on the model, their refusals.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from autofit.errors import UsageError
from autofit.export import accelerate, deepspeed, torchrun, trainer
from autofit.export.measured import require_fit
from autofit.export.model_setup import left_out, refusal
from autofit.files import check_replaceable

if TYPE_CHECKING:
    from autofit.plan import Plan

FORMATS = {"accelerate": accelerate, "deepspeed": deepspeed, "trainer": trainer, "torchrun": torchrun}
# How your training script applies what a format's files do not (`notes`); torchrun's script applies everything
YOUR_SCRIPT = {
    "deepspeed": "your train.py applies {them}: autofit.prepare(plan, model, engine=False) with the plan.json this "
                 "file came from does, as probed (its \"autofit\" section names {them})",
    "accelerate": "your train.py applies {them}: autofit.prepare(os.environ[\"AUTOFIT_PLAN\"], model, engine=False) "
                  "does, as accelerate_launch.sh says",
    "trainer": "launch train_with_trainer.py as its docstring says ({launch})",
}


class ExportWarning(UserWarning):
    """An export whose files alone do not apply every knob of the plan (`notes` says which, and how)."""


def export(plan: "Plan", fmt: str, out_dir: str | Path, *, force: bool = False) -> list[Path]:
    """Write the launcher files of format `fmt` (any case) for `plan` into `out_dir` (created); returns their
    paths. Refused (`UsageError`) when the plan does not fit, when the format cannot run one of its knobs, or
    when a file there would replace one autofit did not write (`force` replaces it; a link is never written
    through). The files are checked before any is written: an export is whole or not at all. Where the files
    alone leave a knob to your training script, an `ExportWarning` says which (`notes`)."""
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
    outputs = FORMATS[fmt].files(plan, out)
    if out.is_dir():
        for output in outputs:
            check_replaceable(out / output.name, force=force, ours=output.ours)
    out.mkdir(parents=True, exist_ok=True)
    paths = [output.write(out, force) for output in outputs]
    for note in notes(plan, fmt):
        warnings.warn(note, ExportWarning, stacklevel=2)
    return paths


def notes(plan: "Plan", fmt: str) -> list[str]:
    """What format `fmt`'s files alone do not apply of `plan` (the knobs a launcher key or its own script does
    not say: `model_setup.left_out`), naming them, how your script applies them and the format that does it for
    you; none for torchrun (train_with_prepare.py applies every knob)."""
    module = FORMATS[fmt]
    left = left_out(plan, module.launched)
    if not left:
        return []
    names = [o.name for o in module.files(plan, Path(".")) if not o.ours]
    them = "it" if len(left) == 1 else "them"
    how = YOUR_SCRIPT[fmt].format(them=them, launch=trainer.launch_words(plan))
    return [f"{' and '.join(names)} alone {'does' if len(names) == 1 else 'do'} not apply {', '.join(left)}: {how}; "
            f"or export torchrun, whose train_with_prepare.py applies every knob as probed."]


def applicable(plan: "Plan") -> list[str]:
    """The formats that apply to `plan` (DeepSpeed does not, for a plan sharded with FSDP2)."""
    return [fmt for fmt in FORMATS if not refusal(plan, fmt)]


def export_all(plan: "Plan", out_dir: str | Path, *, force: bool = False) -> list[Path]:
    """Every format that applies into `out_dir`; the paths, each once. No `ExportWarning`: torchrun's and the
    Trainer's scripts beside the other files apply what those leave out."""
    paths: list[Path] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        for fmt in applicable(plan):
            paths += [p for p in export(plan, fmt, out_dir, force=force) if p not in paths]
    return paths


__all__ = ["FORMATS", "ExportWarning", "applicable", "export", "export_all", "notes"]
