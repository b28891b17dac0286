"""`autofit dry-run`: predict every candidate's peak per GPU for a GPU that is not here, and the fastest fit.

    autofit dry-run --model llama-2-7b --seq-len 4096 --global-batch-size 64 --gpu a100-80gb --num-gpus 8
    autofit dry-run --model ./my-model/config.json --seq-len 2048 --global-batch-size 32 --gpu rtx-4090 --json
    autofit dry-run --model llama-2-70b --seq-len 4096 --global-batch-size 512 --gpu h100 --nodes 4 --gpus-per-node 8

Nothing is trained and nothing real is allocated (fake tensors). Exit codes: 0 a candidate is predicted
to fit, 3 none is (the message names the closest and what to allow next), 4 a candidate fits by the
activation formula alone (the step could not be simulated: the verdict carries the formula's error
bound), 2 bad usage, 1 other errors.
"""

from __future__ import annotations

import json

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autofit.cli.tune import (ALLOW_HELP, COUNT, LENGTH, MODEL_HELP, OPTIMIZER_HELP, env_columns, nothing_fits_words,
                              parse_allow_option, positive_option)
from autofit.errors import UsageError
from autofit.pipelines.candidate import also
from autofit.pipelines.dry_run import DEFAULT_MAX_MICRO_BATCH, Candidate, DryRunReport
from autofit.devices.gpus import other_sizes, split_count
from autofit.models.names import resolve_optimizer
from autofit.units import format_size

EXIT_FITS, EXIT_NOTHING_FITS, EXIT_FORMULA_ONLY = 0, 3, 4
PARTS = ("params", "grads", "optimizer", "gathered", "activations", "overhead")
WIDE = 150  # columns from which each row carries every part of its peak (below: a compact table)
REASONS = 200  # columns from which each row carries its reason too (narrower, it would fold to a word a line)
DEFAULT_WIDTH = 80  # piped output without COLUMNS, as a terminal's default


def render_width() -> int:
    """Columns to render in: `COLUMNS` when set (piped output included), else the terminal's, else 80."""
    import shutil

    return env_columns() or (shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns if _is_terminal() else DEFAULT_WIDTH)


def _is_terminal() -> bool:
    import sys

    return sys.stdout.isatty()


def make_console(as_json: bool, width: int) -> Console:
    """Rich console `width` columns wide, on stderr with --json (stdout is the JSON document's)."""
    return Console(stderr=as_json, highlight=False, width=width)


def candidate_table(report: DryRunReport, top: int, width: int = WIDE) -> Table:
    """One row per candidate, chosen starred and first; candidates predicted alike are one row naming the
    others ("also attn=flash", `DryRunReport.rows`). From `WIDE` columns: knobs, the predicted peak split
    into parts, its error bound, fit, speed, host RAM, and from `REASONS` each row's reason; narrower: knobs,
    peak, fit, speed (and host RAM where a row offloads), numbers never split; the chosen row's parts follow in
    `breakdown_table`."""
    rows = shown_rows(report, top)
    shown = tuple(row[0] for row in rows)
    count = sum(len(row) for row in rows)
    where = report.layout
    machines = (f"{where.nodes} nodes x {where.per_node} x {report.gpu.name}" if where else
                f"{report.num_gpus} x {report.gpu.name}")
    network = f", {where.inter_node_gbps:g} GB/s per GPU across nodes" if where else ""
    title = (f"{report.model} on {machines} ({format_size(report.gpu.memory_bytes)}{network}, "
             f"fit limit {format_size(report.fit_limit)}): {count} of {len(report.candidates)} candidates"
             + (f" in {len(rows)} rows" if count > len(rows) else "")
             + (f"; per sample: {report.batch}" if report.batch else ""))
    wide, reasons = width >= WIDE, width >= REASONS
    host = any(c.estimate.cpu_bytes for c in shown)
    # each row's bound: a column where the table is wide; narrower, each bound and its basis once below it
    # ("engine" for the rows with a sharding engine, the model's family/kernel for the rest)
    bounds = wide
    columns = ["#", "configuration", *(PARTS if wide else ()), "peak/GPU", *(("bound",) if bounds else ()), "fits",
               "samples/s",
               *(("host RAM",) if wide or host else ()), *(("reason",) if reasons else ())]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for name in columns:
        text = name in ("configuration", "reason")
        table.add_column(name, justify="left" if text or name == "fits" else "right", overflow="fold",
                         no_wrap=not text, ratio=(3 if name == "reason" else 2) if text else None)
    for index, (candidate, *others) in enumerate(rows, 1):
        parts = candidate.estimate.breakdown.to_dict()
        cells = [str(index), ("★ " if candidate is report.chosen else "") + escape(candidate.config.describe()
                                                                                + also(candidate, others)),
                 *(format_size(parts[p]) for p in PARTS if wide), format_size(candidate.peak_bytes),
                 *((bound_cell(candidate),) if bounds else ()), fit_cell(candidate), f"{candidate.samples_per_s:,.1f}"]
        if wide or host:
            cells.append(format_size(candidate.estimate.cpu_bytes) if candidate.estimate.cpu_bytes else "-")
        if reasons:
            cells.append(escape(short_reason(candidate)))
        table.add_row(*cells, style="bold" if candidate is report.chosen else None)
    return table


