"""Probe one node, plan many: hybrid FSDP2 on 4 CPU ranks over gloo shards over a 2 x 2 mesh (two "nodes" of
two), so each rank holds what full sharding over one node's two ranks holds, not a quarter; on CUDA a plan over
several nodes is probed on one node's ranks, and its reason says which figures that measured."""

from __future__ import annotations

import types

import pytest
import torch

from autofit.config import Config
from autofit.job.target import Target
from autofit.job.train_spec import make_spec
from autofit.probe.launch import one_node_note, ranks_here
from autofit.probe.run import ProbeStatus
from autofit.strategies import Fsdp, MicroBatch
from autofit.strategies.fsdp import mesh_shape
from models import LinearBlocks, run_ranks

WIDTH = 512
MIB = 2**20


class Blocks(LinearBlocks):
    """Four 512x512 linear blocks: 4 MiB of fp32 weights, 16 MiB with gradients and AdamW's moments."""

    def __init__(self):
        super().__init__(WIDTH, 4)


def make_batch(n):
    return torch.randn(n, WIDTH)


def spec(ranks: int, nodes: int = 1):
    target = Target.from_device(torch.device("cpu"), ranks, 2**30, nodes)
    return make_spec(Blocks, make_batch, device="cpu", num_gpus=ranks, global_batch_size=ranks, memory_budget="1GiB",
                     warmup_steps=1, timed_steps=1, target=target)


def test_the_mesh_is_replicas_by_shards_where_several_nodes_run_and_one_dimension_on_one():
    hybrid = Config(num_gpus=4, nodes=2, sharding="fsdp_hybrid")
    assert mesh_shape(hybrid, 4) == (2, 2)  # every node here: 2 replicas of a 2-way shard
    assert mesh_shape(hybrid, 2) == (2,)  # one node probed: it shards as each node does
    assert mesh_shape(Config(num_gpus=4, nodes=2, sharding="fsdp_full"), 4) == (4,)


def test_cuda_probes_one_node_of_a_multi_node_plan_and_the_cpu_rehearses_every_node():
    config = Config(num_gpus=32, nodes=4, sharding="fsdp_hybrid")
    assert ranks_here(types.SimpleNamespace(device=torch.device("cuda", 0)), config) == 8
    assert ranks_here(types.SimpleNamespace(device=torch.device("cpu")), config) == 32
    assert ranks_here(types.SimpleNamespace(device=torch.device("cuda", 0)), Config(num_gpus=8)) == 8
    note = one_node_note(config)
    assert "one node of 4 (8 ranks)" in note and "leaves out the collectives across nodes" in note


def test_hybrid_on_a_2_by_2_mesh_holds_what_one_node_holds():
    strategies = [MicroBatch(), Fsdp()]
    hybrid = run_ranks(spec(4, nodes=2), Config(num_gpus=4, nodes=2, sharding="fsdp_hybrid"), strategies, timeout=240)
    assert hybrid.status is ProbeStatus.FIT, hybrid.reason
    every = run_ranks(spec(4), Config(num_gpus=4, sharding="fsdp_full"), strategies, timeout=240)
    one_node = run_ranks(spec(2), Config(num_gpus=2, sharding="fsdp_full"), strategies, timeout=240)
    assert every.status is ProbeStatus.FIT and one_node.status is ProbeStatus.FIT
    # a half of the 16 MiB of states per rank, against a quarter over every rank
    assert hybrid.peak_bytes - every.peak_bytes > 2 * MIB, (hybrid.reason, every.reason)
    assert hybrid.peak_bytes == pytest.approx(one_node.peak_bytes, abs=1.5 * MIB), (hybrid.reason, one_node.reason)
    assert "one node of" not in hybrid.reason  # every rank ran here: nothing left to prediction


def test_tune_over_two_nodes_of_two_rehearses_them_and_exports_a_multi_node_launch(tmp_path):
    import autofit

    plan = autofit.autofit(Blocks, make_batch, device="cpu", num_gpus=4, nodes=2, global_batch_size=4,
                           memory_budget="1GiB", strategies=[MicroBatch(), Fsdp()], warmup_steps=1, timed_steps=1)
    assert plan.fits, plan.reason
    assert plan.config.nodes == 2 and plan.config.num_gpus == 4
    hybrid = [p for p in plan.probes if p.config.sharding.value == "fsdp_hybrid"]
    assert hybrid and all(len(p.rank_peaks) == 4 for p in hybrid if p.fits)  # every rank of both nodes ran here
    script = plan.export("torchrun", tmp_path)[0].read_text()
    assert "--nnodes 2 --nproc_per_node 2 --rdzv_backend c10d" in script
    assert autofit.Plan.load(tmp_path / "plan.json").config.nodes == 2
