"""Exports a user acts on without reading them (issue 54): plan text never becomes code, files are never written
through a link or over one autofit did not write, and every knob is either in a format's files or named."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import sys
import warnings

import pytest

from autofit import Config, UsageError
from autofit.export import FORMATS, ExportWarning, export, notes
from autofit.export.model_setup import left_out
from autofit.strategies.optimizer import _import_class, allowed_class

HOSTILE = 'x"""\nINJECTED_CALL()\n"""\n\r\u2028INJECTED_LINE = 1 # \\'


def _names(source: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}


@pytest.mark.parametrize("fmt,script", [("torchrun", "train_with_prepare.py"), ("trainer", "train_with_trainer.py")])
def test_plan_text_reaches_a_generated_script_only_as_a_literal(tmp_path, plan_for, fmt, script):
    plan = dataclasses.replace(plan_for(), reason=HOSTILE)
    plan = dataclasses.replace(plan, spec={**plan.spec, "model": HOSTILE})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        export(plan, fmt, tmp_path)
    source = (tmp_path / script).read_text()
    tree = ast.parse(source)
    assert not {"INJECTED_CALL", "INJECTED_LINE"} & _names(source)
    measured = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                    and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["MEASURED"])
    assert ast.literal_eval(measured)["reason"] == HOSTILE  # the text itself, kept as data


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_plan_text_in_a_shell_or_yaml_comment_stays_one_comment_line(tmp_path, plan_for, fmt):
    config = Config(micro_batch_size=2, grad_accum_steps=2)
    plan = dataclasses.replace(plan_for(config), reason=HOSTILE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        paths = export(plan, fmt, tmp_path)
    for path in paths:
        if path.suffix in (".sh", ".yaml"):
            for line in path.read_text().splitlines():
                assert "INJECTED" not in line or line.lstrip().startswith("#"), (path.name, line)


def test_an_optimizer_class_from_a_plan_is_imported_from_the_allow_list_only(tmp_path, monkeypatch, plan_for):
    marker = tmp_path / "ran"
    (tmp_path / "planted_optimizer.py").write_text(
        f"import pathlib, torch\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "class Evil(torch.optim.SGD):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = dataclasses.replace(plan_for(Config(micro_batch_size=2, grad_accum_steps=2, optimizer="user")),
                               settings={"optimizer": {"class": "planted_optimizer.Evil", "kwargs": {"lr": 0.1}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        export(plan, "deepspeed", tmp_path / "out")  # names the class; imports nothing
        with pytest.raises(UsageError, match="your own optimizer"):
            export(plan, "trainer", tmp_path / "out")
    assert _import_class("planted_optimizer.Evil") is None
    assert not marker.exists() and "planted_optimizer" not in sys.modules
    assert _import_class("torch.optim.sgd.SGD").__name__ == "SGD"
    assert not allowed_class("torch.optimx.Evil") and allowed_class("bitsandbytes.optim.adamw.AdamW8bit")


def test_a_planted_link_is_never_written_through_and_nothing_is_half_written(tmp_path, plan_for):
    outside = tmp_path / "outside.sh"
    outside.write_text("mine\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "torchrun.sh")
    with pytest.raises(UsageError, match="torchrun.sh.*is a link"):
        export(plan_for(), "torchrun", out)
    assert outside.read_text() == "mine\n" and oct(outside.stat().st_mode & 0o777) != oct(0o755)
    assert sorted(p.name for p in out.iterdir()) == ["torchrun.sh"]  # refused before any file was written


def test_export_replaces_its_own_files_but_not_yours_unless_forced(tmp_path, plan_for):
    plan = plan_for()
    (path,) = export(plan, "deepspeed", tmp_path)
    export(plan, "deepspeed", tmp_path)  # its own file: replaced
    path.write_text("{}\n")  # edited since: yours now
    with pytest.raises(UsageError, match="autofit did not write it.*--force"):
        export(plan, "deepspeed", tmp_path)
    assert path.read_text() == "{}\n"
    export(plan, "deepspeed", tmp_path, force=True)
    assert json.loads(path.read_text())["train_micro_batch_size_per_gpu"] == 2


def test_the_deepspeed_export_of_a_lora_plan_names_lora(tmp_path, plan_for):
    """The issue's plan: fp32, zero1, lora=r16, gpus=2. deepspeed.json cannot say LoRA: it is named, not dropped."""
    plan = plan_for(Config(micro_batch_size=2, grad_accum_steps=2, sharding="zero1", lora=16, num_gpus=2),
                    device="cuda:0")
    with pytest.warns(ExportWarning, match=r"lora=16.*autofit.prepare"):
        (path,) = export(plan, "deepspeed", tmp_path)
    assert "lora=16" in json.loads(path.read_text())["autofit"]["left_to_your_script"]


# Every knob value, with what it needs beside it to be a configuration a plan can hold.
KNOB_VALUES = [
    {"precision": "bf16"}, {"precision": "fp16"}, {"precision": "pure_bf16"},
    {"attention": "sdpa"}, {"attention": "flash_attention_2", "precision": "bf16"}, {"attention": "eager"},
    {"checkpointing": "ops"}, {"checkpointing": "every_k", "checkpoint_every": 2}, {"checkpointing": "full"},
    {"micro_batch_size": 4, "grad_accum_steps": 1}, {"grad_accum_steps": 4},
    {"optimizer": "adamw8bit"}, {"optimizer": "paged_adamw8bit"}, {"optimizer": "adafactor"},
    {"sharding": "zero1", "num_gpus": 2}, {"sharding": "zero2", "num_gpus": 2}, {"sharding": "zero3", "num_gpus": 2},
    {"sharding": "fsdp_grad_op", "num_gpus": 2}, {"sharding": "fsdp_full", "num_gpus": 2},
    {"sharding": "zero3", "offload": "cpu", "num_gpus": 2}, {"sharding": "zero3", "offload": "nvme", "num_gpus": 2},
    {"sharding": "fsdp_full", "offload": "cpu", "num_gpus": 2},
    {"lora": 16}, {"lora": 16, "quantization": "int8"}, {"lora": 16, "quantization": "nf4", "precision": "bf16"},
    {"num_gpus": 2}, {"activation_offload": "cpu"}, {"optimizer_step": "in_backward"}, {"loss": "chunked"}]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("knobs", KNOB_VALUES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_every_knob_in_every_format_is_exported_or_named(tmp_path, plan_for, knobs, fmt):
    """The export reproduces the knob (its files change when the knob is at its default), or refuses naming
    it, or warns naming it and the format that applies it: never silent."""
    config = Config(**{"micro_batch_size": 2, "grad_accum_steps": 2, **knobs})
    plan = plan_for(config, device="cuda:0", nvme_path=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        try:
            export(plan, fmt, tmp_path / "out")
        except UsageError as refusal:
            words = {*knobs, *map(str, knobs.values()), *(str(v).replace("_", " ") for v in knobs.values())}
            assert any(word in str(refusal) for word in words) and "export " in str(refusal), str(refusal)
            return
    said = " ".join(str(w.message) for w in caught if issubclass(w.category, ExportWarning))
    left = left_out(plan, FORMATS[fmt].launched)
    assert said == " ".join(notes(plan, fmt))
    for field in knobs:
        word = f"{field}={config.knob(field)}"
        if word in left:
            assert word in said and "torchrun" in said, (word, said)
