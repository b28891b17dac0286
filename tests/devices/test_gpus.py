"""GPU profiles: the shipped data, lookups and their errors."""

import pytest

from autofit.errors import UsageError
from autofit.devices.gpus import get_gpu, list_gpus, other_sizes, split_count

GIB = 1024**3


def test_required_profiles_with_memory_and_bf16():
    names = {g.name for g in list_gpus()}
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "l40s", "a10g", "rtx-3090", "rtx-4090", "t4",
            "v100-16gb", "v100-32gb"} <= names
    assert get_gpu("a100-80gb").memory_bytes == 80 * GIB
    assert get_gpu("t4").bf16 is False and get_gpu("v100-32gb").bf16 is False
    assert get_gpu("h100-80gb").bf16 is True


def test_tflops_per_precision():
    h100 = get_gpu("H100")  # alias, any case
    assert h100.tflops("bf16") == 989
    assert h100.tflops("fp32") < h100.tflops("fp16")
    assert get_gpu("t4").tflops("bf16") == get_gpu("t4").fp16_tflops  # no bf16: fp16 figure


def test_list_is_largest_first():
    sizes = [g.memory_bytes for g in list_gpus()]
    assert sizes == sorted(sizes, reverse=True)


def test_with_memory_overrides_size_only():
    small = get_gpu("a100-80gb").with_memory(20 * GIB)
    assert small.memory_bytes == 20 * GIB and small.bf16_tflops == 312


def test_unknown_gpu_lists_profiles():
    with pytest.raises(UsageError, match=r"Did you mean a100-80gb.*Known GPUs: a10, a100-40gb.*--gpu-memory"):
        get_gpu("a100-90gb")


@pytest.mark.parametrize("name, others", [("a100", ["a100-80gb"]), ("V100", ["v100-32gb"]), ("h100", ["h100-pcie"]),
                                          ("a100-80gb", []), ("4090", [])])
def test_an_alias_of_several_sizes_names_the_others(name, others):
    assert other_sizes(name) == others


@pytest.mark.parametrize("written, split", [("8xa100-40gb", (8, "a100-40gb")), ("8×A100-40GB", (8, "A100-40GB")),
                                            ("2 x h100", (2, "h100")), ("4*l4", (4, "l4")), ("h100", (None, "h100")),
                                            ("rtx-4090", (None, "rtx-4090")), ("4090", (None, "4090")),
                                            ("h100x8", (8, "h100")), ("A100 x 4", (4, "A100")),  # count after
                                            ("4090x2", (2, "4090")), ("rtx4090", (None, "rtx4090"))])
def test_a_count_in_front_is_read_apart(written, split):
    assert split_count(written) == split
    assert other_sizes(written) == other_sizes(split[1])


@pytest.mark.parametrize("typed, profile", [("h100sxm", "h100-80gb"), ("A10040GB", "a100-40gb"), ("V10016GB", "v100-16gb"),
                                            ("a100-80", "a100-80gb"), ("V100 32", "v100-32gb")])  # unit left out
def test_a_name_typed_without_its_hyphens_is_the_profile_it_spells(typed, profile):
    assert get_gpu(typed).name == profile


def test_the_start_of_a_name_is_no_profile():
    with pytest.raises(UsageError, match="Unknown GPU 'h1'. Did you mean h100?"):
        get_gpu("h1")


def test_a_card_of_another_maker_is_offered_no_nvidia_card_that_merely_shares_digits():
    """"mi300x" had been answered "Did you mean 3090?"; a suggestion keeps the family letter typed."""
    with pytest.raises(UsageError) as raised:
        get_gpu("mi300x")
    assert "Did you mean" not in str(raised.value) and "--gpu-memory 20GiB" in str(raised.value)
    with pytest.raises(UsageError, match="Did you mean 3090"):
        get_gpu("3090ti")


@pytest.mark.parametrize("typed, profile", [("L40", "l40"), ("l40s", "l40s"), ("2xA6000", "rtx-a6000"), ("RTX A6000", "rtx-a6000"), ("a40", "a40"),
                                            ("RTX 6000 Ada", "rtx-6000-ada"), ("h100-pcie", "h100-pcie"), ("A10", "a10")])
def test_the_48gb_workstation_cards_and_pcie_h100_are_profiles(typed, profile):
    """Cards common in labs and clouds (RTX A6000, A40, RTX 6000 Ada, H100 PCIe, A10) were unknown: a dry-run
    for 2 x A6000 ended "Unknown GPU 'A6000'". Memory as nvidia-smi reports it (49140, 46068, 49140, 81559 and
    23028 MiB)."""
    assert get_gpu(split_count(typed)[1]).name == profile
