import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from autofit import Config, Plan, UsageError
from autofit.config import Checkpointing, Engine, Offload, Precision, Sharding

FIXTURES = Path(__file__).parent / "fixtures"


def test_round_trip_through_json():
    config = Config(precision="bf16", checkpointing="every_k", checkpoint_every=2, micro_batch_size=4,
                    grad_accum_steps=8, sharding="zero2", num_gpus=2)
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert json.dumps(config.to_dict())  # str-enums serialise as they are


def test_values_become_their_knob_types():
    config = Config(precision="bf16", sharding="fsdp_full", offload="cpu")
    assert config.precision is Precision.BF16 and config.sharding is Sharding.FSDP_FULL
    assert config.offload is Offload.CPU


@pytest.mark.parametrize("field, value", [("precision", "bf61"), ("sharding", "zero7"), ("offload", "disk"),
                                          ("attention", "flash"), ("optimizer", "sgdd")])
def test_a_bad_value_names_itself_and_the_allowed_ones(field, value):
    with pytest.raises(UsageError, match=rf"{field}='{value}' is not known( \(did you mean '\w+'( or '\w+')?\?\))?; use one of"):
        Config(**{field: value})


def test_a_value_typed_close_to_a_known_one_is_named():
    with pytest.raises(UsageError, match=r"checkpointing='ful' is not known \(did you mean 'full'\?\)"):
        Config(checkpointing="ful")
    with pytest.raises(UsageError, match=r"precision='fp8' is not known; use one of"):  # nothing close: no guess
        Config(precision="fp8")


@pytest.mark.parametrize("field, value", [("micro_batch_size", 0), ("grad_accum_steps", -1), ("lora", -4),
                                          ("num_gpus", 1.5), ("micro_batch_size", True)])
def test_counts_are_checked(field, value):
    with pytest.raises(UsageError, match=field):
        Config(**{field: value})


@pytest.mark.parametrize("field, value", [("micro_batch_size", 0), ("grad_accum_steps", -1),
                                          ("micro_batch_size", True), ("grad_accum_steps", 2.0)])
def test_a_replaced_size_is_checked_as_a_new_one_is(field, value):
    with pytest.raises(UsageError, match=field):
        Config(precision="bf16").replace(**{field: value})


def test_a_replaced_size_is_the_config_built_with_it():
    level = Config(precision="bf16", checkpointing="every_k", checkpoint_every=2, num_gpus=2)
    sized = level.replace(micro_batch_size=4, grad_accum_steps=3)
    built = Config(precision="bf16", checkpointing="every_k", checkpoint_every=2, num_gpus=2, micro_batch_size=4,
                   grad_accum_steps=3)
    assert sized == built and hash(sized) == hash(built) and sized.to_dict() == built.to_dict()
    assert (level.micro_batch_size, level.grad_accum_steps) == (1, 1)  # the level itself is unchanged


def test_checkpointing_mode_and_frequency_agree():
    with pytest.raises(UsageError, match="every_k needs checkpoint_every >= 2"):
        Config(checkpointing="every_k")
    with pytest.raises(UsageError, match="checkpoint_every"):
        Config(checkpointing="full", checkpoint_every=3)
    assert Config(checkpointing="every_k", checkpoint_every=4).checkpointed_share == 0.25


def test_derived_properties():
    zero3 = Config(sharding="zero3", num_gpus=4, precision="fp16")
    assert zero3.engine is Engine.DEEPSPEED and zero3.zero_stage == 3 and zero3.shards_parameters
    assert zero3.half_precision
    fsdp = Config(sharding="fsdp_grad_op", num_gpus=2)
    assert fsdp.engine is Engine.FSDP and fsdp.zero_stage == 0 and fsdp.shards_gradients
    assert not fsdp.shards_parameters and not fsdp.half_precision
    assert Config().engine is Engine.TORCH and not Config().shards_optimizer
    assert Config(quantization="nf4", lora=8).adapters and not Config().adapters


def test_global_batch_multiplies_out():
    assert Config(micro_batch_size=4, grad_accum_steps=8, num_gpus=2).global_batch_size == 64


def test_unknown_keys_are_named():
    with pytest.raises(UsageError, match="wings"):
        Config.from_dict({**Config().to_dict(), "wings": 2})


def test_frozen_and_hashable():
    config = Config()
    with pytest.raises(Exception):
        config.precision = "bf16"
    assert {config: 1}[Config()] == 1


def test_describe_names_the_knobs():
    text = Config(precision="bf16", checkpointing="full", micro_batch_size=2, grad_accum_steps=4).describe()
    assert text == "bf16, ckpt=full, mb=2x4, opt=adamw"
    every = Config(checkpointing=Checkpointing.EVERY_K, checkpoint_every=3, sharding="zero2", num_gpus=2)
    assert every.describe() == "fp32, ckpt=every_3, mb=1x1, opt=adamw, shard=zero2, gpus=2"


def test_configs_of_autofit_0_1_still_load():
    old = {"precision": "bf16", "attention": "default", "checkpointing": "every_2", "micro_batch_size": 4,
           "grad_accum_steps": 2, "optimizer": "adamw", "zero_stage": 2, "fsdp": "none", "offload": "none",
           "quantization": "none", "lora": 0, "num_gpus": 2}
    config = Config.from_dict(old)
    assert config.sharding is Sharding.ZERO2 and config.checkpoint_every == 2
    fsdp = Config.from_dict({**old, "zero_stage": 0, "fsdp": "full_shard"})
    assert fsdp.sharding is Sharding.FSDP_FULL
    with pytest.raises(UsageError, match="two sharding engines"):
        Config.from_dict({**old, "fsdp": "full_shard"})


def test_a_plan_saved_by_autofit_0_1_still_loads(tmp_path):
    path = shutil.copy(FIXTURES / "plan-v0.1.json", tmp_path / "plan.json")
    plan = Plan.load(path)
    assert plan.fits and plan.config.sharding is Sharding.ZERO2
    statuses = [(p.status.value, p.skip.value if p.skip else None, p.source.value) for p in plan.probes]
    assert statuses == [("fit", None, "probed"), ("oom", None, "probed"), ("pruned", None, "probed"),
                        ("skipped", "implied", "decided"), ("skipped", "predicted", "decided"),
                        ("skipped", "budget", "decided"), ("error", None, "probed"), ("fit", None, "stored")]
    assert Plan.load(plan.save(tmp_path / "again.json")) == plan


def test_a_plans_repr_is_one_line_with_its_probes_counted():
    plan = Plan.load(FIXTURES / "plan-v0.1.json")
    many = dataclasses.replace(plan, probes=plan.probes * 100)  # a search decides hundreds of candidates
    shown = repr(many)
    assert "\n" not in shown and len(shown) < 600
    assert "probes=800 (400 run, 100 saved by the estimator)" in shown
    assert "peak_memory=10485760 (10.00 MiB)" in shown and "sharding='zero2'" in shown
    assert "probes=" in repr(dataclasses.replace(plan, fits=False, config=None, throughput=None, peak_memory=None))
