"""`autofit tune`: probe a model's candidates, then write the plan, the trial store, each probe's log,
the launcher files and report.html into one run directory.

    autofit tune --model gpt2 --seq-len 512 --global-batch-size 32 --device cpu --memory-budget 4GiB --out runs/gpt2
    autofit tune --model net.py:make_model --batch net.py:make_batch --loss-fn net.py:loss --global-batch-size 64

Progress and tables go to stderr with --json (stdout then carries exactly one JSON document), else to
stdout. Exit codes: 0 fits, 3 nothing fits, 2 bad usage, 1 other errors.
"""

from __future__ import annotations

import collections
import datetime
import fcntl
import json
import os
import re
import shlex
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autofit.config import Config
from autofit.errors import UsageError
from autofit.export import export_all
from autofit.files import append_line, check_replaceable, make_folder
from autofit.plan import is_plan_json
from autofit.models.names import factory_loss_fn, resolve_batch, resolve_loss_fn, resolve_model, resolve_optimizer
from autofit.probe.outcome import ProbeResult, ProbeStatus
from autofit.report import COLORS, label, status_of, write_report
from autofit.strategies import EngineChoice
from autofit.search.options import SearchOptions
from autofit.search.trials import check_resumable
from autofit.search.walk import Heartbeat, SkipTally, failure, skip_counts
from autofit.units import format_size, parse_length

if TYPE_CHECKING:
    from autofit.plan import Plan
    from autofit.search.shortfall import Shortfall

EXIT_FITS, EXIT_NOTHING_FITS, EXIT_INTERRUPTED = 0, 3, 130  # 130: the shell's code for Ctrl-C (128 + SIGINT)
PLAN, TRIALS, PROBES_LOG, REPORT, LAUNCHERS = "plan.json", "trials.db", "probes.jsonl", "report.html", "launch"
LOCK = "tune.lock"  # held (flock) by the running tune; names it for a second one
RUN_FILES = (PLAN, TRIALS, PROBES_LOG, REPORT, LAUNCHERS)  # what a run writes into its folder
NARROW = 110  # columns under which the probe table leaves each probe's reason to report.html
DEFAULTS = SearchOptions()  # the defaults --max-probes, --warmup-steps, ... show


class RichProgress:
    """Shows each probe as it starts (the candidate and why) and as it lands, and counts the quiet skips
    decided between probes (`SkipTally`) in one line; logs every record to probes.jsonl."""

    def __init__(self, console: Console, log_path: Path):
        self.console = console
        self.log_path = log_path
        self.count = 0
        self.finished_count = 0  # probes that ran and whose result is recorded (the trial store has them)
        self._status = None
        self.tally = SkipTally()
        self.heartbeat = Heartbeat()

    def predicted(self, seconds: float) -> None:
        """A peak was predicted in `seconds`: a dim line while predicting goes on (`Heartbeat`)."""
        line = self.heartbeat.heard(seconds)
        if line:
            self.console.print(f"[dim]{line}[/]")

    def learned(self, lesson: str) -> None:
        """The walk laid an error to a knob value (`autofit.search.walk.Lesson`): said once here, the levels it
        skips counted with the other quiet skips."""
        self.flush()
        self._log({"event": "learned", "lesson": lesson})
        self.console.print(f"  [{COLORS['error']}]learned[/] [dim]{escape(lesson)}[/]", highlight=False)

    def starting(self, config: Config, why: str) -> None:
        self.flush()
        self.heartbeat.probed()
        self.count += 1
        self._log({"event": "starting", "config": config.to_dict(), "why": why})
        self.console.print(f"[bold]probe {self.count}[/] {config.describe()} [dim]({why})[/]")
        if self.console.is_terminal:
            self._status = self.console.status("training a few steps ...")
            self._status.start()

    def finished(self, result: ProbeResult) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        self._log({"event": "finished", **result.to_dict()})
        if result.skip is None:  # a skip is decided, not run, and the trial store keeps only what ran
            self.finished_count += 1
        if self.tally.held(result):
            return
        self.flush()
        speed = f", {result.samples_per_s:,.2f} samples/s" if result.samples_per_s else ""
        peak = f": peak {format_size(result.peak_bytes)}{speed}" if result.peak_bytes else ""
        self.console.print(f"  [{COLORS[status_of(result)]}]{label(result)}[/] {result.config.describe()}{peak} "
                           f"[dim]- {escape(result.reason)}[/]", highlight=False)

    def flush(self) -> None:
        """Print the quiet skips counted since the last line, if any."""
        held = self.tally.take()
        if held:
            self.console.print(f"  [{COLORS['skipped']}]skipped[/] [dim]{held} (each with its reason in "
                               f"{PROBES_LOG})[/]", highlight=False)

    def _log(self, record: dict[str, Any]) -> None:
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        append_line(self.log_path, json.dumps({"time": stamp, **record}))  # never through a link


