"""How the ranks of a job agree during an OOM guard's step, so that they step down together.

One process: nothing to agree on. Several ranks: after every micro-batch attempt each rank reports
whether it ran out of memory, failed otherwise, or still has samples left, in one small `all_reduce`
(MAX); every rank then takes the same decision. Gradients are accumulated locally (DDP's `no_sync`)
and averaged once all micro-batches are done, because a rank that fails halfway through a backward
with DDP's bucketed all-reduce would leave the others waiting in that collective forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

NO_FAILURE = 2**30  # "smallest failing micro-batch" of a rank that did not fail


@dataclasses.dataclass(frozen=True)
class Round:
    """What all ranks reported after one micro-batch attempt."""

    oom: bool  # some rank ran out of memory
    error: bool  # some rank failed with an error that is not an OOM
    busy: bool  # some rank still has samples left in this step
    smallest_failure: int  # samples in the smallest micro-batch that ran out of memory (NO_FAILURE if none)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DistributedDataParallel (or similar `.module`) wrapper."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class LocalSync:
    """A single process: every round is what this process saw."""

    rank = 0
    world_size = 1
    _CLEAN = {busy: Round(False, False, busy, NO_FAILURE) for busy in (False, True)}  # made once: every step asks
    _NOTHING = contextlib.nullcontext()

    def agree(self, oom: bool, error: bool, busy: bool, failed_size: int) -> Round:
        """The round as this process saw it."""
        if not (oom or error):
            return self._CLEAN[bool(busy)]
        return Round(oom, error, busy, failed_size if oom else NO_FAILURE)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Nothing to suppress in one process."""
        return self._NOTHING

    def average_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Nothing to average in one process."""


class ProcessGroupSync(LocalSync):
    """Several ranks of a `torch.distributed` process group (gloo on CPU, nccl on CUDA)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # nccl reduces CUDA tensors only; gloo reduces CPU tensors.
        self.flag_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def agree(self, oom: bool, error: bool, busy: bool, failed_size: int) -> Round:
        """All-reduce (MAX) this rank's flags; the smallest failure travels negated."""
        flags = torch.tensor([int(oom), int(error), int(busy), -(failed_size if oom else NO_FAILURE)],
                             dtype=torch.int64, device=self.flag_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        oom_any, error_any, busy_any, smallest = flags.tolist()
        return Round(bool(oom_any), bool(error_any), bool(busy_any), -smallest)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """DDP's `no_sync` when the model is wrapped: gradients stay local until `average_gradients`."""
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def average_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Average every gradient over the ranks, in place (what DDP's reducer would have done).

        Every rank calls this with the same parameters in the same order; a parameter that got no
        gradient on this rank contributes zeros, so the collectives always match.
        """
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.group)
            param.grad.div_(self.world_size)


def sync_for(model: nn.Module, group: dist.ProcessGroup | None = None) -> LocalSync:
    """`ProcessGroupSync` when a process group of more than one rank is running, else `LocalSync`."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return LocalSync()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return ProcessGroupSync(group, device)
