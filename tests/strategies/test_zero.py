"""DeepSpeed ZeRO through deepspeed.initialize on two CPU ranks over gloo (DeepSpeed's CPU accelerator).

The first ZeRO probe on a machine JIT-compiles DeepSpeed's CPU Adam (minutes; cached afterwards in
~/.cache/torch_extensions). ZeRO-1 and ZeRO-2 are `slow`-marked to keep the default run short; ZeRO-3
runs by default."""

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from autofit.config import Config

from autofit.probe.run import ProbeStatus
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.strategies import MicroBatch, Zero
from autofit.strategies.zero import installed_version, version_problem
from models import LinearBlocks, run_ranks

needs_deepspeed = pytest.mark.skipif(installed_version() is None, reason="DeepSpeed is not installed: pip install 'autofit[deepspeed]'")
WIDTH = 64


class Blocks(LinearBlocks):
    def __init__(self):
        super().__init__(WIDTH, 3)


def make_batch(n):
    return torch.randn(n, WIDTH)


def _spec(num_gpus=2):
    return make_spec(Blocks, make_batch, device="cpu", num_gpus=num_gpus, global_batch_size=4, warmup_steps=1,
                     timed_steps=1)


def test_missing_or_old_deepspeed_is_named_with_the_fix():
    assert "pip install 'autofit[deepspeed]'" in version_problem(None, "ZeRO")
    old = version_problem("0.9.5", "ZeRO-3 parameter offload")
    assert "DeepSpeed 0.9.5 is too old for ZeRO-3 parameter offload" in old and "pip install -U 'deepspeed>=" in old
    assert version_problem("0.19.8", "ZeRO") is None


@needs_deepspeed
def test_options_need_several_ranks_on_cpu():
    one = Zero().options(_spec(num_gpus=1))
    assert [o.value for o in one] == ["none", "zero1", "zero2", "zero3"]
    assert [o.available for o in one] == [True, False, False, False]
    assert all(o.available for o in Zero().options(_spec()))


@needs_deepspeed
def test_outside_launched_ranks_it_refuses():
    with pytest.raises(RuntimeError, match="no process group"):
        build_run(_spec(), Config(num_gpus=2, sharding="zero3", micro_batch_size=2), [MicroBatch(), Zero()])
    assert not dist.is_initialized()


# slow: on a fresh machine DeepSpeed compiles its CPU ops (fused Adam) on first use,
# about 4 minutes; run with `python -m pytest -m slow tests/strategies/test_zero.py`.
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_trains_on_two_cpu_ranks(stage):
    # accumulation 2: DeepSpeed's own micro-step counting must agree with the run's micro-batches
    config = Config(num_gpus=2, sharding=f"zero{stage}", micro_batch_size=1, grad_accum_steps=2)
    result = run_ranks(_spec(), config, [MicroBatch(), Zero()], timeout=300)
    assert result.status is ProbeStatus.FIT, result.reason
    assert result.peak_bytes > 0 and result.samples_per_s > 0
    assert not dist.is_initialized() and not multiprocessing.active_children()
