"""The dry-run over several nodes: hybrid and full sharding side by side with their per-GPU memory and
predicted step time (its part across nodes), the choice saying what crossing nodes costs, in Python, in
JSON and on the command line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from autofit.cli.main import main
from autofit.config import Sharding
from autofit.pipelines.dry_run import dry_run
from autofit.strategies import (ActivationOffloading, ChunkedLoss, FusedAttention, OptimizerInBackward, PureBf16,
                                default_strategies)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=512)


def rungs():
    """The rungs that decide sharding (fewer simulations than every rung)."""
    return [s for s in default_strategies() if not isinstance(s, (FusedAttention, ActivationOffloading, ChunkedLoss,
                                                                   OptimizerInBackward, PureBf16))]


def plan(gbps: float):
    return dry_run(tiny_llama(), seq_len=128, global_batch_size=16, gpu="h100", nodes=2, gpus_per_node=2,
                   inter_node_gbps=gbps, strategies=rungs())


@pytest.fixture(scope="module")
def slow():
    return plan(0.01)  # 10 MB/s across nodes: crossing them dominates every step


def same_but_sharding(candidates, like, sharding: Sharding):
    return next(c for c in candidates if c.config.sharding is sharding and
                c.config.precision is like.config.precision and c.config.checkpointing is like.config.checkpointing and
                c.config.offload is like.config.offload and c.config.optimizer is like.config.optimizer and
                c.config.micro_batch_size == like.config.micro_batch_size)


def test_hybrid_and_full_sharding_are_candidates_with_memory_and_time(slow):
    shardings = {c.config.sharding for c in slow.candidates}
    assert {Sharding.FSDP_HYBRID, Sharding.FSDP_FULL, Sharding.ZERO3_HPZ, Sharding.ZERO3}.issubset(shardings)
    assert all(c.config.nodes == 2 and c.config.num_gpus == 4 for c in slow.candidates)
    hybrid = next(c for c in slow.candidates if c.config.sharding is Sharding.FSDP_HYBRID and not c.config.offloads)
    full = same_but_sharding(slow.candidates, hybrid, Sharding.FSDP_FULL)
    assert hybrid.peak_bytes > full.peak_bytes  # a node's share of the states, not a quarter
    assert hybrid.cost.across_nodes < full.cost.across_nodes  # only a node's shard of the gradients crosses
    assert "across nodes" in hybrid.reason


def test_on_a_slow_network_the_choice_keeps_its_gathers_in_the_node_and_says_what_crossing_costs(slow):
    assert slow.chosen.config.sharding.hierarchical or not slow.chosen.config.sharding.stage
    assert "Across nodes:" in slow.reason
    fast = plan(1000.0)
    assert "Across nodes:" in fast.reason
    assert slow.chosen.step_seconds > fast.chosen.step_seconds


def test_the_json_document_carries_the_nodes_and_each_step_by_part(slow):
    document = json.loads(json.dumps(slow.to_dict()))
    assert (document["nodes"], document["gpus_per_node"], document["inter_node_gbps"]) == (2, 2, 0.01)
    parts = document["candidates"][0]["step_cost"]
    assert set(parts) == {"compute", "within_node", "across_nodes", "offload", "host"}


def test_the_command_line_names_what_a_layout_is_missing_in_its_words(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(tiny_llama().to_json_string())
    base = ["dry-run", "--model", str(config), "--seq-len", "64", "--global-batch-size", "8"]
    assert main([*base, "--gpu", "h100", "--inter-node-gbps", "25"]) == 2
    assert "--inter-node-gbps 25" in capsys.readouterr().err  # and the plan has one node: pass --nodes
    assert main([*base, "--gpu", "l4", "--nodes", "2"]) == 2
    err = capsys.readouterr().err
    assert "--nodes 2" in err and "--gpus-per-node" in err


def test_autofit_gpus_lists_the_networks_the_messages_point_to(capsys):
    assert main(["gpus", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    networks = {n["name"]: n for n in document["networks"]}
    assert networks["ib-ndr"]["gbit"] == 400 and networks["ib-ndr"]["per_gpu"]
    assert {g["name"]: g["node_network"] for g in document["gpus"]}["h100-80gb"] == "ib-ndr"
    assert main(["gpus"]) == 0
    assert "efa-p5" in capsys.readouterr().out
