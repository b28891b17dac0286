"""Dropout as a CUDA GPU runs it, for a step simulated on CPU kernels standing in for CUDA.

What a training-mode `F.dropout` keeps for backward depends on the device. On CUDA, `at::dropout`
takes the fused kernel (aten/src/ATen/native/Dropout.cpp, `is_fused_kernel_acceptable`: CUDA tensors,
0 < p < 1), `native_dropout`, whose mask is a bool tensor, one byte per element
(aten/src/ATen/native/cuda/Dropout.cu, `native_dropout_cuda` -> `dropout_cuda<bool>`). On the CPU the
composite `_dropout` (`is_fused_kernel_acceptable` is false for CPU tensors) draws its noise in the
input's dtype and keeps it: four bytes per element in fp32, two in bf16. A CPU simulation
of a CUDA step therefore counts 1 to 3 bytes too many per element of every dropout, which for a
BERT- or GPT-2-style model (dropout after attention, after each projection, on the embeddings) is
gigabytes at realistic batches. In-place dropout (`inplace=True`) keeps its noise in the input's dtype
on both devices (`dropout_` always takes `_dropout<true>`) and is left as it runs.

Attention dropout inside `scaled_dot_product_attention` is `autofit.estimate.cuda.attention`'s: CUDA's
fused kernels keep no mask at all.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F


class _NativeDropout(torch.autograd.Function):
    """CUDA's `native_dropout` and its backward: the output, and a bool mask kept for backward."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, p: float) -> torch.Tensor:
        mask = torch.empty_like(input, dtype=torch.bool).bernoulli_(1 - p)
        ctx.save_for_backward(mask)
        ctx.scale = 1 / (1 - p)
        return torch.mul(input, mask).mul_(ctx.scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mask,) = ctx.saved_tensors
        return torch.mul(grad, mask).mul_(ctx.scale), None  # native_dropout_backward: grad * mask * scale


def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """`F.dropout` as it runs on a CUDA tensor: `native_dropout` where CUDA takes it, else as given."""
    if training and not inplace and 0 < p < 1 and input.numel() > 0:
        return _NativeDropout.apply(input, p)
    return _original(input, p, training, inplace)


_original = F.dropout


@contextlib.contextmanager
def as_on_cuda(on: bool) -> Iterator[None]:
    """While active (`on`), `F.dropout` keeps for backward what it keeps on a CUDA tensor (`dropout`)."""
    if not on:
        yield
        return
    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = _original
