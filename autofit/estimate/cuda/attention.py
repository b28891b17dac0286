"""Attention as a CUDA GPU runs it, for a step simulated on CPU kernels standing in for CUDA.

`scaled_dot_product_attention` picks a kernel per call. On the CPU it is nearly always its fused kernel,
which keeps the output and the log-sum-exp for backward, as CUDA's flash and memory-efficient kernels
do. CUDA falls back to the math backend where neither fused kernel takes the inputs, and the math
backend materialises the scores: it keeps the softmax of every head's (query x key) matrix for backward,
[batch, heads, seq, seq] per layer, and copies of the grouped keys and values. Measured on one H100
(torch 2.11, bench/README.md#cuda-attention): a 1.1B Llama with grouped-query attention at
1,024 tokens in fp32 peaks at 46.1 GB; the CUDA simulation predicted 44.1 GB.

The rules (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, `can_use_flash_attention`,
`can_use_mem_efficient_attention`, `select_sdp_backend`: flash first, then memory-efficient, then math):
- both fused kernels take 4-D inputs only (`check_tensor_shapes`), as the CPU's does.
- flash: fp16/bf16 on Ampere or later (sm80+), no attention mask (`is_causal` is fine), one head size
  for q, k and v of at most 256; grouped keys and values with `enable_gqa`.
- memory-efficient: fp16 or fp32 (bf16 too on sm80+), head sizes divisible by the GEMM alignment (8 for
  16-bit types, 4 for fp32 on sm80+), masks allowed, and as many key/value heads as query heads. Grouped
  heads were added to it by pytorch/pytorch#191085; which release carries it is not checked
  here, so grouped heads outside flash are simulated on the math backend: on a torch that has it, that
  over-counts (a margin), where the opposite would promise fits that run out of memory.
- dropout: both fused kernels take it (no `check_for_dropout` among their constraints) and keep no mask,
  only the random generator's seed and offset, from which backward draws it again; the CPU's fused
  kernel refuses it (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp `use_flash_attention_cpp`:
  `check_for_dropout`) and runs the math backend, [batch, heads, seq, seq] scores and noise per layer,
  so a fused call is simulated without its dropout. The math backend's own dropout (`at::dropout` inside
  it) keeps its noise in the scores' dtype here where CUDA keeps a bool mask: over-counted, a margin.
cuDNN attention, preferred on some Hopper and Blackwell stacks, keeps what flash keeps. Rules that need
the exact architecture (flash refuses head sizes over 192 in training on sm86/89) are not applied.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

HALF = (torch.float16, torch.bfloat16)


def backend(dtype: torch.dtype, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attn_mask: torch.Tensor | None, enable_gqa: bool, ampere: bool) -> str:
    """"flash", "efficient" or "math": the kernel CUDA runs for these inputs in `dtype` (the dtype the
    call computes in, after autocast) on a GPU that is Ampere or later (`ampere`) or older."""
    if not query.dim() == key.dim() == value.dim() == 4:  # both fused kernels take 4-D inputs only
        return "math"
    heads = (query.size(-3), key.size(-3), value.size(-3))
    dims = (query.size(-1), key.size(-1), value.size(-1))
    grouped = len(set(heads)) > 1
    if dtype in HALF and ampere and attn_mask is None and len(set(dims)) == 1 and dims[0] <= 256 and \
            (not grouped or (enable_gqa and heads[1] == heads[2] and heads[0] % heads[1] == 0)):
        return "flash"
    alignment = 8 if dtype in HALF else (4 if ampere else 1)
    efficient_dtypes = (torch.float16, torch.float32, torch.bfloat16) if ampere else (torch.float16, torch.float32)
    if dtype in efficient_dtypes and not grouped and dims[0] == dims[1] and \
            dims[0] % alignment == 0 and dims[2] % alignment == 0:
        return "efficient"
    return "math"


@contextlib.contextmanager
def as_on_cuda(ampere: bool | None, half: torch.dtype) -> Iterator[None]:
    """While active, `F.scaled_dot_product_attention` keeps for backward what CUDA's kernel would: calls
    CUDA runs on the math backend run on it here (`torch.ops.aten._scaled_dot_product_attention_math`, the
    same composite ops), the others on the CPU's fused kernel. `ampere`: None (the kernels are the
    target's own: nothing changes), else whether the GPU is Ampere or later. `half`: the dtype autocast
    computes in on that GPU (CPU autocast stands in for fp16 with bf16, which has the same size)."""
    if ampere is None:
        yield
        return
    original = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        device = query.device.type
        autocast = torch.is_autocast_enabled(device) and query.dtype == torch.float32
        dtype = torch.float32 if query.dtype == torch.float32 and not autocast else half
        if backend(dtype, query, key, value, attn_mask, enable_gqa, ampere) != "math":
            # CUDA's fused kernels keep no dropout mask (they draw it again in backward from a kept seed);
            # the CPU's fused kernel refuses dropout and would run the math backend: run it without
            return original(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if autocast:  # what autocast does to the inputs of scaled_dot_product_attention
            cast = torch.get_autocast_dtype(device)
            query, key, value = (t.to(cast) for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def describe(ampere: bool | None) -> str:
    """How attention, dropout and autocast were simulated, for an estimate's reason ("" where the kernels are
    the target's own)."""
    if ampere is None:
        return ""
    gpu = "an Ampere or later" if ampere else "a pre-Ampere"
    return f"; attention, dropout and autocast as CUDA runs them on {gpu} GPU"

