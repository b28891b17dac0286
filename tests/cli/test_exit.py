"""How the `autofit` console script ends: its exit handlers run and everything it wrote (Python's output and a C
library's buffered stdout) reaches a pipe, with its exit code, but the interpreter is not torn down module by
module (a second or more after torch and transformers' modeling are imported: `autofit.probe.orphans.exit_process`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, ctypes, sys
    import autofit.cli.main as cli

    class Finalized:
        def __del__(self):
            print("torn down", flush=True)

    cli.kept = Finalized()  # a module's global: an interpreter's teardown finalizes it
    atexit.register(lambda: print("exit handler ran", flush=True))
    ctypes.CDLL(None).printf(b"written by C\\n")  # buffered: stdout is a pipe
    sys.stdout.write("x" * 200_000 + "\\n")  # more than a pipe holds at once
    sys.argv = ["autofit", *sys.argv[1:]]
    cli.main()
""")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(sys.platform == "win32", reason="C's printf through ctypes.CDLL(None): POSIX")
def test_the_console_script_flushes_runs_its_exit_handlers_and_skips_the_teardown():
    done = _run("gpus")
    assert done.returncode == 0, done.stderr
    assert "x" * 200_000 in done.stdout and "written by C" in done.stdout
    assert "a100-80gb" in done.stdout  # the command's own output
    assert "exit handler ran" in done.stdout
    assert "torn down" not in done.stdout  # no module-by-module teardown


def test_a_usage_error_keeps_its_exit_code():
    done = _run("dry-run", "--model", "no-such-model")
    assert done.returncode == 2
    assert "Unknown model preset 'no-such-model'" in done.stderr
    assert "exit handler ran" in done.stdout
