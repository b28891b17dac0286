"""report.html: self-contained, figures drawn by matplotlib, the chosen plan marked; chromium renders it
(slow-marked: needs Debian's chromium)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import autofit
from autofit import Config
from autofit.report import breakdown, render, report_data, write_report

ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)])

    def forward(self, x, y):
        return (self.blocks(x).mean(1) - y).pow(2).mean()


def make_batch(n):
    return {"x": torch.randn(n, 64, 32), "y": torch.randn(n, 32)}


@pytest.fixture(scope="module")
def plan():
    # 8 samples at once peak at ~420 KiB, over the 400 KiB budget: the search records an OOM and two fits
    # (probing alone: the estimator would skip the OOM candidate without running it)
    return autofit.autofit(Net, make_batch, global_batch_size=8, device="cpu", memory_budget="400KiB", allow=0,
                           max_probes=3, warmup_steps=1, timed_steps=1, predict=False)


def test_report_is_self_contained_and_marks_the_choice(tmp_path, plan):
    text = write_report(plan, tmp_path / "report.html").read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", text)  # nothing fetched: opens offline
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == 2 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    assert plan.fits and f"★ {plan.config.describe()}" in text
    assert text.count('class="chosen"') == 1
    compared = plan.confirmation.comparisons if plan.confirmation else ()
    assert text.count("<tr") == len(plan.probes) + 1 + (len(compared) + 1 if compared else 0)


def test_rows_cover_every_measured_probe_and_add_up(plan):
    rows = report_data(plan)
    assert "fit" in {r.status for r in rows}
    assert [r.peak for r in rows] == [p.peak_bytes for p in plan.probes if p.peak_bytes]
    assert sum(r.chosen for r in rows) == 1
    for row in rows:
        assert sum(row.parts) == pytest.approx(row.peak)


def test_breakdown_model_states():
    n = 1000
    assert breakdown(Config(), n, 20 * n)[:3] == (4 * n, 4 * n, 8 * n)  # fp32 weights, grads, AdamW states
    assert breakdown(Config(precision="pure_bf16"), n, 20 * n)[:3] == (2 * n, 2 * n, 4 * n)  # all in bf16
    zero3 = breakdown(Config(sharding="zero3", num_gpus=4), n, 20 * n)
    assert zero3[:3] == (n, n, 2 * n)  # sharded over 4 ranks
    assert breakdown(Config(sharding="zero2", offload="cpu"), n, 10 * n)[2] == 0  # states left the device
    assert sum(breakdown(Config(), n, 2 * n)) == pytest.approx(2 * n)  # never above the measured peak


def test_nothing_fits_report(plan):
    failed = autofit.Plan(False, None, None, None, None, "No candidate fits 1 MiB.", plan.probes, plan.spec)
    text = render(failed)
    assert "Nothing fits." in text and "No candidate fits 1 MiB." in text and 'class="chosen"' not in text


@pytest.mark.slow
def test_chromium_renders_the_report(tmp_path, plan):
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    report = write_report(plan, tmp_path / "report.html")
    shot = tmp_path / "report.png"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "screenshot_report.sh"), str(report), str(shot)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000


def test_the_report_keeps_every_comparison_of_the_confirmation(tmp_path):
    """plan.summary() is three lines at most; the report keeps the whole decision, a row per comparison with
    the test that decided it."""
    from autofit.config import Optimizer
    from autofit.plan import make_plan
    from autofit.probe.outcome import ProbeResult, ProbeStatus
    from autofit.search.confirm import confirm
    from autofit.search.space import build_space
    from autofit.job.train_spec import make_spec
    from autofit.strategies import MicroBatch, OptimizerStates

    spec = make_spec(Net, make_batch, global_batch_size=8, device="cpu", memory_budget="1GiB")
    space = build_space(spec, [OptimizerStates(), MicroBatch()])
    exact, adafactor = Config(micro_batch_size=8), Config(micro_batch_size=8, optimizer=Optimizer.ADAFACTOR)
    results = [ProbeResult(c, ProbeStatus.FIT, "fits", 2**20, 0.1, s) for c, s in ((exact, 80.0), (adafactor, 100.0))]
    figures = {exact: (80.0,) * 7, adafactor: (60, 260, 130, 200, 150, 60, 260)}
    plan = make_plan(space, results, None, confirm(space, results, lambda configs, rounds, more: figures, 7, 0.10,
                                                   "live runs"))
    text = render(plan)
    assert plan.config == exact and "<th>decided by</th>" in text
    assert f"<td>{adafactor.describe()}</td><td>{exact.describe()} (exact)</td>" in text
    assert "kept the choice: noise" in text

