"""Two CPU ranks with every option allowed (allow={"lora"}, every extra this machine can run): the
rules leave out what cannot run, so no probe ends in an error."""

import pytest
from models import make_gpt2

import autofit
from autofit.probe.launch import probe_placed
from autofit.probe.outcome import ProbeStatus
from autofit.search.space import build_space
from autofit.job.train_spec import make_spec
from autofit.strategies import default_strategies

ARGS = dict(global_batch_size=2, device="cpu", num_gpus=2, allow={"lora"}, seq_len=16, warmup_steps=1,
            timed_steps=1)


def test_a_two_rank_search_with_everything_allowed_has_no_errors():
    plan = autofit.autofit(make_gpt2, memory_budget="1GiB", max_probes=6, **ARGS)
    assert plan.fits, plan.reason
    assert not [p for p in plan.probes if p.status is ProbeStatus.ERROR]


# slow: 144 levels x ~8 s of two spawned ranks each (about 20 minutes on 2 cores)
@pytest.mark.slow
def test_every_level_of_the_two_rank_space_runs():
    spec = make_spec(make_gpt2, memory_budget="8GiB", **ARGS)
    space = build_space(spec, default_strategies())
    errors = []
    for level in space.levels():
        config = space.at(level, 1)
        result = probe_placed(spec, config, space.strategies, space.placement(config), 300)
        if result.status is ProbeStatus.ERROR:
            errors.append(f"{config.describe()}: {result.reason}")
    assert not errors, "\n".join(errors)
