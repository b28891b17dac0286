import pytest
import torch

from autofit import UsageError
from autofit.spec.batch import default_loss, factory_from_sample, leading_dim, take_rows, tokens_per_sample


def test_leading_dim_of_a_dict():
    assert leading_dim({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(3, 5)}) == 3


def test_disagreeing_sample_axes_are_an_error():
    with pytest.raises(UsageError, match=r"disagree.*\[2, 3\]"):
        leading_dim((torch.zeros(2, 4), torch.zeros(3)))


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


def test_default_loss_explains_what_to_do():
    with pytest.raises(UsageError, match="loss_fn=lambda output, batch"):
        default_loss(torch.zeros(2, 3), None)
    assert default_loss(torch.tensor(2.0), None).item() == 2.0
    assert default_loss({"loss": torch.tensor(1.0)}, None).item() == 1.0
