"""A technique added as one strategy file (freeze_embeddings.py): the search, the dry-run, the exports
and the report handle it with no edit elsewhere."""

import json

from accelerate.commands.config.config_args import load_config_from_file
from deepspeed.runtime.config import DeepSpeedConfig
from freeze_embeddings import FreezeEmbeddings, Frozen
from models import make_gpt2

import autofit
from autofit.config import Config
from autofit.probe.outcome import Skip
from autofit.report import render
from autofit.strategies import MicroBatch, MixedPrecision, default_strategies


def test_config_carries_the_plugin_knob():
    config = Config().replace(freeze_embeddings="on")
    assert config.knob("freeze_embeddings") is Frozen.ON and "freeze_embeddings=on" in config.describe()
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_search_dry_run_exports_and_report_handle_it(tmp_path):
    strategies = [*default_strategies(), FreezeEmbeddings()]
    plan = autofit.autofit(make_gpt2, global_batch_size=2, device="cpu", memory_budget="512MiB", seq_len=16,
                           allow={"lora"}, strategies=strategies, warmup_steps=1, timed_steps=1, max_probes=6)
    assert plan.fits
    frozen = [p for p in plan.probes if p.config.knob("freeze_embeddings") is Frozen.ON]
    assert frozen and all(p.skip is not Skip.EXCLUDED for p in frozen)
    assert "freeze_embeddings=on" in render(plan)

    # a config every launcher can express (the plan's own may be one DeepSpeed refuses, pure bf16 say)
    on = Config(micro_batch_size=2).replace(freeze_embeddings="on")
    plan_on = autofit.Plan(True, on, plan.throughput, None, plan.peak_memory, "test", plan.probes, plan.spec)
    env = (tmp_path / "t").mkdir() or plan_on.export("torchrun", tmp_path / "t")[0].read_text()
    assert "AUTOFIT_FREEZE_EMBEDDINGS=on" in env
    ds_json = json.loads(plan_on.export("deepspeed", tmp_path / "d")[0].read_text())
    assert ds_json["autofit_plugins"] == {"freeze_embeddings": "on"}
    DeepSpeedConfig(ds_json)  # DeepSpeed's own parser reads it
    accelerate_path = plan_on.export("accelerate", tmp_path / "a")[0]
    load_config_from_file(str(accelerate_path))  # nothing unknown to accelerate's loader
    plan_on.export("trainer", tmp_path / "tr")
    assert autofit.Plan.load(plan_on.save(tmp_path / "plan.json")).config == on

    planned = [MixedPrecision(), MicroBatch(), FreezeEmbeddings()]  # the plug-in beside two rungs: fewer simulations
    report = autofit.dry_run(make_gpt2, seq_len=16, global_batch_size=2, gpu="a100-80gb", allow={"lora"},
                             strategies=planned)
    rows = {c.config.knob("freeze_embeddings") for c in report.candidates}
    assert rows == {Frozen.OFF, Frozen.ON}
    marked = next(c for c in report.candidates if c.config.knob("freeze_embeddings") is Frozen.ON)
    twin = next(c for c in report.candidates if c.config == marked.config.replace(freeze_embeddings="off"))
    assert marked.estimate.peak_bytes == twin.estimate.peak_bytes + 1  # its memory hook ran
