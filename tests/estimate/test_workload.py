"""The dry-run's speed model counts what a sample really costs (autofit/estimate/workload.py) and never
implies more than the card's peak FLOP/s: ViT patches, Whisper frames, T5 source and target tokens.

Bounds are physics, computed here independently of the model: samples/s x FLOPs per sample <= peak.
"""

import functools
from pathlib import Path

import pytest
import torch

from autofit.config import Config
from autofit.estimate.cost_model import engine_host_ops, host_seconds, optimizer_host_ops, step_seconds
from autofit.pipelines.dry_run import dry_run
from autofit.estimate.facts import ModelFacts
from autofit.estimate.estimator import model_facts
from autofit.models.info import meta_model
from autofit.devices.gpus import get_gpu
from autofit.estimate.workload import workload
from autofit.batches.synthetic_batches import TokenBatches
from autofit.models.presets import build_model, get_preset
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch

RTX_4090 = get_gpu("rtx-4090")  # 165 dense bf16 TFLOP/s


def predicted(spec, config, gpu=RTX_4090):
    facts = model_facts(meta_model(spec.model_factory))
    return config.global_batch_size / step_seconds(spec, config, gpu, facts)


def test_vit_b16_counts_197_patches_and_stays_under_the_4090s_peak():
    spec = make_spec(get_preset("vit-base"), global_batch_size=64, device="cpu", memory_budget="24GiB")
    work = workload(spec, spec.model.num_params, 12)
    assert work.positions == 197 and "197 patches per image" in work.how
    images = predicted(spec, Config(precision="bf16", micro_batch_size=64))
    at_peak = 165e12 / (6 * 86e6 * 197)  # ~1,600 images/s at 100% of the tensor cores
    assert 200 < images < at_peak  # was 53,000: one "token" per image


def whisper_small():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
                           decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)
    return functools.partial(WhisperForConditionalGeneration, config)


def audio(n):
    return {"input_features": torch.randn(n, 80, 3000), "labels": torch.randint(0, 51865, (n, 448))}


def test_whisper_counts_encoder_frames_and_decoder_tokens():
    spec = make_spec(whisper_small(), audio, global_batch_size=16, device="cpu", memory_budget="24GiB")
    work = workload(spec, spec.model.num_params, 12)
    encoder, decoder = work.stacks
    assert (encoder.positions, decoder.positions, decoder.attends_to) == (1500, 448, 1500)
    assert 0 < encoder.params < decoder.params < spec.model.num_params  # the decoder holds the 51,865-token head
    # the encoder alone: 12 layers of attention (4 d^2) and MLP (2 d x 3072) weights over 1,500 frames
    encoder_flops = 6 * 12 * (4 * 768**2 + 2 * 768 * 3072) * 1500
    samples = predicted(spec, Config(precision="bf16", micro_batch_size=16))
    assert samples < 165e12 / encoder_flops  # ~216/s even at peak; was ~2,500


def test_t5_counts_source_and_target_tokens():
    t5 = functools.partial(build_model, get_preset("t5-small"))  # T5ForConditionalGeneration, as the dry-run builds it
    spec = make_spec(t5, TokenBatches(32128, 512), global_batch_size=32, device="cpu", memory_budget="24GiB")
    encoder, decoder = workload(spec, spec.model.num_params, 6).stacks
    assert (encoder.positions, decoder.positions) == (512, 512)
    assert encoder.params + decoder.params <= spec.model.num_params
    flops = 6 * spec.model.num_params * 512  # at least every weight over the source (or target) tokens
    assert predicted(spec, Config(precision="bf16", micro_batch_size=32)) < 165e12 / flops


