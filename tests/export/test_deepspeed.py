"""deepspeed.json is read by DeepSpeed's own config parser (which checks the batch arithmetic and rejects
unknown ZeRO keys)."""

from __future__ import annotations

import json

import pytest
import torch

from autofit import Config, UsageError
from autofit.export import applicable, export
from autofit.strategies.deepspeed_config import deepspeed_config

ds_config = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed is not installed (pip install deepspeed)")


def parse(data: dict):
    return ds_config.DeepSpeedConfig(data)


@pytest.mark.parametrize("stage,offload,precision", [
    (0, "none", "fp32"), (1, "none", "bf16"), (2, "cpu", "bf16"), (3, "cpu", "fp16"), (3, "nvme", "bf16")])
def test_deepspeed_parses_every_stage(tmp_path, plan_for, stage, offload, precision):
    config = Config(micro_batch_size=4, grad_accum_steps=8, sharding=f"zero{stage}" if stage else "none", offload=offload,
                    precision=precision)
    plan = plan_for(config, device="cuda:0", nvme_path=str(tmp_path))
    (path,) = export(plan, "deepspeed", tmp_path)
    parsed = parse(json.loads(path.read_text()))
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps,
            parsed.train_batch_size) == (4, 8, 32)
    assert parsed.zero_optimization_stage == stage
    assert parsed.gradient_clipping == 1.0
    assert _enabled(parsed, "bfloat16") is (precision == "bf16")
    assert _enabled(parsed, "float16") is (precision == "fp16")
    offloaded = parsed.zero_config.offload_optimizer
    assert (str(getattr(offloaded.device, "value", offloaded.device)) if offloaded else "none") == offload
    param = parsed.zero_config.offload_param
    assert (str(getattr(param.device, "value", param.device)) if param else "none") == (offload if stage == 3 else "none")
    if offload == "nvme":
        assert str(offloaded.nvme_path) == str(tmp_path)
    assert parsed.optimizer_name == "adamw"


def test_measurement_rides_along(tmp_path, plan_for):
    (path,) = export(plan_for(Config(micro_batch_size=2, grad_accum_steps=2)), "deepspeed", tmp_path)
    record = json.loads(path.read_text())["autofit"]
    assert record["throughput_samples_per_s"] == 8.0
    assert record["peak_memory_bytes"] == 40 * 2**20
    assert record["memory_budget_bytes"] == 64 * 2**20
    assert record["device"] == "cpu" and record["autofit_version"] == "0.1.0" and record["date"]


def test_the_probes_hyperparameters_are_the_files(tmp_path, plan_for):
    import dataclasses

    recorded = {"class": "torch.optim.AdamW", "kwargs": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-8,
                                                          "weight_decay": 0.1}}
    plan = dataclasses.replace(plan_for(Config(micro_batch_size=2, sharding="zero2")),
                               settings={"optimizer": recorded})
    (path,) = export(plan, "deepspeed", tmp_path)
    params = parse(json.loads(path.read_text())).optimizer_params
    assert {k: params[k] for k in recorded["kwargs"]} == recorded["kwargs"]


def test_your_own_torch_sgd_is_named_for_deepspeed(tmp_path, plan_for):
    import dataclasses

    recorded = {"class": "torch.optim.sgd.SGD", "kwargs": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}}
    plan = dataclasses.replace(plan_for(Config(micro_batch_size=2, sharding="zero2", optimizer="user")),
                               settings={"optimizer": recorded})
    (path,) = export(plan, "deepspeed", tmp_path)
    parsed = parse(json.loads(path.read_text()))
    assert parsed.optimizer_name == "SGD" and hasattr(torch.optim, parsed.optimizer_name)  # DeepSpeed's lookup
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), **parsed.optimizer_params)


def test_adafactor_is_named_and_8bit_is_left_to_the_script():
    data = deepspeed_config(Config(micro_batch_size=2, sharding="zero2", optimizer="adafactor"))
    assert data["optimizer"] == {"type": "Adafactor", "params": {"lr": 1e-2, "weight_decay": 0.0}}
    assert data["zero_allow_untested_optimizer"] is True
    parsed = parse(data)
    assert parsed.optimizer_name == "Adafactor" and hasattr(torch.optim, parsed.optimizer_name)  # DeepSpeed's lookup
    torch.optim.Adafactor(torch.nn.Linear(2, 2).parameters(), **parsed.optimizer_params)
    data = deepspeed_config(Config(micro_batch_size=2, sharding="zero2", optimizer="adamw8bit"))
    assert "optimizer" not in data and data["zero_allow_untested_optimizer"] is True  # torchrun / Trainer scripts
    parse(data)


def test_the_deepspeed_export_refuses_an_optimizer_it_cannot_name(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=2, sharding="zero2", num_gpus=2, optimizer="paged_adamw8bit"),
                    device="cuda:0")
    with pytest.raises(UsageError, match="paged_adamw8bit, which a DeepSpeed config cannot name.*export torchrun"):
        export(plan, "deepspeed", tmp_path)
    assert "deepspeed" not in applicable(plan) and "torchrun" in applicable(plan)


def test_dict_is_a_fresh_copy():
    first = deepspeed_config(Config(micro_batch_size=2))
    first["optimizer"]["params"]["lr"] = 5.0
    assert deepspeed_config(Config(micro_batch_size=2))["optimizer"]["params"]["lr"] == 1e-3


def test_offload_needs_zero():
    with pytest.raises(UsageError, match="offload='cpu' needs ZeRO"):
        deepspeed_config(Config(offload="cpu"))


