"""Plans over several nodes export what each launcher needs, read by the real tools: torchrun meets across
two "nodes" on this machine at a c10d rendezvous; DeepSpeed's runner parses the hostfile and the launch line;
accelerate loads the multi-machine config and merges the launch line's rank and address into it; the
Trainer takes the arguments and the 2-D mesh of hybrid sharding."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap

import pytest

from autofit import Config
from autofit.export.nodes import shell_join

SCRIPT = textwrap.dedent("""
    import json, os, sys
    names = ["WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "AUTOFIT_NODES", "AUTOFIT_NUM_GPUS"]
    json.dump({k: os.environ[k] for k in names}, open(sys.argv[1], "w"))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exec_words(script_text: str, env: dict[str, str], here: str) -> list[str]:
    """The words of the script's `exec` line as bash would pass them (its variables from `env`)."""
    line = next(line for line in script_text.splitlines() if line.startswith("exec "))
    for name, value in {**env, "here": here}.items():
        line = line.replace(f"${name}", value)
    return shlex.split(line)[1:]


def hybrid(sharding: str, nodes: int = 4, per_node: int = 8) -> Config:
    return Config(micro_batch_size=2, grad_accum_steps=2, num_gpus=nodes * per_node, nodes=nodes, sharding=sharding,
                  precision="bf16")


def test_torchrun_sh_on_every_node_meets_at_one_rendezvous(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=2, grad_accum_steps=2, num_gpus=2, nodes=2))
    script = plan.export("torchrun", tmp_path / "launch")[0]
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    nodes = [subprocess.Popen(["bash", str(script), str(tmp_path / "train.py"), str(tmp_path / f"node{i}.json")],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    for node in nodes:
        out, _ = node.communicate(timeout=180)
        assert node.returncode == 0, out[-2000:]
    seen = [json.loads((tmp_path / f"node{i}.json").read_text()) for i in range(2)]
    assert sorted(s["RANK"] for s in seen) == ["0", "1"] and sorted(s["GROUP_RANK"] for s in seen) == ["0", "1"]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["AUTOFIT_NODES"], s["AUTOFIT_NUM_GPUS"]) for s in seen} == \
        {("2", "1", "2", "2")}