def test_an_image_to_text_model_counts_its_encoders_patches():
    from transformers import GPT2Config, ViTConfig, VisionEncoderDecoderConfig

    vit = ViTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, image_size=64,
                    patch_size=16)
    gpt2 = GPT2Config(vocab_size=512, n_embd=96, n_layer=2, n_head=4, n_positions=64)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, gpt2, architectures=["VisionEncoderDecoderModel"])
    spec = make_spec(functools.partial(build_model, config), seq_len=32, global_batch_size=8, device="cpu",
                     memory_budget="1GiB")
    encoder, decoder = workload(spec, spec.model.num_params, 2).stacks
    assert (encoder.positions, decoder.positions, decoder.attends_to) == (17, 32, 17)  # (64 / 16)^2 patches + [CLS]
    assert (encoder.layers, decoder.layers, encoder.width, decoder.width) == (3, 2, 64, 96)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_prediction_exceeds_the_peak(precision):
    spec = make_spec(get_preset("vit-base"), global_batch_size=4096, device="cpu", memory_budget="80GiB")
    facts = model_facts(meta_model(spec.model_factory))
    work = workload(spec, facts.num_params, facts.num_blocks)
    h100 = get_gpu("h100-80gb")
    config = Config(precision=precision, micro_batch_size=4096)
    seconds = step_seconds(spec, config, h100, facts, work)
    assert 4096 * work.flops(6) / seconds <= h100.tflops(precision) * 1e12


def test_the_dry_run_of_vit_b16_on_a_4090_is_physical():
    report = dry_run("vit-base", gpu="rtx-4090", global_batch_size=64, strategies=[MicroBatch()])
    assert report.chosen is not None
    assert report.chosen.samples_per_s < 165e12 / (6 * 86e6 * 197)
    assert "197 patches per image" in report.chosen.reason


def _conv_net():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(16 * 16 * 16, 10))


def test_a_model_without_a_sequence_counts_how_often_a_sample_applies_its_weights():
    spec = make_spec(_conv_net, lambda n: torch.randn(n, 3, 16, 16), global_batch_size=64, device="cpu",
                     memory_budget="1GiB", loss_fn=lambda out, batch: out.sum())
    conv, linear = 3 * 3 * 3 * 16, 16 * 16 * 16 * 10  # the conv's weights slide over 16 x 16 pixels
    forward = 2 * conv * 16 * 16 + 2 * linear  # FLOPs, biases aside
    work = workload(spec, spec.model.num_params, 1)
    assert work.positions == round(forward / (2 * spec.model.num_params)) > 1  # it was 1: one "position"
    assert f"applied {work.positions:,} times per sample" in work.how


CLASSIFIER = f"{Path(__file__).resolve().parents[2] / 'examples' / 'classifier.py'}:make"


def test_a_small_cnn_is_bound_by_the_host_issuing_its_ops(monkeypatch):
    import autofit.pipelines.levels as module

    monkeypatch.setattr(module, "_may_win", lambda *args: True)  # checkpointing predicted too, where it fits
    report = dry_run(CLASSIFIER, gpu="t4", global_batch_size=128)
    chosen = report.chosen
    # ~10 k parameters: a step of some tens of ops the host issues at >= 5 us each (the low end of eager
    # PyTorch's 5-25 us per op), not the samples/s its FLOPs alone would allow on a T4
    assert chosen.estimate.kernels >= 40
    assert chosen.samples_per_s < 128 / (chosen.estimate.kernels * 5e-6)
    assert "bound by the host issuing" in chosen.reason
    # an engine's per-parameter or per-unit host work counts too: none for one GPU and 10 k parameters
    assert chosen.config.sharding == "none" and chosen.config.offload == "none"
    recomputed = next(c for c in report.candidates if c.config == chosen.config.replace(checkpointing="full"))
    assert recomputed.estimate.kernels > chosen.estimate.kernels  # the recomputed forward's kernels


def test_the_host_floor_counts_engines_and_the_optimizer_step():
    facts = ModelFacts(num_params=10_000, trainable_params=10_000, trainable_tensors=20, num_blocks=4)
    base = Config(micro_batch_size=8)
    assert engine_host_ops(base, facts) == 0
    # ZeRO: a hook and a bucket copy per parameter tensor, and a copy to the host when offloaded
    assert engine_host_ops(base.replace(sharding="zero2"), facts) == 2 * 20
    assert engine_host_ops(base.replace(sharding="zero2", offload="cpu"), facts) == 3 * 20
    # FSDP2 per unit (4 blocks and the root); resharding after forward gathers again in backward
    grad_op, full = (engine_host_ops(base.replace(sharding=s), facts) for s in ("fsdp_grad_op", "fsdp_full"))
    assert grad_op % 5 == 0 and full > grad_op
    assert engine_host_ops(base.replace(sharding="fsdp_full", num_gpus=2), facts) > full  # the collectives
    # one foreach step over every tensor, against a step per tensor inside backward
    assert optimizer_host_ops(base.replace(optimizer_step="in_backward"), facts) > 4 * optimizer_host_ops(base, facts)
    # accumulation issues every micro-step's kernels again; no simulated count, no floor
    assert host_seconds(base.replace(grad_accum_steps=2), facts, 100) > 1.9 * host_seconds(base, facts, 100)
    assert host_seconds(base, facts, 0) == 0.0


