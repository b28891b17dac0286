"""A technique added as one strategy file (freeze_embeddings.py): the search, the probe, the dry-run (its memory
and its simulated step), `autofit.prepare`, the OOM guard, the four exports and the report handle it with no
edit elsewhere, each through the hook the built-in strategies use."""

import json

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from deepspeed.runtime.config import DeepSpeedConfig
from freeze_embeddings import SEEN, FreezeEmbeddings, Frozen
from models import make_gpt2
from transformers import TrainingArguments

import autofit
from autofit.config import Config
from autofit.errors import UsageError
from autofit.export import applicable
from autofit.probe.outcome import Skip
from autofit.report import render
from autofit.strategies import MicroBatch, MixedPrecision, default_strategies

ON = Config(micro_batch_size=2).replace(freeze_embeddings="on")  # a config every launcher can express


@pytest.fixture(autouse=True)
def _seen():
    SEEN.clear()
    yield
    SEEN.clear()


@pytest.fixture(scope="module")
def plan():
    """A measured plan whose probes ran the plug-in."""
    strategies = [*default_strategies(), FreezeEmbeddings()]
    return autofit.autofit(make_gpt2, global_batch_size=2, device="cpu", memory_budget="512MiB", seq_len=16,
                           allow={"lora"}, strategies=strategies, warmup_steps=1, timed_steps=1, max_probes=6)


@pytest.fixture
def plan_on(plan):
    """`plan` with the plug-in's knob on (the search's choice may be one DeepSpeed refuses, pure bf16 say)."""
    return autofit.Plan(True, ON, plan.throughput, None, plan.peak_memory, "test", plan.probes, plan.spec)


def frozen(model: torch.nn.Module) -> bool:
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return bool(embeddings) and not any(m.weight.requires_grad for m in embeddings)


def test_config_carries_the_plugin_knob():
    config = Config().replace(freeze_embeddings="on")
    assert config.knob("freeze_embeddings") is Frozen.ON and "freeze_embeddings=on" in config.describe()
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_the_search_probes_it_and_the_report_shows_it(plan, tmp_path):
    assert plan.fits
    frozen_probes = [p for p in plan.probes if p.config.knob("freeze_embeddings") is Frozen.ON]
    assert frozen_probes and all(p.skip is not Skip.EXCLUDED for p in frozen_probes)
    assert any(p.peak_bytes for p in frozen_probes)  # a probe of it ran: its `apply` shaped the run
    assert "freeze_embeddings=on" in render(plan)
    assert autofit.Plan.load(plan.save(tmp_path / "plan.json")).config == plan.config


def test_a_probe_runs_its_apply():
    from autofit.job.train_spec import make_spec
    from autofit.probe.run import run_probe

    spec = make_spec(make_gpt2, global_batch_size=2, device="cpu", memory_budget="512MiB", seq_len=16)
    result = run_probe(spec, ON, [*default_strategies(), FreezeEmbeddings()], None)
    assert result.fits, result.reason
    assert ("apply", "probe") in SEEN


def test_the_dry_run_simulates_it_and_asks_its_memory():
    planned = [MixedPrecision(), MicroBatch(), FreezeEmbeddings()]  # the plug-in beside two rungs: fewer simulations
    report = autofit.dry_run(make_gpt2, seq_len=16, global_batch_size=2, gpu="a100-80gb", allow={"lora"},
                             strategies=planned)
    rows = {c.config.knob("freeze_embeddings") for c in report.candidates}
    assert rows == {Frozen.OFF, Frozen.ON}
    assert ("apply", "simulated") in SEEN  # the simulated step was shaped by it (its value keys its own)
    assert ("memory", "") in SEEN
    marked = next(c for c in report.candidates if c.config.knob("freeze_embeddings") is Frozen.ON)
    twin = next(c for c in report.candidates if c.config == marked.config.replace(freeze_embeddings="off"))
    assert marked.estimate.peak_bytes != twin.estimate.peak_bytes


def test_prepare_applies_it(plan_on, tmp_path):
    prepared = autofit.prepare(plan_on.save(tmp_path / "plan.json"), make_gpt2())
    assert frozen(prepared.model) and ("apply", "probe") in SEEN
    assert all(p.requires_grad for group in prepared.optimizer.param_groups for p in group["params"])


def test_the_guard_applies_it_to_the_live_model(plan_on, tmp_path):
    model = make_gpt2()
    guard = autofit.OomGuard(model, torch.optim.AdamW(model.parameters()), plan=plan_on.save(tmp_path / "plan.json"))
    assert guard.config.knob("freeze_embeddings") is Frozen.ON
    assert frozen(model) and ("apply", "live") in SEEN


def test_every_export_carries_it_and_each_file_loads(plan_on, tmp_path):
    env = plan_on.export("torchrun", tmp_path / "t")[0].read_text()
    assert "AUTOFIT_FREEZE_EMBEDDINGS=on" in env and "AUTOFIT_FROZEN_EMBEDDINGS=1" in env  # its key
    assert "#   freeze(model)" in env

    ds_json = json.loads(plan_on.export("deepspeed", tmp_path / "d")[0].read_text())
    assert ds_json["autofit_plugins"] == {"freeze_embeddings": "on"}
    assert "freeze(model)  # input embeddings frozen, as probed" in ds_json["autofit"]["apply_in_script"]
    DeepSpeedConfig(ds_json)  # DeepSpeed's own parser reads it
    assert ("deepspeed_keys", "") in SEEN  # the engine config is assembled from every strategy, plug-ins too

    accelerate_path = plan_on.export("accelerate", tmp_path / "a")[0]
    assert "#   freeze(model)" in accelerate_path.read_text()
    load_config_from_file(str(accelerate_path))  # nothing unknown to accelerate's loader

    args_path, script_path = plan_on.export("trainer", tmp_path / "tr")[:2]
    TrainingArguments(**json.loads(args_path.read_text()))  # transformers reads the arguments
    assert "    freeze(model)" in script_path.read_text()  # train_with_trainer.py runs it on the model
    from autofit.export.trainer import beyond_arguments

    assert "freeze_embeddings=on" in beyond_arguments(plan_on)
    for fmt in ("torchrun", "deepspeed", "accelerate", "trainer"):
        assert {("setup_lines", fmt), ("launcher_keys", fmt), ("refuses", fmt)} <= set(SEEN), fmt


def test_a_format_it_refuses_is_not_exported(plan_on, tmp_path, monkeypatch):
    why = "freeze_embeddings=on has no accelerate switch; export torchrun instead"
    monkeypatch.setattr(FreezeEmbeddings, "refuses", lambda self, config, fmt: why if fmt == "accelerate" else None)
    assert "accelerate" not in applicable(plan_on) and "torchrun" in applicable(plan_on)
    with pytest.raises(UsageError, match="export torchrun instead"):
        plan_on.export("accelerate", tmp_path)
