"""One of two CPU ranks (gloo) for test_clipping.py: `autofit.prepare(..., max_grad_norm=...)` under DDP,
FSDP2 and ZeRO-2, both ranks given the same batch, so the averaged gradient is one process's. Rank 0
prints one JSON line per engine: the norm before clipping and the first weights after the step."""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import autofit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_clipping import MAX_NORM, batch, loss_fn, make_model  # noqa: E402

for sharding in ("none", "fsdp_full", "zero2"):
    config = autofit.Config(sharding=sharding, num_gpus=2, micro_batch_size=4, grad_accum_steps=2, optimizer="user")
    prepared = autofit.prepare(config, make_model(), device="cpu", loss_fn=loss_fn, max_grad_norm=MAX_NORM,
                               optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
    prepared.step(batch())
    weight = next(p for p in prepared.model.parameters())
    weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    if dist.get_rank() == 0:
        print(json.dumps({"sharding": sharding, "norm": prepared.grad_norm,
                          "weight": weight.detach().float().flatten()[:8].tolist()}), flush=True)

gc.collect()  # as train_with_prepare.py ends: without it a rank may abort at exit (docs/prepare.md)
dist.destroy_process_group()
