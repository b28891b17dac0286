"""report.html: one self-contained page (opens offline) showing what the search measured.

Two matplotlib figures, embedded as base64 PNG: each measured candidate's peak memory against the budget,
split into model states (estimated from the parameter count and the knobs) and the rest of the measured
peak (activations and workspace); and throughput against peak memory. The chosen plan is marked in both.
A table lists every probe with its reason. `report_data(plan)` computes; `render`/`write_report` draw.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from autofit.probe.outcome import ProbeResult, ProbeStatus, Source
from autofit.units import format_size

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from autofit.plan import Plan
    from autofit.config import Config

COLORS = {"fit": "#2e7d32", "oom": "#c62828", "error": "#757575", "too slow": "#ef6c00", "skipped": "#bdbdbd"}
PARTS = ("weights", "gradients", "optimizer states", "activations & rest")
PART_COLORS = ("#1565c0", "#42a5f5", "#90caf9", "#ffb74d")


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured candidate: its label, status, peak (bytes), throughput (samples/s) and estimated parts."""

    label: str
    status: str
    peak: int
    samples_per_s: float | None
    parts: tuple[float, ...]  # bytes per PARTS entry; the last one is the measured rest
    chosen: bool


def status_of(probe: ProbeResult) -> str:
    """"fit", "oom", "error", "too slow" or "skipped" (the key of `COLORS`)."""
    return "too slow" if probe.status is ProbeStatus.PRUNED else probe.status.value


def label(probe: ProbeResult) -> str:
    """The status as tables show it: with why a skip was not run, or that a result was stored."""
    if probe.skip is not None:
        return f"{status_of(probe)} ({probe.skip.value})"
    return status_of(probe) + (" (stored)" if probe.source is Source.STORED else "")


def breakdown(config: "Config", num_params: int, peak: int) -> tuple[float, ...]:
    """Bytes of (weights, gradients, optimizer states, the rest of `peak`) for `config`: the model states by
    the usual per-parameter counts (`autofit.estimate.states.usual_states`), never above the measured peak, and
    the rest what the probe measured beyond them: activations and workspace."""
    from autofit.estimate.states import usual_states

    model_states = list(usual_states(config, num_params))
    scale = min(1.0, peak / sum(model_states)) if sum(model_states) else 1.0  # never above the measured peak
    model_states = [part * scale for part in model_states]
    return (*model_states, max(peak - sum(model_states), 0.0))


def report_data(plan: "Plan") -> list[Row]:
    """A row per candidate with a measured peak, in the order they were decided."""
    rows = []
    num_params = int(plan.spec.get("num_params") or 0)
    for probe in plan.probes:
        if not probe.peak_bytes:
            continue
        chosen = plan.fits and probe.config == plan.config and probe.fits
        rows.append(Row(probe.config.describe(), status_of(probe), probe.peak_bytes, probe.samples_per_s,
                        breakdown(probe.config, num_params, probe.peak_bytes), chosen))
    return rows


