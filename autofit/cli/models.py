"""`autofit models`: the model presets `--model` accepts by short name (published configurations, no weights)."""

from __future__ import annotations

import json

import click
from rich import box
from rich.table import Table

from autofit.cli.tune import make_console
from autofit.batches.synthetic import max_positions
from autofit.models.presets import get_preset, list_presets, preset_aliases

# (column, config attribute): read through transformers' attribute maps (GPT-2's n_layer is num_hidden_layers)
SHAPE = (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("heads", "num_attention_heads"),
         ("vocab", "vocab_size"))  # and "max len": the tokens a sample may hold (`max_positions`)
WIDE = 120  # columns from which the architecture and aliases are shown
NARROW = 62  # columns under which only the name, layers, hidden size and vocabulary are shown (no figure cut, to 44)


def preset_rows() -> list[dict]:
    """Each preset: its name, transformers class, shape and aliases (None where the model has no such field:
    ViT no vocabulary, T5 no position table: no maximum length)."""
    rows = []
    for name in list_presets():
        config = get_preset(name)
        shape = {**{column: getattr(config, attribute, None) for column, attribute in SHAPE},
                 "max len": max_positions(config) if getattr(config, "max_position_embeddings", None) else None}
        rows.append({"name": name, "architecture": config.architectures[0], **shape, "aliases": preset_aliases(name)})
    return rows


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def models_command(as_json: bool) -> None:
    """List the model presets `--model` accepts by name (any case, or an alias such as meta-llama/Llama-2-7b-hf)."""
    rows = preset_rows()
    if as_json:
        click.echo(json.dumps({"models": rows}, indent=2))
        return
    console = make_console(False)
    wide = console.width >= WIDE
    table = Table(title="Model presets (configurations only: dry-run builds them without weights)",
                  title_justify="left", box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD, pad_edge=wide,
                  caption=None if wide else "All fields, the architecture and aliases: --json or a wider COLUMNS")
    fields = (*(c for c, _ in SHAPE), "max len")
    shape = [c for c in fields if console.width >= NARROW or c in ("layers", "hidden", "vocab")]
    columns = ["name", *(["architecture"] if wide else []), *shape, *(["aliases"] if wide else [])]
    for column in columns:
        table.add_column(column, justify="left" if column in ("name", "architecture", "aliases") else "right",
                         no_wrap=column != "aliases", overflow="fold")
    for row in rows:
        cells = {**row, "aliases": ", ".join(row["aliases"])}
        table.add_row(*(str(cells[c]) if isinstance(cells[c], str) else _count(cells[c]) for c in columns))
    console.print(table)


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
