"""torchrun.sh is run for real: torchrun starts a one-process job that reads the exported environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from autofit import Config

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    names = [k for k in os.environ if k.startswith("AUTOFIT_")] + ["WORLD_SIZE", "RANK"]
    json.dump({k: os.environ[k] for k in names}, open(sys.argv[1], "w"))
""")


def run(script, target, result, tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return subprocess.run(["bash", str(script), str(target), str(result)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


def test_torchrun_launches_with_the_plan_environment(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=2, grad_accum_steps=4, precision="bf16", checkpointing="full"))
    (script,) = plan.export("torchrun", tmp_path / "launch")
    (tmp_path / "train.py").write_text(SCRIPT)
    done = run(script, tmp_path / "train.py", tmp_path / "env.json", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0"
    assert env["AUTOFIT_MICRO_BATCH_SIZE"] == "2" and env["AUTOFIT_GRAD_ACCUM_STEPS"] == "4"
    assert env["AUTOFIT_GLOBAL_BATCH_SIZE"] == "8"
    assert env["AUTOFIT_PRECISION"] == "bf16" and env["AUTOFIT_CHECKPOINTING"] == "full"
    assert "AUTOFIT_DEEPSPEED_CONFIG" not in env
    assert "8.00 samples/s" in script.read_text()


def test_zero_plan_points_at_its_deepspeed_config(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=2, grad_accum_steps=2, num_gpus=2, sharding="zero3"), device="cuda:0")
    script, ds = plan.export("torchrun", tmp_path)
    text = script.read_text()
    assert "--nproc_per_node 2" in text
    assert 'AUTOFIT_DEEPSPEED_CONFIG="$here/deepspeed.json"' in text
    assert json.loads(ds.read_text())["train_batch_size"] == 8


def test_new_knobs_travel_and_their_setup_is_named(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=4, optimizer_step="in_backward", activation_offload="cpu"),
                    device="cuda:0")
    path, = plan.export("torchrun", tmp_path)
    text = path.read_text()
    assert "AUTOFIT_OPTIMIZER_STEP=in_backward" in text and "AUTOFIT_ACTIVATION_OFFLOAD=cpu" in text
    assert "#   optimizer = InBackward(model.parameters(), torch.optim.AdamW)" in text
