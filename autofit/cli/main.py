"""Entry point of the `autofit` console script.

Exit codes (docs/design.md): 0 a configuration fits, 3 nothing fits, 2 bad usage, 1 any other error. With
`--json`, stdout carries exactly one JSON document (on an error, `{"error": ..., "exit_code": ...}`);
logs go to stderr.
"""

from __future__ import annotations

import json
import re
import sys

import click

from autofit.errors import UsageError
from autofit.probe.orphans import exit_process
from autofit.units import is_unit

EXIT_FITS, EXIT_ERROR, EXIT_USAGE, EXIT_NOTHING_FITS = 0, 1, 2, 3
SIZE_OPTIONS = ("--gpu-memory", "--memory-budget")  # options whose value is a size
COUNTED_OPTION = "--gpu"  # an option whose value may start with a count of GPUs ("8xa100")
COUNT_FIRST = re.compile(r"\d+\s*[x×]", re.IGNORECASE)  # that count typed apart from the name: "8x", "8 x"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="autofit")
def cli() -> None:
    """autofit: the fastest training configuration that fits in memory, measured."""


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the exit code."""
    args = sizes_joined(sys.argv[1:] if argv is None else argv)
    error = None
    try:
        code = cli.main(args=args, standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except (click.UsageError, UsageError) as exc:
        error, code = exc.format_message() if isinstance(exc, click.UsageError) else exc.words(cli=True), EXIT_USAGE
    except click.Abort:
        error, code = "aborted", EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - the last line of defence: say what broke, exit 1
        error, code = f"{type(exc).__name__}: {exc}", EXIT_ERROR
    if error is not None:
        click.echo(f"error: {error}" if error != "aborted" else error, err=True)
        if "--json" in args:  # stdout still carries its one JSON document
            click.echo(json.dumps({"error": error, "exit_code": code}, indent=2))
    code = EXIT_FITS if code is None else int(code)
    if argv is None:  # the console script: its work is done, the interpreter's teardown is skipped
        exit_process(code)
    return code


def sizes_joined(args: list[str]) -> list[str]:
    """`args` with a value typed with a space and no quotes joined again: the shell splits
    `--gpu-memory 24 GiB` into three words and `--gpu 8x a100` into two, and click would read "GiB" and
    "a100" as extra arguments."""
    joined: list[str] = []
    for word in args:
        previous = joined[-1] if joined else ""
        option = joined[-2] if len(joined) > 1 else ""
        typed_as = previous.split("=", 1)[0] if "=" in previous else option  # --gpu-memory=24 GiB
        value = previous.split("=", 1)[1] if "=" in previous else previous
        if is_unit(word) and typed_as in SIZE_OPTIONS:
            joined[-1] = previous + word
        elif typed_as == COUNTED_OPTION and (COUNT_FIRST.fullmatch(value) and not word.startswith("-")
                                             or value.isdigit() and COUNT_FIRST.fullmatch(value + word)):
            joined[-1] = f"{previous} {word}"  # "8x a100", "8 x a100": read as `split_count` reads "8 x a100"
        else:
            joined.append(word)
    return joined


from autofit.cli.tune import tune  # noqa: E402
cli.add_command(tune)
from autofit.cli.export import export_command  # noqa: E402
cli.add_command(export_command)
from autofit.cli.dry_run import dry_run_command  # noqa: E402
cli.add_command(dry_run_command)
from autofit.cli.gpus import gpus_command  # noqa: E402
cli.add_command(gpus_command)
from autofit.cli.models import models_command  # noqa: E402
cli.add_command(models_command)

if __name__ == "__main__":
    main()
