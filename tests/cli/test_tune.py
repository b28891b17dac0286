"""`autofit tune`: the run directory it writes, --json, --resume and the exit codes (0 / 3 / 2 / 1)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from autofit import Plan
from autofit.cli.main import main
from autofit.cli.tune import parse_allow_option
from autofit.errors import UsageError
from autofit.units import format_size

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
    assert "probe 1" in captured.err and "Probes" in captured.err
    paths = document["paths"]
    plan = Plan.load(paths["plan"])
    assert plan.fits and plan.peak_memory <= 8 * 2**20
    assert (out / "trials.db").stat().st_size > 0
    events = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][:2] == ["starting", "finished"]
    assert "<img" in (out / "report.html").read_text()
    names = {os.path.basename(p) for p in paths["launchers"]}
    assert {"deepspeed.json", "accelerate_config.yaml", "trainer_args.json", "torchrun.sh"} <= names


def test_resume_reprobes_nothing(tmp_path, model_arg, capsys, monkeypatch):
    out = tmp_path / "run"
    assert tune(model_arg, out, "--json") == 0
    first = json.loads(capsys.readouterr().out)
    assert tune(model_arg, out, "--json") == 2  # the run exists: refuse to mix without --resume
    assert "--resume" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "80")  # a narrow terminal, or a pipe that asks for one
    assert tune(model_arg, out, "--json", "--resume") == 0
    captured = capsys.readouterr()
    again = json.loads(captured.out)
    assert [p["source"] for p in again["probes"] if p["status"] != "skipped"] == \
        ["stored"] * sum(p["status"] != "skipped" for p in first["probes"])
    assert again["config"] == first["config"]
    table = captured.err[captured.err.index("Probes"):]
    assert max(len(line.rstrip()) for line in table.splitlines()) <= 80 and "reasons: report.html" in table
    assert all(format_size(p["peak_bytes"]) in table for p in again["probes"] if p["peak_bytes"])  # whole figures


def test_nothing_fits_exits_3_without_launchers(tmp_path, model_arg, capsys):
    out = tmp_path / "run"
    assert tune(model_arg, out, "--json", budget="40KiB") == 3
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["fits"] is False and "No candidate fits" in document["reason"]
    # one shortfall, kept as fields, said in each one's words: plan.json's reason in Python's, the terminal's
    assert document["shortfall"]["remedy"] == "allow" and document["shortfall"]["tier"] == 1
    assert "Pass allow={'numerics'} (mixed precision" in document["reason"]
    assert "Pass --allow numerics (mixed precision" in " ".join(captured.err.split())
    assert document["paths"]["launchers"] == [] and not (out / "launch").exists()
    assert (out / "report.html").exists()


@pytest.mark.parametrize("args,message", [
    (["--model", "gtp2"], "Unknown model preset 'gtp2'"),
    (["--model", "gpt2", "--allow", "1", "--allow", "lora"], "either one tier"),
    (["--model", "gpt2", "--memory-budget", "lots"], "memory_budget must be a size"),
    (["--model", "gpt2", "--resume"], "holds no trials.db"),
    (["--model", "gpt2", "--max-probes", "0"], "--max-probes must be an integer >= 1 (probes the search may run)"),
    (["--global-batch-size", "4"], "Missing option '--model'"),
])
def test_bad_usage_exits_2(tmp_path, capsys, args, message):
    assert main(["tune", "--out", str(tmp_path / "run"), "--device", "cpu", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("values,expected", [
    (("lora", "numerics"), {"lora", "numerics"}),
    (("lora,numerics",), {"lora", "numerics"}),  # as --lora-targets takes its modules
    (("lora, quantization",), {"lora", "quantization"}),
    (("1",), 1),
    ((), None),
])
def test_allow_takes_names_repeated_or_comma_separated(values, expected):
    assert parse_allow_option(values) == expected


def test_allow_refuses_a_tier_mixed_with_names_however_given():
    with pytest.raises(UsageError, match="either one tier"):
        parse_allow_option(("1,lora",))


def test_other_errors_exit_1(tmp_path, model_arg, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert tune(model_arg, blocker / "run") == 1
    assert "error:" in capsys.readouterr().err


def test_console_script_subprocess(tmp_path, model_arg):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "autofit.cli.main", "tune", "--model", model_arg,
                           "--global-batch-size", "4", "--memory-budget", "8MiB", "--out", str(tmp_path / "run"),
                           "--json", *FAST], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["fits"] is True
    # a plain PyTorch model's search, plan, report and every launcher file import none of the libraries
    # it does not use (transformers alone took seconds: to find the model is not one of its classes)
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"transformers", "peft", "deepspeed", "accelerate"}


def test_a_bad_nvme_path_and_engine_are_usage_errors(tmp_path, model_arg, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert tune(model_arg, tmp_path / "run", "--nvme-path", str(blocker / "nvme")) == 2
    assert "not a writable folder" in capsys.readouterr().err
    assert tune(model_arg, tmp_path / "run2", "--engine", "zero") == 2


CLASSIFIER = textwrap.dedent("""
    import torch
    from layers import Block   # beside this file: the factory's folder is importable

    def make():
        model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 3))
        return model, lambda n: (torch.randn(n, 8), torch.randint(0, 3, (n,))), loss

    def loss(output, batch):
        return torch.nn.functional.cross_entropy(output, batch[1])
