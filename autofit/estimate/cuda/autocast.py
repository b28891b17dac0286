"""Autocast as CUDA runs it, for a step simulated on CPU kernels under CPU autocast.

Autocast on CUDA runs a list of ops in fp32 whatever their inputs' dtype: a 16-bit input is cast to an
fp32 copy and the result is fp32 (aten/src/ATen/autocast_mode.h, `AT_FORALL_FP32`: exp, log, pow,
rsqrt, layer_norm, group_norm, the losses, ...; `AT_FORALL_FP32_SET_OPT_DTYPE`: softmax, log_softmax,
sum, prod, cumsum, cumprod, in fp32 unless the call names a dtype). The CPU's autocast has a list of its
own (autocast_mode.cpp, `KERNEL_CPU`: mostly losses, linear algebra and pooling), so on the CPU the
softmax of bf16 attention scores stays bf16, and what backward keeps differs:

- a hand-written attention (`softmax(q @ k.T)`) keeps its [batch, heads, seq, seq] probabilities in fp32
  on CUDA, and the bf16 copy the next matmul casts: 6 bytes per score where the CPU keeps 2;
- GPT-2's `gelu_new` (`torch.pow(x, 3.0)` on the bf16 output of a projection) computes in fp32 on CUDA
  and keeps fp32 copies of the [batch, seq, 4 x hidden] input, its tanh and more;
- a GroupNorm or LayerNorm after a bf16 convolution or projection keeps an fp32 copy of its input;
- `cross_entropy` of bf16 logits keeps the bf16 log-probabilities (`cross_entropy_loss` passes the
  input's dtype to log_softmax, LossNLL.cpp) and the fp32 copy `nll_loss` casts, where the CPU's autocast
  casts the logits first (`cross_entropy_loss` is on its fp32 list) and keeps fp32 log-probabilities only.

While active and autocast is on, those functions run as CUDA's autocast runs them. In-place and `out=`
variants are left alone, as autocast leaves them. Composite functions are seen whole, at the Python API
(`torch.nn.functional.rms_norm`'s inner pow, for one, is not), which is where models call them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

HALF = (torch.float16, torch.bfloat16)
# AT_FORALL_FP32: every 16-bit floating input cast to fp32
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp"})
# AT_FORALL_FP32_SET_OPT_DTYPE: dtype=float32 where the call names none and its input is 16-bit
FP32_UNLESS_DTYPE = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum"})
OPERATORS = {"__pow__": "pow", "__rpow__": "pow"}  # `x ** 3`, `2 ** x`: pow.Tensor_Scalar, pow.Scalar
_INHERITED = object()  # a name a namespace's own __dict__ lacks


def _to_fp32(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in HALF else value


def _half_input(args: tuple, kwargs: dict) -> bool:
    """Whether the call's first tensor (autocast's `firstarg_is_eligible`), given by position or name, is 16-bit."""
    first = next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)), None)
    return first is not None and first.dtype in HALF


def _names_a_dtype(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


def _cross_entropy(args: tuple, kwargs: dict) -> Any:
    """`F.cross_entropy` of 16-bit logits and class indices as CUDA's autocast runs it: log_softmax in the
    logits' dtype, then `nll_loss`, which autocast casts to fp32 (here the CPU's autocast, which lists
    `nll_loss` too). Anything else (probabilities as targets, label smoothing): None, run as given."""
    try:
        bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    except TypeError:  # a call this signature does not take: cross_entropy itself says what is wrong
        return None
    bound.apply_defaults()
    p = bound.arguments
    logits, target = p["input"], p["target"]
    if not (isinstance(logits, torch.Tensor) and logits.dtype in HALF and isinstance(target, torch.Tensor)
            and not target.is_floating_point() and p["label_smoothing"] == 0.0):
        return None
    log_probs = F.log_softmax(logits, 1 if logits.dim() >= 2 else 0, dtype=logits.dtype)
    return F.nll_loss(log_probs, target, weight=p["weight"], size_average=p["size_average"],
                      ignore_index=p["ignore_index"], reduce=p["reduce"], reduction=p["reduction"])


def _cast_as_cuda(name: str, original: Any) -> Any:
    """`original` (the torch function or Tensor method `name`) with CUDA's autocast policy for it applied
    while the CPU's autocast is on."""
    policy = OPERATORS.get(name, name)

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled("cpu") and kwargs.get("out") is None:  # autocast leaves `out=` calls alone
            if policy in FP32:
                args, kwargs = tree_map(_to_fp32, (args, kwargs))
            elif policy in FP32_UNLESS_DTYPE and _half_input(args, kwargs) and not _names_a_dtype(args, kwargs):
                kwargs = {**kwargs, "dtype": torch.float32}
            elif policy == "cross_entropy":
                loss = _cross_entropy(args, kwargs)
                if loss is not None:
                    return loss
        return original(*args, **kwargs)

    return run


def _targets() -> list[tuple[Any, str]]:
    """(namespace, name) of every public entry point to an op CUDA's autocast runs in fp32: the torch
    function, the Tensor method and the `torch.nn.functional` function of each name that exists."""
    names = [*FP32, *FP32_UNLESS_DTYPE, *OPERATORS, "cross_entropy"]
    return [(space, name) for name in names for space in (torch, torch.Tensor, F) if hasattr(space, name)]


@contextlib.contextmanager
def as_on_cuda(on: bool) -> Iterator[None]:
    """While active (`on`), the ops CUDA's autocast runs in fp32 run in fp32 under the CPU's autocast.
    Patched where models call them (not a torch-function mode, which `Tensor.backward` would pop, so that
    activation checkpointing's recomputation in backward casts as the forward did)."""
    if not on:
        yield
        return
    saved = [(space, name, space.__dict__.get(name, _INHERITED)) for space, name in _targets()]
    try:
        for space, name, _ in saved:
            setattr(space, name, _cast_as_cuda(name, getattr(space, name)))
        yield
    finally:
        for space, name, original in saved:
            if original is not _INHERITED:
                setattr(space, name, original)
            elif name in space.__dict__:  # a Tensor method of torch's C base class: the patch shadowed it
                delattr(space, name)
