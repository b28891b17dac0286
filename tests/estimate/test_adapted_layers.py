"""LoRA's adapted layers are simulated by their path inside a block, matched as peft matches targets, so a
model that wraps every projection under one generic name (litgpt's `LoRALinear.linear`) adapts only the
layers its targets name."""

import torch
from torch import nn

from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.estimate.simulate import is_adapted, within_block
from autofit.spec.train import make_spec
from autofit.strategies import Lora

WIDTH, TOKENS = 128, 64


class Wrapped(nn.Module):
    """A projection kept as `.linear`, as litgpt's LoRALinear keeps it."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.linear(x)


class Block(nn.Module):
    def __init__(self, wrapped: bool):
        super().__init__()
        make = Wrapped if wrapped else nn.Linear
        self.attn, self.up, self.down = make(WIDTH, WIDTH), make(WIDTH, 4 * WIDTH), make(4 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, wrapped: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block(wrapped) for _ in range(4))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(n: int):
    return torch.randn(n, TOKENS, WIDTH), torch.randint(0, 8, (n, TOKENS))


def _loss(output, batch):
    return nn.functional.cross_entropy(output.flatten(0, 1), batch[1].flatten())


def _activations(wrapped: bool, target: str):
    spec = make_spec(lambda: Net(wrapped), _batch, device="cpu", memory_budget="1TiB", loss_fn=_loss)
    estimator = Estimator(spec, target="cpu", strategies=[Lora(target_modules=[target])])
    return estimator.activations(Config(micro_batch_size=2, lora=8))[0]


def test_a_wrapped_projection_is_adapted_only_where_the_target_names_it():
    wrapped, plain = _activations(True, "attn.linear"), _activations(False, "attn")
    assert (wrapped.largest, wrapped.grads_at_peak) == (plain.largest, plain.grads_at_peak)
    everything = _activations(False, "up")  # a different target adapts different layers: the figures move
    assert (everything.largest, everything.grads_at_peak) != (plain.largest, plain.grads_at_peak)


def test_names_are_read_inside_their_block_and_matched_as_peft_matches_them():
    assert within_block("model.layers.5.self_attn.q_proj") == "self_attn.q_proj"
    assert within_block("model.layers.0.mlp.experts.3.w1") == "mlp.experts.3.w1"
    assert within_block("lm_head") == "lm_head"
    adapted = frozenset({"attn.attn.linear"})
    assert is_adapted("transformer.h.7.attn.attn.linear", adapted)
    assert not is_adapted("transformer.h.7.attn.proj.linear", adapted)
    assert not is_adapted("transformer.h.7.mlp.fc.linear", adapted)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_adapter_dropout_keeps_a_dropped_out_copy_of_the_input_and_its_mask():
    def forward_peak(dropout: float) -> int:
        spec = make_spec(TwoLayers, _batch, device="cpu", memory_budget="1TiB", loss_fn=_loss)
        lora = Lora(target_modules=["first", "second"], dropout=dropout)
        estimator = Estimator(spec, target="cpu", strategies=[lora])
        return estimator.activations(Config(micro_batch_size=2, lora=8))[0].forward

    elements = 2 * TOKENS * WIDTH  # each adapted layer's input
    # kept through the forward: the first layer's input is the batch (not counted, needs no gradient), so
    # its fp32 copy alone; the second's needs a gradient (the first trains): its copy and the noise the
    # CPU's dropout keeps (fp32). Each peak is taken at its own moment, so the difference is bounded, not exact.
    added = forward_peak(0.1) - forward_peak(0.0)
    assert elements * 4 < added <= elements * 4 + elements * (4 + 4)


def test_lora_dropout_is_a_probability():
    import pytest

    from autofit.errors import UsageError

    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(UsageError, match="LoRA dropout must be a probability"):
            Lora(dropout=bad)