def test_torchrun_sh_without_the_first_nodes_address_says_which_variable(tmp_path, plan_for):
    script = plan_for(Config(num_gpus=2, nodes=2)).export("torchrun", tmp_path)[0]
    env = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR"}
    done = subprocess.run(["bash", str(script), "train.py"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "set MASTER_ADDR to the address" in done.stderr
    assert "on each of the 2 nodes" in done.stderr


def test_one_node_launches_standalone_as_before(plan_for):
    from autofit.export.torchrun import command

    assert command(plan_for(Config(num_gpus=2))) == ["torchrun", "--standalone", "--nnodes", "1",
                                                     "--nproc_per_node", "2"]
    assert "nodes" not in Config(num_gpus=2).to_dict() and Config.from_dict(hybrid("fsdp_hybrid").to_dict()).nodes == 4


@pytest.mark.parametrize("sharding", ["zero3", "zero3_hpz", "zero3_hpz_quantized"])
def test_deepspeed_runner_reads_the_hostfile_and_the_launch_line(tmp_path, plan_for, sharding):
    runner = pytest.importorskip("deepspeed.launcher.runner")
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    config_path, hostfile, script = plan_for(hybrid(sharding), device="cuda:0").export("deepspeed", tmp_path)
    assert runner.fetch_hostfile(str(hostfile)) == {f"node-{i}": 8 for i in range(1, 5)}
    words = exec_words(script.read_text(), {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, str(tmp_path))
    assert words[0] == "deepspeed"
    args = runner.parse_args(["train.py" if w == "$@" else w for w in words[1:]])  # "$@": the user's script
    assert (args.hostfile, args.num_nodes, args.num_gpus, args.master_addr) == (str(hostfile), 4, 8, "10.0.0.1")
    assert args.user_script == "train.py" and args.user_args[-1] == str(config_path)
    data = json.loads(config_path.read_text())
    zero = data["zero_optimization"]
    parsed = ds_config.DeepSpeedConfig({**data, "train_batch_size": 4})  # one rank parsing: 2 x 2
    assert parsed.zero_optimization_stage == 3
    if sharding == "zero3":
        assert "zero_hpz_partition_size" not in zero
    else:
        assert parsed.zero_config.zero_hpz_partition_size == 8  # a node's GPUs
        assert parsed.zero_config.zero_quantized_weights is (sharding == "zero3_hpz_quantized")
        assert parsed.zero_config.zero_quantized_gradients is (sharding == "zero3_hpz_quantized")


def test_one_node_deepspeed_writes_no_hostfile(tmp_path, plan_for):
    paths = plan_for(Config(micro_batch_size=2, num_gpus=2, sharding="zero3"), device="cuda:0").export("deepspeed",
                                                                                                       tmp_path)
    assert [p.name for p in paths] == ["deepspeed.json"]


def test_accelerate_loads_the_machines_and_merges_each_nodes_rank_and_address(tmp_path, plan_for):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config_path, script, _ = plan_for(hybrid("fsdp_hybrid"), device="cuda:0").export("accelerate", tmp_path)
    loaded = load_config_from_file(str(config_path))
    assert (loaded.num_machines, loaded.num_processes, loaded.machine_rank) == (4, 32, 0)
    assert loaded.parallelism_config == {"parallelism_config_dp_replicate_size": 4,
                                         "parallelism_config_dp_shard_size": 8}
    words = exec_words(script.read_text(), {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511", "NODE_RANK": "3"},
                       str(tmp_path))
    assert words[:2] == ["accelerate", "launch"] and words[-1] == "$@"
    args = launch_command_parser().parse_args(words[2:-1] + ["train.py"])
    args, *_ = _validate_launch_command(args)
    assert (args.num_machines, args.machine_rank, args.main_process_ip, args.main_process_port) == \
        (4, 3, "10.0.0.1", 29511)
    assert args.num_processes == 32 and args.training_script == "train.py"
    env = {k: v for k, v in os.environ.items() if k != "NODE_RANK"}
    done = subprocess.run(["bash", str(script), "train.py"], env={**env, "MASTER_ADDR": "10.0.0.1"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "set NODE_RANK to the rank of this node" in done.stderr


def test_the_trainer_takes_the_arguments_and_the_hybrid_mesh(tmp_path, plan_for):
    from transformers import TrainingArguments

    args_path, script = plan_for(hybrid("fsdp_hybrid"), device="cuda:0").export("trainer", tmp_path)
    kwargs = json.loads(args_path.read_text())
    args = TrainingArguments(**{**kwargs, "use_cpu": True})  # no GPU here to check the FSDP arguments against
    assert args.fsdp_config["version"] == 2 and args.fsdp_config["reshard_after_forward"] is True
    text = script.read_text()
    setup = [line.strip() for line in text.splitlines() if "ParallelismConfig" in line]
    namespace = {"args": args}
    exec("\n".join(setup), namespace)  # the script's own lines, on the arguments the JSON made
    mesh = args.parallelism_config
    assert (mesh.dp_replicate_size, mesh.dp_shard_size) == (4, 8)
    assert "torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d" in text


def test_shell_join_leaves_variables_to_bash():
    assert shell_join(["a b", "$X:$Y", "c"]) == "'a b' \"$X:$Y\" c"


def test_accelerate_launches_zero_on_every_node_and_refuses_hpz_it_cannot_say(tmp_path, plan_for):
    from accelerate.commands.config.config_args import load_config_from_file

    from autofit.errors import UsageError

    config_path, *_ = plan_for(hybrid("zero3"), device="cuda:0").export("accelerate", tmp_path)
    loaded = load_config_from_file(str(config_path))
    assert loaded.deepspeed_config["deepspeed_multinode_launcher"] == "standard" and loaded.num_machines == 4
    with pytest.raises(UsageError, match="no key for ZeRO"):
        plan_for(hybrid("zero3_hpz"), device="cuda:0").export("accelerate", tmp_path / "hpz")