def nothing_fits_words(reason: str, shortfall: "Shortfall | None") -> str:
    """Why nothing fits, in the command line's words (`--allow numerics`) where the plan or report keeps it as
    fields; else (a plan written before plans kept them, or no verdict) its reason as it is."""
    return shortfall.words(cli=True) if shortfall is not None else reason


def env_columns() -> int | None:
    """`COLUMNS` when set to a positive number (piped output honours it too), else None."""
    value = os.environ.get("COLUMNS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def make_console(as_json: bool) -> Console:
    """Rich console on stderr with --json (stdout is the JSON document's), else stdout; `COLUMNS` wide
    when set, else the terminal's width, else 140 columns (logs, CI) so the probe table stays readable."""
    probe = Console(stderr=as_json)
    return Console(stderr=as_json, highlight=False, width=env_columns() or (None if probe.is_terminal else 140))


ALLOW_HELP = "Tier 0-2, or names: numerics, lora, quantization (repeatable or comma-separated)."
OPTIMIZER_HELP = ("adamw, adafactor, adamw8bit, ...; or FILE.py:fn returning your optimizer for the parameters it is "
                  "given, e.g. torch.optim.SGD(params, lr=0.1).")
MODEL_HELP = ("Preset name (gpt2, llama-2-7b, ...; autofit models lists them), a Hugging Face hub id (ORG/NAME: its "
              "config.json from the local cache, else downloaded alone), a config.json or model folder, or "
              "FILE.py:make_model (returning the model, with --batch FILE.py:make_batch; or the pair (model, make_batch)).")
BATCH_HELP = ("FILE.py:make_batch: make_batch(n) returns a batch of n samples (a tensor, a tuple (inputs, targets, "
              "...) or a dict of the model's arguments), for a model whose batches autofit cannot synthesize.")


def parse_allow_option(values: tuple[str, ...]) -> Any:
    """--allow values: a tier 0-2, or names such as lora / numerics / quantization, each given on its own
    (`--allow lora --allow numerics`) or comma-separated (`--allow lora,numerics`, as --lora-targets takes)."""
    names = tuple(name.strip() for value in values for name in value.split(",") if name.strip())
    if not names:
        return None
    if len(names) == 1 and names[0].isdigit():
        return int(names[0])
    if any(v.isdigit() for v in names):
        raise UsageError(f"--allow {' '.join(values)}: give either one tier (0, 1, 2) or names, not both.")
    return set(names)


def run_dir(out: str | None, model: str, resume: bool, force: bool = False) -> tuple[Path, "RunLock"]:
    """The run directory (--out, or runs/<model>) and its lock: refuses a directory another `tune` is
    running in (naming it), a link planted where a run file goes, and a directory holding another run's files
    (unless --resume continues that run, or --force replaces its files: the old trial store and probe log are
    then removed, so nothing of that run mixes into this one)."""
    path = Path(out) if out else Path("runs") / (re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).stem) or "run")
    made = not path.exists()
    make_folder(path)
    lock = RunLock(path, made)
    try:
        _check_run_files(path, resume, force)
    except UsageError:
        lock.release()
        raise
    return path, lock


def _check_run_files(path: Path, resume: bool, force: bool) -> None:
    """`UsageError` where `path`'s run files cannot be (re)written by this run (see `run_dir`)."""
    links = [name for name in RUN_FILES if (path / name).is_symlink()]
    if links:
        raise UsageError(f"{path / links[0]} is a link (to {os.readlink(path / links[0])!r}); autofit never writes "
                         "a run's files through a link. Remove it, or choose another --out.")
    exists = (path / TRIALS).exists()
    if resume and not exists:
        raise UsageError(f"--resume: {path} holds no {TRIALS} to resume from; run without --resume first "
                         "or point --out at the interrupted run.")
    if resume:
        check_resumable(path / TRIALS)
    present = [name for name in RUN_FILES if (path / name).exists()]
    if present and not resume and not force:
        hint = "pass --resume to continue it, " if exists else ""
        raise UsageError(f"{path} already holds a run ({', '.join(present)}); {hint}pass --force to replace its "
                         "files, or choose another --out.")
    if force and not resume:
        for name in (TRIALS, PROBES_LOG):
            if (path / name).is_file():
                (path / name).unlink()
    for name, ours in ((PLAN, is_plan_json), (REPORT, None)):  # checked now, not after a long search
        check_replaceable(path / name, force=force, ours=ours)


