"""The OOM guard against a real CUDA out-of-memory error (a budget below the card, enforced by the
caching allocator's per-process fraction). Deselected by default; run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autofit.guard.core import OomGuard
from autofit.devices.memory import CudaBudget

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
VOCAB, WIDTH, SEQ, TOTAL = 8192, 1024, 1024, 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(4)]
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *blocks, nn.Linear(WIDTH, VOCAB)).cuda()


def _loss(logits, batch):
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten())


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (TOTAL, SEQ + 1), generator=gen).cuda()
    return ids[:, :-1], ids[:, 1:]


def _bare_peak(micro_batch: int) -> int:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.cuda.reset_peak_memory_stats()
    for step in range(2):
        batch = _batch(step)
        for start in range(0, TOTAL, micro_batch):
            chunk = (batch[0][start:start + micro_batch], batch[1][start:start + micro_batch])
            (_loss(model(chunk[0]), chunk) * (micro_batch / TOTAL)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_reserved()
    del model, optimizer
    torch.cuda.empty_cache()
    return peak


def test_real_cuda_oom_mid_run_is_recovered_with_the_same_weights():
    device = torch.device("cuda")
    small, large = _bare_peak(TOTAL // 4), _bare_peak(TOTAL)
    assert large > small * 1.3, (small, large)
    budget = CudaBudget(None, device)
    limit = (small + large) // 2 + budget.outside_allocator()
    reference = _model()
    reference_opt = torch.optim.AdamW(reference.parameters())
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    guard = OomGuard(model, optimizer, micro_batch_size=TOTAL, loss_fn=_loss)
    with CudaBudget(limit, device):
        for step in range(3):
            guard.step(_batch(step))
    assert guard.recoveries and "cuda" in guard.recoveries[0].reason
    assert guard.config.micro_batch_size in (TOTAL // 2, TOTAL // 4)
    assert guard.samples_seen == 3 * TOTAL
    # The same sum split another way differs only by reduction order: the reference runs unbudgeted.
    for step in range(3):
        batch = _batch(step)
        for start in range(0, TOTAL, TOTAL // 4):
            chunk = (batch[0][start:start + TOTAL // 4], batch[1][start:start + TOTAL // 4])
            (_loss(reference(chunk[0]), chunk) * 0.25).backward()
        reference_opt.step()
        reference_opt.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)