def shown_rows(report: DryRunReport, top: int) -> tuple[tuple[Candidate, ...], ...]:
    """The rows the table shows (`DryRunReport.rows`: a candidate and its twins): the first `top` (all for 0
    or less)."""
    return report.rows if top <= 0 else report.rows[:top]


def fit_cell(candidate: Candidate) -> str:
    """"yes" / "near" (fits as predicted, not at its error bound) / "no", with "~" where the verdict rests
    on the activation formula (not simulated); "?" where the formula has no bound for the model (no verdict)."""
    if candidate.estimate.upper_bytes is None:
        return "[yellow]?[/]"
    mark = "" if candidate.estimate.simulated else "~"
    if candidate.near_limit:
        return f"[yellow]near{mark}[/]"
    return f"[green]yes{mark}[/]" if candidate.fits else f"[red]no{mark}[/]"


def bound_cell(candidate: Candidate) -> str:
    """The peak's error bound upwards, "+4%"; "?" where it has none."""
    bound = candidate.estimate.error_bound
    return "?" if bound is None else f"+{bound:.0%}"


def memory_note(rows: tuple[Candidate, ...]) -> str:
    """Which memory the peaks are and what each bound rests on, once under the table."""
    if not rows:
        return ""
    bases = sorted({(c.estimate.error_bound, c.estimate.bound_basis) for c in rows if c.estimate.bound_basis},
                   key=lambda pair: (pair[0] or 0, pair[1]))
    return (f"peak/GPU: the predicted {rows[0].estimate.memory.value} per GPU"
            + (" (the caching allocator's reserved peak plus the CUDA context and workspaces: what decides an "
               "out-of-memory error)" if rows[0].estimate.memory.value == "reserved + context" else "")
            + "; bound: how much higher the true peak may be ("
            + "; ".join(f"+{value:.0%}, {basis}" for value, basis in bases if value is not None)
            + "); near: fits as predicted, not at its bound.")


