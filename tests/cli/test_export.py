"""`autofit export PLAN.json|RUN_DIR --format ... --out DIR` on a plan measured for real."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autofit
from autofit.cli.main import main
from autofit.export import FORMATS


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x, y):
        return (self.body(x) - y).pow(2).mean()


def make_batch(n):
    return {"x": torch.randn(n, 16), "y": torch.randn(n, 1)}


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    plan = autofit.autofit(Net, make_batch, global_batch_size=4, device="cpu", memory_budget="4MiB", allow=0,
                           max_probes=1, warmup_steps=1, timed_steps=1)
    assert plan.fits
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_export_each_format(tmp_path, capsys, plan_path, fmt):
    assert main(["export", str(plan_path), "--format", fmt, "--out", str(tmp_path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["format"] == fmt and document["files"]
    for name in document["files"]:
        assert (tmp_path / name.rsplit("/", 1)[-1]).stat().st_size > 0


def test_deepspeed_file_is_what_was_measured(tmp_path, capsys, plan_path):
    main(["export", str(plan_path), "--format", "deepspeed", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "deepspeed.json").read_text())
    plan = autofit.Plan.load(plan_path)
    assert data["train_micro_batch_size_per_gpu"] == plan.config.micro_batch_size
    assert data["train_batch_size"] == 4
    assert data["autofit"]["peak_memory_bytes"] == plan.peak_memory


def test_plan_that_does_not_fit_is_refused(tmp_path, capsys, plan_path):
    data = json.loads(plan_path.read_text())
    data.update(fits=False, config=None, throughput=None, peak_memory=None, reason="No candidate fits 1 MiB.")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["export", str(bad), "--format", "torchrun", "--out", str(tmp_path / "out")]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # a plan that keeps why as fields is told in the command line's words, what to allow included
    from autofit.search.shortfall import Remedy, Shortfall

    shortfall = Shortfall(limit=2**20, capacity=2**21, margin=0.5, smallest=autofit.Config(), need=2**22,
                          basis="held", remedy=Remedy.ALLOW, tier=1)
    bad.write_text(json.dumps({**data, "reason": shortfall.words(), "shortfall": shortfall.to_dict()}))
    assert main(["export", str(bad), "--format", "torchrun", "--out", str(tmp_path / "out")]) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "nothing to export: No candidate fits 1.00 MiB" in error and "Pass --allow numerics (mixed" in error


def test_a_run_directory_exports_its_plan(tmp_path, capsys, plan_path):
    assert main(["export", str(plan_path.parent), "--format", "deepspeed", "--out", str(tmp_path / "a")]) == 0
    assert main(["export", str(plan_path), "--format", "deepspeed", "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "deepspeed.json").read_text() == (tmp_path / "b" / "deepspeed.json").read_text()


@pytest.mark.parametrize("args,message", [
    (["missing.json", "--format", "deepspeed", "--out", "x"], "Cannot read a plan"),
    (["PLAN", "--format", "slurm", "--out", "x"], "Invalid value for '--format'"),
    (["x", "--format", "deepspeed", "--out", "out"], "is a folder without a plan.json"),
])
def test_bad_usage(tmp_path, capsys, plan_path, args, message):
    (tmp_path / "x").mkdir()  # a folder that is no tune run
    args = [str(plan_path) if a == "PLAN" else str(tmp_path / a) if a in ("missing.json", "x", "out") else a for a in args]
    assert main(["export", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_trainer_export_says_what_its_json_alone_leaves_out(tmp_path, capsys, plan_path):
    import dataclasses

    from autofit import Plan

    plan = Plan.load(plan_path)
    assert main(["export", str(plan_path), "--format", "trainer", "--out", str(tmp_path / "plain")]) == 0
    assert "note:" not in capsys.readouterr().err  # fp32, no model-side knob: the JSON is the plan
    pure = dataclasses.replace(plan, config=plan.config.replace(precision="pure_bf16", checkpointing="every_k",
                                                                 checkpoint_every=2))
    path = pure.save(tmp_path / "pure.json")
    assert main(["export", str(path), "--format", "trainer", "--out", str(tmp_path / "pure")]) == 0
    assert ("trainer_args.json alone trains without precision=pure_bf16, checkpointing=every_k"
            in capsys.readouterr().err)
