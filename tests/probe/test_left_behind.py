"""Memory a probe leaves behind, in the CUDA test double (tests/cuda_double.py): the double scripts the
allocator's readings, the tests check what autofit decides from them. Seen on an H100 (torch 2.11,
bench/results/gpu-tests-h100-2026-11-27.json): after an OOM in the backward every later in-process probe
ran out of memory in its forward with ~180 MiB more allocated than it needs alone (pytorch/pytorch#82218:
the step's tensors stay allocated)."""

import pytest
import torch
from cuda_double import ALLOCATOR_OOM, GiB, FakeCuda
from isolation import in_fresh_process
from models import long_gpt2
from torch import nn

import autofit
from autofit import Config
from autofit.probe.launch import fresh_placement
from autofit.devices.memory import memory_left_behind
from autofit.probe.outcome import ProbeStatus
from autofit.probe.run import LEFT_BEHIND_SLACK, run_probe
from autofit.job.train_spec import make_spec
from autofit.strategies import FusedAttention, ActivationCheckpointing, MicroBatch, default_strategies
from autofit.strategies.base import Placement

CUDA0 = torch.device("cuda", 0)
MiB = 2**20


class Leaky:
    """A model factory whose build, once armed, leaves `bytes` allocated in the double and runs out of
    memory: stands in for a step whose OOM in the backward keeps its tensors (nothing here runs on a GPU)."""

    def __init__(self, allocated: list[int], leaves: int):
        self.allocated, self.leaves, self.armed = allocated, leaves, False  # the double's scripted readings

    def __call__(self) -> nn.Module:
        if self.armed:
            self.allocated[0] += self.leaves
            raise torch.OutOfMemoryError(ALLOCATOR_OOM)
        return nn.Linear(4, 1)


def _batch(n):
    return torch.randn(n, 4)


def _probe(cuda: FakeCuda, leaves: int):
    factory = Leaky(cuda.allocated, leaves)
    spec = make_spec(factory, _batch, device="cuda", global_batch_size=2, memory_budget="8GiB",
                     loss_fn=lambda out, batch: out.sum())
    factory.armed = True
    return spec, run_probe(spec, Config(micro_batch_size=2), [MicroBatch()])


def test_a_probe_that_leaves_memory_allocated_says_so_and_later_probes_run_in_a_fresh_child():
    with FakeCuda() as cuda:
        cuda.allocated[0] = GiB  # the user's own tensors, there before: not the probe's
        spec, result = _probe(cuda, 200 * MiB)
        assert result.status is ProbeStatus.OOM and result.left_behind == 200 * MiB
        assert "left 200.00 MiB allocated" in result.reason and "pytorch/pytorch#82218" in result.reason
        assert memory_left_behind(CUDA0) == 200 * MiB
        assert fresh_placement(spec, [MicroBatch()], Placement.IN_PROCESS) is Placement.CHILD
        assert fresh_placement(spec, [MicroBatch()], Placement.RANKS) is Placement.RANKS
    assert memory_left_behind(CUDA0) == 0  # a new runtime (the double's exit) starts clean


def test_a_probe_that_returns_its_memory_keeps_later_probes_in_this_process():
    with FakeCuda() as cuda:
        spec, result = _probe(cuda, LEFT_BEHIND_SLACK)  # within the slack: a library's small global buffers
        assert result.status is ProbeStatus.OOM and result.left_behind is None
        assert "left" not in result.reason and memory_left_behind(CUDA0) == 0
        assert fresh_placement(spec, [MicroBatch()], Placement.IN_PROCESS) is Placement.IN_PROCESS


def test_a_spec_that_cannot_reach_a_child_stays_in_this_process():
    with FakeCuda() as cuda:
        spec, _ = _probe(cuda, GiB)
        unpicklable = [MicroBatch(), _Unpicklable()]
        assert fresh_placement(spec, unpicklable, Placement.IN_PROCESS) is Placement.IN_PROCESS


class _Unpicklable(MicroBatch):
    def __reduce__(self):
        raise TypeError("cannot pickle this strategy")


def test_on_the_cpu_nothing_is_tracked():
    spec = make_spec(nn.Linear(4, 1), _batch, device="cpu", global_batch_size=2, memory_budget="1GiB",
                     loss_fn=lambda out, batch: out.sum())
    result = run_probe(spec, Config(micro_batch_size=2), [MicroBatch()])
    assert result.fits and result.left_behind is None
    assert fresh_placement(spec, [MicroBatch()], Placement.IN_PROCESS) is Placement.IN_PROCESS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_after_an_oom_in_the_backward_the_fitting_checkpointing_still_fits():
    # The H100 sequence of 2026-11-27 (bench/results/gpu-tests-h100-2026-11-27.json): just above full
    # checkpointing's peak, no checkpointing runs out in the forward, operator checkpointing in the
    # backward; full checkpointing must then fit as it does alone. Passed on an H200 the same day
    # (bench/results/gpu-tests-h200-2026-11-27.json). In its own process: what it may leave there would
    # count in the peaks of the tests the worker runs next.
    fits, reason, left = in_fresh_process(_tune_after_an_oom_in_the_backward)
    assert fits, reason
    assert all("later probes run in fresh child processes" in r for r in left), left


def _tune_after_an_oom_in_the_backward() -> tuple[bool, str, list[str]]:
    """(the plan fits, its reason, the reasons of the probes that left memory behind)."""
    spec = make_spec(long_gpt2, global_batch_size=1, device="cuda", seq_len=4096, warmup_steps=1, timed_steps=1)
    full = run_probe(spec, Config(attention="sdpa", checkpointing="full"), default_strategies())
    assert full.fits, full.reason
    plan = autofit.autofit(long_gpt2, global_batch_size=1, device="cuda", seq_len=4096,
                           memory_budget=int(full.peak_bytes * 1.1 / 0.9), predict=False, warmup_steps=1,
                           timed_steps=1, strategies=[FusedAttention(), ActivationCheckpointing(), MicroBatch()])
    return plan.fits, plan.reason, [p.reason for p in plan.probes if p.left_behind]