def breakdown_table(candidate: Candidate) -> Table:
    """The predicted peak of one candidate, part by part (bytes per GPU), with the overhead's terms."""
    table = Table(title=f"Predicted peak of {candidate.config.describe()}", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_header=False)
    table.add_column("part", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("what", overflow="fold")
    for name, value in candidate.estimate.breakdown.to_dict().items():
        if name == "gathered" and not value:
            continue  # nothing is sharded
        what = {"overhead": ", ".join(f"{term} {format_size(b)}" for term, b in candidate.estimate.terms),
                "gathered": "full weights of the layers in use, gathered from their shards"}.get(name, "")
        table.add_row(name, format_size(value), what)
    table.add_row("[bold]peak[/]", f"[bold]{format_size(candidate.peak_bytes)}[/]",
                  "the parts are not all live at once" if candidate.peak_bytes < candidate.estimate.breakdown.total else "")
    return table


def short_reason(candidate: Candidate) -> str:
    """A row's reason without the activation method (the same for most rows; printed once under the table):
    the verdict and speed, then the estimate's notes."""
    return "; ".join((candidate.verdict, *candidate.estimate.notes))


def method_note(report: DryRunReport) -> str:
    """How the activations were predicted, for the chosen or first row."""
    row = report.chosen or (report.candidates[0] if report.candidates else None)
    return row.estimate.method if row else ""


def _targets(text: str | None) -> list[str] | None:
    """--lora-targets "q_proj, v_proj" -> ["q_proj", "v_proj"]; `UsageError` when it names nothing."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UsageError(f"--lora-targets {text!r} names no module; give names such as q_proj,v_proj.")
    return names


def render(report: DryRunReport, console: Console, top: int, width: int) -> None:
    """The table, the chosen row's parts (narrow layout), the verdict and how it was predicted."""
    console.print(candidate_table(report, top, width))
    row = report.chosen or (report.candidates[0] if report.candidates else None)
    if row is not None and width < WIDE:
        console.print(breakdown_table(row))
    rows = [row[0] for row in shown_rows(report, top)]
    if rows:
        console.print(f"[dim]{escape(memory_note(rows))}[/]")
    if any(not c.estimate.simulated and c.estimate.upper_bytes is not None for c in rows):
        console.print("[dim]~ marks a verdict resting on the activation formula (that step could not be simulated).[/]")
    if any(c.estimate.upper_bytes is None for c in rows):
        console.print("[dim]? marks a peak that cannot be predicted: the step could not be simulated, and the "
                      "activation formula does not cover this model.[/]")
    if report.fits and report.formula_only:
        console.print(f"[bold yellow]Fits by formula only, not simulated:[/] {escape(report.reason)}")
    elif report.fits:
        console.print(f"[bold green]Chosen:[/] {escape(report.reason)}")
    elif report.unknown:
        console.print(f"[bold yellow]No verdict.[/] {escape(report.reason)}")
    else:
        console.print(f"[bold red]Nothing fits.[/] {escape(nothing_fits_words(report.reason, report.shortfall))}")
        near = len(report.near_limit)
        if near:
            console.print(f"[yellow]{near} candidate(s) near the limit:[/] they fit as predicted, not at their error "
                          "bound; autofit tune on the card decides.")
    console.print(f"[dim]Predicted in {report.seconds:.1f} s ({escape(method_note(report))}); nothing was trained: "
                  "autofit tune measures.[/]")


@click.command("dry-run")
@click.option("--model", "model_arg", required=True, help=MODEL_HELP)
@click.option("--seq-len", type=LENGTH, default=None, callback=positive_option,
              help="Tokens per sample, e.g. 4096 or 4k (at most the model's maximum); audio samples at 16 kHz for "
                   "waveform models (wav2vec2, HuBERT); none for image models.")
@click.option("--global-batch-size", type=COUNT, default=None, callback=positive_option,
              help="Samples per optimizer step over all GPUs, kept exactly; default: micro-batches up to "
                   f"{DEFAULT_MAX_MICRO_BATCH} without accumulation.")
@click.option("--gpu", default="h100-80gb", show_default=True,
              help="GPU profile (autofit gpus lists them), with the count in front where you like: 8xa100-40gb.")
@click.option("--gpu-memory", default=None, help="Memory per GPU, e.g. 20GiB: overrides the profile's.")
@click.option("--host-memory", default=None,
              help="RAM of each node, e.g. 512GiB: candidates whose offloaded states need more are ruled out.")
@click.option("--num-gpus", type=click.IntRange(min=1), default=None,
              help="Data-parallel GPUs over every node  [default: the count in --gpu, else nodes x GPUs per node, "
                   "else 1]")
@click.option("--nodes", type=click.IntRange(min=1), default=None,
              help="Machines the GPUs are on: over several, sharding within a node (hybrid FSDP2, ZeRO++) is "
                   "planned beside sharding over every GPU  [default: 1]")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None,
              help="GPUs on each node  [default: --num-gpus / --nodes, else the GPU's node type: 8 on HGX boards]")
