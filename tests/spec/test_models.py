"""`--model` resolution: presets, local configs, FILE.py:factory; each with its errors."""

from __future__ import annotations

import json
import pickle
import textwrap

import pytest
import torch
from transformers import GPT2Config

from autofit import UsageError, make_spec
from autofit.spec.models import resolve_model

TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)


def test_preset_builds_its_architecture():
    factory, batch, description = resolve_model("gpt2")
    assert batch is None and "preset gpt2" in description
    with torch.device("meta"):
        model = factory()
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert sum(p.numel() for p in model.parameters()) > 100e6  # gpt2 small: 124M


def test_unknown_preset_lists_close_names():
    with pytest.raises(UsageError, match="gpt2"):
        resolve_model("gtp2")


@pytest.mark.parametrize("as_folder", [True, False])
def test_local_config(tmp_path, as_folder):
    GPT2Config(**TINY).save_pretrained(tmp_path)
    factory, batch, description = resolve_model(str(tmp_path if as_folder else tmp_path / "config.json"))
    model = factory()
    assert model.config.n_embd == 32 and "random weights" in description
    spec = make_spec(factory, batch, global_batch_size=2, device="cpu", memory_budget="1GiB")
    assert spec.tokens_per_sample == 16  # the batch is synthesized from the config
    pickle.dumps(factory)  # probes in child processes rebuild it


def test_bad_local_configs(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UsageError, match="Cannot read .*broken.json"):
        resolve_model(str(tmp_path / "broken.json"))
    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "nonesuch"}))
    with pytest.raises(UsageError, match="model_type='nonesuch'"):
        resolve_model(str(tmp_path / "odd.json"))
    with pytest.raises(UsageError, match="holds no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(UsageError, match="no such file"):
        resolve_model(str(tmp_path / "missing.json"))


FILE = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x, y):
            return (self.body(x) - y).pow(2).mean()

    def make():
        return Net()

    def make_pair():
        return Net(), lambda n: {"x": torch.randn(n, 8), "y": torch.randn(n, 1)}

    def not_a_model():
        return 3
""")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(FILE)
    return path


def test_file_factory_returning_a_model(model_file):
    factory, batch, description = resolve_model(f"{model_file}:make")
    assert batch is None and "make() from" in description
    assert isinstance(factory(), torch.nn.Module)
    pickle.loads(pickle.dumps(factory))()


def test_file_factory_returning_model_and_batch(model_file):
    factory, batch, description = resolve_model(f"{model_file}:make_pair")
    sample = batch(3)
    assert sample["x"].shape == (3, 8) and not sample["x"].is_meta
    assert factory()(**sample).dim() == 0
    pickle.loads(pickle.dumps(batch))(2)


@pytest.mark.parametrize("suffix,message", [
    (":not_a_model", "returned int"),
    (":nope", "has no function 'nope'.*make_pair"),
    ("", "names a file but no factory"),
])
def test_file_errors(model_file, suffix, message):
    with pytest.raises(UsageError, match=message):
        resolve_model(f"{model_file}{suffix}")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        resolve_model(f"{tmp_path}/absent.py:make")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UsageError, match="Importing .*broken.py failed: RuntimeError: boom"):
        resolve_model(f"{tmp_path}/broken.py:make")
