"""A time-major batch (steps first) is refused before it is split across its steps, wherever batches are split."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit import Config, UsageError
from autofit.guard.core import OomGuard
from autofit.batches.sample_axis import check_sample_axis
from autofit.job.train_spec import make_spec

STEPS, SAMPLES, FEATURES = 50, 8, 16


class Tagger(nn.Module):
    """An LSTM tagger as nn.LSTM's defaults have it: (steps, samples, features) in and out."""

    def __init__(self, transpose: bool = False):
        super().__init__()
        self.transpose = transpose
        self.norm = nn.BatchNorm1d(FEATURES)  # its running statistics change in place in a forward
        self.rnn = nn.LSTM(FEATURES, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, x):
        x = self.norm(x.transpose(-1, -2)).transpose(-1, -2)
        if self.transpose:  # samples-first batches, turned for the LSTM and back
            return self.out(self.rnn(x.transpose(0, 1))[0].transpose(0, 1))
        return self.out(self.rnn(x)[0])


def loss_fn(output, batch):
    return F.cross_entropy(output.reshape(-1, 5), batch[1].reshape(-1))


def time_major(n=SAMPLES):
    return torch.randn(STEPS, n, FEATURES), torch.randint(0, 5, (STEPS, n))


def samples_first(n=SAMPLES):
    return torch.randn(n, STEPS, FEATURES), torch.randint(0, 5, (n, STEPS))


def _spec(model, batch, **kwargs):
    return make_spec(model, batch, loss_fn=loss_fn, device="cpu", memory_budget="1GiB", **kwargs)


@pytest.mark.parametrize("global_batch_size", [SAMPLES, None])
def test_a_time_major_batch_is_refused_before_any_probe(global_batch_size):
    # was: 50 "samples" of (8, 16) each; a global batch of 8 took 8 time steps, "finding the batch" grew the sequence
    with pytest.raises(UsageError, match=r"samples reach the steps axis of LSTM `rnn`.*batch_first=False.*"
                                         r"\(1, 8, 16\).*x\.transpose\(0, 1\)"):
        _spec(Tagger, time_major(), global_batch_size=global_batch_size)


def test_a_samples_first_batch_turned_inside_forward_runs():
    spec = _spec(Tagger(transpose=True), samples_first(), global_batch_size=SAMPLES)
    assert spec.global_batch_size == SAMPLES


def test_the_users_model_is_not_changed_by_the_check():
    model = Tagger()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(UsageError):
        _spec(model, time_major())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # batch norm's statistics too
    assert all(p.grad is None for p in model.parameters())


class Encoder(nn.Module):
    """nn.TransformerEncoder at its default, batch_first=False."""

    def __init__(self, transpose: bool):
        super().__init__()
        self.transpose = transpose
        self.embed = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 100)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(self.encoder(h.transpose(0, 1)).transpose(0, 1) if self.transpose else self.encoder(h))


@pytest.mark.parametrize("build", [lambda t: Encoder(t), lambda t: (lambda: Encoder(t))], ids=["module", "factory"])
def test_attention_built_time_major_is_checked_on_a_module_and_on_a_factory_alike(build):
    ids = torch.randint(0, 100, (SAMPLES, 20))
    check = lambda model: _spec(model, (ids, ids), global_batch_size=SAMPLES)  # noqa: E731
    check(build(True))
    with pytest.raises(UsageError, match="steps axis of MultiheadAttention `encoder.layers.0.self_attn`"):
        check(build(False))


def test_packed_sequences_and_batch_first_modules_are_not_questioned():
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.gru = nn.LSTM(FEATURES, 32), nn.GRU(FEATURES, 8, batch_first=True)

        def forward(self, x):
            lengths = torch.full((x.shape[0],), x.shape[1])
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return self.rnn(packed)[1][0][-1].sum() + self.gru(x)[0].sum()

    check_sample_axis(Packed(), lambda n: torch.randn(n, STEPS, FEATURES))


def test_the_guard_and_prepare_refuse_a_time_major_first_batch():
    model = Tagger()
    guard = OomGuard(model, torch.optim.AdamW(model.parameters()), micro_batch_size=4, loss_fn=loss_fn)
    with pytest.raises(UsageError, match="steps axis of LSTM `rnn`"):
        guard.step(time_major())
    turned = Tagger(transpose=True)
    guard = OomGuard(turned, torch.optim.AdamW(turned.parameters()), micro_batch_size=4, loss_fn=loss_fn)
    assert guard.step(samples_first()).micro_batches == (4, 4)
    prepared = autofit.prepare(Config(micro_batch_size=4, grad_accum_steps=2), Tagger(), loss_fn=loss_fn)
    with pytest.raises(UsageError, match="steps axis of LSTM `rnn`"):
        prepared.step(time_major())
    prepared = autofit.prepare(Config(micro_batch_size=4, grad_accum_steps=2), Tagger(transpose=True), loss_fn=loss_fn)
    assert torch.isfinite(prepared.step(samples_first()))
