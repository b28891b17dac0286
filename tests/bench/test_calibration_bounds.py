"""The dry-run's bounds per family and kernel (autofit/estimate/tolerance.py `FAMILY_BOUNDS`) are what the
committed split of the calibration rows gives (bench/calibration/bounds.py), fitted on the fitted sources only."""

import json

from autofit.estimate.tolerance import FAMILY_BOUNDS, UNCALIBRATED_BOUND
from bench.calibration import bounds


def test_the_package_bounds_are_the_committed_fitted_ones_and_the_file_is_what_the_script_writes():
    committed = json.loads((bounds.RESULTS / "bounds.json").read_text())
    assert committed["bounds"] == bounds.bounds(bounds.rows())  # the results follow from the rows as committed
    assert {key: (b["bound"], b["rows"]) for key, b in committed["bounds"].items()} == FAMILY_BOUNDS
    assert UNCALIBRATED_BOUND >= max(value for value, _ in FAMILY_BOUNDS.values())  # no rows: never narrower


def test_nothing_is_fitted_on_the_held_out_sources():
    found = bounds.rows()
    held = [r for r in found if r["part"] == "held-out"]
    assert {r["source"] for r in held} == set(bounds.HELD_OUT_SOURCES)
    moved = [dict(r, error=-0.9) for r in held]  # however wrong the held-out rows were, no bound moves
    fitted = [r for r in found if r["part"] == "fitted"]
    assert bounds.bounds(fitted + moved) == bounds.bounds(fitted)
    assert bounds.summary(moved, bounds.bounds(fitted))["under_beyond_bound"]  # they are reported instead


def test_a_bound_is_the_fitted_rows_largest_under_prediction_rounded_up():
    rows = [{"part": "fitted", "key": "decoder/fused", "source": "a", "error": e} for e in (0.02, -0.031, -0.001)]
    rows += [{"part": "fitted", "key": "other/none", "source": "b", "error": 0.03}]
    made = bounds.bounds(rows)
    assert made["decoder/fused"]["bound"] == 0.04 and made["decoder/fused"]["largest_under"] == -0.031
    assert made["other/none"]["bound"] == 0.01  # never under-predicted: the smallest bound, not none
