"""`autofit tune`: the run directory it writes, --json, --resume and the exit codes (0 / 3 / 2 / 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from autofit import Plan
from autofit.cli.main import main

MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)])

        def forward(self, x, y):
            return (self.blocks(x).mean(1) - y).pow(2).mean()

    def make():
        return Net(), lambda n: {"x": torch.randn(n, 16, 32), "y": torch.randn(n, 32)}
""")
FAST = ["--device", "cpu", "--allow", "0", "--max-probes", "2", "--warmup-steps", "1", "--timed-steps", "1"]


@pytest.fixture
def model_arg(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return f"{path}:make"


def tune(model_arg, out, *extra, budget="8MiB"):
    return main(["tune", "--model", model_arg, "--global-batch-size", "4", "--memory-budget", budget,
                 "--out", str(out), *FAST, *extra])


def test_fitting_run_writes_everything_and_one_json_document(tmp_path, model_arg, capsys):
    out = tmp_path / "run"
    assert tune(model_arg, out, "--json") == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # exactly one JSON document: this fails on anything else
    assert document["fits"] is True and document["config"]["micro_batch_size"] * document["config"]["grad_accum_steps"] == 4
    assert "probe 1" in captured.err and "Every probe" in captured.err
    paths = document["paths"]
    plan = Plan.load(paths["plan"])
    assert plan.fits and plan.peak_memory <= 8 * 2**20
    assert (out / "trials.db").stat().st_size > 0
    events = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][:2] == ["starting", "finished"]
    assert "<img" in (out / "report.html").read_text()
    names = {os.path.basename(p) for p in paths["launchers"]}
    assert {"deepspeed.json", "accelerate_config.yaml", "trainer_args.json", "torchrun.sh"} <= names


def test_resume_reprobes_nothing(tmp_path, model_arg, capsys):
    out = tmp_path / "run"
    assert tune(model_arg, out, "--json") == 0
    first = json.loads(capsys.readouterr().out)
    assert tune(model_arg, out, "--json") == 2  # the run exists: refuse to mix without --resume
    assert "--resume" in capsys.readouterr().err
    assert tune(model_arg, out, "--json", "--resume") == 0
    again = json.loads(capsys.readouterr().out)
    assert [p["source"] for p in again["probes"] if p["status"] != "skipped"] == \
        ["stored"] * sum(p["status"] != "skipped" for p in first["probes"])
    assert again["config"] == first["config"]


def test_nothing_fits_exits_3_without_launchers(tmp_path, model_arg, capsys):
    out = tmp_path / "run"
    assert tune(model_arg, out, "--json", budget="40KiB") == 3
    document = json.loads(capsys.readouterr().out)
    assert document["fits"] is False and "No candidate fits" in document["reason"]
    assert document["paths"]["launchers"] == [] and not (out / "launch").exists()
    assert (out / "report.html").exists()


@pytest.mark.parametrize("args,message", [
    (["--model", "gtp2"], "Unknown model preset 'gtp2'"),
    (["--model", "gpt2", "--allow", "1", "--allow", "lora"], "either one tier"),
    (["--model", "gpt2", "--memory-budget", "lots"], "memory_budget must be a size"),
    (["--model", "gpt2", "--resume"], "holds no trials.db"),
    (["--global-batch-size", "4"], "Missing option '--model'"),
])
def test_bad_usage_exits_2(tmp_path, capsys, args, message):
    assert main(["tune", "--out", str(tmp_path / "run"), "--device", "cpu", *args]) == 2
    assert message in capsys.readouterr().err


def test_other_errors_exit_1(tmp_path, model_arg, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert tune(model_arg, blocker / "run") == 1
    assert "error:" in capsys.readouterr().err


def test_console_script_subprocess(tmp_path, model_arg):
    done = subprocess.run([sys.executable, "-m", "autofit.cli.main", "tune", "--model", model_arg,
                           "--global-batch-size", "4", "--memory-budget", "8MiB", "--out", str(tmp_path / "run"),
                           "--json", *FAST], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["fits"] is True


def test_a_bad_nvme_path_and_engine_are_usage_errors(tmp_path, model_arg, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert tune(model_arg, tmp_path / "run", "--nvme-path", str(blocker / "nvme")) == 2
    assert "not a writable folder" in capsys.readouterr().err
    assert tune(model_arg, tmp_path / "run2", "--engine", "zero") == 2
