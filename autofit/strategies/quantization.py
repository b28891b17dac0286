"""Rung 7, quantized base weights (QLoRA): the frozen linear layers stored in 4-bit NF4 or 8 bits.

"nf4": 4-bit NormalFloat with double quantisation (the quantisation constants quantised too) and bf16
compute, as in the QLoRA paper: base weights take ~0.5 byte per parameter instead of 4. "int8": 8-bit
base weights (LLM.int8, outlier threshold 6.0): 1 byte per parameter. Both train LoRA adapters only
(the LoRA strategy, applied right after this one), so they change what is trained: tier 2, opt-in.
Needs bitsandbytes (`pip install 'autofit[bnb]'`) and CUDA. The output head stays in full precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autofit.config import Config
from autofit.config import Quantization as Q
from autofit.errors import MissingExtraError
from autofit.strategies.base import Ladder, Option, Placement
from autofit.strategies.lora import output_head

if TYPE_CHECKING:
    from autofit.probe.step import TrainRun
    from autofit.spec.train import TrainSpec
    from autofit.spec.target import Target
INT8_THRESHOLD = 6.0  # LLM.int8 outlier threshold: features above it stay in fp16


class Quantization(Ladder):
    """none, 8-bit or 4-bit NF4 base weights (with LoRA adapters)."""

    field = "quantization"
    rung = 7
    values = (Q.NONE, Q.INT8, Q.NF4)  # least base-weight memory saved first

    def options(self, spec: "TrainSpec") -> list[Option]:
        why_not = unavailable_reason(spec.target)
        return [
            Option(Q.NONE, 0, "base weights in full precision"),
            Option(Q.INT8, 2, why_not or "8-bit base weights (LLM.int8) + LoRA: 1 byte per weight",
                   available=why_not is None),
            Option(Q.NF4, 2, why_not or "4-bit NF4 base weights, double quant, bf16 compute + LoRA: ~0.5 byte per weight",
                   available=why_not is None),
        ]

    def placement(self, config: Config) -> Placement:
        """bitsandbytes keeps process-global state (CUDA kernels, paged buffers): probe in a child."""
        return Placement.IN_PROCESS if config.quantization is Q.NONE else Placement.CHILD

    def apply(self, run: "TrainRun") -> None:
        value = run.config.quantization
        if value is Q.NONE:
            return
        quantize_linears(run.model, value)
        run.model.to(run.device)  # bitsandbytes quantizes the weights as they move to the GPU
        run.placed = True


def unavailable_reason(target: "Target") -> str | None:
    """Why 4/8-bit base weights cannot be used on `target`, or None when they can."""
    if not target.has("bitsandbytes"):
        return "quantized base weights need bitsandbytes, which is not installed: pip install 'autofit[bnb]'"
    if not target.has("peft"):
        return "quantized base weights train LoRA adapters through peft, which is not installed: pip install 'autofit[peft]'"
    if not target.cuda:
        return f"bitsandbytes 4/8-bit base weights need CUDA; the target is {target.name}"
    return None


def quantize_linears(model: nn.Module, value: Q) -> int:
    """Replace every linear layer but the output head by a frozen bitsandbytes 4-bit NF4 ("nf4") or
    8-bit ("int8") one, in place; the weights are quantized when the model moves to CUDA. Returns the
    number of layers replaced and marks the model as peft's `prepare_model_for_kbit_training` expects."""
    bnb = _import_bnb()
    head = output_head(model)
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name == head:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _quantized(bnb, module, value))
        replaced += 1
    setattr(model, "is_loaded_in_4bit" if value is Q.NF4 else "is_loaded_in_8bit", True)
    return replaced


def _quantized(bnb: Any, linear: nn.Linear, value: Q) -> nn.Module:
    has_bias = linear.bias is not None
    if value is Q.NF4:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4")
    elif value is Q.INT8:
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                    has_fp16_weights=False, threshold=INT8_THRESHOLD)
        layer.weight = bnb.nn.Int8Params(linear.weight.data.to(torch.float16), requires_grad=False,
                                         has_fp16_weights=False)
    else:
        raise ValueError(f"quantization={value!r} has no bitsandbytes layer")
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return layer


def _import_bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError as exc:
        raise MissingExtraError("bitsandbytes", "bnb", "4/8-bit base weights") from exc
    return bitsandbytes
