"""Dry-runs from a config.json beyond causal LMs: each architecture gets a batch of its own modality and
its activations are simulated (never the formula fallback); a step that cannot be simulated is said so."""

import json

import pytest
import torch
from transformers import (BertConfig, CLIPConfig, ConvNextConfig, DistilBertConfig, Gemma2Config, MixtralConfig,
                          SegformerConfig, T5Config, ViTConfig, Wav2Vec2Config, WhisperConfig)

from autofit.cli.main import main
from autofit.estimate.dry_run import dry_run
from autofit.strategies import MicroBatch, Precision

TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHITECTURES = {
    "whisper": (WhisperConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                              max_source_positions=64, max_target_positions=48, decoder_start_token_id=3,
                              architectures=["WhisperForConditionalGeneration"], **TOKENS),
                {"input_features": (16, 128), "labels": (32,)}),
    "clip": (CLIPConfig(text_config=dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, max_position_embeddings=32, **TOKENS),
                        vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, image_size=32, patch_size=8),
                        projection_dim=32, architectures=["CLIPModel"]),
             {"input_ids": (32,), "pixel_values": (3, 32, 32)}),
    "t5": (T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                    architectures=["T5ForConditionalGeneration"]),
           {"input_ids": (32,), "decoder_input_ids": (32,), "labels": (32,)}),
    "vit": (ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
                      patch_size=8, architectures=["ViTForImageClassification"]),
            {"pixel_values": (3, 32, 32), "labels": ()}),
    "mixtral": (MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=64, architectures=["MixtralForCausalLM"], **TOKENS),
                {"input_ids": (32,), "labels": (32,)}),
    "bert-token-classifier": (BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, num_labels=5,
                                         architectures=["BertForTokenClassification"]),
                              {"input_ids": (32,), "labels": (32,)}),
    "wav2vec2-ctc": (Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                    num_feat_extract_layers=2, num_conv_pos_embeddings=16,
                                    num_conv_pos_embedding_groups=4, architectures=["Wav2Vec2ForCTC"]),
                     {"input_values": (1600,), "labels": (53,)}),  # 1,600 samples: 159 frames, a character per 3
    "segformer": (SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                  num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=5, image_size=32,
                                  architectures=["SegformerForSemanticSegmentation"]),
                  {"pixel_values": (3, 32, 32), "labels": (32, 32)}),
    "convnext": (ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10, image_size=32,
                                architectures=["ConvNextForImageClassification"]),
                 {"pixel_values": (3, 32, 32), "labels": ()}),
    "distilbert-qa": (DistilBertConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                       architectures=["DistilBertForQuestionAnswering"]),
                      {"input_ids": (32,), "start_positions": (), "end_positions": ()}),
}
SEQ_LEN = {"wav2vec2-ctc": 1600, "vit": None, "convnext": None, "segformer": None}  # audio samples; images: none


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _config_file(tmp_path, name):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    ARCHITECTURES[name][0].to_json_file(path)
    return path


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_dry_run_from_config_json_simulates_every_architecture(tmp_path, name):
    path = _config_file(tmp_path, name)
    report = dry_run(str(path), seq_len=SEQ_LEN.get(name, 32), global_batch_size=4, gpu="rtx-4090",
                     strategies=[Precision(), MicroBatch()])
    assert report.fits and not report.formula_only
    for candidate in report.candidates:
        assert candidate.estimate.simulated, candidate.reason
        assert candidate.estimate.error_bound == 0
        assert "simulated under fake tensors" in candidate.estimate.method
        assert candidate.estimate.breakdown.activations > 0
    # the synthesized batch is the modality's own, shaped as the model's forward takes it
    from autofit.spec.models import resolve_model
    from autofit.spec.train import make_spec

    factory, _, _ = resolve_model(str(path))
    spec = make_spec(factory, seq_len=SEQ_LEN.get(name, 32), device="cpu", memory_budget="1GiB")
    batch = spec.batch_factory(2)
    shapes = {key: tuple(value.shape[1:]) for key, value in batch.items() if isinstance(value, torch.Tensor)}
    assert shapes == ARCHITECTURES[name][1]


