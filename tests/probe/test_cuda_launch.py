"""What a launched probe takes over from its parent: its cards, a memory baseline, the TF32/cuDNN flags.

The device binding runs the launcher's process entry in this process under the CUDA test double (the
double records which card each `set_device` lands on through CUDA_VISIBLE_DEVICES); the flags run in a
real spawned child on the CPU.
"""

import os

import pytest
import torch
from cuda_double import FakeCuda, FakeGpu

from autofit import Config, ProbeStatus
from autofit.errors import UsageError
from autofit.probe import launch as launcher
from autofit.probe.child import run_job
from autofit.probe.payload import payload
from autofit.devices.memory import accounting
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch, Placement
from models import LinearBlocks

THREE_CARDS = [FakeGpu(pci=(0, 0x18 + i, 0)) for i in range(3)]


class Blocks(LinearBlocks):
    def __init__(self):
        super().__init__(8, 2)


def _batch(n):
    return torch.randn(n, 8)


def _run_main(rank, world, port, spec, monkeypatch):
    """The probe process's entry (`autofit.probe.child.run_job`), here, in the environment the launcher
    gives rank `rank`: what it binds is what the double records."""
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the entry edits the environment
    monkeypatch.delitem(os.environ, "CUDA_VISIBLE_DEVICES", raising=False)
    job = launcher.make_job(spec, Config(micro_batch_size=1, num_gpus=world), world, 1.0, None)
    os.environ.update(launcher._environment(rank, world, port, spec.device) if port else {})
    run_job(job, payload(spec, [MicroBatch()]))  # an error here (no NCCL on a CPU build); the binding came first


@pytest.mark.parametrize("rank, world, card", [(0, 1, 1), (1, 2, 2)])
def test_ranks_start_at_the_chosen_device(rank, world, card, monkeypatch):
    # Defect 2: set_device(rank) put a cuda:1 engine probe on GPU 0 (and its rank 1 on GPU 1).
    with FakeCuda([FakeGpu(pci=(0, 0x18 + i, 0)) for i in range(3)]) as cuda:
        spec = make_spec(Blocks, _batch, device="cuda:1", global_batch_size=world)
        _run_main(rank, world, 29500, spec, monkeypatch)
        bound = [c for c in cuda.calls if c[0] == "set_device"]
        assert bound and bound[-1][2] == card, cuda.calls


def test_a_child_probe_binds_its_card_before_anything_touches_cuda(monkeypatch):
    with FakeCuda(THREE_CARDS, nvml_sees_pid=False) as cuda:
        spec = make_spec(Blocks, _batch, device="cuda:2", global_batch_size=1)
        cuda.context_made = False  # a fresh process
        _run_main(0, 1, None, spec, monkeypatch)
        assert [c for c in cuda.calls if c[0] == "set_device"][0][1:] == (0, 2)
        # Defect 1: the baseline was read from NVML (card 2's address) before the context existed.
        assert ("nvmlDeviceGetMemoryInfo", 2) in cuda.calls
        assert "before this process's CUDA context" in accounting(torch.device("cuda", 0))


def test_ranks_past_the_last_card_are_refused_naming_the_range():
    with FakeCuda(THREE_CARDS):
        launcher.check_ranks(torch.device("cuda", 1), 2)
        refused = r"num_gpus=2 but 1 CUDA device\(s\) are visible from cuda:2 on \(3 in all\)"
        with pytest.raises(UsageError, match=refused):
            launcher.check_ranks(torch.device("cuda", 2), 2)


def tf32_checking_loss(output, batch):
    """Raises in the child unless the parent's flags came along (matmul TF32 on, cuDNN benchmark on)."""
    if torch.backends.cuda.matmul.fp32_precision != "tf32" or not torch.backends.cudnn.benchmark:
        raise RuntimeError(f"flags not passed: matmul {torch.backends.cuda.matmul.fp32_precision}, "
                           f"cudnn.benchmark {torch.backends.cudnn.benchmark}")
    return output


def test_tf32_and_cudnn_flags_reach_the_child():
    # Defect 12: a child started with torch's defaults, so its throughput was not comparable.
    spec = make_spec(Blocks, _batch, device="cpu", global_batch_size=2, loss_fn=tf32_checking_loss,
                     warmup_steps=1, timed_steps=1)
    torch.backends.cuda.matmul.allow_tf32 = True  # the legacy setter: the legacy getters keep working here
    torch.backends.cudnn.benchmark = True
    try:
        result = launcher.launch(spec, Config(micro_batch_size=2), [MicroBatch()], Placement.CHILD, timeout=300)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
    assert result.status is ProbeStatus.FIT, result.reason
