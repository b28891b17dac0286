"""`autofit dry-run`: predict every candidate's peak per GPU for a GPU that is not here, and the fastest fit.

    autofit dry-run --model llama-2-7b --seq-len 4096 --global-batch-size 64 --gpu a100-80gb --num-gpus 8
    autofit dry-run --model ./my-model/config.json --seq-len 2048 --global-batch-size 32 --gpu rtx-4090 --json

Nothing is trained and nothing real is allocated (fake tensors). Exit codes: 0 a candidate is predicted
to fit, 3 none is (the message names the closest and what to allow next), 4 a candidate fits by the
activation formula alone (the step could not be simulated: the verdict carries the formula's error
bound), 2 bad usage, 1 other errors.
"""

from __future__ import annotations

import json

import click
from rich.table import Table

from autofit.cli.tune import make_console, parse_allow_option
from autofit.estimate.dry_run import DEFAULT_MAX_MICRO_BATCH, DryRunReport
from autofit.units import format_size

EXIT_FITS, EXIT_NOTHING_FITS, EXIT_FORMULA_ONLY = 0, 3, 4
PARTS = ("params", "grads", "optimizer", "activations", "overhead")


def candidate_table(report: DryRunReport, top: int) -> Table:
    """One row per candidate: knobs, the predicted peak split into parts, fit and reason; chosen starred."""
    shown = report.candidates if top <= 0 else report.candidates[:top]
    title = (f"{report.model} on {report.num_gpus} x {report.gpu.name} ({format_size(report.gpu.memory_bytes)}, "
             f"fit limit {format_size(report.fit_limit)}): {len(shown)} of {len(report.candidates)} candidates")
    table = Table(title=title, title_justify="left")
    for name in ("#", "configuration", *PARTS, "peak/GPU", "fits", "samples/s", "CPU RAM", "reason"):
        table.add_column(name, justify="left" if name in ("configuration", "reason", "fits") else "right",
                         overflow="fold")
    for index, candidate in enumerate(shown, 1):
        chosen = candidate is report.chosen
        parts = candidate.estimate.breakdown.to_dict()
        cpu = candidate.estimate.cpu_bytes
        table.add_row(str(index), ("★ " if chosen else "") + candidate.config.describe(),
                      *(format_size(parts[p]) for p in PARTS), format_size(candidate.peak_bytes),
                      "[green]yes[/]" if candidate.fits else "[red]no[/]", f"{candidate.samples_per_s:,.2f}",
                      format_size(cpu) if cpu else "-", short_reason(candidate.reason, candidate.estimate.method),
                      style="bold" if chosen else None)
    return table


def short_reason(reason: str, method: str) -> str:
    """The reason without the activation method (the same for most rows; printed once under the table)."""
    return "; ".join(part for part in reason.split("; ") if part != method)


def method_note(report: DryRunReport) -> str:
    """How the activations were predicted, for the chosen or first row."""
    row = report.chosen or (report.candidates[0] if report.candidates else None)
    return row.estimate.method if row else ""


@click.command("dry-run")
@click.option("--model", "model_arg", required=True,
              help="Preset name (gpt2, llama-2-7b, ...), a Hugging Face hub id (ORG/NAME: its config.json from "
                   "the local cache, else downloaded alone), a config.json or model folder, or FILE.py:factory.")
@click.option("--seq-len", type=int, default=None, help="Tokens per sample (at most the model's maximum).")
@click.option("--global-batch-size", type=int, default=None,
              help="Samples per optimizer step over all GPUs, kept exactly; default: micro-batches up to "
                   f"{DEFAULT_MAX_MICRO_BATCH} without accumulation.")
@click.option("--gpu", default="h100-80gb", show_default=True, help="GPU profile (autofit gpus lists them).")
@click.option("--gpu-memory", default=None, help="Memory per GPU, e.g. 20GiB: overrides the profile's.")
@click.option("--num-gpus", type=int, default=1, show_default=True, help="Data-parallel GPUs.")
@click.option("--allow", multiple=True, help="Tier 0-2, or names: numerics, lora, quantization (repeatable).")
@click.option("--optimizer", default="adamw", show_default=True, help="adamw, adafactor, ...")
@click.option("--top", type=int, default=20, show_default=True, help="Rows shown in the table (0: all).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout, logs on stderr.")
def dry_run_command(model_arg: str, seq_len: int | None, global_batch_size: int | None, gpu: str,
                    gpu_memory: str | None, num_gpus: int, allow: tuple[str, ...], optimizer: str, top: int,
                    as_json: bool) -> int:
    """Predict, without a GPU, which training configuration fits the GPU and which is fastest."""
    from autofit.estimate.dry_run import dry_run

    console = make_console(as_json)
    report = dry_run(model_arg, seq_len=seq_len, global_batch_size=global_batch_size, gpu=gpu,
                     gpu_memory=gpu_memory, num_gpus=num_gpus, allow=parse_allow_option(allow), optimizer=optimizer)
    console.print(candidate_table(report, top))
    if report.fits and report.formula_only:
        console.print(f"[bold yellow]Fits by formula only, not simulated:[/] {report.reason}")
    elif report.fits:
        console.print(f"[bold green]Chosen:[/] {report.reason}")
    else:
        console.print(f"[bold red]Nothing fits.[/] {report.reason}")
    console.print(f"[dim]Predicted in {report.seconds:.1f} s ({method_note(report)}); nothing was trained: "
                  "autofit tune measures.[/]")
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    if not report.fits:
        return EXIT_NOTHING_FITS
    return EXIT_FORMULA_ONLY if report.formula_only else EXIT_FITS