""")
LAYERS = "import torch\nclass Block(torch.nn.Sequential):\n    def __init__(self):\n" \
         "        super().__init__(torch.nn.Linear(8, 8), torch.nn.ReLU())\n"


def test_a_plain_classifier_tunes_with_its_loss(tmp_path, capsys):
    (tmp_path / "layers.py").write_text(LAYERS)
    (tmp_path / "cls.py").write_text(CLASSIFIER)
    assert tune(f"{tmp_path}/cls.py:make", tmp_path / "a", "--json") == 0  # the triple's loss_fn
    assert json.loads(capsys.readouterr().out)["fits"] is True
    (tmp_path / "cls2.py").write_text(CLASSIFIER.replace("), loss", ")"))  # a pair: the loss comes from --loss-fn
    assert tune(f"{tmp_path}/cls2.py:make", tmp_path / "b", "--json", "--loss-fn", f"{tmp_path}/cls.py:loss") == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert tune(f"{tmp_path}/cls2.py:make", tmp_path / "c") == 2  # no loss at all: says how to give one
    assert "--loss-fn FILE.py:fn" in capsys.readouterr().err


PLAIN_LM = textwrap.dedent("""
    import torch

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

        def forward(self, idx):
            return self.head(self.embed(idx))

    def make_model():
        return LM()

    def make_batch(n):
        return {"idx": torch.randint(0, 64, (n, 24)), "targets": torch.randint(0, 64, (n, 24))}

    def loss(logits, batch):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    def pair():
        return LM(), make_batch

    def no_count():
        return make_batch(2)
