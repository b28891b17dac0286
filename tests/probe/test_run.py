import re

import pytest
import torch
from models import make_mlp, make_mlp_batch, mlp_loss

from autofit import Config, ProbeResult, ProbeStatus
from autofit.probe.launch import launch
from autofit.strategies import Placement
from autofit.devices.memory import CpuBudget
from autofit.probe.run import run_probe
from autofit.search.decision import Confirmation
from autofit.job.train_spec import make_spec
from autofit.strategies import default_strategies

STRATEGIES = default_strategies()
FULL = Config(micro_batch_size=8)


def spec(budget="1GiB", **kwargs):
    return make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget=budget,
                     loss_fn=mlp_loss, warmup_steps=1, timed_steps=1, **kwargs)


def test_a_fit_has_its_figures():
    result = run_probe(spec(), FULL, STRATEGIES)
    assert result.status is ProbeStatus.FIT, result.reason
    assert 1_000_000 < result.peak_bytes < 50_000_000
    assert result.step_seconds > 0 and result.samples_per_s == pytest.approx(8 / result.step_seconds)
    assert result.tokens_per_s is None  # float inputs: no sequence axis of token ids


class TinyConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 2)

    def forward(self, pixels):
        return self.head(self.conv(pixels).mean((2, 3)))


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)

    def forward(self, idx):
        return self.head(self.embed(idx))


def test_a_fit_counts_images_and_tokens_where_its_batch_holds_them():
    """images/s for a batch of images (samples/s times the images a sample holds), tokens/s for a plain
    model's dict of token ids {"idx", "targets"}; each None where the batch holds none."""
    images = make_spec(TinyConv, lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 2, (n,))), global_batch_size=4,
                       device="cpu", memory_budget="1GiB", warmup_steps=1, timed_steps=1,
                       loss_fn=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]))
    result = run_probe(images, Config(micro_batch_size=4), STRATEGIES)
    assert result.fits and result.images_per_s == pytest.approx(result.samples_per_s)
    assert result.tokens_per_s is None
    tokens = make_spec(TinyLM, lambda n: {"idx": torch.randint(0, 50, (n, 12)), "targets": torch.randint(0, 50, (n, 12))},
                       global_batch_size=4, device="cpu", memory_budget="1GiB", warmup_steps=1, timed_steps=1,
                       loss_fn=lambda out, batch: torch.nn.functional.cross_entropy(out.flatten(0, 1),
                                                                                    batch["targets"].flatten()))
    result = run_probe(tokens, Config(micro_batch_size=4), STRATEGIES)
    assert result.fits and result.tokens_per_s == pytest.approx(12 * result.samples_per_s)
    assert result.images_per_s is None


def test_peak_is_the_same_on_every_run():
    # the CPU budget counts bytes, not time: probes are reproducible to the byte
    assert run_probe(spec(), FULL, STRATEGIES).peak_bytes == run_probe(spec(), FULL, STRATEGIES).peak_bytes


def test_oom_is_a_result():
    result = run_probe(spec("2MiB"), FULL, STRATEGIES)
    assert result.status is ProbeStatus.OOM and result.oom_kind == "cpu-budget"
    assert "over the budget of 2.00 MiB" in result.reason


def test_inside_the_safety_margin_is_not_a_fit():
    peak = run_probe(spec(), FULL, STRATEGIES).peak_bytes
    result = run_probe(spec(int(peak * 1.05)), FULL, STRATEGIES)  # fits the budget, not the 10% margin
    assert result.status is ProbeStatus.OOM and result.oom_kind == "margin"
    assert "safety margin" in result.reason
    assert run_probe(spec(int(peak * 1.05), safety_margin=0.0), FULL, STRATEGIES).fits


def broken_batch(n):
    return torch.randn(n, 32, 63), torch.zeros(n, 32, dtype=torch.long)  # wrong width


def test_an_error_is_a_result_with_its_message():
    bad = make_spec(make_mlp, broken_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                    loss_fn=mlp_loss)
    result = run_probe(bad, FULL, STRATEGIES)
    assert result.status is ProbeStatus.ERROR
    assert result.reason.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")


def test_twenty_oom_probes_leave_no_memory_behind():
    tight = spec("2MiB")
    with CpuBudget(None) as outer:  # counts everything the probes allocate, from outside them
        for _ in range(20):
            assert run_probe(tight, FULL, STRATEGIES).status is ProbeStatus.OOM
            assert outer.current == 0  # the probe collected its own cycles: no collection here
    assert outer.peak > 0  # the probes did allocate


def test_too_slow_is_stopped_at_the_deadline(monkeypatch):
    monkeypatch.setattr("autofit.probe.run.MIN_ALLOWANCE", 0.0)
    result = run_probe(spec(), FULL, STRATEGIES, step_limit=1e-6)
    assert result.status is ProbeStatus.PRUNED
    assert "too slow to win" in result.reason