@click.option("--node-network", default=None,
              help="Network between nodes, e.g. ib-ndr, ib-hdr, efa-p5 (autofit gpus lists them)  "
                   "[default: the GPU's node type's]")
@click.option("--inter-node-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="GB/s each GPU sends across nodes, instead of --node-network (bytes: a 400 Gb/s NIC per GPU "
                   "is 50).")
@click.option("--allow", multiple=True, help=ALLOW_HELP)
@click.option("--optimizer", default="adamw", show_default=True, help=OPTIMIZER_HELP)
@click.option("--lora-targets", default=None,
              help="Modules LoRA adapts, comma-separated (e.g. q_proj,v_proj); default: every linear layer "
                   "but the output head.")
@click.option("--deferred-sync", is_flag=True,
              help="Your loop reduces gradients on an optimizer step's last micro-batch only (accelerate's "
                   "accumulate(), the Trainer without sync_each_batch): FSDP2 with accumulation holds every "
                   "gradient unsharded. Default: reduced after every micro-batch, as autofit's exports run.")
@click.option("--varied-lengths", is_flag=True,
              help="Each batch is padded to its own longest sample, up to --seq-len (no packing): predict the "
                   "reserved memory after a run of shorter batches, which the caching allocator keeps. Default: "
                   "every batch is --seq-len long.")
@click.option("--top", type=click.IntRange(min=0), default=20, show_default=True,
              help="Rows shown in the table (0: all).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout, logs on stderr.")
def dry_run_command(model_arg: str, seq_len: int | None, global_batch_size: int | None, gpu: str,
                    gpu_memory: str | None, host_memory: str | None, num_gpus: int | None, nodes: int | None,
                    gpus_per_node: int | None, node_network: str | None, inter_node_gbps: float | None,
                    allow: tuple[str, ...], optimizer: str,
                    lora_targets: str | None, deferred_sync: bool, varied_lengths: bool, top: int,
                    as_json: bool) -> int:
    """Predict, without a GPU, which training configuration fits the GPU and which is fastest."""
    from autofit.pipelines.dry_run import dry_run

    width = render_width()
    console = make_console(as_json, width)
    # a terminal sees that work is going on (a recurrent model's step simulates token by token: minutes),
    # on one line at any width: the count first, the rest cut where the terminal ends
    def line(count: str) -> str:
        text = escape(f"{count} (nothing is trained): {model_arg}")
        return text if len(text) <= width - 3 else text[:width - 4] + "…"  # the spinner and a space before it

    with console.status(line("Simulating training steps")) as status:
        def progress(done: int, total: int) -> None:
            status.update(line(f"{done} of {total} training steps simulated"))

        report = dry_run(model_arg, seq_len=seq_len, global_batch_size=global_batch_size, gpu=gpu,
                         gpu_memory=gpu_memory, num_gpus=num_gpus, nodes=nodes, gpus_per_node=gpus_per_node,
                         node_network=node_network, inter_node_gbps=inter_node_gbps, allow=parse_allow_option(allow),
                         optimizer=resolve_optimizer(optimizer), lora_targets=_targets(lora_targets), deferred_sync=deferred_sync,
                         progress=progress, host_memory=host_memory, varied_lengths=varied_lengths)
    others = other_sizes(gpu) if gpu_memory is None else []
    if others:
        count = split_count(gpu)[0]
        console.print(f"--gpu {gpu} is read as {report.gpu.name} (another of that name: "
                      + " or ".join(f"--gpu {f'{count}x' if count else ''}{name}" for name in others) + ")", style="dim")
    if gpu_memory is not None and click.get_current_context().get_parameter_source("gpu").name == "DEFAULT":
        console.print(f"--gpu-memory {gpu_memory} without --gpu: speeds are the {report.gpu.name} profile's; pass "
                      "--gpu for your card's (autofit gpus lists them).", style="dim")
    render(report, console, top, width)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    if not report.fits:
        return EXIT_FORMULA_ONLY if report.unknown else EXIT_NOTHING_FITS
    return EXIT_FORMULA_ONLY if report.formula_only else EXIT_FITS
