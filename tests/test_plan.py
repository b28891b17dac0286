"""`Plan`'s figures: samples/s with tokens/s and images/s where the batch holds them, kept through a save."""

from __future__ import annotations

from pathlib import Path

from autofit import Config, Plan

FIXTURES = Path(__file__).parent / "fixtures"


def test_images_per_second_is_shown_and_saved(tmp_path):
    plan = Plan(fits=True, config=Config(micro_batch_size=4), throughput=12.5, tokens_per_second=None, peak_memory=2**20,
                reason="tuned", probes=(), spec={}, images_per_second=200.0)
    assert plan.figures() == "12.50 samples/s, 200.00 images/s, peak 1.00 MiB"
    assert Plan.load(plan.save(tmp_path / "plan.json")).images_per_second == 200.0


def test_a_plan_written_before_images_per_second_loads_without_it():
    assert Plan.load(FIXTURES / "plan-v0.1.json").images_per_second is None
