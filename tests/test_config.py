import json

import pytest

from autofit import Config, UsageError


def test_round_trip_through_json():
    config = Config(precision="bf16", checkpointing="every_2", micro_batch_size=4, grad_accum_steps=8)
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


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
