import pytest
import torch

from autofit import UsageError
from autofit.batches.batch import (call_model, default_loss, factory_from_sample, forward_names, images_per_sample,
                                leading_dim, made, take_rows, tokens_per_sample)


def test_leading_dim_of_a_dict():
    assert leading_dim({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(3, 5)}) == 3


def test_disagreeing_sample_axes_are_an_error():
    with pytest.raises(UsageError, match=r"disagree.*\[2, 3\]"):
        leading_dim((torch.zeros(2, 4), torch.zeros(3)))


def test_a_time_major_sequence_is_named_with_the_layout_that_works():
    """nn.LSTM's default takes (steps, samples, features): beside per-sample labels the first axes disagree,
    and the message says which tensor is time-major and the shape to pass."""
    with pytest.raises(UsageError, match=r"shape \(50, 16, 12\) looks time-major.*samples first, \(16, 50, 12\)"):
        leading_dim((torch.randn(50, 16, 12), torch.zeros(16)))
    with pytest.raises(UsageError) as plain:
        leading_dim((torch.randn(2, 4), torch.randn(3, 4)))
    assert "time-major" not in str(plain.value)


def test_a_factory_making_time_major_batches_is_named_with_the_layout_that_works():
    """Its tensors agree on their first axis (the steps), which is not the count it was asked for."""
    with pytest.raises(UsageError, match=r"make_batch\(3\) returned a batch of 50 samples.*shape \(50, 3, 16\) looks "
                                         r"time-major.*samples first, \(3, 50, 16\)"):
        made(lambda n: (torch.randn(50, n, 16), torch.zeros(50, n)), 3)
    with pytest.raises(UsageError) as fixed:
        made(lambda n: torch.randn(8, 4), 3)
    assert "time-major" not in str(fixed.value)


def test_scalar_cannot_be_sliced():
    with pytest.raises(UsageError, match="0-dimensional"):
        leading_dim((torch.zeros(2, 4), torch.tensor(1.0)))


def test_take_rows_cycles_through_the_sample():
    sample = torch.arange(3).unsqueeze(1)
    assert take_rows(sample, 2, 4).flatten().tolist() == [2, 0, 1, 2]