def test_isolated_probe_runs_in_a_child_process():
    result = launch(spec(), FULL, STRATEGIES, Placement.CHILD, timeout=120)
    assert result.status is ProbeStatus.FIT, result.reason
    assert result.peak_bytes == run_probe(spec(), FULL, STRATEGIES).peak_bytes


def test_isolated_probe_takes_lambdas_and_refuses_the_unserialisable_once():
    import threading

    from autofit.errors import UsageError

    local = make_spec(lambda: make_mlp(), lambda n: make_mlp_batch(n), global_batch_size=8, device="cpu",
                      memory_budget="1GiB", loss_fn=lambda out, batch: mlp_loss(out, batch))
    result = launch(local, FULL, STRATEGIES, Placement.CHILD, timeout=120)
    assert result.status is ProbeStatus.FIT, result.reason  # lambdas travel by value (cloudpickle)
    lock = threading.Lock()

    def locked_loss(out, batch):
        with lock:
            return mlp_loss(out, batch)

    bad = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                    loss_fn=locked_loss)
    with pytest.raises(UsageError, match=r"the loss function \(loss_fn\).*lock.*inside the factory"):
        launch(bad, FULL, STRATEGIES, Placement.CHILD)


def test_an_error_records_its_type_and_the_site_it_was_raised_at():
    """The error's identity as fields (`walk.failure` compares them): the type, and the frame in the
    user's code (this file), not torch's or autofit's."""
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 2)

        def forward(self, x):
            raise KeyError("no such feature")

    spec = make_spec(Broken, lambda n: torch.randn(n, 8), device="cpu", memory_budget="1GiB", warmup_steps=1,
                     timed_steps=1, loss_fn=lambda out, batch: out.sum())
    result = run_probe(spec, Config(micro_batch_size=2), default_strategies())
    assert result.status is ProbeStatus.ERROR and result.error_type == "KeyError"
    assert result.error_site is not None and result.error_site.startswith("test_run.py:")
    assert result.error_site.endswith("in forward") and f"(at {result.error_site})" in result.reason
    assert result.phase == "forward"
    child = launch(spec, Config(micro_batch_size=2), default_strategies(), Placement.CHILD, timeout=120)
    assert (child.error_type, child.error_site, child.phase) == ("KeyError", result.error_site, "forward")


def test_a_probe_records_the_steps_it_trained(monkeypatch):
    """What a search spends is steps: a probe's warm-up and timed steps (and the settling steps of the first
    probe of a process), one that was stopped or ran out the steps it started."""
    run_probe(spec(), FULL, STRATEGIES)  # this process has settled: later probes take warm-up + timed steps
    longer = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                       loss_fn=mlp_loss, warmup_steps=2, timed_steps=3)
    assert run_probe(longer, FULL, STRATEGIES).steps == 5
    assert run_probe(spec(), FULL, STRATEGIES).steps == 2
    assert run_probe(spec("200KiB"), FULL, STRATEGIES).steps <= 1  # out of memory building or in its first step
    monkeypatch.setattr("autofit.probe.run.MIN_ALLOWANCE", 0.0)
    pruned = run_probe(longer, FULL, STRATEGIES, step_limit=1e-6)
    assert pruned.status is ProbeStatus.PRUNED and 1 <= pruned.steps < 5  # stopped before its last step


@pytest.mark.parametrize("steps", [-1, 1.5, "2"])
def test_steps_are_a_count(steps):
    with pytest.raises(ValueError, match="steps"):
        ProbeResult(FULL, ProbeStatus.ERROR, "failed", steps=steps)
    with pytest.raises(ValueError, match="steps"):
        Confirmation((), 0, (), "none", 0.1, steps=steps)


class SlowMlp(torch.nn.Module):
    """Half a second a step, whatever the machine does."""

    def __init__(self):
        super().__init__()
        self.inner = make_mlp()

    def forward(self, x):
        import time

        time.sleep(0.5)
        return self.inner(x)


def test_a_probe_that_cannot_finish_in_time_is_stopped_before_its_deadline(monkeypatch):
    """5 steps of 0.5 s against 1.5 s from the end of the first: after the second, 3 steps left need 1.5 s
    more, past the deadline, so it stops there and then rather than at its fourth step."""
    monkeypatch.setattr("autofit.probe.run.MIN_ALLOWANCE", 0.0)
    slow = make_spec(SlowMlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss, warmup_steps=2, timed_steps=3)
    result = run_probe(slow, FULL, STRATEGIES, step_limit=1.5 / 7)  # allowance: (2 + 3 + 2) x step_limit
    assert result.status is ProbeStatus.PRUNED and result.steps == 2, result.reason
    assert re.search(r"stopped before its deadline \(1\.5 s after its first step\): at \d+\.\d\d s a step, its 3 steps "
                     r"left would end \d+\.\d s past it", result.reason), result.reason
