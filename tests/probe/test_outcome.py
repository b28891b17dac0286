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


def test_closed_choices_are_enums_that_refuse_an_unknown_value():
    from autofit.probe.outcome import OomKind, Phase

    oom = ProbeResult(Config(), ProbeStatus.OOM, "out of memory", oom_kind="cpu-budget", phase="backward")
    assert oom.oom_kind is OomKind.CPU_BUDGET and oom.phase is Phase.BACKWARD
    assert oom.oom_kind == "cpu-budget" and f"{oom.phase}" == "backward"  # str-enums: compared and said as values
    with pytest.raises(ValueError, match="oom_kind='cpu-budjet' is not known.*did you mean 'cpu-budget'"):
        ProbeResult(Config(), ProbeStatus.OOM, "out of memory", oom_kind="cpu-budjet")
    with pytest.raises(ValueError, match="phase='optimizer' is not known"):
        ProbeResult(Config(), ProbeStatus.ERROR, "boom", phase="optimizer")


def test_an_error_keeps_its_type_and_site_through_json():
    import json

    error = ProbeResult(Config(), ProbeStatus.ERROR, "RuntimeError: shapes (4x3) mismatch (at model.py:12 in forward)",
                        phase="forward", error_type="RuntimeError", error_site="model.py:12 in forward")
    data = json.loads(json.dumps(error.to_dict()))
    assert (data["error_type"], data["error_site"], data["phase"]) == ("RuntimeError", "model.py:12 in forward",
                                                                       "forward")
    assert ProbeResult.from_dict(data) == error
    with pytest.raises(ValueError, match="only an error has an error's type and site"):
        ProbeResult(Config(), ProbeStatus.OOM, "out of memory", oom_kind="cpu-budget", error_type="RuntimeError")


def test_a_record_written_before_errors_kept_their_identity_still_loads():
    """A trial store's or plan's record from before `error_type`/`error_site` and the enums: no such keys,
    closed choices as plain strings."""
    from autofit.probe.outcome import OomKind, Phase

    old = {"config": Config().to_dict(), "status": "error", "reason": "TypeError: bad (at loss.py:3 in loss)",
           "peak_bytes": None, "step_seconds": None, "samples_per_s": None, "tokens_per_s": None, "oom_kind": None,
           "skip": None, "source": "probed", "rank_peaks": [], "phase": "step", "step_spread": None,
           "alloc_retries": None, "fragmentation": None, "left_behind": None}
    record = ProbeResult.from_dict(old)
    assert record.error_type is None and record.error_site is None and record.phase is Phase.STEP
    oom = ProbeResult.from_dict({**old, "status": "oom", "oom_kind": "host-killed"})
    assert oom.oom_kind is OomKind.HOST_KILLED
