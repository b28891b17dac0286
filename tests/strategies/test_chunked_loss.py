"""Chunked loss: the model's own loss and gradients from one chunk of logits at a time; offered only
where the model exposes its output head; chosen where only it fits; predicted."""

import pytest
import torch
from forcing import budget_between, peak, tune
from models import make_mlp, make_mlp_batch, mlp_loss

from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.estimate.tolerance import PREDICTION_TOLERANCE
from autofit.probe.run import run_probe
from autofit.job.train_spec import make_spec
from autofit.strategies import ChunkedLoss, MicroBatch, default_strategies
from autofit.strategies.chunked_loss import enable


def big_vocab_gpt2():
    """Logits dominate: 8192 tokens of vocabulary over a 32-wide model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=8192, n_positions=256,
                                      bos_token_id=0, eos_token_id=0))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512))


def _batch(vocab, n=2, length=64):
    ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions count as Hugging Face counts them
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("factory,vocab", [(big_vocab_gpt2, 8192), (tiny_llama, 512)], ids=["gpt2", "llama"])
def test_same_loss_and_gradients_as_the_models_own(factory, vocab):
    batch = _batch(vocab)
    own, chunked = factory(), enable(factory())
    results = []
    for model in (own, chunked):
        torch.manual_seed(1)  # the same dropout masks
        output = model(**batch)
        output.loss.backward()
        results.append((output.loss, [p.grad for p in model.parameters()]))
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-5, atol=0)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(results[0][1], results[1][1]))
    assert chunked(**batch).logits is None and chunked(input_ids=batch["input_ids"]).logits is not None


def test_offered_only_where_the_head_is_known():
    mlp = make_spec(make_mlp, make_mlp_batch, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss)
    own_loss = make_spec(big_vocab_gpt2, device="cpu", memory_budget="1GiB", seq_len=16,
                         loss_fn=lambda output, batch: output.logits.mean())
    assert "not a Hugging Face causal LM" in ChunkedLoss().options(mlp)[1].reason
    assert "your loss_fn" in ChunkedLoss().options(own_loss)[1].reason
    assert not any(o.available for o in ChunkedLoss().options(own_loss)[1:])


def test_not_offered_for_an_encoder_decoder():
    # Whisper's and T5's decoders read the labels shifted right; chunking the causal LM's shifted logits
    # over their base model failed ("You cannot specify both decoder_input_ids and decoder_inputs_embeds").
    from transformers import T5Config, T5ForConditionalGeneration

    def tiny_t5():
        return T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                   num_heads=2, decoder_start_token_id=0))

    spec = make_spec(tiny_t5, device="cpu", memory_budget="1GiB", seq_len=16)
    chunked = ChunkedLoss().options(spec)[1]
    assert not chunked.available and "encoder-decoder" in chunked.reason
    with pytest.raises(ValueError, match="encoder-decoder"):
        enable(tiny_t5())


def test_forced_by_a_budget_only_the_chunked_loss_meets():
    kwargs = dict(seq_len=256)
    full = peak(big_vocab_gpt2, None, Config(attention="sdpa"), **kwargs)
    chunked = peak(big_vocab_gpt2, None, Config(attention="sdpa", loss="chunked"), **kwargs)
    assert chunked < full / 2
    plan = tune(big_vocab_gpt2, None, [ChunkedLoss(), MicroBatch()], budget_between(chunked, full), 1, **kwargs)
    assert plan.fits and plan.config.loss == "chunked", plan.reason


def test_estimator_predicts_the_peak_within_its_tolerance():
    spec = make_spec(big_vocab_gpt2, global_batch_size=2, device="cpu", memory_budget="1GiB", seq_len=256)
    config = Config(attention="sdpa", loss="chunked", micro_batch_size=2)
    measured = run_probe(spec, config, default_strategies()).peak_bytes
    predicted = Estimator(spec).predict(config).peak_bytes
    assert abs(predicted / measured - 1) <= PREDICTION_TOLERANCE["cpu"], (predicted, measured)