def test_factory_from_sample_makes_any_size():
    make = factory_from_sample({"x": torch.arange(4)})
    assert make(10)["x"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_tokens_per_sample():
    assert tokens_per_sample({"input_ids": torch.zeros(2, 128, dtype=torch.long)}) == 128
    assert tokens_per_sample((torch.zeros(2, 7, dtype=torch.long), torch.zeros(2))) == 7
    assert tokens_per_sample(torch.zeros(2, 7)) is None


def test_tokens_per_sample_of_a_plain_models_dict():
    """Any dict with a field of token ids has a sequence axis ({"idx", "targets"} read None before): a bool
    mask, a (samples, 1) label column, floats and 1-D labels are not tokens."""
    ids = torch.zeros(2, 64, dtype=torch.long)
    assert tokens_per_sample({"idx": ids, "targets": ids}) == 64
    assert tokens_per_sample({"x": torch.zeros(2, 64), "mask": torch.ones(2, 64, dtype=torch.bool)}) is None
    assert tokens_per_sample({"x": torch.zeros(2, 8), "label": torch.zeros(2, 1, dtype=torch.long)}) is None
    assert tokens_per_sample({"x": torch.zeros(2, 8), "label": torch.zeros(2, dtype=torch.long)}) is None
    # input_ids still wins over other fields of another length
    assert tokens_per_sample({"segments": torch.zeros(2, 5, dtype=torch.long), "input_ids": ids}) == 64


def test_images_per_sample():
    image = torch.zeros(2, 3, 32, 32)
    assert images_per_sample(image) == 1
    assert images_per_sample((image, torch.zeros(2, dtype=torch.long))) == 1
    assert images_per_sample({"pixel_values": torch.zeros(2, 1, 28, 28), "labels": torch.zeros(2)}) == 1
    assert images_per_sample({"pixel_values": torch.zeros(2, 16, 3, 224, 224)}) == 16  # VideoMAE: frames
    assert images_per_sample({"video": torch.zeros(2, 3, 8, 112, 112)}) == 8  # (samples, channels, frames, ...)
    assert images_per_sample({"input_ids": torch.zeros(2, 7, dtype=torch.long)}) is None
    assert images_per_sample(torch.zeros(2, 16, 32, 32)) is None  # 16 channels: not an image
    assert images_per_sample(torch.zeros(2, 3, 32, 32, dtype=torch.long)) is None  # integers: not pixels


def test_default_loss_explains_what_to_do():
    with pytest.raises(UsageError, match="loss_fn=lambda output, batch"):
        default_loss(torch.zeros(2, 3), None)
    assert default_loss(torch.tensor(2.0), None).item() == 2.0
    assert default_loss({"loss": torch.tensor(1.0)}, None).item() == 1.0
    # a tuple's one scalar: nanoGPT's (logits, loss), a return_dict=False model's (loss, logits)
    logits = torch.zeros(2, 3)
    assert default_loss((logits, torch.tensor(3.0)), None).item() == 3.0
    assert default_loss([torch.tensor(4.0), logits], None).item() == 4.0
    with pytest.raises(UsageError, match="a tuple of 2 items, 2 of them a scalar tensor"):  # which one? not guessed
        default_loss((torch.tensor(1.0), torch.tensor(2.0)), None)
    with pytest.raises(UsageError, match=r"a tuple of 2 items, 0 of them .* A tuple batch gives the model its first"):
        default_loss((logits, None), (logits, logits))  # nanoGPT without its targets


def test_a_tokenizers_batch_encoding_is_a_dict_batch():
    from transformers import BatchEncoding

    from autofit.batches.batch import slice_rows
    from autofit.batches.batch import call_model, factory_from_sample, leading_dim, to_device

    ids = torch.arange(12).reshape(4, 3)
    encoded = BatchEncoding({"input_ids": ids, "labels": ids})
    assert leading_dim(encoded) == 4
    assert torch.equal(factory_from_sample(encoded)(2)["input_ids"], ids[:2])
    assert torch.equal(slice_rows(encoded, 1, 2)["labels"], ids[1:3])
    assert isinstance(to_device(encoded, torch.device("cpu")), dict)
    assert call_model(lambda input_ids, labels: input_ids.sum() + labels.sum(), encoded) == 2 * ids.sum()


def test_a_field_with_a_value_per_sample_is_sliced_with_its_samples():
    from autofit.batches.batch import slice_rows

    batch = {"input_ids": torch.arange(8).reshape(4, 2), "texts": ["a", "b", "c", "d"], "task": "qa"}
    assert take_rows(batch, 1, 2)["texts"] == ["b", "c"] and take_rows(batch, 3, 2)["texts"] == ["d", "a"]
    assert slice_rows(batch, 2, 2)["texts"] == ["c", "d"]
    assert slice_rows(batch, 2, 2)["task"] == "qa"  # one value for the whole batch is kept whole


def test_detection_targets_hold_one_dict_per_sample_and_go_with_their_samples():
    """Object detectors take `labels` as one dict per image (DETR: class_labels and boxes), whose tensors
    count objects, not samples: the batch's size is its tensors', and slicing keeps each image's targets."""
    from autofit.batches.batch import slice_rows

    targets = [{"class_labels": torch.full((k,), k), "boxes": torch.rand(k, 4)} for k in (1, 2, 3)]
    batch = {"pixel_values": torch.zeros(3, 3, 8, 8), "labels": targets}
    assert leading_dim(batch) == 3
    assert [t["class_labels"][0].item() for t in take_rows(batch, 2, 2)["labels"]] == [3, 1]
    assert slice_rows(batch, 1, 1)["labels"][0]["boxes"].shape == (2, 4)
    with pytest.raises(UsageError, match=r"batch\['labels'\] holds 2 per-sample entries, but the batch's tensors"):
        leading_dim({"pixel_values": torch.zeros(3, 3, 8, 8), "labels": targets[:2]})


class IdsAndMask(torch.nn.Module):
    """A model of one's own: forward takes the inputs by name; the loss, from `labels`, is loss_fn's."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids, mask):
        return self.head((self.embed(ids) * mask.unsqueeze(-1)).mean(1))


def _labelled(n):
    return {"ids": torch.randint(0, 50, (n, 6)), "mask": torch.ones(n, 6), "labels": torch.randint(0, 3, (n,))}


def _labelled_loss(output, batch):
    return torch.nn.functional.cross_entropy(output, batch["labels"])


def test_keys_the_forward_does_not_take_reach_the_loss_alone():
    model, batch = IdsAndMask(), _labelled(4)
    assert call_model(model, batch).shape == (4, 3)  # was TypeError: unexpected keyword 'labels'
    assert forward_names(model) == {"ids", "mask"}


def test_a_pass_through_wrapper_is_read_through_to_the_forward_it_calls(tmp_path):
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel

    batch = _labelled(4)
    lora = get_peft_model(IdsAndMask(), LoraConfig(target_modules=["head"]))  # PeftModel.forward(*args, **kwargs)
    assert forward_names(lora) == {"ids", "mask"} and call_model(lora, batch).shape == (4, 3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(IdsAndMask())  # forward(*inputs, **kwargs) around .module
        assert forward_names(ddp) == {"ids", "mask"} and call_model(ddp, batch).shape == (4, 3)
    finally:
        dist.destroy_process_group()


def test_a_model_taking_any_keyword_gets_every_key():
    class AnyKeyword(torch.nn.Module):
        def forward(self, **fields):
            return sorted(fields)

    assert forward_names(AnyKeyword()) is None
    assert call_model(AnyKeyword(), _labelled(2)) == ["ids", "labels", "mask"]




def _packed_batch():
    """Qwen2-VL's processor output for 3 samples: sample 1 holds two images (2 and 4 placeholders), the others
    one; a placeholder per 4 patches (spatial_merge_size 2); each patch's row holds its own index."""
    types = torch.zeros(3, 12, dtype=torch.long)
    types[0, 1:5] = types[1, 1:3] = types[1, 5:9] = types[2, 2:6] = 1
    grid = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 4], [1, 4, 4]])
    patches = torch.arange(56.0)[:, None].repeat(1, 6)
    return {"input_ids": torch.randint(3, 100, (3, 12)), "mm_token_type_ids": types, "pixel_values": patches,
            "image_grid_thw": grid}


