"""accelerate_config.yaml is read by accelerate's own config loader, and `accelerate launch --config_file`
runs a two-step example with it on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from autofit import Config, UsageError

EXAMPLE = textwrap.dedent("""
    import json, os, sys
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    import autofit

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x.pow(2).mean()

    accelerator = Accelerator()
    prepared = autofit.prepare(os.environ["AUTOFIT_PLAN"], Net(), engine=False)  # micro-batch, checkpointing, optimizer
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=prepared.micro_batch_size)
    model, optimizer, loader = accelerator.prepare(prepared.model, prepared.optimizer, loader)
    steps = 0
    for (x,), _ in zip(loader, range(2 * accelerator.gradient_accumulation_steps)):  # two optimizer steps
        with accelerator.accumulate(model):
            accelerator.backward(model(x))
            optimizer.step()
            steps += accelerator.sync_gradients
            optimizer.zero_grad()
    json.dump({"accumulation": accelerator.gradient_accumulation_steps, "steps": steps,
               "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device),
               "processes": accelerator.num_processes, "micro_batch": x.shape[0],
               "checkpointed": "forward" in vars(prepared.model.blocks[0]),
               "optimizer": type(optimizer.optimizer).__name__}, open(sys.argv[1], "w"))
""")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loader_reads_single_process_config(tmp_path, plan_for, precision):
    plan = plan_for(Config(micro_batch_size=2, grad_accum_steps=3, precision=precision))
    config_path, *_ = plan.export("accelerate", tmp_path)
    loaded = load_config_from_file(str(config_path))
    assert loaded.distributed_type == "NO"
    assert loaded.num_processes == 1
    assert loaded.mixed_precision == {"fp32": "no", "bf16": "bf16"}[precision]
    assert loaded.use_cpu is True
    assert "40.00 MiB" in config_path.read_text()  # the measured peak, as a comment


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "nvme")])
def test_loader_reads_deepspeed_section(tmp_path, plan_for, stage, offload):
    config = Config(micro_batch_size=2, grad_accum_steps=4, num_gpus=2, sharding=f"zero{stage}", offload=offload,
                    precision="bf16")
    config_path, *_ = plan_for(config, device="cuda:0", nvme_path="/local_nvme").export("accelerate", tmp_path)
    loaded = load_config_from_file(str(config_path))
    assert loaded.distributed_type == "DEEPSPEED"
    assert loaded.num_processes == 2
    section = loaded.deepspeed_config
    assert section["zero_stage"] == stage and section["gradient_accumulation_steps"] == 4
    assert section["offload_optimizer_device"] == offload
    assert section["offload_param_device"] == (offload if stage == 3 else "none")
    if offload == "nvme":
        assert section["offload_param_nvme_path"] == "/local_nvme"


def test_multi_gpu_without_zero(tmp_path, plan_for):
    config_path, *_ = plan_for(Config(micro_batch_size=4, num_gpus=4), device="cuda:0").export("accelerate", tmp_path)
    loaded = load_config_from_file(str(config_path))
    assert (loaded.distributed_type, loaded.num_processes, loaded.use_cpu) == ("MULTI_GPU", 4, False)


def test_accelerate_launch_runs_two_steps(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=2, grad_accum_steps=3, checkpointing="full", optimizer="adafactor"))
    _, launch, _ = plan.export("accelerate", tmp_path / "launch")
    (tmp_path / "example.py").write_text(EXAMPLE)
    result_path = tmp_path / "result.json"
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    done = subprocess.run(["bash", str(launch), str(tmp_path / "example.py"), str(result_path)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(result_path.read_text())
    assert result == {"accumulation": 3, "steps": 2, "mixed_precision": "no", "device": "cpu", "processes": 1,
                      "micro_batch": 2, "checkpointed": True, "optimizer": "Adafactor"}


@pytest.mark.parametrize("fsdp,offload", [("fsdp_full", "cpu"), ("fsdp_grad_op", "none")])
def test_fsdp_section_builds_accelerates_plugin(tmp_path, plan_for, fsdp, offload):
    from accelerate.utils import FullyShardedDataParallelPlugin

    config = Config(micro_batch_size=2, grad_accum_steps=2, num_gpus=2, sharding=fsdp, offload=offload, precision="bf16")
    config_path, launch, _ = plan_for(config, device="cuda:0").export("accelerate", tmp_path)
    loaded = load_config_from_file(str(config_path))
    assert (loaded.distributed_type, loaded.num_processes) == ("FSDP", 2)
    section = loaded.fsdp_config
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=section["fsdp_version"], reshard_after_forward=section["fsdp_reshard_after_forward"],
        cpu_offload=section["fsdp_offload_params"], auto_wrap_policy=section["fsdp_auto_wrap_policy"].lower())
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is (fsdp == "fsdp_full")
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") is (offload == "cpu")
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2" in launch.read_text()
    assert "gradient_accumulation_plugin=prepared.gradient_accumulation_plugin()" in launch.read_text()


def test_the_step_in_backward_refuses_accelerate_and_pure_bf16_is_cast_in_the_script(tmp_path, plan_for):
    with pytest.raises(UsageError, match="whole-model gradients"):
        plan_for(Config(micro_batch_size=4, optimizer_step="in_backward")).export("accelerate", tmp_path)
    config_path, *_ = plan_for(Config(micro_batch_size=4, precision="pure_bf16")).export("accelerate", tmp_path)
    assert "#   pure_bf16(model)" in config_path.read_text()
    assert load_config_from_file(str(config_path)).mixed_precision == "no"
