"""The command line of the benchmark scripts that take no options: `--help` prints what the script
measures and exits, and anything else typed is refused, before a run starts or a results file is written."""

from __future__ import annotations

import argparse


def no_options(doc: str | None) -> None:
    """Parse `sys.argv` for a script that takes no options (its docstring is the help)."""
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
