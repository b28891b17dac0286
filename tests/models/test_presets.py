"""Model presets: every preset builds on the meta device with its published parameter count."""

import pytest
import torch

from autofit.errors import UsageError
from autofit.models.presets import build_model, get_preset, list_presets

# Published parameter counts (embedding tied where the model ties it), in billions, to 2 decimals.
PUBLISHED = {"gpt2": 0.12, "llama-2-7b": 6.74, "llama-2-13b": 13.02, "llama-2-70b": 68.98, "llama-3-8b": 8.03,
             "llama-3-70b": 70.55, "mistral-7b": 7.24, "qwen2.5-0.5b": 0.49, "qwen2.5-7b": 7.62, "phi-2": 2.78}


def _params(name: str) -> int:
    with torch.device("meta"):
        model = build_model(get_preset(name))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    assert round(_params(name) / 1e9, 2) == PUBLISHED[name]


def test_every_preset_builds_on_meta_with_its_architecture():
    for name in list_presets():
        config = get_preset(name)
        with torch.device("meta"):
            model = build_model(config)
        assert type(model).__name__ == config.architectures[0]
        assert all(p.device.type == "meta" for p in model.parameters())


def test_aliases_and_case_resolve():
    assert get_preset("meta-llama/Llama-2-7b-hf").hidden_size == 4096
    assert get_preset("  GPT2-XL ").n_embd == 1600


def test_required_families_are_present():
    names = set(list_presets())
    for family in ("gpt2", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "mistral-7b",
                   "qwen2.5-0.5b", "qwen2.5-7b", "phi-2", "bert-base", "roberta-base", "t5-small", "vit-base"):
        assert family in names


def test_unknown_preset_lists_close_names():
    with pytest.raises(UsageError, match=r"llama-2-7b"):
        get_preset("llama2-7")
    with pytest.raises(UsageError, match="known presets: gpt2, gpt2-medium"):
        get_preset("zzzz")
