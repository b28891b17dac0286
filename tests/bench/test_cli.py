"""Every benchmark script answers `--help` with what it measures and refuses what it does not take, before it
runs (a script without options had run its benchmark on `--help` and rewritten its committed results)."""

import sys
from pathlib import Path

import pytest

from bench.cli import no_options

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_help_prints_the_docstring_and_exits(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["experiment.py", "--help"])
    with pytest.raises(SystemExit) as stopped:
        no_options("What the experiment measures.")
    assert stopped.value.code == 0 and "What the experiment measures." in capsys.readouterr().out


def test_an_option_a_script_does_not_take_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["experiment.py", "--gpu"])
    with pytest.raises(SystemExit) as stopped:
        no_options("What the experiment measures.")
    assert stopped.value.code == 2 and "unrecognized arguments: --gpu" in capsys.readouterr().err


@pytest.mark.parametrize("script", sorted(path.relative_to(BENCH).as_posix() for path in BENCH.rglob("*.py")
                                          if "vendor" not in path.parts and "__main__" in path.read_text()))
def test_every_script_parses_its_command_line(script):
    source = (BENCH / script).read_text()
    assert "argparse.ArgumentParser" in source or "no_options(__doc__)" in source