def test_float_inputs_are_simulated_under_every_16_bit_weight_mode(tmp_path):
    """Pure bf16, ZeRO's bf16 and FSDP2's policy train 16-bit weights without autocast and cast a model's float
    inputs (audio features here) to them; the simulation casts them too. It did not under ZeRO and FSDP2,
    and pure bf16 rows shared that failed simulation: a real-size Whisper dry-run rested on the formula."""
    from autofit.strategies import ChunkedLoss, Fsdp, PureBf16, Zero

    path = _config_file(tmp_path, "whisper")
    report = dry_run(str(path), seq_len=32, global_batch_size=4, gpu="rtx-4090", num_gpus=2,
                     strategies=[Precision(), PureBf16(), ChunkedLoss(), Zero(), Fsdp(), MicroBatch()])
    assert {c.config.precision.value for c in report.candidates} >= {"bf16", "pure_bf16"}
    assert {c.config.sharding.value for c in report.candidates} >= {"none", "zero2", "fsdp_full"}
    assert all(c.estimate.simulated for c in report.candidates), \
        [c.reason for c in report.candidates if not c.estimate.simulated][:1]


def test_whisper_labels_follow_the_decoder_not_the_2048_default(tmp_path):
    from autofit.spec.batch import synthesize_batch

    config = ARCHITECTURES["whisper"][0]
    make_batch, description = synthesize_batch(config, None, "WhisperForConditionalGeneration")
    assert make_batch(1)["labels"].shape == (1, 48)  # max_target_positions, not 2048
    assert "input_features 16x128" in description
    from autofit.errors import UsageError

    with pytest.raises(UsageError, match="seq_len 64 exceeds the model's maximum of 48"):
        synthesize_batch(config, 64, "WhisperForConditionalGeneration")


def test_a_failed_simulation_is_never_a_confident_fit(tmp_path, monkeypatch, capsys):
    """Where the step cannot be simulated, the row, the summary, the JSON and the exit code say that the
    verdict rests on the formula, with its error bound."""
    import autofit.estimate.estimator as estimator

    def no_fake_kernel(*args, **kwargs):
        raise NotImplementedError("aten::made_up has no fake kernel")

    monkeypatch.setattr(estimator, "simulate_step", no_fake_kernel)
    monkeypatch.setattr(estimator, "_SIMULATIONS", estimator._Simulations())  # none of the real ones kept
    path = _config_file(tmp_path, "bert-token-classifier")
    report = dry_run(str(path), seq_len=32, global_batch_size=4, gpu="rtx-4090", strategies=[Precision(), MicroBatch()])
    assert report.fits and report.formula_only
    chosen = report.chosen
    assert not chosen.estimate.simulated and chosen.estimate.error_bound > 0
    assert chosen.estimate.upper_bytes > chosen.peak_bytes
    assert "by formula only" in chosen.reason and "by formula only" in report.reason
    assert report.to_dict()["verdict_basis"] == "formula"
    code = main(["dry-run", "--model", str(path), "--seq-len", "32", "--global-batch-size", "4", "--gpu", "rtx-4090",
                 "--json"])
    assert code == 4
    data = json.loads(capsys.readouterr().out)
    assert data["verdict_basis"] == "formula" and data["chosen"]["activations"] == "formula"
    # the tuner never prunes by the formula: the probe decides
    from autofit.config import Config
    from autofit.estimate.estimator import predictor_for
    from autofit.spec.models import resolve_model
    from autofit.spec.train import make_spec

    spec = make_spec(resolve_model(str(path))[0], seq_len=32, device="cpu", memory_budget="1GiB")
    assert predictor_for(spec)(Config()) is None


