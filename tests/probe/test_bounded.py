"""Every probe bounded and clean (issue 54): a diverging step is an error naming the step, a step that blocks is
stopped at the probe's wall-clock limit in this process too, and no knob's probe leaves memory behind."""

from __future__ import annotations

import re
import time

import pytest
import torch
from models import make_mlp, make_mlp_batch, mlp_loss

from autofit import Config, ProbeStatus
from autofit.devices.memory import CpuBudget
from autofit.job.train_spec import make_spec
from autofit.probe.run import run_probe
from autofit.strategies import default_strategies

STRATEGIES = default_strategies()


def spec(budget="1GiB", loss_fn=mlp_loss, model=make_mlp, **kwargs):
    return make_spec(model, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget=budget,
                     loss_fn=loss_fn, warmup_steps=1, timed_steps=2, **kwargs)


@pytest.mark.parametrize("bad, word", [(float("nan"), "nan"), (float("inf"), "inf")])
def test_a_nan_or_infinite_loss_is_an_error_naming_the_step(bad, word):
    calls = []

    def diverging(output, batch):
        calls.append(1)
        loss = mlp_loss(output, batch)
        return loss * bad if len(calls) >= 2 else loss  # the first step is finite, the second diverges

    result = run_probe(spec(loss_fn=diverging), Config(micro_batch_size=8), STRATEGIES)
    assert result.status is ProbeStatus.ERROR and result.error_type == "NonFiniteLoss"
    assert re.search(f"the loss was {word} at step [0-9]+ of the probe", result.reason) and not result.fits


class Blocking(torch.nn.Module):
    blocks = False  # set once the spec is made (making it runs the forward too)

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(64, 10)

    def forward(self, x):
        if Blocking.blocks:
            time.sleep(60)  # a forward that blocks (a lock, a queue, a collective nobody joins)
        return self.layer(x)


def test_an_in_process_probe_that_blocks_is_stopped_at_its_wall_clock_limit(monkeypatch):
    blocking = spec(model=Blocking)
    monkeypatch.setattr(Blocking, "blocks", True)
    start = time.monotonic()
    result = run_probe(blocking, Config(micro_batch_size=8), STRATEGIES, timeout=1.0)
    assert time.monotonic() - start < 30
    assert result.status is ProbeStatus.ERROR and result.error_type == "ProbeTimedOut"
    assert "ran past its limit of 1 s" in result.reason and "--probe-timeout" in result.reason


def test_the_command_line_takes_the_probe_timeout():
    from click.testing import CliRunner

    from autofit.cli.tune import tune

    assert "--probe-timeout" in CliRunner().invoke(tune, ["--help"]).output


# A configuration of each knob value this CPU machine can probe (the others need CUDA or several ranks).
KNOB_VALUES = [Config(micro_batch_size=8), Config(micro_batch_size=8, precision="bf16"),
               Config(micro_batch_size=8, precision="pure_bf16"), Config(micro_batch_size=8, checkpointing="full"),
               Config(micro_batch_size=8, checkpointing="every_k", checkpoint_every=2),
               Config(micro_batch_size=8, optimizer="adafactor"), Config(micro_batch_size=8, activation_offload="cpu"),
               Config(micro_batch_size=8, optimizer_step="in_backward"), Config(micro_batch_size=4, grad_accum_steps=2),
               Config(micro_batch_size=8, lora=4)]


@pytest.mark.parametrize("config", KNOB_VALUES, ids=lambda c: c.describe())
def test_twenty_oom_probes_of_every_knob_value_leave_no_memory_behind(config):
    fits = run_probe(spec(), config, STRATEGIES)
    if fits.status is not ProbeStatus.FIT:
        pytest.skip(f"{config.describe()} does not run on this model here: {fits.reason}")
    tight = spec(max(fits.peak_bytes // 2, 2**20))
    with CpuBudget(None) as outer:  # counts everything the probes allocate, from outside them
        for _ in range(20):
            assert run_probe(tight, config, STRATEGIES).status is ProbeStatus.OOM
            assert outer.current == 0, f"{outer.current} bytes left behind by {config.describe()}"
    assert outer.peak > 0