""")


def test_a_model_and_its_batches_from_two_functions(tmp_path, capsys):
    """`--model FILE.py:make_model --batch FILE.py:make_batch --loss-fn FILE.py:loss`: no wrapper factory
    returning (model, make_batch). Its dict of token ids reports tokens/s."""
    lm = tmp_path / "lm.py"
    lm.write_text(PLAIN_LM)
    assert tune(f"{lm}:make_model", tmp_path / "a", "--json", "--batch", f"{lm}:make_batch",
                "--loss-fn", f"{lm}:loss", budget="64MiB") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["tokens_per_second"] == pytest.approx(24 * plan["throughput"])
    assert plan["spec"]["tokens_per_sample"] == 24
    assert tune(f"{lm}:make_model", tmp_path / "b", "--loss-fn", f"{lm}:loss") == 2  # no batch: says --batch
    assert "--batch FILE.py:make_batch" in capsys.readouterr().err
    assert tune(f"{lm}:pair", tmp_path / "c", "--batch", f"{lm}:make_batch", "--loss-fn", f"{lm}:loss") == 2
    assert "returns its own make_batch too" in capsys.readouterr().err
    assert tune(f"{lm}:make_model", tmp_path / "d", "--batch", f"{lm}:no_count") == 2
    assert "must take the number of samples" in capsys.readouterr().err
    assert tune(f"{lm}:make_model", tmp_path / "e", "--batch", str(lm)) == 2
    assert f"write FILE.py:function, e.g. {lm}:make_batch" in capsys.readouterr().err


OPTIMIZERS = "import torch\ndef sgd(params):\n    return torch.optim.SGD(params, lr=0.05, momentum=0.9)\n"


def test_your_own_optimizer_from_a_file(tmp_path, model_arg, capsys):
    """`--optimizer FILE.py:fn`: the probes train with what `fn(params)` returns; the plan records its class
    and hyperparameters, which the torchrun script's `autofit.prepare` rebuilds, and the Trainer's
    arguments name."""
    (tmp_path / "opt.py").write_text(OPTIMIZERS)
    assert tune(model_arg, tmp_path / "run", "--json", "--optimizer", f"{tmp_path}/opt.py:sgd") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["config"]["optimizer"] == "user" and plan["spec"]["optimizer"] == "user (torch.optim.sgd.SGD)"
    assert plan["settings"]["optimizer"]["kwargs"]["momentum"] == 0.9
    args = json.loads((tmp_path / "run" / "launch" / "trainer_args.json").read_text())
    assert (args["optim"], args["learning_rate"]) == ("sgd", 0.05)


@pytest.mark.parametrize("args,message", [
    (["--seq-len", "0"], "--seq-len 0: must be an integer >= 1"),
    (["--loss-fn", "nowhere.py:loss"], "--loss-fn file .*nowhere.py does not exist"),
    (["--optimizer", "sgd"], r"--optimizer 'sgd' is not known.*on the command line, --optimizer FILE\.py:fn"),
    (["--optimizer", "opt.py"], r"--optimizer 'opt.py' names a file but no function; write FILE.py:function, "
                                r"e.g. opt.py:make_optimizer"),
    (["--optimizer", "nowhere.py:sgd"], "--optimizer file .*nowhere.py does not exist"),
])
def test_bad_values_name_the_fix(tmp_path, model_arg, capsys, args, message):
    assert tune(model_arg, tmp_path / "run", *args) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_run_refused_before_its_first_trial_leaves_no_folder_it_made(tmp_path, model_arg, capsys):
    assert tune(model_arg, tmp_path / "new", "--seq-len", "7") == 2  # refused once the model and batch are read
    assert "--seq-len 7 sets the length" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert tune(model_arg, tmp_path / "mine", "--seq-len", "7") == 2
    assert (tmp_path / "mine").is_dir()  # a folder of yours stays, with the lock file in it


def test_a_second_tune_on_the_same_out_is_refused_naming_the_first(tmp_path, model_arg, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.argv = ["autofit"]
        from autofit.cli.tune import RunLock
        from pathlib import Path
        lock = RunLock(Path({str(out)!r}))
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert tune(model_arg, out) == 2
        err = capsys.readouterr().err
        assert f"in use by a running autofit tune (pid {holder.pid} on" in err
    finally:
        holder.kill()
        holder.wait()
    assert tune(model_arg, out) == 0  # the lock died with its process


SLOW = textwrap.dedent("""
    import time
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x):
            if x.shape[0] > 2:
                raise torch.OutOfMemoryError("more than 2 samples (a test's stand-in for a small card)")
            time.sleep(0.5)
            return self.lin(x).pow(2).mean()

    def make():
        return Net(), lambda n: torch.randn(n, 8)