def test_each_section_is_its_strategy_s():
    """The builder writes the skeleton; the precision, optimizer and offload sections are the strategies'
    (`Strategy.deepspeed_keys`), and a fresh copy each time (the precision's too)."""
    from autofit.strategies import MixedPrecision, OptimizerStates, StateOffloading
    from autofit.strategies.base import EngineInputs

    config = Config(precision="fp16", sharding="zero3", num_gpus=2, offload="nvme", optimizer="adafactor")
    built = deepspeed_config(config, nvme_path="/scratch", hyperparameters={"lr": 0.5})
    inputs = EngineInputs("/scratch", {"lr": 0.5})
    assert built["fp16"] == MixedPrecision().deepspeed_keys(config, inputs)["fp16"]
    assert built["optimizer"] == OptimizerStates().deepspeed_keys(config, inputs)["optimizer"]
    assert built["optimizer"]["params"]["lr"] == 0.5 and built["zero_allow_untested_optimizer"] is True
    offload = StateOffloading().deepspeed_keys(config, inputs)
    assert built["zero_optimization"]["offload_param"] == offload["zero_optimization.offload_param"]
    assert built["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/scratch"
    built["fp16"]["loss_scale"] = 7
    assert deepspeed_config(config, nvme_path="/scratch")["fp16"]["loss_scale"] == 0


def test_pure_bf16_has_no_deepspeed_mode():
    with pytest.raises(UsageError, match="pure_bf16.*precision='bf16'"):
        deepspeed_config(Config(precision="pure_bf16"))


def test_nvme_needs_a_path():
    with pytest.raises(UsageError, match="nvme_path"):
        deepspeed_config(Config(sharding="zero3", offload="nvme"))


def test_plan_that_does_not_fit_refuses(tmp_path, plan_for):
    with pytest.raises(UsageError, match="does not fit.*No candidate fits 57.60 MiB"):
        plan_for(fits=False).export("deepspeed", tmp_path)
    assert not any(tmp_path.iterdir())


def test_unknown_format(tmp_path, plan_for):
    with pytest.raises(UsageError, match="format 'slurm' is not known"):
        plan_for().export("slurm", tmp_path)
    assert [p.name for p in plan_for().export("DeepSpeed", tmp_path)] == ["deepspeed.json"]  # typed in any case
    with pytest.raises(UsageError, match="deepspeed.json' is a file; give a folder"):
        plan_for().export("deepspeed", tmp_path / "deepspeed.json")


def test_fsdp_plan_is_not_a_deepspeed_plan(tmp_path, plan_for):
    from autofit.export import applicable, export_all

    plan = plan_for(Config(micro_batch_size=2, num_gpus=2, sharding="fsdp_full"), device="cuda:0")
    with pytest.raises(UsageError, match="shards with FSDP2"):
        plan.export("deepspeed", tmp_path)
    assert applicable(plan) == ["accelerate", "trainer", "torchrun"]
    assert "deepspeed.json" not in {p.name for p in export_all(plan, tmp_path)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_buffers_are_sized_for_the_model_and_budget(tmp_path, plan_for, stage):
    config = Config(micro_batch_size=2, grad_accum_steps=2, sharding=f"zero{stage}")  # one rank: the parser's world
    plan = plan_for(config, hidden_size=256, memory_budget=400 * 2**20)
    (path,) = export(plan, "deepspeed", tmp_path)
    data = json.loads(path.read_text())
    zero = data["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 256 * 256  # not DeepSpeed's 5e8
    if stage == 3:
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 256 * 256)
        assert zero["stage3_param_persistence_threshold"] == 2560
        assert zero["stage3_max_live_parameters"] == 40 * 2**20 // 4  # a tenth of the budget, fp32 parameters
    else:
        assert not any(key.startswith("stage3") for key in zero)
    assert data["optimizer"]["params"]["fused"] is True
    parsed = parse(data)
    assert parsed.zero_config.reduce_bucket_size == 256 * 256
    # the probe builds the same dict from the spec's summary
    from autofit.strategies.deepspeed_config import buffers_for

    assert deepspeed_config(config, buffers=buffers_for(plan.spec))["zero_optimization"] == zero


def test_a_plan_without_a_hidden_size_keeps_deepspeeds_defaults(tmp_path, plan_for):
    (path,) = export(plan_for(Config(micro_batch_size=2, num_gpus=2, sharding="zero2")), "deepspeed", tmp_path)
    assert "reduce_bucket_size" not in json.loads(path.read_text())["zero_optimization"]


def test_pure_bf16_and_the_step_in_backward_refuse_with_the_reason(tmp_path, plan_for):
    for knobs, why in (({"precision": "pure_bf16"}, "keeps fp32 master weights"),
                       ({"optimizer_step": "in_backward"}, "steps the optimizer after backward")):
        with pytest.raises(UsageError, match=why):
            plan_for(Config(micro_batch_size=4, **knobs)).export("deepspeed", tmp_path)


def test_model_side_rungs_are_listed_for_the_script(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=4, checkpointing="ops", loss="chunked"), device="cuda:0")
    path, = plan.export("deepspeed", tmp_path)
    document = json.loads(path.read_text())
    parse({k: v for k, v in document.items() if k != "autofit"})  # the real parser still accepts it
    lines = document["autofit"]["apply_in_script"]
    assert any("chunk_loss(model)" in line for line in lines) and any("ops=True" in line for line in lines)


def _enabled(parsed, mode):
    """Whether DeepSpeed's parsed config enables `mode` ("float16", "bfloat16"): a `<mode>_config` section in
    recent releases, a flag in older ones (0.14: `fp16_enabled`, `bfloat16_enabled`)."""
    section = getattr(parsed, f"{mode}_config", None)
    return section.enabled if section is not None else getattr(parsed, {"float16": "fp16"}.get(mode, mode) + "_enabled")