class RunLock:
    """An exclusive lock on a run directory for one `autofit tune`: a second one on the same --out is
    refused with the first's pid, host, start time and command. The operating system releases it when
    the process ends, however it ends, so a crashed run leaves no stale lock. The lock file is made
    exclusively, never through a link; an existing one is taken only when it is a lock autofit wrote (empty,
    or naming a holder), and nothing else is ever truncated."""

    def __init__(self, folder: Path, made: bool = False):
        self.path = folder / LOCK
        self._made = made  # the folder was made for this run: one that ends with nothing in it takes it away
        self._file = _open_lock(self.path)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise UsageError(f"{folder} is in use by a running autofit tune ({holder}); wait for it to finish, "
                             "or choose another --out.") from None
        self._file.seek(0)
        held = self._file.read()
        if held and not held.startswith("pid "):
            self._file.close()
            raise UsageError(f"{self.path} exists and is not autofit's lock (it holds {held[:40]!r}); it is left as "
                             "it is. Move it away, or choose another --out.")
        self._file.seek(0)
        self._file.truncate(0)
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
                         f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}: "
                         f"{shlex.join(_command_line())}\n")
        self._file.flush()

    def release(self) -> None:
        """Unlock (the file stays: removing it could let two later runs lock two different files), unless
        the run made the folder and ended leaving nothing else in it (an error before the first trial):
        then the folder goes, so the next try starts where the first would have."""
        if self._file.closed:
            return
        self._file.truncate(0)
        if self._made and [entry.name for entry in self.path.parent.iterdir()] == [LOCK]:
            self.path.unlink()
            self.path.parent.rmdir()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def _open_lock(path: Path) -> Any:
    """The lock file at `path`, opened for reading and writing without truncating: made exclusively where
    missing; `UsageError` where a link or something other than a file is there."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except FileExistsError:
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            fd = -1
        if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
            if fd >= 0:
                os.close(fd)
            raise UsageError(f"{path} is a link or not a file; autofit never opens its lock through a link. Remove "
                             "it, or choose another --out.") from None
    return os.fdopen(fd, "r+")


def _command_line() -> list[str]:
    """The tune command as typed (from click's parsed options, so it holds under `main(argv)` too)."""
    context = click.get_current_context(silent=True)
    if context is None:
        return ["autofit", "tune"]
    words = ["autofit", "tune"]
    for param in context.command.params:
        value = context.params.get(param.name)
        if not isinstance(param, click.Option) or value in (None, False, ()) or value == param.default:
            continue
        flag = param.opts[-1] if param.opts[-1].startswith("--") else param.opts[0]
        if param.is_flag:
            words.append(flag)
        else:
            for item in value if param.multiple else (value,):
                words += [flag, str(item)]
    return words


def resume_command(out_dir: Path) -> str:
    """The command that continues an interrupted run in `out_dir`."""
    words = [w for w in _command_line() if w != "--resume"]
    if "--out" not in words:
        words += ["--out", str(out_dir)]
    return shlex.join(words + ["--resume"])


class Length(click.ParamType):
    """A sequence length as people type it: 4096, 4,096 or 4k (k = 1,024, as context lengths are named:
    8k = 8,192, 128k = 131,072)."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_length(str(value))
        except UsageError:
            self.fail(f"{value!r} is not a length: pass a whole number, e.g. 4096, or 4k (k = 1,024)", param, ctx)


LENGTH = Length()


class Count(click.ParamType):
    """A count of samples as people type it: 1024, 1,024 or 1_024. "1k" is refused with both readings, as a
    batch of "1k" is 1,000 to some and 1,024 to others (a length's k is 1,024 by the name of context lengths)."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().replace(",", "").replace("_", "")
        if text.isdigit():
            return int(text)
        if text[-1:] in ("k", "K") and text[:-1].isdigit():
            thousands = int(text[:-1])
            self.fail(f"{value!r}: pass the number of samples, {thousands * 1024} or {thousands * 1000}", param, ctx)
        self.fail(f"{value!r} is not a count of samples: pass a whole number, e.g. 256", param, ctx)


COUNT = Count()


def positive_option(context: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """Click callback: an integer option that must be >= 1 when given."""
    if value is not None and value < 1:
        what = param.help.rstrip(".")
        raise UsageError(f"{param.opts[-1]} {value}: must be an integer >= 1 ({what[:1].lower() + what[1:]}).")
    return value


def probe_table(plan: "Plan", width: int = NARROW) -> Table:
    """What ran: knobs, status, peak, throughput, and from `NARROW` columns its reason (narrower, the reasons
    stay in report.html and probes.jsonl); the chosen one starred; figures never split. The skips are counted
    by why in the caption; each row keeps its number in `plan.probes` (report.html's order)."""
    reasons = width >= NARROW
    skips = collections.Counter(p.skip for p in plan.probes if p.skip is not None)
    notes = ([f"not run: {skip_counts(skips)} (each in report.html, plan.json)"] if skips else []) + \
        ([] if reasons else ["reasons: report.html, probes.jsonl (or a wider COLUMNS)"])
    table = Table(title="Probes", show_lines=False, title_justify="left", caption="\n".join(notes) or None)
    for name, justify, wrap in (("#", "right", False), ("configuration", "left", True), ("status", "left", True),
                                ("peak", "right", False), ("samples/s", "right", False), ("reason", "left", True)):
        if name != "reason" or reasons:
            table.add_column(name, justify=justify, overflow="fold", no_wrap=not wrap)
    for index, probe in enumerate(plan.probes, 1):
        if probe.skip is not None:
            continue
        chosen = plan.fits and probe.fits and probe.config == plan.config
        table.add_row(str(index), ("★ " if chosen else "") + probe.config.describe(),
                      f"[{COLORS[status_of(probe)]}]{label(probe)}[/]", format_size(probe.peak_bytes),
                      f"{probe.samples_per_s:,.2f}" if probe.samples_per_s else "-",
                      *([escape(probe.reason)] if reasons else []), style="bold" if chosen else None)
    return table


def error_lines(plan: "Plan") -> list[str]:
    """One line per error the probes met (its type and where it was raised: `walk.failure`): the probes it
    struck, by their row in the table, and its reason."""
    struck: dict[str, list[int]] = {}
    for index, probe in enumerate(plan.probes, 1):
        if probe.status is ProbeStatus.ERROR:
            struck.setdefault(failure(probe), []).append(index)
    return [f"in probe{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}: {plan.probes[rows[0] - 1].reason}"
            for rows in struck.values()]


def write_run(plan: "Plan", out: Path, force: bool = False) -> dict[str, Any]:
    """plan.json, report.html and (when it fits) the launcher files of every format; returns the paths. Each
    written atomically, never through a link, over a file autofit did not write only with `force`."""
    paths: dict[str, Any] = {"run_dir": str(out), "plan": str(plan.save(out / PLAN, force=force)),
                             "trials": str(out / TRIALS), "probes_log": str(out / PROBES_LOG),
                             "report": str(write_report(plan, out / REPORT, force=force)), "launchers": []}
    if plan.fits:
        paths["launchers"] = [str(p) for p in export_all(plan, make_folder(out / LAUNCHERS), force=force)]
    return paths


@click.command("tune")
@click.option("--model", "model_arg", required=True, help=MODEL_HELP)
@click.option("--batch", "batch_arg", default=None, help=BATCH_HELP)
@click.option("--loss-fn", "loss_fn_arg", default=None,
              help="FILE.py:fn computing fn(output, batch) -> scalar loss, for a model whose output has no .loss.")
@click.option("--seq-len", type=LENGTH, default=None, callback=positive_option,
              help="Tokens per sample of the synthesized batch, e.g. 4096 or 4k; audio samples at 16 kHz for "
                   "waveform models; none for image models.")
@click.option("--global-batch-size", type=COUNT, default=None, callback=positive_option,
              help="Samples per optimizer step, kept exactly.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when present).")
@click.option("--memory-budget", default=None, help="e.g. 4GiB; default the card, or free RAM on the CPU.")
@click.option("--num-gpus", type=int, default=1, show_default=True, help="Data-parallel ranks to plan for.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Machines the --num-gpus ranks span: one node's ranks are probed here, and sharding within a "
                   "node is searched beside sharding over every GPU.")
@click.option("--allow", multiple=True, help=ALLOW_HELP)
@click.option("--optimizer", default="adamw", show_default=True, help=OPTIMIZER_HELP)
@click.option("--engine", type=click.Choice([e.value for e in EngineChoice]), default="auto", show_default=True,
              help="Sharding engine over several ranks: auto searches ZeRO (DeepSpeed) and FSDP2; or pin one.")
@click.option("--nvme-path", default=None,
              help="Folder on a fast local disk for NVMe offload (DeepSpeed ZeRO-3); kept in the plan and its launchers.")
@click.option("--max-probes", type=int, default=DEFAULTS.max_probes, show_default=True)
@click.option("--warmup-steps", type=int, default=DEFAULTS.warmup_steps, show_default=True)
@click.option("--timed-steps", type=int, default=DEFAULTS.timed_steps, show_default=True)
@click.option("--probe-timeout", type=float, default=DEFAULTS.probe_timeout, show_default=True,
              help="Wall seconds one probe may take before it is stopped and recorded as an error (stops a hang).")
@click.option("--exact-margin", type=float, default=DEFAULTS.exact_margin, show_default=True,
              help="How much faster a numerics change (bf16, 8-bit states, Adafactor) must be than an exact fit.")
@click.option("--out", default=None, help="Run directory (default runs/<model>).")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its trial store.")
@click.option("--force", is_flag=True, help="Replace the files of another run in --out (and files autofit did not "
              "write there) instead of refusing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout, logs on stderr.")
def tune(model_arg: str, batch_arg: str | None, loss_fn_arg: str | None, seq_len: int | None,
         global_batch_size: int | None, device: str | None, memory_budget: str | None, num_gpus: int, nodes: int,
         allow: tuple[str, ...], optimizer: Any, engine: str, nvme_path: str | None, max_probes: int,
         warmup_steps: int, timed_steps: int, probe_timeout: float, exact_margin: float, out: str | None,
         resume: bool, force: bool, as_json: bool) -> int:
    """Probe the candidates for a model and write the fastest plan that fits, with its launcher files."""
    import autofit

    console = make_console(as_json)
    model_factory, batch_factory, description = resolve_model(model_arg)
    if batch_arg:
        batch_factory, description = resolve_batch(batch_arg, model_arg), f"{description}, batches from {batch_arg}"
    loss_fn = resolve_loss_fn(loss_fn_arg) if loss_fn_arg else factory_loss_fn(model_arg)
    optimizer = resolve_optimizer(optimizer)
    out_dir, lock = run_dir(out, model_arg, resume, force)
    try:
        progress = RichProgress(console, out_dir / PROBES_LOG)
        console.print(f"Tuning {description}; run directory {out_dir}")
        try:
            options = SearchOptions(max_probes=max_probes, warmup_steps=warmup_steps, timed_steps=timed_steps,
                                    probe_timeout=probe_timeout, exact_margin=exact_margin)
            plan = autofit.autofit(model_factory, batch_factory, global_batch_size=global_batch_size, device=device,
                                   memory_budget=memory_budget, num_gpus=num_gpus, nodes=nodes,
                                   allow=parse_allow_option(allow),
                                   optimizer=optimizer, loss_fn=loss_fn, seq_len=seq_len,
                                   storage=f"sqlite:///{out_dir / TRIALS}", progress=progress, engine=engine,
                                   nvme_path=nvme_path, options=options)
        except KeyboardInterrupt:
            click.echo(f"\nInterrupted. {progress.finished_count} finished probe(s) are recorded in "
                       f"{out_dir / TRIALS} (and {PROBES_LOG}); the one running was dropped. Resume, re-probing "
                       f"nothing already measured:\n  {resume_command(out_dir)}", err=True)
            return EXIT_INTERRUPTED
        paths = write_run(plan, out_dir, force)
        console.print(probe_table(plan, console.width))
        if console.width < NARROW:  # the table left the reasons out: an error's is what the user acts on
            for line in error_lines(plan):
                console.print(f"[{COLORS['error']}]error[/] {escape(line)}", highlight=False)
        if plan.fits:
            console.print(f"[bold green]Chosen:[/] {escape(plan.summary())}")
        else:
            console.print(f"[bold red]Nothing fits.[/] {escape(nothing_fits_words(plan.reason, plan.shortfall))}")
        console.print(f"Run directory {out_dir}: {PLAN}, {TRIALS}, {PROBES_LOG}, {REPORT}"
                      + (f", launchers in {LAUNCHERS}/" if plan.fits else ""))
        if as_json:
            click.echo(json.dumps({**plan.to_dict(), "paths": paths}, indent=2))
        return EXIT_FITS if plan.fits else EXIT_NOTHING_FITS
    finally:
        lock.release()
