"""Gradient clipping in the guard's step and `autofit.prepare`: the global norm of the whole step's
gradient (after accumulation, over every rank's shard), clipped before the optimizer step, as a plain
loop with `clip_grad_norm_` on the whole batch would; refused where there is no global gradient."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autofit

torch.set_num_threads(1)
MAX_NORM = 0.05  # far under the gradients' norm: every step clips


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


def loss_fn(output: torch.Tensor, _batch) -> torch.Tensor:
    return output.pow(2).mean()


def reference() -> tuple[float, nn.Module]:
    """A plain loop: the whole batch's gradient, its norm, clipped, one SGD step at lr 1."""
    model = make_model()
    loss_fn(model(batch()), None).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return float(norm), model


def test_the_guard_clips_the_whole_steps_gradient():
    norm, expected = reference()
    model = make_model()
    guard = autofit.OomGuard(model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=3,
                             loss_fn=loss_fn, max_grad_norm=MAX_NORM)
    report = guard.step(batch())  # micro-batches of 3, 3 and 2: clipped once, after the last
    assert report.micro_batches == (3, 3, 2) and report.grad_norm == pytest.approx(norm, rel=1e-5)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q)
    plain = make_model()
    unclipped = autofit.OomGuard(plain, torch.optim.SGD(plain.parameters(), lr=1.0), loss_fn=loss_fn)
    assert unclipped.step(batch()).grad_norm is None


def test_prepare_clips_after_accumulation():
    norm, expected = reference()
    config = autofit.Config(micro_batch_size=2, grad_accum_steps=4, optimizer="user")
    prepared = autofit.prepare(config, make_model(), loss_fn=loss_fn, max_grad_norm=MAX_NORM,
                               optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
    prepared.step(batch())
    assert prepared.grad_norm == pytest.approx(norm, rel=1e-5)
    for p, q in zip(prepared.model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q)


def test_bad_or_impossible_clipping_is_refused():
    with pytest.raises(autofit.UsageError, match="max_grad_norm must be a positive number .* got 0"):
        autofit.OomGuard(make_model(), None, max_grad_norm=0)
    with pytest.raises(autofit.UsageError, match="steps the optimizer inside the backward"):
        autofit.prepare(autofit.Config(optimizer_step="in_backward"), make_model(), max_grad_norm=1.0)


def test_two_ranks_clip_the_global_norm_under_ddp_fsdp2_and_zero():
    norm, expected = reference()
    script = Path(__file__).with_name("clipping_rank.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    rows = {row["sharding"]: row for row in map(json.loads, lines)}
    assert set(rows) == {"none", "fsdp_full", "zero2"}
    first = next(expected.parameters()).detach().flatten()[:8]
    for sharding, row in rows.items():
        assert row["norm"] == pytest.approx(norm, rel=1e-4), sharding
        torch.testing.assert_close(torch.tensor(row["weight"]), first, rtol=1e-4, atol=1e-6, msg=sharding)
