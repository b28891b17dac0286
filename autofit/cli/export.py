"""`autofit export PLAN.json|RUN_DIR --format accelerate|deepspeed|trainer|torchrun --out DIR`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import click

from autofit.cli.tune import PLAN
from autofit.errors import UsageError
from autofit.export import FORMATS, ExportWarning, export, notes, trainer
from autofit.plan import Plan


@click.command("export")
@click.argument("plan_path", metavar="PLAN.json|RUN_DIR", type=click.Path())
@click.option("--format", "fmt", required=True, type=click.Choice(sorted(FORMATS), case_sensitive=False),
              help="Launcher to write for (any case).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the files.")
@click.option("--force", is_flag=True, help="Replace files in --out that autofit did not write (or that changed since).")
@click.option("--json", "as_json", is_flag=True, help="Print the written paths as one JSON document.")
def export_command(plan_path: str, fmt: str, out: str, force: bool, as_json: bool) -> int:
    """Write the launcher files for a saved plan, or the plan of a `tune` run directory (a plan that does
    not fit is refused, exit 2; so is a file in --out that autofit did not write, unless --force)."""
    plan = Plan.load(plan_file(Path(plan_path)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)  # said below, once, as a note
        paths = export(plan, fmt, out, force=force)
    beyond = trainer.beyond_arguments(plan) if fmt.lower() == "trainer" else []
    if beyond:
        click.echo(f"note: trainer_args.json alone trains without {', '.join(beyond)}; "
                   "train_with_trainer.py applies them to the model, as probed.", err=True)
    for note in notes(plan, fmt.lower()):
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(json.dumps({"format": fmt, "files": [str(p) for p in paths]}))
    else:
        for path in paths:
            click.echo(str(path))
    return 0


def plan_file(path: Path) -> Path:
    """`path`, or the plan.json in it when it is a folder (the --out of `autofit tune`)."""
    if not path.is_dir():
        return path
    if not (path / PLAN).is_file():
        raise UsageError(f"{path} is a folder without a {PLAN}: pass a plan file, or the run directory "
                         "(--out) of a finished `autofit tune`.")
    return path / PLAN