def memory_figure(rows: list[Row], budget: int, fit_limit: int) -> Figure:
    """Stacked horizontal bars of each candidate's peak against the budget and the fit limit."""
    from matplotlib.figure import Figure  # on first use: every CLI command imports this module

    fig = Figure(figsize=(9, 0.45 * len(rows) + 2.2), layout="constrained")
    ax = fig.add_subplot()
    unit = 2**20
    labels = [("★ " if r.chosen else "") + r.label for r in rows]
    left = [0.0] * len(rows)
    for index, (part, color) in enumerate(zip(PARTS, PART_COLORS)):
        widths = [r.parts[index] / unit for r in rows]
        ax.barh(labels, widths, left=left, color=color, label=part, height=0.6)
        left = [a + b for a, b in zip(left, widths)]
    for y, row in enumerate(rows):
        if row.chosen:  # outline the chosen candidate's whole bar
            ax.barh([y], [row.peak / unit], height=0.72, fill=False, edgecolor="black", linewidth=2)
        ax.text(row.peak / unit, y, f"  {format_size(row.peak)} {row.status}", va="center", fontsize=8,
                color=COLORS[row.status], fontweight="bold" if row.chosen else "normal")
    ax.axvline(budget / unit, color="#c62828", linestyle="-", linewidth=1.5, label=f"budget {format_size(budget)}")
    ax.axvline(fit_limit / unit, color="#c62828", linestyle=":", linewidth=1.2,
               label=f"fit limit {format_size(fit_limit)} (safety margin)")
    ax.set_xlim(0, max([budget, *(r.peak for r in rows)]) / unit * 1.3)
    ax.invert_yaxis()
    ax.set_xlabel("peak memory (MiB); model states estimated, the rest measured")
    fig.legend(loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return fig


def throughput_figure(rows: list[Row], budget: int) -> Figure:
    """Throughput (samples/s) against peak memory for the candidates that finished their steps."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.6), layout="constrained")
    ax = fig.add_subplot()
    unit = 2**20
    timed = [r for r in rows if r.samples_per_s]
    for status in COLORS:
        group = [r for r in timed if r.status == status]
        if group:
            ax.scatter([r.peak / unit for r in group], [r.samples_per_s for r in group], s=40,
                       color=COLORS[status], label=status, zorder=3)
    right = max([budget, *(r.peak for r in timed)]) / unit * 1.1
    for row in timed:
        flip = row.peak / unit > 0.6 * right  # labels on the right half point left, staying inside the axes
        ax.annotate(row.label, (row.peak / unit, row.samples_per_s), fontsize=7, xytext=(-6 if flip else 6, 5),
                    textcoords="offset points", color="#424242", ha="right" if flip else "left")
    for row in (r for r in timed if r.chosen):
        ax.scatter([row.peak / unit], [row.samples_per_s], s=260, marker="*", color="#fdd835",
                   edgecolors="black", zorder=4, label="chosen")
    ax.axvline(budget / unit, color="#c62828", linewidth=1.5, label=f"budget {format_size(budget)}")
    ax.set_xlim(0, right)
    ax.set_ylim(0, max(r.samples_per_s for r in timed) * 1.15 if timed else 1)
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncol=6, fontsize=8, frameon=False)
    return fig


def png(fig: Figure) -> str:
    """`fig` as a data: URI (base64 PNG)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1000px;color:#212121;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.15em;margin-top:1.6em}
.meta{color:#616161;font-size:.9em}
.verdict{border-left:6px solid VERDICT;background:#fafafa;padding:.8em 1em;margin:1em 0}
.verdict b{font-size:1.1em}
img{max-width:100%;border:1px solid #eee}
table{border-collapse:collapse;width:100%;font-size:.85em}
th,td{text-align:left;padding:.35em .5em;border-bottom:1px solid #eee;vertical-align:top}
th{background:#f5f5f5} td.num{text-align:right;white-space:nowrap}
tr.chosen{background:#fff8e1;font-weight:600}
.status{font-weight:600}
"""


def render(plan: "Plan") -> str:
    """The whole report as one HTML string (figures inlined; no network needed to open it)."""
    spec = plan.spec
    budget = int(spec.get("memory_budget") or 0)
    fit_limit = int(budget * (1 - float(spec.get("safety_margin") or 0)))
    rows = report_data(plan)
    figures = ""
    if rows:
        figures = (f'<h2>Memory of each candidate against the budget</h2><img alt="peak memory per candidate" '
                   f'src="{png(memory_figure(rows, budget, fit_limit))}">'
                   f'<h2>Throughput against peak memory</h2><img alt="throughput against peak memory" '
                   f'src="{png(throughput_figure(rows, budget))}">')
    title = f"autofit: {html.escape(str(spec.get('model')))} on {html.escape(str(spec.get('device')))}"
    style = STYLE.replace("VERDICT", COLORS["fit"] if plan.fits else COLORS["oom"])
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{style}</style></head><body><h1>{title}</h1>{_meta(plan, budget)}{_verdict(plan)}"
            f"{_comparisons(plan)}{figures}<h2>Every probe</h2>{_table(plan)}</body></html>\n")


def _meta(plan: "Plan", budget: int) -> str:
    spec = plan.spec
    parts = [f"budget {format_size(budget)} ({spec.get('budget_reason', 'given')})",
             f"global batch {spec.get('global_batch_size') or 'best micro-batch'}",
             f"{int(spec.get('num_params') or 0) / 1e6:,.1f}M parameters",
             f"batch: {spec.get('batch', '')}", f"{plan.created}", f"autofit {plan.autofit_version}"]
    return f'<p class="meta">{html.escape(" · ".join(parts))}</p>'


def _verdict(plan: "Plan") -> str:
    if not plan.fits:
        return f'<div class="verdict"><b>Nothing fits.</b><br>{html.escape(plan.reason)}</div>'
    return (f'<div class="verdict"><b>★ {html.escape(plan.config.describe())}</b>: '
            f"{html.escape(plan.figures())}<br>{html.escape(plan.reason)}</div>")


def _comparisons(plan: "Plan") -> str:
    """The confirmation's comparisons, one row each: the finalist that changes more against the choice so far
    (and what that one is: exact, or its numerics), the paired ratio with its interval and the share of
    rounds won, the margin it had to clear and the test that decided (plan.confirmation holds them)."""
    confirmation = plan.confirmation
    if confirmation is None or not confirmation.comparisons:
        return ""
    head = ("<tr><th>finalist</th><th>against</th><th>ratio</th><th>interval</th><th>faster in</th>"
            "<th>margin</th><th>decided by</th></tr>")
    rows = []
    for c in confirmation.comparisons:
        challenger, holder = confirmation.finalists[c.challenger], confirmation.finalists[c.holder]
        what = ", ".join(holder.numerics) or ("exact" if not holder.tier else f"tier {holder.tier}")
        rounds = f"{c.ratio.wins:.0%} of {c.ratio.rounds}" if c.ratio.rounds else "as probed"
        rows.append(f"<tr><td>{html.escape(challenger.config.describe())}</td>"
                    f"<td>{html.escape(holder.config.describe())} ({html.escape(what)})</td>"
                    f"<td class=num>{c.ratio.median:.2f}x</td><td class=num>{c.ratio.low:.2f}-{c.ratio.high:.2f}</td>"
                    f"<td class=num>{rounds}</td><td class=num>{c.margin:.0%} ({c.kind.value})</td>"
                    f"<td>{'taken' if c.won else 'kept the choice'}: {c.decided_by.value}</td></tr>")
    return f"<h2>The finalists re-measured back to back ({confirmation.method.value})</h2><table>{head}{''.join(rows)}</table>"


def _table(plan: "Plan") -> str:
    head = "<tr><th>#</th><th>status</th><th>configuration</th><th>peak</th><th>samples/s</th><th>reason</th></tr>"
    lines = []
    for index, probe in enumerate(plan.probes, 1):
        chosen = plan.fits and probe.fits and probe.config == plan.config
        speed = f"{probe.samples_per_s:,.2f}" if probe.samples_per_s else "-"
        lines.append(f'<tr class="{"chosen" if chosen else ""}"><td class="num">{index}</td>'
                     f'<td class="status" style="color:{COLORS[status_of(probe)]}">{"★ " if chosen else ""}'
                     f'{label(probe)}</td>'
                     f"<td>{html.escape(probe.config.describe())}</td><td class=num>{format_size(probe.peak_bytes)}</td>"
                     f"<td class=num>{speed}</td><td>{html.escape(probe.reason)}</td></tr>")
    return f"<table>{head}{''.join(lines)}</table>"


def write_report(plan: "Plan", path: str | Path, *, force: bool = False) -> Path:
    """Write report.html for `plan` to `path`; returns the path. Atomically, never through a link, never over a
    file autofit did not write unless `force` (`autofit.files.write_file`)."""
    from autofit.files import write_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file(path, render(plan), force=force)
