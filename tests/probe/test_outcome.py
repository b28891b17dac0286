"""One outcome per candidate: the record checks itself, and old records are read into today's model."""

import pytest

from autofit.config import Config
from autofit.probe.outcome import ProbeResult, ProbeStatus, Skip, Source, decided


def test_a_fit_carries_its_peak_and_throughput():
    with pytest.raises(ValueError, match="a fit needs its peak and throughput"):
        ProbeResult(Config(), ProbeStatus.FIT, "fits")
    assert ProbeResult(Config(), ProbeStatus.FIT, "fits", peak_bytes=1, samples_per_s=2.0).fits


def test_an_oom_carries_its_kind():
    with pytest.raises(ValueError, match="an OOM needs its kind"):
        ProbeResult(Config(), ProbeStatus.OOM, "out of memory")


def test_only_a_skip_is_decided_without_running_and_says_why():
    with pytest.raises(ValueError, match="says why"):
        ProbeResult(Config(), ProbeStatus.SKIPPED, "not run")
    with pytest.raises(ValueError, match="says why"):
        ProbeResult(Config(), ProbeStatus.ERROR, "boom", skip=Skip.BUDGET)
    with pytest.raises(ValueError, match="decided without running"):
        ProbeResult(Config(), ProbeStatus.ERROR, "boom", source=Source.DECIDED)
    skip = decided(Config(), Skip.PREDICTED, "predicted to need 2 GiB")
    assert skip.source is Source.DECIDED and not skip.measured


def test_round_trip():
    record = ProbeResult(Config(precision="bf16"), ProbeStatus.PRUNED, "too slow to win", peak_bytes=5)
    assert ProbeResult.from_dict(record.to_dict()) == record
    skip = decided(Config(), Skip.EXCLUDED, "flash-attention needs CUDA")
    assert ProbeResult.from_dict(skip.to_dict()) == skip
