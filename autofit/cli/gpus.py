"""`autofit gpus`: the GPU profiles dry-run plans against (memory, bf16, peak TFLOP/s, link bandwidths, node
type), and the networks between nodes (`--node-network`)."""

from __future__ import annotations

import dataclasses
import json

import click
from rich import box
from rich.table import Table

from autofit.cli.tune import make_console
from autofit.devices.gpus import list_gpus, list_networks
from autofit.units import format_size


FIELDS = ("name", "GPU", "memory", "bf16", "bf16 TFLOP/s", "fp16 TFLOP/s", "fp32 TFLOP/s", "PCIe GB/s",
           "GPU-GPU GB/s", "aliases")
WIDE = 130  # columns from which every field is shown; narrower: name, memory and compute
NARROW = ("name", "memory", "bf16", "16-bit TF", "fp32 TF")


@click.command("gpus")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def gpus_command(as_json: bool) -> None:
    """List the GPU profiles `autofit dry-run --gpu` accepts."""
    profiles = list_gpus()
    if as_json:
        click.echo(json.dumps({"gpus": [dataclasses.asdict(g) for g in profiles],
                               "networks": [dataclasses.asdict(n) for n in list_networks()]}, indent=2))
        return
    console = make_console(False)
    wide = console.width >= WIDE
    table = Table(title="GPU profiles (dense tensor-core TFLOP/s, FP32 accumulate)", title_justify="left",
                  box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
                  caption=None if wide else "TF: TFLOP/s (16-bit: bf16 where native, else fp16). The driver's name, "
                  "links and aliases: --json or a wider COLUMNS")
    for name in FIELDS if wide else NARROW:
        wrap = name in ("GPU", "aliases")
        table.add_column(name, justify="left" if name in ("name", "GPU", "aliases", "bf16") else "right",
                         no_wrap=not wrap, overflow="fold")
    for g in profiles:
        cells = [g.name, g.display, format_size(g.memory_bytes), "yes" if g.bf16 else "no",
                 f"{g.bf16_tflops:g}" if g.bf16_tflops else "-", f"{g.fp16_tflops:g}", f"{g.fp32_tflops:g}",
                 f"{g.pcie_gbps:g}", f"{g.interconnect_gbps:g}", ", ".join(g.aliases)]
        half = f"{g.bf16_tflops or g.fp16_tflops:g}"  # what autocast runs in: bf16 where native, else fp16
        table.add_row(*(cells if wide else [g.name, cells[2], cells[3], half, cells[6]]))
    console.print(table)
    console.print(network_table())


def network_table() -> Table:
    """The networks between nodes `autofit dry-run --node-network` takes, with what each GPU sends on 8-GPU
    nodes."""
    table = Table(title="Networks between nodes (--node-network; any other: --inter-node-gbps)", title_justify="left",
                  box=box.SIMPLE_HEAD)
    for name in ("name", "network", "GB/s per GPU (8 a node)", "aliases"):
        table.add_column(name, justify="right" if name.startswith("GB/s") else "left", overflow="fold")
    for n in list_networks():
        table.add_row(n.name, n.display, f"{n.gbps_per_gpu(8):g}", ", ".join(n.aliases))
    return table
