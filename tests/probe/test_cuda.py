"""On a real card: probes OOM for real under a budget fraction, and memory returns afterwards.

Deselected by default; run with `python -m pytest -m gpu` on a GPU machine.
"""

import pytest
import torch
from models import make_gpt2, make_mlp, make_mlp_batch, mlp_loss

import autofit
from autofit import Config, ProbeStatus
from autofit.probe.run import run_probe
from autofit.devices.memory import CudaBudget, accounting, outside_allocator
from autofit.devices.device import bf16_support
from autofit.job.train_spec import make_spec
from autofit.strategies import default_strategies

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def wide_batch(n):
    return torch.randn(n, 4096, 64), torch.randint(0, 10, (n, 4096))


def test_budget_fraction_makes_a_real_cuda_oom_and_memory_returns():
    spec = make_spec(make_mlp, wide_batch, global_batch_size=64, device="cuda", memory_budget="1GiB",
                     loss_fn=mlp_loss, warmup_steps=1, timed_steps=1)
    # The first probe leaves cuBLAS workspaces behind for good (allocated through the caching allocator
    # per thread and stream, CublasHandlePool.cpp; the autograd thread's are not cleared from this one):
    # memory returns to what it was after the first probe, every time.
    first = run_probe(spec, Config(micro_batch_size=64), default_strategies())
    assert first.status is ProbeStatus.OOM and first.oom_kind == "cuda-allocator", first.reason
    before = torch.cuda.memory_allocated()
    for _ in range(4):
        result = run_probe(spec, Config(micro_batch_size=64), default_strategies())
        assert result.status is ProbeStatus.OOM and result.oom_kind == "cuda-allocator", result.reason
        assert torch.cuda.memory_allocated() == before
    fits = run_probe(spec, Config(micro_batch_size=1, grad_accum_steps=64), default_strategies())
    assert fits.fits and fits.peak_bytes <= 2**30


def test_tuning_a_gpt2_under_a_budget_fraction():
    plan = autofit.autofit(make_gpt2, global_batch_size=32, device="cuda", memory_budget="1GiB")
    assert plan.fits and plan.peak_memory <= 2**30, plan.reason
    half = "bf16" if bf16_support(torch.device("cuda"))[0] else "fp16"
    assert {p.config.precision for p in plan.probes} >= {"fp32", half}


def test_mlp_end_to_end_on_cuda():
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=16, device="cuda", memory_budget="2GiB",
                           loss_fn=mlp_loss)
    assert plan.fits and plan.config.global_batch_size == 16


def test_this_process_is_charged_its_context_and_its_fraction_comes_back():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.ones(1, device=device)  # a context exists
    outside = outside_allocator(device)
    assert 0 <= outside < 4 * 2**30, outside  # a context and workspaces, not the card
    if accounting(device) == "this process's own memory (NVML)":
        assert outside > 0  # the context is counted
    torch.cuda.set_per_process_memory_fraction(0.9, device)
    try:
        with CudaBudget(2**30, device):
            pass
        assert torch.cuda.get_per_process_memory_fraction(device) == pytest.approx(0.9)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)

