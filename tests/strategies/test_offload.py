"""Offload: on the CPU it is unavailable with its reason; NVMe paths are checked; the GPU runs
(ZeRO-StateOffloading, ZeRO-3 parameter offload, FSDP2 CPU offload on one GPU) are `gpu`-marked."""

import pytest
import torch
from torch import nn

from autofit.config import Config

from autofit.errors import UsageError
from autofit.probe.run import ProbeStatus
from autofit.job.train_spec import make_spec
from autofit.devices.gpus import get_gpu
from autofit.search.rules import violation
from autofit.job.target import Target
from autofit.strategies import Fsdp, MicroBatch, StateOffloading, MixedPrecision, Zero
from autofit.strategies.offload import aio_problem
from autofit.strategies.zero import installed_version
from models import run_ranks

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_ds = pytest.mark.skipif(installed_version() is None, reason="needs DeepSpeed")


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def make_batch(n):
    return torch.randn(n, 256)


def test_unavailable_on_cpu_with_reason(tmp_path):
    options = StateOffloading(nvme_path=tmp_path).options(make_spec(Blocks, make_batch, device="cpu"))
    assert [o.value for o in options] == ["none", "cpu", "nvme"]
    assert [o.available for o in options] == [True, False, False]
    assert "already the host" in options[1].reason


def test_nvme_path_not_writable_names_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(UsageError, match="a-file/nvme.*not a writable folder"):
        StateOffloading(nvme_path=blocker / "nvme")


def test_nvme_path_is_created(tmp_path):
    assert StateOffloading(nvme_path=tmp_path / "new" / "nvme").nvme_path == str((tmp_path / "new" / "nvme").resolve())


def test_without_nvme_path_the_reason_says_how_to_give_one():
    assert "nvme_path" in StateOffloading().options(_FakeCudaSpec())[2].reason


class _FakeCudaSpec:
    """Only what `options` reads: a CUDA target (no GPU is touched)."""

    target = Target.from_profile(get_gpu("a100-80gb"), 1)


class _ProbedOnCuda(_FakeCudaSpec):
    """As a search on this machine's card reads it: the probes' device is CUDA (no GPU is touched)."""

    device = torch.device("cuda", 0)


@needs_ds
def test_nvme_is_offered_for_probes_here_only_where_deepspeeds_async_io_op_builds(tmp_path):
    # Seen on an H100 machine without libaio-dev: every NVMe probe failed in the engine's build with
    # "Unable to JIT load the async_io op". DeepSpeed's own check decides, as it does on this machine.
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builds = AsyncIOBuilder().is_compatible(verbose=False)
    nvme = StateOffloading(nvme_path=tmp_path).options(_ProbedOnCuda())[2]
    assert nvme.available is builds
    if not builds:
        assert "async_io" in nvme.reason and "libaio" in nvme.reason
    planned = StateOffloading(nvme_path=tmp_path).options(_FakeCudaSpec())[2]  # a plan for another machine: not checked
    assert planned.available


def test_offload_without_an_engine_is_a_rule():
    config = Config(offload="cpu")
    assert "needs ZeRO or FSDP2" in violation(config, _FakeCudaSpec.target)[1]
    assert violation(config.replace(sharding="zero2"), _FakeCudaSpec.target) is None
    assert "NVMe offload needs DeepSpeed ZeRO-3" in violation(Config(offload="nvme", sharding="zero2"),
                                                              _FakeCudaSpec.target)[1]


def test_order():
    nvme, cpu, none = Config(offload="nvme"), Config(offload="cpu"), Config()
    assert StateOffloading().saves_at_least(nvme, cpu) and not StateOffloading().saves_at_least(none, cpu)



@pytest.mark.gpu
@needs_gpu
@needs_ds
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_offload_on_one_gpu(stage, tmp_path):
    spec = make_spec(Blocks, make_batch, device="cuda", global_batch_size=4, warmup_steps=1, timed_steps=1)
    for value in ("cpu", "nvme") if stage == 3 else ("cpu",):  # NVMe needs ZeRO-3 (the rule table)
        if value == "nvme" and aio_problem():  # no libaio here: the rung does not offer it (tested above)
            continue
        config = Config(sharding=f"zero{stage}", offload=value, micro_batch_size=4, precision="bf16")
        # MixedPrecision sets bf16 autocast: DeepSpeed casts the weights to bf16, the batch stays fp32
        result = run_ranks(spec, config, [MixedPrecision(), MicroBatch(), Zero(), StateOffloading(nvme_path=tmp_path)],
                           timeout=600)
        assert result.status is ProbeStatus.FIT, result.reason


@pytest.mark.gpu
@needs_gpu
def test_fsdp_cpu_offload_on_one_gpu():
    spec = make_spec(Blocks, make_batch, device="cuda", global_batch_size=4, warmup_steps=1, timed_steps=1)
    config = Config(sharding="fsdp_full", offload="cpu", micro_batch_size=4, precision="bf16")
    result = run_ranks(spec, config, [MicroBatch(), Fsdp(), StateOffloading()], timeout=600)
    assert result.status is ProbeStatus.FIT, result.reason


def test_the_specs_nvme_path_is_offered_and_kept_in_the_plan(tmp_path):
    spec = make_spec(Blocks, make_batch, device="cpu", nvme_path=tmp_path / "nvme")
    assert spec.summary()["nvme_path"] == str((tmp_path / "nvme").resolve())
    assert StateOffloading().folder(spec) == spec.nvme_path



def test_zero_casts_float_inputs_to_its_16_bit_dtype():
    # DeepSpeed's forward switches off the run's bf16 autocast (deepspeed/runtime/torch_autocast.py), so the
    # engine's float inputs are cast to its dtype (zero.py, `pure_bf16.cast_inputs`, a forward pre-hook).
    # Without it a float-input model failed on an H100 ("mat1 and mat2 must have the same dtype"); on CPU
    # ranks DeepSpeed keeps fp32 weights, so only test_zero_offload_on_one_gpu (-m gpu) runs the engine this way.
    from autofit.strategies.pure_bf16 import cast_inputs

    seen = []

    class Engine(torch.nn.Module):
        def forward(self, *args, **kwargs):
            seen.append((args, kwargs))

    engine = Engine()
    cast_inputs(engine, torch.bfloat16)
    pixels, ids = torch.randn(2, 3), torch.arange(4)
    engine(pixels, [ids], x=pixels, mask=ids > 1)
    (args, kwargs), = seen
    assert args[0].dtype is torch.bfloat16 and args[1][0].dtype is torch.int64
    assert kwargs["x"].dtype is torch.bfloat16 and kwargs["mask"].dtype is torch.bool
