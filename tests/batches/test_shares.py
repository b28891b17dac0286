"""A step split into micro-batches keeps the whole batch's gradient when a Hugging Face model's own loss
is a mean over the targets its labels hold: padded rows (-100) weigh by their targets, not as samples.

Real transformers models (GPT-2, whose `loss_type` is None; T5, sequence-to-sequence and unshifted; a
BERT token classifier; a sequence classifier, which keeps sample shares), real peft, the real guard,
`autofit.prepare` and the Trainer integration.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (BertConfig, BertForSequenceClassification, BertForTokenClassification, GPT2Config,
                          GPT2LMHeadModel, T5Config, T5ForConditionalGeneration)

import autofit
from autofit.batches.shares import micro_batch_shares, target_counts
from autofit.batches.batch import default_loss

torch.set_num_threads(1)
LENGTHS = [3, 16, 5, 16, 2, 12, 9, 16]  # targets per row; the rest of each row is padding (-100)


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _t5():
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2, dropout_rate=0.0, decoder_start_token_id=0))


def _bert(cls, **extra):
    return cls(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, **extra))


MODELS = {"gpt2": _gpt2, "t5": _t5, "bert-token": lambda: _bert(BertForTokenClassification, num_labels=5)}


def _batch(kind: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (len(LENGTHS), 16), generator=gen)
    labels = ids.clone() % 5 if kind == "bert-token" else ids.clone()
    for row, length in enumerate(LENGTHS):
        labels[row, length:] = -100
    if kind == "t5":
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _whole_batch_grads(kind: str) -> tuple[torch.Tensor, float]:
    torch.manual_seed(0)
    model = MODELS[kind]()
    loss = model(**_batch(kind)).loss
    loss.backward()
    return _grads(model), float(loss.detach())


def test_counts_follow_each_models_own_loss():
    labels = torch.tensor([[1, 2, 3, -100], [4, -100, -100, -100]])
    assert target_counts(_gpt2(), {"labels": labels}).tolist() == [2, 0]  # a causal LM's shift: from position 1
    assert target_counts(_t5(), {"labels": labels}).tolist() == [3, 1]  # encoder-decoder: unshifted
    assert target_counts(_bert(BertForTokenClassification), {"labels": labels}).tolist() == [3, 1]
    assert target_counts(_gpt2(), {"labels": labels, "shift_labels": labels}).tolist() == [3, 1]
    assert target_counts(_bert(BertForSequenceClassification), {"labels": torch.tensor([0, 1])}) is None
    assert target_counts(torch.nn.Linear(2, 2), {"labels": labels}) is None  # a model of your own
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(_gpt2(), peft.LoraConfig(target_modules=["c_attn"], fan_in_fan_out=True))
    assert target_counts(adapted, {"labels": labels}).tolist() == [2, 0]  # read through peft's wrapper
    halves = [{"labels": labels[:1]}, {"labels": labels[1:]}]
    shares = micro_batch_shares(_gpt2(), halves, default_loss)
    assert all(isinstance(w, torch.Tensor) for w in shares)  # on the labels' device: no wait in a timed step
    assert [float(w) for w in shares] == [1.0, 0.0]
    assert micro_batch_shares(_gpt2(), halves, lambda output, batch: output.loss) == [0.5, 0.5]
    nothing = [{"labels": torch.full((1, 4), -100)}] * 2  # no target anywhere: the samples' shares
    assert [float(w) for w in micro_batch_shares(_gpt2(), nothing, default_loss)] == [0.5, 0.5]


@pytest.mark.parametrize("kind", list(MODELS))
def test_guard_split_by_an_oom_keeps_the_whole_batchs_gradient(kind):
    reference, whole_loss = _whole_batch_grads(kind)
    torch.manual_seed(0)
    model = MODELS[kind]()
    guard = autofit.OomGuard(model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch_size=3)
    report = guard.accumulate(_batch(kind))  # pieces of 3, 3 and 2 rows holding unlike numbers of targets
    assert report.micro_batches == (3, 3, 2)
    torch.testing.assert_close(_grads(model), reference, rtol=1e-5, atol=1e-7)
    assert float(report.loss) == pytest.approx(whole_loss, rel=1e-5)
    assert float(guard.evaluate(_batch(kind))) == pytest.approx(whole_loss, rel=1e-5)


def test_guard_passes_over_a_piece_with_no_targets():
    reference, _ = _whole_batch_grads("gpt2")
    batch = _batch("gpt2")
    batch["labels"][:2] = -100  # the first piece of two rows holds no target: its mean loss would be NaN
    torch.manual_seed(0)
    whole = _gpt2()
    whole(**batch).loss.backward()
    torch.manual_seed(0)
    model = _gpt2()
    autofit.OomGuard(model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch_size=2).accumulate(batch)
    assert torch.isfinite(_grads(model)).all()
    torch.testing.assert_close(_grads(model), _grads(whole), rtol=1e-5, atol=1e-7)


def test_prepared_step_with_accumulation_keeps_the_whole_batchs_gradient():
    reference, _ = _whole_batch_grads("gpt2")
    torch.manual_seed(0)
    prepared = autofit.prepare(autofit.Config(micro_batch_size=2, grad_accum_steps=4, optimizer="adamw"), _gpt2())
    weights = [float(w) for w in prepared.weights(prepared.micro_batches(_batch("gpt2")))]
    assert sum(weights) == pytest.approx(1.0) and weights[0] == pytest.approx((2 + 15) / sum(n - 1 for n in LENGTHS))
    stepped = []  # the gradient the optimizer step is given
    prepared.optimizer.register_step_pre_hook(lambda *_: stepped.append(_grads(prepared.model).clone()))
    prepared.step(_batch("gpt2"))
    torch.testing.assert_close(stepped[0], reference, rtol=1e-5, atol=1e-7)


def test_an_unsplit_guard_step_reads_no_targets(monkeypatch):
    # the OOM guard's step is a hot path: the targets are counted (a device read) only once it splits a batch
    import autofit.guard.core as core

    calls = []
    monkeypatch.setattr(core, "target_counts", lambda *args: calls.append(1) or torch.ones(len(LENGTHS)))
    model = _gpt2()
    guard = autofit.OomGuard(model, torch.optim.SGD(model.parameters(), lr=0.0))
    guard.accumulate(_batch("gpt2"))
    assert calls == []
    autofit.OomGuard(model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch_size=4).accumulate(_batch("gpt2"))
    assert calls == [1]  # once a step, however many pieces
