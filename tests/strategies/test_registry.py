"""The registry finds the built-in strategies by the `order` each declares (it imports none by name), and the
hooks consumers ask instead of naming a technique: `rules`, `activation_knobs`, `recomputes`, `required`."""

import pytest

from autofit.config import Config
from autofit.search.rules import ORDER, rules, violation
from autofit.search.walk import activation_knobs
from autofit.strategies import BUILT_IN, default_strategies, in_order, with_required

APPLY_ORDER = ["ExpandableSegments", "MixedPrecision", "PureBf16", "FusedAttention", "ChunkedLoss",
               "ActivationCheckpointing", "ActivationOffloading", "MicroBatch", "OptimizerStates",
               "OptimizerInBackward", "Zero", "Fsdp", "DataParallel", "QuantizedBase", "Lora", "StateOffloading"]


def names(strategies):
    return [type(s).__name__ for s in strategies]


def test_the_built_ins_are_found_in_the_order_they_apply():
    assert [cls.__name__ for cls in BUILT_IN] == APPLY_ORDER
    assert names(in_order(reversed(default_strategies()))) == APPLY_ORDER
    assert names(s for s in default_strategies("fsdp") if s.rung == 6) == ["Fsdp", "DataParallel"]
    assert names(s for s in default_strategies("deepspeed") if s.rung == 6) == ["Zero", "DataParallel"]


def test_every_run_gets_the_micro_batch_the_rank_count_and_the_users_optimizer():
    added = with_required([])
    assert names(added) == ["MicroBatch", "OptimizerStates", "DataParallel"]
    assert added[1].explore is False  # the user's optimizer alone, not searched
    assert names(with_required(default_strategies()[7:8])) == names(added)  # the micro-batch given: not twice


def test_every_rule_is_checked_in_the_tables_order_the_strategies_own_among_them():
    assert [rule.name for rule in rules()] == list(ORDER)
    assert {rule.name for s in default_strategies() for rule in s.rules()} == {
        "flash-attention needs half precision", "activation offload with none or full checkpointing",
        "quantization needs LoRA", "offload needs an engine", "NVMe needs ZeRO-3", "ZeRO-Offload steps with CPU Adam",
        "8-bit states cannot step on the host", "Adafactor cannot step FSDP2 shards",
        "step in backward at accumulation 1", "ZeRO++'s node partition stays on the GPU",
        "ZeRO++ quantizes 16-bit collectives"}


@pytest.mark.parametrize("precision, refused", [("fp32", True), ("bf16", False), ("fp16", False), ("pure_bf16", False)])
def test_flash_attention_needs_a_strategy_computing_in_16_bits(precision, refused):
    broken = violation(Config(attention="flash_attention_2", precision=precision), None)
    assert (broken is not None and broken[0].name == "flash-attention needs half precision") is refused


@pytest.mark.parametrize("checkpointing, every, refused", [("none", 1, False), ("full", 1, False), ("ops", 1, True),
                                                           ("every_k", 2, True)])
def test_activation_offload_pairs_with_none_or_full_checkpointing(checkpointing, every, refused):
    broken = violation(Config(activation_offload="cpu", checkpointing=checkpointing, checkpoint_every=every), None)
    assert (broken is not None and "checkpointing=" in broken[1]) is refused


def test_the_activation_only_knobs_are_the_strategies():
    assert sorted(activation_knobs()) == sorted(["micro_batch_size", "grad_accum_steps", "checkpointing",
                                                 "checkpoint_every", "attention"])


@pytest.mark.parametrize("knobs, share", [({}, 0.0), ({"checkpointing": "full"}, 1.0), ({"checkpointing": "ops"}, 0.0),
                                          ({"checkpointing": "every_k", "checkpoint_every": 4}, 0.25)])
def test_the_recomputed_share_is_the_strategies(knobs, share):
    assert sum(s.recomputes(Config(**knobs)) for s in default_strategies()) == share


@pytest.mark.parametrize("precision, dtype", [("fp32", None), ("bf16", "bfloat16"), ("fp16", "float16"),
                                              ("pure_bf16", "bfloat16")])
def test_the_compute_dtype_is_the_strategies(precision, dtype):
    """What DeepSpeed's buffers, ZeRO's bytes per parameter and a plan's note on 16-bit weights read."""
    from autofit.strategies import compute_dtype

    found = compute_dtype(Config(precision=precision))
    assert (None if found is None else str(found).removeprefix("torch.")) == dtype
