"""torchrun.sh is run for real: torchrun starts a one-process job that reads the exported environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

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
    script = plan.export("torchrun", tmp_path / "launch")[0]
    (tmp_path / "train.py").write_text(SCRIPT)
    done = run(script, tmp_path / "train.py", tmp_path / "env.json", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0"
    assert env["AUTOFIT_MICRO_BATCH_SIZE"] == "2" and env["AUTOFIT_GRAD_ACCUM_STEPS"] == "4"
    assert env["AUTOFIT_GLOBAL_BATCH_SIZE"] == "8"
    assert env["AUTOFIT_PRECISION"] == "bf16" and env["AUTOFIT_CHECKPOINTING"] == "full"
    assert "AUTOFIT_DEEPSPEED_CONFIG" not in env
    assert env["AUTOFIT_PLAN"] == str(tmp_path / "launch" / "plan.json")
    assert "8.00 samples/s" in script.read_text()


def test_zero_plan_points_at_its_deepspeed_config(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=2, grad_accum_steps=2, num_gpus=2, sharding="zero3"), device="cuda:0")
    script, plan_file, trainer, ds = plan.export("torchrun", tmp_path)
    assert plan_file.name == "plan.json" and trainer.name == "train_with_prepare.py"
    text = script.read_text()
    assert "--nproc_per_node 2" in text
    assert 'AUTOFIT_DEEPSPEED_CONFIG="$here/deepspeed.json"' in text
    assert json.loads(ds.read_text())["train_batch_size"] == 8


def test_new_knobs_travel_and_their_setup_is_named(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=4, optimizer_step="in_backward", activation_offload="cpu"),
                    device="cuda:0")
    path, *_ = plan.export("torchrun", tmp_path)
    text = path.read_text()
    assert "AUTOFIT_OPTIMIZER_STEP=in_backward" in text and "AUTOFIT_ACTIVATION_OFFLOAD=cpu" in text
    assert "#   optimizer = InBackward(model.parameters(), torch.optim.AdamW)" in text


DATA = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def make():
        return Net(), lambda n: (torch.randn(n, 8), torch.randint(0, 3, (n,))), loss

    def loss(output, batch):
        return nn.functional.cross_entropy(output, batch[1])

    def make_dataset():
        return torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
""")


OBJECTS = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, x):
            return self.body(x)

    def make():  # a model whose loss reads a different count of objects per sample (as a detector's does)
        return Net(), batch, loss

    def batch(n):
        return collate([sample(i) for i in range(n)])

    def sample(i):
        return {"x": torch.randn(8), "objects": torch.randn(1 + i % 3)}

    def loss(output, batch):
        return nn.functional.mse_loss(output[:, 0], torch.stack([o.sum() for o in batch["objects"]]))

    def make_dataset():
        return [sample(i) for i in range(32)]

    def collate(samples):  # torch's default cannot stack objects of different counts
        return {"x": torch.stack([s["x"] for s in samples]), "objects": [s["objects"] for s in samples]}
""")


def test_the_exported_script_takes_a_collate_fn_for_samples_of_different_object_counts(tmp_path, plan_for):
    """Samples holding a different count of objects each (Mask2Former's masks, DETR's boxes) need a collate
    function of one's own: the exported loop had no way to take one (torch's default cannot stack them)."""
    script = plan_for(Config(micro_batch_size=2, grad_accum_steps=2)).export("torchrun", tmp_path / "launch")[0]
    (tmp_path / "objects.py").write_text(OBJECTS)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    command = ["bash", str(script), str(tmp_path / "launch" / "train_with_prepare.py"), "--model", "objects.py:make",
               "--dataset", "objects.py:make_dataset", "--max-steps", "2"]
    done = subprocess.run([*command, "--collate-fn", "objects.py:collate"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("step ")] == ["step 1", "step 2"]
    default = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert default.returncode != 0 and "stack expects each tensor to be equal size" in default.stderr


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_exported_script_trains_with_autofit_prepare(tmp_path, plan_for, ranks):
    config = Config(micro_batch_size=2, grad_accum_steps=2, checkpointing="full", optimizer="adafactor", num_gpus=ranks)
    script = plan_for(config).export("torchrun", tmp_path / "launch")[0]
    (tmp_path / "data.py").write_text(DATA)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    done = subprocess.run(["bash", str(script), str(tmp_path / "launch" / "train_with_prepare.py"), "--model",
                           "data.py:make", "--dataset", "data.py:make_dataset", "--max-steps", "3"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2", "step 3"]  # rank 0 prints
    assert "ckpt=full, mb=2x2, opt=adafactor" in lines[0]
    bare = subprocess.run(["bash", str(script), str(tmp_path / "launch" / "train_with_prepare.py")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert bare.returncode != 0 and "pass --model and --dataset" in bare.stderr


def test_the_exported_script_takes_your_optimizer_where_the_plan_cannot_rebuild_it(tmp_path, plan_for):
    """A plan tuned with an optimizer factory whose build could not be recorded: the script says how to pass
    it (`--optimizer FILE.py:fn`) and trains with it when passed."""
    script = plan_for(Config(micro_batch_size=2, grad_accum_steps=2, optimizer="user")).export(
        "torchrun", tmp_path / "launch")[0]
    (tmp_path / "data.py").write_text(DATA + "\ndef sgd(params):\n    return torch.optim.SGD(params, lr=0.1)\n")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    command = ["bash", str(script), str(tmp_path / "launch" / "train_with_prepare.py"), "--model", "data.py:make",
               "--dataset", "data.py:make_dataset", "--max-steps", "2"]
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert refused.returncode != 0 and "train_with_prepare.py takes --optimizer FILE.py:fn" in refused.stderr
    done = subprocess.run([*command, "--optimizer", "data.py:sgd"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("step ")] == ["step 1", "step 2"]