def _real_forward_flops(model, batch):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**batch)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["swin", "convnext"])
def test_a_vision_model_in_stages_counts_its_forward_not_its_first_stage_patches(name):
    """Swin and ConvNeXt name a 4 px patch_size, but merge patches stage by stage: their first stage's
    3,137 positions through every weight counted Swin-T 34 times over (880 GFLOP a sample for ~26)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification, SwinConfig, SwinForImageClassification

    from autofit.estimate.facts import formula_positions

    config, cls = {"swin": (SwinConfig(embed_dim=16, depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8]),
                            SwinForImageClassification),
                   "convnext": (ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1]),
                                ConvNextForImageClassification)}[name]
    spec = make_spec(functools.partial(cls, config), global_batch_size=8, device="cpu", memory_budget="1GiB")
    work = workload(spec, spec.model.num_params, 5)
    first_stage = (224 // 4) ** 2 + 1  # the configs' 224 px in 4 px patches
    assert formula_positions(config, None) is None and "applied" in work.how
    torch.manual_seed(0)
    forward = _real_forward_flops(cls(config).eval(), spec.batch_factory(1))
    assert work.positions == round(forward / (2 * spec.model.num_params)) < first_stage


def test_segmentation_labels_are_pixels_not_tokens():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], decoder_hidden_size=32,
                             image_size=64, num_labels=4)
    spec = make_spec(functools.partial(SegformerForSemanticSegmentation, config), global_batch_size=8,
                     device="cpu", memory_budget="1GiB")
    assert spec.batch_factory(2)["labels"].shape == (2, 64, 64)
    assert spec.tokens_per_sample is None  # was 64: the labels' height read as a sequence
    assert "tokens per sample" not in workload(spec, spec.model.num_params, 4).how


def test_a_model_that_cannot_run_one_sample_in_training_still_counts_its_flops():
    """Batch norm in training needs more than one value per channel (LeViT's head): the count runs on two."""
    spec = make_spec(lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256),
                                                 torch.nn.Linear(256, 10)),
                     lambda n: torch.randn(n, 64), global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=lambda output, batch: output.square().mean())
    work = workload(spec, spec.model.num_params, 1)
    assert work.how.startswith("each weight applied once per sample")  # was "its FLOPs could not be counted"


class _Tagger(torch.nn.Module):
    """A bidirectional 2-layer LSTM over 30 feature frames, a label per frame."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(12, 24, num_layers=2, bidirectional=True)
        self.out = torch.nn.Linear(48, 5)

    def forward(self, frames):
        return self.out(self.rnn(frames.transpose(0, 1))[0])


def test_a_recurrent_model_applies_its_weights_at_every_step():
    """The flop counter has no formula for the fused LSTM kernel: every recurrent weight counted as unused
    (each weight applied 1 time per sample for a model that is almost all LSTM)."""
    spec = make_spec(_Tagger, lambda n: torch.randn(n, 30, 12), global_batch_size=8, device="cpu",
                     memory_budget="1GiB", loss_fn=lambda out, batch: out.square().mean())
    recurrent = sum(p.numel() for name, p in _Tagger().rnn.named_parameters() if name.startswith("weight"))
    forward = 2 * 30 * (recurrent + 48 * 5)  # every weight matrix at each of 30 frames, biases aside
    work = workload(spec, spec.model.num_params, 1)
    assert work.positions == round(forward / (2 * spec.model.num_params)) >= 25