def test_flash_attention_is_simulated_for_a_model_that_refuses_sdpa(tmp_path):
    # Gemma-2 soft-caps its attention scores, which flash-attention's kernels do and SDPA does not
    # (`_supports_sdpa = False`): its flash rows failed to simulate as SDPA and rested on the formula.
    from autofit.strategies import Attention

    config = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          architectures=["Gemma2ForCausalLM"], **TOKENS)
    path = tmp_path / "gemma2" / "config.json"
    path.parent.mkdir()
    config.to_json_file(path)
    report = dry_run(str(path), seq_len=64, global_batch_size=2, gpu="rtx-4090",
                     strategies=[Precision(), Attention(), MicroBatch()])
    by_attention = {c.config.attention.value: c for c in report.candidates
                    if c.config.micro_batch_size == 2 and c.config.precision.value == "bf16"}
    assert set(by_attention) == {"eager", "flash_attention_2"}
    assert all(c.estimate.simulated for c in report.candidates), [c.reason for c in report.candidates]
    flash, eager = by_attention["flash_attention_2"], by_attention["eager"]
    assert flash.estimate.breakdown.activations < eager.estimate.breakdown.activations  # no scores kept


def test_the_simulation_leaves_the_callers_config_as_it_was():
    # A factory built from the caller's config shares it with the simulated model; the simulation switches
    # off LayerDrop and SpecAugment (random, data-dependent steps) and sets the attention, then sets them back.
    from transformers import Wav2Vec2ForCTC

    from autofit.strategies import Attention

    config = Wav2Vec2Config(**{k: v for k, v in ARCHITECTURES["wav2vec2-ctc"][0].to_dict().items()
                               if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "intermediate_size", "conv_dim", "conv_stride", "conv_kernel",
                                        "num_feat_extract_layers", "num_conv_pos_embeddings",
                                        "num_conv_pos_embedding_groups")},
                            layerdrop=0.1, apply_spec_augment=True, mask_time_prob=0.05)
    Wav2Vec2ForCTC(config)  # transformers settles the attention implementation on the first build
    before = dict(vars(config))
    report = dry_run(lambda: Wav2Vec2ForCTC(config), seq_len=1600, global_batch_size=2, gpu="rtx-4090",
                     strategies=[Attention(), MicroBatch()])
    assert report.fits and all(c.estimate.simulated for c in report.candidates)
    assert vars(config) == before


def test_a_sequence_length_for_an_image_model_is_refused(tmp_path):
    # typed in a hurry: --seq-len means nothing to a ViT, whose batch is its config's image size
    from autofit.errors import UsageError

    with pytest.raises(UsageError, match="seq_len 512 does not apply to ViTForImageClassification"):
        dry_run(str(_config_file(tmp_path, "vit")), seq_len=512, global_batch_size=4, gpu="rtx-4090")


def test_audio_batches_follow_each_audio_models_input():
    from transformers import ASTConfig

    from autofit.errors import UsageError
    from autofit.spec.batch import synthesize_batch

    waveform = ARCHITECTURES["wav2vec2-ctc"][0]
    make_batch, description = synthesize_batch(waveform, None, "Wav2Vec2ForCTC")  # default: 10 s at 16 kHz
    batch = make_batch(2)
    assert batch["input_values"].shape == (2, 160_000) and batch["input_values"].is_floating_point()
    assert batch["labels"].shape == (2, 5333) and batch["labels"].min() >= 1  # 16,000 frames; 0 is CTC's blank
    assert "10.0 s at 16 kHz" in description
    clip = synthesize_batch(waveform, 16_000, "Wav2Vec2ForSequenceClassification")[0](1)
    assert clip["labels"].shape == (1,)
    with pytest.raises(UsageError, match="shorter than Wav2Vec2ForCTC's convolutions"):
        synthesize_batch(waveform, 8, "Wav2Vec2ForCTC")
    with pytest.raises(UsageError, match="Wav2Vec2ForPreTraining"):
        synthesize_batch(waveform, None, "Wav2Vec2ForPreTraining")
    spectrogram = ASTConfig(max_length=128, num_mel_bins=16, architectures=["ASTForAudioClassification"])
    assert synthesize_batch(spectrogram, None, "ASTForAudioClassification")[0](1)["input_values"].shape == (1, 128, 16)
