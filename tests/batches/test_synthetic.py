"""Batches synthesized from a Hugging Face config (`autofit/batches/synthetic.py`): the fields each head's
loss takes, at the shapes its config allows."""

import pytest
import torch

from autofit import UsageError
from autofit.batches.batch import call_model, tokens_per_sample
from autofit.batches.synthetic import synthesize_batch


def test_a_non_square_image_size_gives_images_of_that_height_and_width():
    """YOLOS names [height, width] (512 x 864): its batch and its positions follow both sides, not the
    first one squared."""
    from transformers import YolosConfig, YolosForObjectDetection

    from autofit.estimate.facts import formula_positions

    config = YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         image_size=[64, 96], patch_size=16, num_detection_tokens=10, num_labels=5)
    make_batch, how = synthesize_batch(config, None, "YolosForObjectDetection")
    batch = make_batch(2)
    assert batch["pixel_values"].shape == (2, 3, 64, 96) and "3x64x96" in how
    assert formula_positions(config, None) == 4 * 6 + 1 + 10
    torch.manual_seed(0)
    assert YolosForObjectDetection(config)(**batch).loss.isfinite()


@pytest.mark.parametrize("head, shapes", [
    ("BertForMultipleChoice", {"input_ids": (4, 16), "labels": ()}),  # was input_ids and labels of 16 tokens
    ("BertForNextSentencePrediction", {"input_ids": (16,), "labels": ()}),
    ("BertForPreTraining", {"input_ids": (16,), "labels": (16,), "next_sentence_label": ()}),  # was no loss
])
def test_bert_heads_get_the_targets_their_loss_takes(head, shapes):
    import transformers
    from transformers import BertConfig


    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, architectures=[head])
    make_batch, _ = synthesize_batch(config, 16, head)
    batch = make_batch(2)
    assert {key: tuple(value.shape[1:]) for key, value in batch.items()} == shapes
    assert tokens_per_sample(batch) == (4 * 16 if head.endswith("MultipleChoice") else 16)  # every choice's tokens
    torch.manual_seed(0)
    assert getattr(transformers, head)(config)(**batch).loss.requires_grad


def test_a_vision_language_batch_puts_the_images_tokens_first_and_trains_on_the_text():
    from transformers import LlavaNextConfig, PaliGemmaConfig


    small = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = PaliGemmaConfig(text_config=dict(model_type="gemma", **small, num_image_tokens=4), image_token_id=7,
                             vision_config=dict(model_type="siglip_vision_model", **small, image_size=28, patch_size=14))
    make_batch, how = synthesize_batch(config, 32, "PaliGemmaForConditionalGeneration")
    batch = make_batch(3)
    image = batch["input_ids"][:, :4]
    assert (image == 7).all() and not (batch["input_ids"][:, 4:] == 7).any()  # no placeholder in the text
    assert (batch["labels"][:, :4] == -100).all() and (batch["labels"][:, 4:] == batch["input_ids"][:, 4:]).all()
    assert (batch["token_type_ids"].sum(1) == 28).all() and batch["pixel_values"].shape == (3, 3, 28, 28)
    assert "4 image tokens, 28 of text" in how
    with pytest.raises(UsageError, match="no text after the image's 4 tokens"):
        synthesize_batch(config, 4, "PaliGemmaForConditionalGeneration")
    with pytest.raises(UsageError, match="follow the image's size and tiling; pass a batch"):  # LLaVA-NeXT's tiles
        synthesize_batch(LlavaNextConfig(), 1024, "LlavaNextForConditionalGeneration")


def test_roberta_positions_after_padding_leave_two_fewer_tokens():
    """RoBERTa numbers positions from padding_idx + 1: of max_position_embeddings=130, 128 hold tokens. The
    synthesized batch took 130 and the first probe failed ("index 130 is out of bounds for dimension 1")."""
    from transformers import RobertaConfig, RobertaForMultipleChoice, RobertaForSequenceClassification


    config = RobertaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=130)
    for model in (RobertaForSequenceClassification(config), RobertaForMultipleChoice(config)):
        factory, _ = synthesize_batch(config, None, type(model).__name__)
        batch = factory(2)
        assert batch["input_ids"].shape[-1] == 128
        assert call_model(model, batch).loss.isfinite()  # the real model takes it
    with pytest.raises(UsageError, match="seq_len 130 exceeds the model's maximum of 128 positions"):
        synthesize_batch(config, 130, "RobertaForSequenceClassification")