""")


def test_ctrl_c_records_what_finished_and_says_how_to_resume(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "autofit.cli.main", "tune", "--model", f"{tmp_path}/slow.py:make",
            "--global-batch-size", "4", "--out", str(out), "--device", "cpu", "--allow", "0", "--timed-steps", "100"]
    # As a terminal starts a foreground job: SIGINT at its default, which Python turns into KeyboardInterrupt. A
    # suite started in the background (`nohup pytest &`, a CI runner's job) runs with SIGINT ignored, and a child
    # inherits that, as a shell's background job keeps ignoring Ctrl-C.
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = out / "probes.jsonl"
    try:  # the first probe runs out of memory (a recorded result), the second is slow: interrupt it
        _wait_for(lambda: log.exists() and log.read_text().count('"starting"') == 2)
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, err[-2000:]
    assert "Interrupted. 1 finished probe(s) are recorded" in err
    resume = err.strip().splitlines()[-1].strip()
    assert resume.startswith("autofit tune --model") and resume.endswith(f"--out {out} --resume")
    assert not (out / "plan.json").exists()
    from autofit.search.trials import RESULT_ATTR
    import optuna

    (study,) = optuna.get_all_study_summaries(f"sqlite:///{out / 'trials.db'}")
    trials = optuna.load_study(study_name=study.study_name, storage=f"sqlite:///{out / 'trials.db'}").trials
    assert [t.user_attrs[RESULT_ATTR]["status"] for t in trials] == ["oom"]


def _wait_for(condition, timeout=240.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_square_brackets_in_a_reason_reach_the_terminal(capsys):
    from rich.console import Console

    from autofit.cli.tune import probe_table
    from autofit import Config, Plan
    from autofit.probe.outcome import ProbeResult, ProbeStatus

    failed = ProbeResult(Config(optimizer="adamw8bit"), ProbeStatus.ERROR,
                         "ValueError: got [the limit]; pip install 'autofit[bnb]'")
    plan = Plan(False, None, None, None, None, "nothing", (failed,), {})
    Console(width=200).print(probe_table(plan, 200))
    assert "ValueError: got [the limit]; pip install 'autofit[bnb]'" in capsys.readouterr().out


def test_at_60_columns_the_statuses_wrap_before_the_configurations_split(capsys):
    from rich.console import Console

    from autofit.cli.tune import probe_table
    from autofit import Config, Plan
    from autofit.probe.outcome import ProbeResult, ProbeStatus

    oom = ProbeResult(Config(micro_batch_size=32, optimizer="adafactor"), ProbeStatus.OOM, "out of memory",
                      oom_kind="cpu-budget")
    Console(width=60).print(probe_table(Plan(False, None, None, None, None, "nothing", (oom,), {}), 60))
    table = capsys.readouterr().out
    assert "opt=adafactor" in table and "mb=32x1" in table and "oom" in table
    assert max(len(line.rstrip()) for line in table.splitlines()) <= 60


def test_skips_are_counted_not_listed_and_the_table_lists_what_ran(tmp_path, capsys):
    from rich.console import Console

    from autofit.cli.tune import RichProgress, probe_table
    from autofit import Config, Plan
    from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, decided

    fit = ProbeResult(Config(micro_batch_size=4), ProbeStatus.FIT, "fits", 2**20, 0.1, 40.0)
    implied = [decided(Config(micro_batch_size=4, checkpointing=c), Skip.IMPLIED, "cannot be faster")
               for c in ("ops", "full")]
    excluded = decided(Config(micro_batch_size=4, optimizer="adamw8bit"), Skip.EXCLUDED, "not installed")
    predicted = decided(Config(micro_batch_size=8), Skip.PREDICTED, "predicted over")
    oom = ProbeResult(Config(micro_batch_size=2, grad_accum_steps=2, checkpointing="full"), ProbeStatus.OOM,
                      "out of memory", oom_kind="cpu-budget")
    console = Console(width=120)
    progress = RichProgress(console, tmp_path / "probes.jsonl")
    progress.starting(fit.config, "largest")
    for record in (fit, *implied, excluded, predicted, oom):
        progress.finished(record)
    live = capsys.readouterr().out
    assert "skipped 2 implied by a measured result, 1 excluded" in live and "cannot be faster" not in live
    assert live.index("skipped 2 implied") < live.index("predicted over")  # in the order they were decided
    assert len((tmp_path / "probes.jsonl").read_text().splitlines()) == 7  # every record is logged
    assert progress.finished_count == 2  # what an interrupt says is in the trial store: what ran, no skip
    plan = Plan(True, fit.config, 40.0, None, 2**20, "won", (fit, *implied, excluded, predicted, oom), {})
    console.print(probe_table(plan, 120))
    table = capsys.readouterr().out
    assert "adamw8bit" not in table and "mb=8x1" not in table and "mb=4x1" in table  # what ran, no skip
    assert "not run: 1 predicted not to fit, 2 implied by a measured result, 1 excluded" in table
    assert re.search(r"│ 6 │ fp32, ckpt=full, mb=2x2", table)  # numbered as in plan.probes and report.html


def test_tune_says_when_it_is_predicting_between_probes(tmp_path, capsys):
    """`autofit tune` shows the predictions' heartbeat (`Heartbeat`) between its probe lines."""
    from rich.console import Console

    from autofit.cli.tune import RichProgress

    progress = RichProgress(Console(width=120), tmp_path / "probes.jsonl")
    progress.predicted(6.0)
    assert capsys.readouterr().out == ""
    progress.predicted(6.0)
    assert "predicting peaks (2 predicted in 12 s: training steps simulated" in capsys.readouterr().out


def test_a_narrow_table_leaves_reasons_out_but_each_error_is_said_once_with_its_rows():
    from autofit import Config, Plan
    from autofit.cli.tune import error_lines
    from autofit.probe.outcome import ProbeResult, ProbeStatus

    fit = ProbeResult(Config(micro_batch_size=4), ProbeStatus.FIT, "fits", 2**20, 0.1, 40.0)
    dtype = [ProbeResult(Config(precision="pure_bf16", optimizer=o), ProbeStatus.ERROR, f"RuntimeError: got Float "
                         f"and BFloat16 ({o}) (at unet.py:30 in forward); pure bf16 runs with no autocast")
             for o in ("adamw", "adafactor")]
    other = ProbeResult(Config(checkpointing="full"), ProbeStatus.ERROR, "ValueError: no blocks (at model.py:3 in f)")
    plan = Plan(True, fit.config, 40.0, None, 2**20, "won", (fit, dtype[0], other, dtype[1]), {})
    assert error_lines(plan) == [f"in probes 2, 4: {dtype[0].reason}", f"in probe 3: {other.reason}"]
