import pytest

from autofit import UsageError, format_size, parse_size


@pytest.mark.parametrize("text, expected", [
    ("20GiB", 20 * 2**30), ("1.5 GB", 1_500_000_000), ("512MiB", 512 * 2**20), ("64MIB", 64 * 2**20),
    ("1048576", 2**20), (2**30, 2**30), (769_392, 769_392), ("2TiB", 2 * 2**40), ("10KB", 10_000),
    ("1e9", 10**9), ("2.5E10", 25 * 10**9), ("1e3 MiB", 1000 * 2**20),  # as code writes a number
    ("8Gi", 8 * 2**30), ("512 Mi", 512 * 2**20),  # as Kubernetes writes a size
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["twenty", "20 parsecs", "", "-3GiB", 0, -5, True, None, "1.2.3GB", float("nan"), float("inf")])
def test_parse_size_rejects_with_the_value(bad):
    with pytest.raises(UsageError) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("hurried", ["24", "80 ", "1.5"])
def test_a_number_without_a_unit_under_a_mebibyte_asks_for_one(hurried):
    with pytest.raises(UsageError, match=f"give a unit, e.g. '{str(hurried).strip()}GiB'"):
        parse_size(hurried, "gpu_memory")


@pytest.mark.parametrize("typed, fix", [("4,5GiB", "'4.5GiB'"), ("4_000MB", "'4000MB'"), ("1'024MiB", "'1024MiB'")])
def test_a_size_with_a_decimal_comma_or_separators_is_refused_with_its_fix(typed, fix):
    with pytest.raises(UsageError, match=f"got {typed!r} \\(write decimals with a dot and no separators between digits: {fix}"):
        parse_size(typed)


def test_format_size():
    assert format_size(5 * 2**30) == "5.00 GiB"
    assert format_size(512) == "512 B"
    assert format_size(None) == "-"


def test_a_length_as_people_type_it_in_code_too():
    """`autofit.dry_run(..., seq_len="1k")` as `--seq-len 1k` takes it (was: "seq_len must be an integer")."""
    from autofit.units import parse_length

    assert [parse_length(v) for v in (4096, "4,096", "4k", "128K", " 2_048 ")] == [4096, 4096, 4096, 131072, 2048]
    for typo in ("2.5k", "4kb", True, 4096.0):
        with pytest.raises(UsageError, match="is not a length: pass a whole number"):
            parse_length(typo)


@pytest.mark.parametrize("typed, fixes", [("16Mb", "'16MiB' (x 1024**n) or '16MB'"), ("16mb", "'16MiB'"),
                                          ("2 Gb", "'2GiB' (x 1024**n) or '2GB'"), ("64mib", "'64MiB'"),
                                          ("10kb", "'10KiB' (x 1024**n) or '10KB'")])
def test_a_unit_ending_in_a_small_b_is_refused_asking_bits_or_bytes(typed, fixes):
    """Issue 54: `--memory-budget 16Mb` (megabits) was taken as 16 MB and a whole tune ran."""
    with pytest.raises(UsageError) as refused:
        parse_size(typed)
    assert fixes in str(refused.value) and "a bit" in str(refused.value) and repr(typed) in str(refused.value)
