"""The probe, the simulation, prepare, the guard and the exporters loop over strategies and name no technique
(scripts/technique_names.py), but where a file says below why it still does."""

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "technique_names.py"
spec = importlib.util.spec_from_file_location("technique_names", SCRIPT)
technique_names = importlib.util.module_from_spec(spec)
spec.loader.exec_module(technique_names)

# every consumer of the strategies -> the techniques it may still name, beside the micro-batch and the rank
# count (every step's shape)
CONSUMERS = {
    "autofit/strategies/run.py": set(),  # the probe's run: `build_run`
    "autofit/probe/run.py": set(),
    "autofit/estimate/simulation/step.py": set(),
    "autofit/estimate/simulation/memo.py": set(),
    "autofit/estimate/estimator.py": set(),
    "autofit/estimate/cost_model.py": set(),  # the compute dtype: the strategies' (`Strategy.compute_dtype`)
    "autofit/estimate/engines.py": set(),
    "autofit/estimate/facts.py": set(),
    "autofit/estimate/tolerance.py": {"attention"},  # the calibration's kernel classes read the model's implementation
    "autofit/estimate/cuda/training_replay.py": set(),
    "autofit/estimate/simulation/adapters.py": set(),
    "autofit/prepare.py": {"optimizer"},  # the optimizer a user passes is checked against the plan's
    "autofit/guard/plan.py": set(),
    "autofit/guard/trainer.py": set(),
    "autofit/guard/accelerate.py": set(),
    "autofit/plan.py": set(),
    "autofit/search/walk.py": set(),
    "autofit/search/shortfall.py": set(),
    "autofit/pipelines/tune.py": set(),
    "autofit/pipelines/notes.py": set(),
    "autofit/pipelines/host_memory.py": set(),
    "autofit/pipelines/dry_run.py": set(),
    "autofit/devices/gpus.py": set(),  # its "bf16"/"fp16" are a card's dtypes (DEVICE_FACTS)
    "autofit/cli/gpus.py": set(),
    "autofit/export/__init__.py": set(),
    "autofit/export/deepspeed.py": set(),  # the engine strategy's file (`Strategy.launcher_files`)
    "autofit/search/rules.py": set(),  # loops: the rules live with their strategies and the joint module
    "autofit/models/info.py": {"attention"},  # reads the attention implementation a model was given
    "autofit/export/accelerate.py": set(),
    "autofit/export/torchrun.py": set(),
    "autofit/export/trainer.py": set(),
    "autofit/export/model_setup.py": set(),
    "autofit/export/measured.py": set(),
    "autofit/report.py": set(),
}


# technique -> the most package files that may name it outside its own strategy file, `config.py` and the
# joint formula module (issue 53's goal: 3 for every technique; the micro-batch and the rank count are
# structural and not held)
CEILINGS = {"precision": 1, "zero": 3, "fsdp": 3, "pure_bf16": 1, "optimizer": 3, "lora": 1, "offload": 3,
            "checkpointing": 1, "quantization": 1, "attention": 2, "optimizer_in_backward": 1, "chunked_loss": 0,
            "activation_offload": 1, "allocator": 0}


def test_no_technique_is_named_in_more_files_than_its_ceiling():
    found = technique_names.survey()
    assert set(CEILINGS) == set(technique_names.NAMES) - set(technique_names.STRUCTURAL)
    over = {stem: sorted(found[stem]) for stem, most in CEILINGS.items() if len(found[stem]) > most}
    assert not over, over


def test_the_builders_name_no_technique_but_zero_they_belong_to():
    """DeepSpeed's config builder is ZeRO's: the precision, optimizer and offload sections are their strategies'
    (`Strategy.deepspeed_keys`)."""
    tree = ast.parse((ROOT / "autofit/strategies/deepspeed_config.py").read_text())
    named = {stem for stem, names in technique_names.NAMES.items()
             if stem not in technique_names.STRUCTURAL and technique_names.hits(tree, names, stem)}
    assert named <= {"zero"}, named  # its own: the ZeRO stage and buffers


def test_the_registry_names_no_technique():
    tree = ast.parse((ROOT / "autofit/strategies/__init__.py").read_text())
    assert not [stem for stem, names in technique_names.NAMES.items() if technique_names.hits(tree, names, stem)]


@pytest.mark.parametrize("path", sorted(CONSUMERS))
def test_a_consumer_names_no_technique_but_those_it_says(path):
    tree = ast.parse((ROOT / path).read_text())
    facts = technique_names.DEVICE_FACTS.get(path, ())
    named = {stem for stem, names in technique_names.NAMES.items()
             if stem not in technique_names.STRUCTURAL and technique_names.hits(tree, names, stem, facts)}
    assert named <= CONSUMERS[path], {stem: technique_names.hits(tree, technique_names.NAMES[stem], stem)
                                      for stem in named - CONSUMERS[path]}


def test_the_survey_finds_a_technique_however_it_is_named():
    source = ('from autofit.config import Loss as L\n'
              'def f(config, run):\n'
              '    """pure_bf16 in a docstring is prose."""\n'
              '    return config.loss is L.CHUNKED or run.config.pure_bf16 or "in_backward"\n')
    tree = ast.parse(source)
    found = {stem for stem, names in technique_names.NAMES.items() if technique_names.hits(tree, names, stem)}
    assert found == {"chunked_loss", "pure_bf16", "optimizer_in_backward"}
    assert not technique_names.hits(ast.parse('"""pure_bf16, Loss.CHUNKED"""\n'), technique_names.NAMES["pure_bf16"],
                                    "pure_bf16")


def test_a_cards_dtypes_are_device_facts_but_the_knob_still_counts_there():
    names = technique_names.NAMES["precision"]
    facts = technique_names.DEVICE_FACTS["autofit/devices/gpus.py"]
    catalogue = ast.parse('def tflops(self, precision):\n    return self.bf16 if precision == "bf16" else self.fp16\n')
    assert not technique_names.hits(catalogue, names, "precision", facts)
    assert technique_names.hits(catalogue, names, "precision")  # the same strings elsewhere count
    knob = ast.parse("from autofit.config import Precision\nBEST = Precision.BF16\n")
    assert technique_names.hits(knob, names, "precision", facts)
