"""Small pieces the OOM guard is built from: counting and joining a batch's rows (slicing them without
copies is `autofit.batches.batch.slice_rows`), joining evaluation outputs, telling which gradients a failed backward touched, and the device peak."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from autofit.batches.batch import leading_dim


def rows(batch: Any) -> int:
    """Samples in `batch` (`autofit.batches.batch.leading_dim`, with a fast path for flat batches)."""
    leaves = batch.values() if type(batch) is dict else batch if type(batch) in (tuple, list) else (batch,)
    sizes = {x.shape[0] if x.dim() else None for x in leaves if isinstance(x, torch.Tensor)}
    if len(sizes) == 1 and None not in sizes and all(isinstance(x, torch.Tensor) for x in leaves):
        return sizes.pop()
    return leading_dim(batch)  # validates and names what is wrong


def concat_rows(parts: list[Any]) -> Any:
    """Concatenate micro-batch outputs (tensors, or tuples/dicts of them) along the sample axis."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else torch.stack(parts)
    if isinstance(first, dict):
        return {key: concat_rows([p[key] for p in parts]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat_rows(list(items)) for items in zip(*parts))
    return parts


def detach(value: Any) -> Any:
    """`value` detached when it is a tensor."""
    return value.detach() if isinstance(value, torch.Tensor) else value


class GradLedger:
    """Which parameters' gradients a backward has added to, read from the gradients' in-place versions.

    Autograd adds a parameter's whole gradient for a micro-batch at once (one AccumulateGrad per
    parameter), so after a backward that failed halfway each parameter has either all of that
    micro-batch's contribution or none of it.
    """

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        self._before: list[tuple[Any, int]] = []

    def snapshot(self) -> None:
        """Remember every gradient as it is now (a reference and its version; nothing is copied)."""
        self._before = [(p.grad, p.grad._version if p.grad is not None else -1) for p in self.params]

    def touched(self) -> list[nn.Parameter]:
        """The parameters whose gradient changed since `snapshot`; forgets the snapshot."""
        changed = [p for p, (grad, version) in zip(self.params, self._before)
                   if p.grad is not grad or (grad is not None and grad._version != version)]
        self.forget()
        return changed

    def forget(self) -> None:
        """Drop the snapshot's references, so that gradients cleared by `zero_grad` are freed at once."""
        self._before = []


@contextlib.contextmanager
def held(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Hold `params` out of the backward (no gradient is added to them) for the duration."""
    for param in params:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in params:
            param.requires_grad_(True)


def peak_bytes(device: torch.device) -> int | None:
    """The peak bytes `device` has held so far: CUDA's allocator peak, or the active CPU budget's peak."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from autofit.devices.memory import CpuBudget

    budgets = [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, CpuBudget)]
    return budgets[-1].peak if budgets else None
