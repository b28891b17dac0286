"""How a probe times its steps (autofit/probe/run.py): per-step seconds with their spread, one-time process
costs paid before the first timed probe, and the CUDA allocator's retries recorded (through a double of
`torch.cuda.memory_stats`: no GPU here)."""

import pytest
import torch
from models import make_mlp, make_mlp_batch, mlp_loss

from autofit import Config, ProbeStatus
from autofit.probe import run as run_module
from autofit.probe.run import AllocatorWatch, Timed, run_probe, settle
from autofit.job.train_spec import make_spec
from autofit.strategies import default_strategies


def spec(**kwargs):
    return make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss, **kwargs)


def test_a_fit_records_the_spread_of_its_timed_steps():
    result = run_probe(spec(warmup_steps=2, timed_steps=4), Config(micro_batch_size=8), default_strategies())
    assert result.fits and result.step_spread is not None and result.step_spread >= 0
    assert result.alloc_retries is None and not result.near_limit  # no allocator to watch on the CPU


def test_timed_keeps_the_median_step():
    timed = Timed((0.10, 0.50, 0.11))  # one step disturbed by another process
    assert timed.median == 0.11 and timed.spread == pytest.approx(0.40 / 0.11)


def test_the_first_probe_of_a_process_steps_until_the_times_agree(monkeypatch):
    monkeypatch.setattr(run_module, "_SETTLED", set())
    times = iter([3.0, 1.5, 1.05, 1.0, 1.0, 1.0])  # thread pools, kernel selection, then steady
    taken = settle(torch.device("cpu"), lambda: next(times))
    assert taken == 4  # 1.05 and 1.0 agree within 15%
    assert settle(torch.device("cpu"), lambda: pytest.fail("a warm process settles nothing")) == 0


def test_settling_is_bounded(monkeypatch):
    monkeypatch.setattr(run_module, "_SETTLED", set())
    times = iter([1.0, 2.0] * 10)
    assert settle(torch.device("cpu"), lambda: next(times)) == run_module.MAX_SETTLE_STEPS


class CudaStatsDouble:
    """Stands in for `torch.cuda.memory_stats`: the counters a caching allocator keeps."""

    def __init__(self):
        self.stats = {"num_alloc_retries": 5, "reserved_bytes.all.current": 1000, "inactive_split_bytes.all.current": 0}

    def __call__(self, device=None):
        return dict(self.stats)


def test_allocator_retries_during_the_timed_steps_are_counted(monkeypatch):
    double = CudaStatsDouble()
    monkeypatch.setattr(torch.cuda, "memory_stats", double)
    watch = AllocatorWatch(torch.device("cuda", 0))
    double.stats.update({"num_alloc_retries": 8, "inactive_split_bytes.all.current": 250})
    assert watch.stop() == (3, 0.25)  # retries before the timed steps are not counted
    assert AllocatorWatch(torch.device("cpu")).stop() == (None, None)


def test_a_fit_with_retries_is_marked_near_the_limit():
    result = run_module._measured(spec(), Config(micro_batch_size=8), 2**20, Timed((0.1, 0.1), 3, 0.2))
    assert result.status is ProbeStatus.FIT and result.near_limit and result.alloc_retries == 3
    assert "3 allocator retries while timed: near the limit" in result.reason
    calm = run_module._measured(spec(), Config(micro_batch_size=8), 2**20, Timed((0.1, 0.1), 0, 0.0))
    assert not calm.near_limit and "retries" not in calm.reason
