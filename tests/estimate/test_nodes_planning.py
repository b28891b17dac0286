"""Several nodes: the target's layout and network, hybrid sharding and ZeRO++ as candidates with the rules
between them, the per-GPU states they leave (a node's share; hpZ's second partition), and a cost model that
charges each collective to the slowest link it crosses."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from autofit.config import Config, Sharding
from autofit.devices.gpus import get_gpu, get_network, layout
from autofit.errors import UsageError
from autofit.estimate.cost_model import Links, collective_seconds
from autofit.estimate.estimator import Estimator
from autofit.estimate.states import model_states
from autofit.job.target import Target
from autofit.job.train_spec import make_spec
from autofit.search.rules import violation
from autofit.strategies import Fsdp, Zero

H100 = get_gpu("h100")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def facts():
    llama = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=512)
    spec = make_spec(llama, seq_len=64, device="cpu", memory_budget="4GiB", num_gpus=8)
    return Estimator(spec, target="cuda").facts


def spec_on(nodes: int, per_node: int, cuda: bool = True):
    llama = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128)
    target = Target.from_profile(H100, nodes * per_node, nodes, 50.0)
    if not cuda:
        target = Target("cpu", "cpu", nodes * per_node, 2**32, False, "cpu", frozenset(), None, True, nodes)
    return make_spec(llama, seq_len=32, device="cpu", memory_budget="4GiB", num_gpus=nodes * per_node,
                     target=target)


# -- the layout ---------------------------------------------------------------------------------------

def test_an_hgx_node_type_and_its_network_fill_in_what_is_not_given():
    where = layout(H100, None, nodes=4)
    assert (where.nodes, where.per_node, where.count) == (4, 8, 32)
    assert where.inter_node_gbps == 50.0  # a 400 Gb/s NDR NIC per GPU
    assert layout(H100, 32, nodes=4).per_node == 8 and layout(H100, None, gpus_per_node=8, nodes=2).count == 16
    shared = layout(H100, None, nodes=2, node_network="efa-p5")  # 3,200 Gb/s per node of 8
    assert shared.inter_node_gbps == pytest.approx(3200 / 8 / 8)
    assert layout(H100, None, nodes=2, inter_node_gbps=12.5).inter_node_gbps == 12.5
    assert layout(H100, 8) == layout(H100, 8, nodes=None)  # one node as before
    assert get_network("NDR").name == "ib-ndr"


@pytest.mark.parametrize("kwargs,words", [
    ({"count": 30, "nodes": 4}, "num_gpus=30 over nodes=4: .* a multiple"),
    ({"count": 30, "nodes": 4, "gpus_per_node": 8}, "num_gpus=30 is not nodes=4 x gpus_per_node=8 GPUs \\(32\\)"),
    ({"count": None, "node_network": "ib-ndr"}, "the plan has one node"),
    ({"count": None, "nodes": 2, "node_network": "ib-xdr"}, "Unknown node network 'ib-xdr'"),
])
def test_a_layout_that_does_not_add_up_names_the_options(kwargs, words):
    count = kwargs.pop("count")
    with pytest.raises(UsageError, match=words):
        layout(H100, count, **kwargs)


def test_a_card_without_a_node_type_asks_for_the_node_size():
    with pytest.raises(UsageError, match="no common node type"):
        layout(get_gpu("l4"), None, nodes=2)
    with pytest.raises(UsageError, match="name the network between them"):
        layout(get_gpu("l4"), None, nodes=2, gpus_per_node=4)
    with pytest.raises(UsageError, match="multiple of the nodes"):
        Target.from_profile(H100, 30, 4)
    with pytest.raises(UsageError, match="multiple of nodes"):
        Config(num_gpus=30, nodes=4)


# -- candidates and rules -----------------------------------------------------------------------------

def test_hierarchical_sharding_is_offered_over_several_nodes_only():
    one, four = spec_on(1, 8), spec_on(4, 8)
    assert Sharding.FSDP_HYBRID not in [o.value for o in Fsdp().options(one)]
    offered = {o.value: o for o in Fsdp().options(four) + Zero().options(four)}
    assert offered[Sharding.FSDP_HYBRID].available and "4 x 8 mesh" in offered[Sharding.FSDP_HYBRID].reason
    assert offered[Sharding.ZERO3_HPZ].available and offered[Sharding.ZERO3_HPZ].tier == 0
    assert offered[Sharding.ZERO3_HPZ_QUANTIZED].tier == 1  # the communicated weights and gradients are rounded
    on_cpu = {o.value: o for o in Zero().options(spec_on(2, 2, cuda=False))}
    assert not on_cpu[Sharding.ZERO3_HPZ_QUANTIZED].available and "CUDA" in on_cpu[Sharding.ZERO3_HPZ_QUANTIZED].reason


def test_the_rules_keep_hierarchy_to_several_nodes_its_partition_on_the_gpu_and_quantizing_to_16_bits():
    target = spec_on(4, 8).target
    assert violation(Config(num_gpus=8, sharding="fsdp_hybrid"), target)[1].startswith("fsdp_hybrid shards")
    assert violation(Config(num_gpus=32, nodes=4, sharding="fsdp_hybrid", precision="bf16"), target) is None
    offloaded = violation(Config(num_gpus=32, nodes=4, sharding="zero3_hpz", offload="cpu", precision="bf16"), target)
    assert "secondary partition" in offloaded[1]
    assert "in fp32 use zero3_hpz" in violation(Config(num_gpus=32, nodes=4, sharding="zero3_hpz_quantized"), target)[1]


def test_hybrid_saves_less_than_sharding_over_every_gpu():
    full = Config(num_gpus=32, nodes=4, sharding="fsdp_full")
    hybrid = Config(num_gpus=32, nodes=4, sharding="fsdp_hybrid")
    zero3, hpz = (Config(num_gpus=32, nodes=4, sharding=s) for s in ("zero3", "zero3_hpz"))
    assert Fsdp().saves_at_least(full, hybrid) and not Fsdp().saves_at_least(hybrid, full)
    assert Zero().saves_at_least(zero3, hpz) and not Zero().saves_at_least(hpz, zero3)


# -- per-GPU states -----------------------------------------------------------------------------------

def test_hybrid_holds_what_full_sharding_over_one_node_holds(facts):
    hybrid = model_states(facts, Config(num_gpus=8, nodes=2, sharding="fsdp_hybrid", precision="bf16"))
    one_node = model_states(facts, Config(num_gpus=4, sharding="fsdp_full", precision="bf16"))
    every_gpu = model_states(facts, Config(num_gpus=8, nodes=2, sharding="fsdp_full", precision="bf16"))
    assert hybrid == one_node
    assert every_gpu.params < hybrid.params and every_gpu.optimizer < hybrid.optimizer


def test_hpz_adds_a_partition_of_the_16_bit_weights_over_a_node(facts):
    zero3 = model_states(facts, Config(num_gpus=8, nodes=2, sharding="zero3", precision="bf16"))
    hpz = model_states(facts, Config(num_gpus=8, nodes=2, sharding="zero3_hpz", precision="bf16"))
    assert hpz.params - zero3.params == pytest.approx(2 * facts.trainable_params / 4, abs=2)
    assert (hpz.grads, hpz.optimizer) == (zero3.grads, zero3.optimizer)


# -- the cost of crossing nodes -----------------------------------------------------------------------

def test_a_collective_over_every_gpu_runs_at_the_network_and_hybrid_sends_a_node_share_across():
    links = Links(within=450e9, across=50e9, nodes=4)
    grads, weights = 2e9, 2e9  # bytes of 16-bit gradients and weights
    full = Config(num_gpus=32, nodes=4, sharding="fsdp_full", grad_accum_steps=4)
    hybrid = Config(num_gpus=32, nodes=4, sharding="fsdp_hybrid", grad_accum_steps=4)
    full_within, full_across = collective_seconds(full, links, grads, weights)
    hybrid_within, hybrid_across = collective_seconds(hybrid, links, grads, weights)
    assert full_within == 0  # a ring over every GPU runs at its slowest link
    # the gradients' reduce-scatter + all-gather (2) and both gathers of every micro-step (2 x 4), at 50 GB/s
    assert full_across == pytest.approx((2 + 8) * 31 / 32 * 2e9 / 50e9)
    assert hybrid_across == pytest.approx(2 * 3 / 4 * (2e9 / 8) / 50e9)  # a node's shard among its 4 replicas
    assert hybrid_within == pytest.approx((2 + 8) * 7 / 8 * 2e9 / 450e9)
    one_node = collective_seconds(Config(num_gpus=8, sharding="fsdp_full", grad_accum_steps=4),
                                  Links(450e9, None), grads, weights)
    assert one_node[1] == 0 and one_node[0] == pytest.approx(10 * 7 / 8 * 2e9 / 450e9)


def test_hpz_gathers_the_backward_within_a_node_and_quantized_halves_the_forward():
    links = Links(within=450e9, across=50e9, nodes=4)
    zero3, hpz, quantized = (collective_seconds(Config(num_gpus=32, nodes=4, sharding=s, precision="bf16"), links,
                                                2e9, 2e9) for s in ("zero3", "zero3_hpz", "zero3_hpz_quantized"))
    assert hpz[1] < zero3[1] and hpz[0] > 0  # the backward's gather moved onto the node's links
    assert quantized[1] == pytest.approx(31 / 32 * (2 * 0.25 * 2e9 + 0.5 * 2e9) / 50e9)
