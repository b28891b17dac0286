"""Speech models in the dry-run: Whisper's features and decoder labels, waveform models' audio and CTC
transcripts, float inputs under every 16-bit weight mode, and the caller's config left as it was
(the architectures' shared table and its simulation test: test_architectures.py)."""

import pytest
import torch
from test_architectures import ARCHITECTURES, SPEECH, _config_file, check_simulated
from transformers import Wav2Vec2Config

from autofit.pipelines.dry_run import dry_run
from autofit.strategies import MicroBatch, MixedPrecision


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("name", SPEECH)
def test_dry_run_from_config_json_simulates_speech_models(tmp_path, name):
    check_simulated(tmp_path, name)


def test_float_inputs_are_simulated_under_every_16_bit_weight_mode(tmp_path):
    """Pure bf16, ZeRO's bf16 and FSDP2's policy train 16-bit weights without autocast and cast a model's float
    inputs (audio features here) to them; the simulation casts them too. It did not under ZeRO and FSDP2,
    and pure bf16 rows shared that failed simulation: a real-size Whisper dry-run rested on the formula."""
    from autofit.strategies import ChunkedLoss, Fsdp, PureBf16, Zero

    path = _config_file(tmp_path, "whisper")
    report = dry_run(str(path), seq_len=32, global_batch_size=4, gpu="rtx-4090", num_gpus=2,
                     strategies=[MixedPrecision(), PureBf16(), ChunkedLoss(), Zero(), Fsdp(), MicroBatch()])
    assert {c.config.precision.value for c in report.candidates} >= {"bf16", "pure_bf16"}
    assert {c.config.sharding.value for c in report.candidates} >= {"none", "zero2", "fsdp_full"}
    assert all(c.estimate.simulated for c in report.candidates), \
        [c.reason for c in report.candidates if not c.estimate.simulated][:1]


def test_whisper_labels_follow_the_decoder_not_the_2048_default(tmp_path):
    from autofit.batches.synthetic import synthesize_batch

    config = ARCHITECTURES["whisper"][0]
    make_batch, description = synthesize_batch(config, None, "WhisperForConditionalGeneration")
    assert make_batch(1)["labels"].shape == (1, 48)  # max_target_positions, not 2048
    assert "input_features 16x128" in description
    from autofit.errors import UsageError

    with pytest.raises(UsageError, match="seq_len 64 exceeds the model's maximum of 48"):
        synthesize_batch(config, 64, "WhisperForConditionalGeneration")


def test_the_simulation_leaves_the_callers_config_as_it_was():
    # A factory built from the caller's config shares it with the simulated model; the simulation switches
    # off LayerDrop and SpecAugment (random, data-dependent steps) and sets the attention, then sets them back.
    from transformers import Wav2Vec2ForCTC

    from autofit.strategies import FusedAttention

    config = Wav2Vec2Config(**{k: v for k, v in ARCHITECTURES["wav2vec2-ctc"][0].to_dict().items()
                               if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "intermediate_size", "conv_dim", "conv_stride", "conv_kernel",
                                        "num_feat_extract_layers", "num_conv_pos_embeddings",
                                        "num_conv_pos_embedding_groups")},
                            layerdrop=0.1, apply_spec_augment=True, mask_time_prob=0.05)
    Wav2Vec2ForCTC(config)  # transformers settles the attention implementation on the first build
    before = dict(vars(config))
    report = dry_run(lambda: Wav2Vec2ForCTC(config), seq_len=1600, global_batch_size=2, gpu="rtx-4090",
                     strategies=[FusedAttention(), MicroBatch()])
    assert report.fits and all(c.estimate.simulated for c in report.candidates)
    assert vars(config) == before


def test_audio_batches_follow_each_audio_models_input():
    from transformers import ASTConfig

    from autofit.errors import UsageError
    from autofit.batches.synthetic import synthesize_batch

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


def test_speech_clip_classifiers_get_a_label_per_clip():
    """Whisper's audio classifier (language ID) took decoder labels of 48 tokens; feature-frame models'
    classifiers were refused."""
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertForSequenceClassification, WhisperForAudioClassification

    from autofit.errors import UsageError
    from autofit.batches.synthetic import synthesize_batch

    whisper = ARCHITECTURES["whisper"][0]
    make_batch, description = synthesize_batch(whisper, None, "WhisperForAudioClassification")
    batch = make_batch(2)
    assert batch["labels"].shape == (2,) and description.endswith("a label per clip (2 classes)")
    assert WhisperForAudioClassification(whisper)(**batch).loss.requires_grad
    with pytest.raises(UsageError, match="takes the encoder's whole window of frames"):
        synthesize_batch(whisper, 32, "WhisperForAudioClassification")
    frames = Wav2Vec2BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                output_hidden_size=32, feature_projection_input_dim=32, num_labels=3)
    batch = synthesize_batch(frames, 120, "Wav2Vec2BertForSequenceClassification")[0](2)
    assert batch["input_features"].shape == (2, 120, 32) and batch["labels"].shape == (2,)
    assert Wav2Vec2BertForSequenceClassification(frames)(**batch).loss.requires_grad
