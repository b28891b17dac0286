"""Every benchmark script answers `--help` with what it measures and refuses what it does not take, before it
runs (a script without options had run its benchmark on `--help` and rewritten its committed results), and
runs from any folder: each finds the checkout (autofit, bench, tests) from where it lies."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import no_options

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = sorted(path.relative_to(BENCH).as_posix() for path in BENCH.rglob("*.py")
                 if "vendor" not in path.parts and "__main__" in path.read_text())

# Runs each script named on its command line as `python SCRIPT --help` would, one after another in one
# process (torch is imported once): before each, the modules of the checkout are forgotten and sys.path is
# restored, so each script must put the checkout on the path itself. Prints {script: [exit code, stdout]}.
HELP_EACH = """
import contextlib, io, json, runpy, sys
path, answers = list(sys.path), {}
for script in sys.argv[1:]:
    for name in [n for n in sys.modules if n.split(".")[0] in ("bench", "models", "examples")]:
        del sys.modules[name]
    sys.path[:] = path
    sys.argv = [script, "--help"]
    out, code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except Exception as error:
        code = f"{type(error).__name__}: {error}"
    answers[script] = [code, out.getvalue()]
print(json.dumps(answers))
"""


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


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses_its_command_line(script):
    source = (BENCH / script).read_text()
    assert "argparse.ArgumentParser" in source or "no_options(__doc__)" in source


def test_every_script_answers_help_from_another_folder(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", HELP_EACH, *(str(BENCH / s) for s in SCRIPTS)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout.splitlines()[-1])
    for script in SCRIPTS:
        code, out = answers[str(BENCH / script)]
        assert code == 0, f"{script} --help: {code}"
        assert out.startswith(f"usage: {Path(script).name}"), f"{script} --help printed {out[:200]!r}"
    assert not list(tmp_path.iterdir())  # --help wrote nothing where it ran