def test_packed_images_go_with_their_samples():
    """Qwen2-VL and its kin pack every image's patches in one tensor and a grid row per image: a micro-batch
    takes its own samples' images (was: "The batch's tensors disagree on the sample axis")."""
    from autofit.batches.batch import slice_rows

    batch = _packed_batch()
    assert leading_dim(batch) == 3
    taken = take_rows(batch, 2, 3)  # samples 2, 0, 1: wrapping around
    assert taken["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4], [1, 2, 4], [1, 4, 4]]
    assert taken["pixel_values"][:, 0].tolist() == [*range(40, 56), *range(0, 40)] and leading_dim(taken) == 3
    sliced = slice_rows(batch, 1, 2)  # a micro-batch: views
    assert sliced["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 4], [1, 4, 4]]
    assert sliced["pixel_values"][:, 0].tolist() == list(range(16, 56)) and sliced["pixel_values"]._base is not None
    assert sliced["input_ids"].shape == (2, 12)


def test_packed_images_need_the_token_types_that_place_them():
    batch = _packed_batch()
    with pytest.raises(UsageError, match="needs the processor's 'mm_token_type_ids' too"):
        leading_dim({key: value for key, value in batch.items() if key != "mm_token_type_ids"})
    batch["image_grid_thw"] = batch["image_grid_thw"][:3]
    with pytest.raises(UsageError, match=r"gives 40 patches for batch\['pixel_values'\]'s 56 rows"):
        leading_dim(batch)
