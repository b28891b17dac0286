import torch
from torch import nn

from autofit.models.depth import depth_key, shallow
from autofit.models.info import meta_model


def _gpt2(n_layer: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=256, n_positions=64))


def test_a_deep_hugging_face_model_is_rebuilt_at_one_block_on_meta():
    model = meta_model(_gpt2)
    assert depth_key(model) == "n_layer"
    one = shallow(model)
    assert one is not model and one.config.n_layer == 1 and len(one.transformer.h) == 1
    assert all(p.is_meta for p in one.parameters())
    assert model.config.n_layer == 4 and len(model.transformer.h) == 4  # the model given is left as it was
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    assert one(input_ids=ids).logits.shape == model(input_ids=ids).logits.shape


def test_what_cannot_be_made_shallower_is_kept_as_it_is():
    one_block = meta_model(lambda: _gpt2(1))
    frozen = meta_model(_gpt2)
    frozen.transformer.wte.weight.requires_grad_(False)  # a shallow copy would train what this one does not
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for model in (one_block, frozen, plain):
        assert shallow(model) is model
    assert depth_key(frozen) is None and depth_key(plain) is None
