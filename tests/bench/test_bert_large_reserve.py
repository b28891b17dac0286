"""bench/measurements/bert_large_reserve.py's prediction side, on a 2-layer BERT (its measuring side needs a
card: bench/gpu_session.sh's bert-reserve part runs it). Each measured point gets the dry-run's peak, which
memory that is, and its bound: an encoder is uncalibrated, so the wider bound; eager and SDPA alike."""

import json
import subprocess
import sys

from autofit.estimate.tolerance import UNCALIBRATED_BOUND
from bench.measurements import bert_large_reserve as bench


def test_a_measured_file_is_predicted_point_by_point(tmp_path):
    # the measured figures are inputs of the test (a point per allocator and kernel), not results
    rows = [{"allocator": allocator, "attention": attention, "precision": "fp32", "out_of_memory": False,
             "max_allocated": 10 * 2**20, "max_reserved": 12 * 2**20, "nvml_peak": 600 * 2**20}
            for allocator in bench.ALLOCATOR for attention in bench.ATTENTION]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"device": "NVIDIA Test", "date": "2026-01-01T00:00:00+00:00", "rows": rows}))
    done = subprocess.run([sys.executable, bench.__file__, "--predict", str(path), "--small"], capture_output=True,
                          text=True, timeout=600, cwd=bench.ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    made = json.loads(path.read_text())["rows"]
    assert len(made) == 4 and all(r["memory"] == "reserved + context" for r in made)
    assert {r["bound_basis"].split(":")[0] for r in made} == {"encoder/eager", "encoder/fused"}
    assert all(r["error_bound"] == UNCALIBRATED_BOUND for r in made)
    for row in made:
        assert row["error"] == round(row["predicted_bytes"] / row["nvml_peak"] - 1, 4)
