"""`autofit export PLAN.json --format accelerate|deepspeed|trainer|torchrun --out DIR`."""

from __future__ import annotations

import json

import click

from autofit.export import FORMATS, export, trainer
from autofit.plan import Plan


@click.command("export")
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", required=True, type=click.Choice(sorted(FORMATS), case_sensitive=False),
              help="Launcher to write for (any case).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the files.")
@click.option("--json", "as_json", is_flag=True, help="Print the written paths as one JSON document.")
def export_command(plan_path: str, fmt: str, out: str, as_json: bool) -> int:
    """Write the launcher files for a saved plan (a plan that does not fit is refused, exit 2)."""
    plan = Plan.load(plan_path)
    paths = export(plan, fmt, out)
    beyond = trainer.beyond_arguments(plan) if fmt.lower() == "trainer" else []
    if beyond:
        click.echo(f"note: trainer_args.json alone trains without {', '.join(beyond)}; "
                   "train_with_trainer.py applies them to the model, as probed.", err=True)
    if as_json:
        click.echo(json.dumps({"format": fmt, "files": [str(p) for p in paths]}))
    else:
        for path in paths:
            click.echo(str(path))
    return 0
