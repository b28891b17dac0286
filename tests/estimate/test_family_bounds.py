"""Each CUDA prediction says which memory it is and carries the error bound of its architecture family and
attention kernel (autofit/estimate/tolerance.py); a family or kernel without calibration rows gets the wider
bound, and a peak within its bound of a limit is "near the limit", not "fits"."""

import pytest
import torch
import transformers as T
from torch import nn

from autofit.config import Config
from autofit.estimate.estimator import CUDA_CONTEXT_BYTES, Estimator
from autofit.estimate.prediction import Estimate, Fit, Memory
from autofit.estimate.tolerance import FAMILY_BOUNDS, UNCALIBRATED_BOUND, Family, bound_for, family_key
from autofit.job.train_spec import make_spec
from autofit.models.info import meta_model
from autofit.strategies.memory import Breakdown

MODELS = {
    "decoder": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)),
    "encoder": lambda: T.BertForSequenceClassification(T.BertConfig(num_hidden_layers=1, hidden_size=32,
                                                                    num_attention_heads=2, intermediate_size=64)),
    "encoder-decoder": lambda: T.T5ForConditionalGeneration(T.T5Config(num_layers=1, d_model=32, num_heads=2, d_ff=64,
                                                                       d_kv=16, vocab_size=64)),
    "vision": lambda: T.ViTForImageClassification(T.ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                              intermediate_size=64, image_size=32, patch_size=16)),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_hugging_face_model_is_keyed_by_its_family_and_the_kernel_its_config_runs(family):
    model = meta_model(MODELS[family])
    assert family_key(model, Config(attention="sdpa")) == f"{family}/fused"
    assert family_key(model, Config(attention="eager")) == f"{family}/eager"


def test_a_network_without_attention_has_no_kernel_whatever_the_configuration_says():
    resnet = meta_model(lambda: T.ResNetForImageClassification(T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                                                             depths=[1, 1], num_labels=2)))
    assert family_key(resnet, Config(attention="sdpa")) == "vision/none"


def test_a_model_of_ones_own_is_other_with_its_own_attention_or_none():
    assert family_key(nn.Sequential(nn.Linear(4, 4)), Config()) == "other/none"
    assert family_key(nn.TransformerEncoderLayer(16, 2), Config()) == "other/own"


def test_calibrated_keys_get_their_bound_the_rest_the_wider_one_and_an_engine_its_own():
    decoder, encoder = Family("decoder", "fused", True), Family("encoder", "fused", True)
    assert bound_for(decoder, Config()).value == FAMILY_BOUNDS["decoder/fused"][0] < UNCALIBRATED_BOUND
    eager = bound_for(encoder, Config(attention="eager"))
    assert (eager.key, eager.value, eager.rows) == ("encoder/eager", UNCALIBRATED_BOUND, 0)
    assert "no calibration rows" in eager.basis
    assert bound_for(decoder, Config(attention="eager")).value == UNCALIBRATED_BOUND  # a kernel without rows
    sharded = bound_for(decoder, Config(sharding="fsdp_full", num_gpus=2))
    assert (sharded.key, sharded.value) == ("engine", FAMILY_BOUNDS["engine"][0])
    own = Family("other", "own", False)  # a model of one's own keeps its attention whatever the knob says
    assert family_key(own, Config(attention="sdpa")) == "other/own"


def test_a_cuda_prediction_says_it_is_reserved_plus_context_and_carries_its_familys_bound():
    spec = make_spec(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64), seq_len=16, device="cpu",
                     memory_budget="1TiB")
    estimator = Estimator(spec, target="cuda")
    fused, eager = (estimator.predict(Config(attention=a, micro_batch_size=2)) for a in ("sdpa", "eager"))
    assert fused.simulated and fused.memory is Memory.RESERVED_CONTEXT
    assert fused.error_bound == FAMILY_BOUNDS["decoder/fused"][0] and "decoder/fused" in fused.bound_basis
    assert eager.error_bound == UNCALIBRATED_BOUND and "decoder/eager" in eager.bound_basis
    assert fused.to_dict()["memory"] == "reserved + context" and fused.to_dict()["bound_basis"] == fused.bound_basis
    cpu = Estimator(spec, target="cpu").predict(Config(attention="sdpa", micro_batch_size=2))
    assert cpu.memory is Memory.ALLOCATED and cpu.error_bound == 0  # the CPU budget counts tensors, exactly


def _estimate(need: int, bound: float | None) -> Estimate:
    return Estimate(Breakdown(0, 0, 0, need, 0), need, 0, "simulated", error_bound=bound)


def test_the_bound_multiplies_what_the_calibration_measured_not_the_cuda_context():
    """The calibration's errors are those of the allocator's figures, taken without the CUDA context: the
    bound widens the rest of the need only. On a tiny model, mostly context, 4% of the whole is ~35 MiB."""
    assert Estimate(Breakdown(0, 0, 0, 1000, 0), 1000, 0, "simulated", error_bound=0.04,
                    unbounded_bytes=800).upper_bytes == 1008
    assert _estimate(1000, 0.04).upper_bytes == 1040  # nothing unbounded: the whole need
    spec = make_spec(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64), seq_len=16, device="cpu",
                     memory_budget="1TiB")
    config = Config(attention="sdpa", micro_batch_size=2)
    cuda = Estimator(spec, target="cuda").predict(config)
    assert cuda.unbounded_bytes == CUDA_CONTEXT_BYTES
    assert cuda.upper_bytes == cuda.need_bytes + int((cuda.need_bytes - CUDA_CONTEXT_BYTES) * cuda.error_bound)
    assert cuda.upper_bytes - cuda.need_bytes < CUDA_CONTEXT_BYTES * cuda.error_bound  # a tiny model's room
    assert Estimator(spec, target="cpu").predict(config).unbounded_bytes == 0


def test_within_its_bound_of_the_limit_a_peak_is_near_the_limit_not_fits():
    assert _estimate(1000, 0.04).fit_under(1000) is Fit.NEAR_LIMIT  # as predicted, exactly the limit
    assert _estimate(970, 0.04).fit_under(1000) is Fit.NEAR_LIMIT  # 1,008.8 at its bound
    assert _estimate(960, 0.04).fit_under(1000) is Fit.FITS  # 998.4 at its bound
    assert _estimate(1010, 0.04).fit_under(1000) is Fit.OVER
    assert _estimate(50, None).fit_under(100) is Fit.UNKNOWN
