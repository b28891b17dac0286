"""Rung 7, quantized base weights (QLoRA): the frozen linear layers stored in 4-bit NF4 or 8 bits.

"nf4": 4-bit NormalFloat with double quantisation (the quantisation constants quantised too) and bf16
compute, as in the QLoRA paper: base weights take ~0.5 byte per parameter instead of 4. "int8": 8-bit
base weights (LLM.int8, outlier threshold 6.0): 1 byte per parameter. Both train LoRA adapters only
(the LoRA strategy, applied right after this one), so they change what is trained: tier 2, opt-in.
Needs bitsandbytes (`pip install 'autofit[bnb]'`, 0.43.2 or later: see `SimulatedLinear4bit`) and CUDA.
The output head stays in full precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from autofit.config import Config
from autofit.config import Quantization as Q
from autofit.errors import MissingExtraError, UsageError
from autofit.strategies.base import Ladder, Option, Placement, Rule
from autofit.models.info import partly_trainable
from autofit.strategies.lora import output_head

if TYPE_CHECKING:
    from autofit.strategies.run import TrainRun
    from autofit.job.train_spec import TrainSpec
    from autofit.job.target import Target
INT8_THRESHOLD = 6.0  # LLM.int8 outlier threshold: features above it stay in fp16
INT8_BYTES = 1.0  # LLM.int8 weights; the fp32 per-row scales are counted per output row
# how much slower the step's arithmetic runs with the base weights dequantized in every matmul (the cost model)
SLOWDOWN = {Q.NF4: 1.25, Q.INT8: 2.0}


class QuantizedBase(Ladder):
    """none, 8-bit or 4-bit NF4 base weights (with LoRA adapters)."""

    field = "quantization"
    rung = 7
    order = 0
    values = (Q.NONE, Q.INT8, Q.NF4)  # least base-weight memory saved first

    def rules(self) -> tuple[Rule, ...]:
        return (Rule("quantization needs LoRA", ("quantization", "lora"), _needs_lora),)

    def options(self, spec: "TrainSpec") -> list[Option]:
        why_not = unavailable_reason(spec.target) or _trains_part(spec) or _nothing_to_quantize(spec)
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
        if value is Q.NONE or run.live:  # live: the model's adapters are LoRA's to check
            return
        if run.simulated:
            simulate_quantized(run.model, value)  # bitsandbytes cannot run on fake tensors: its memory can
            return
        if not quantize_linears(run.model, value):
            raise RuntimeError(f"quantization={value.value}: {run.spec.model.name} has no linear layer to quantize")
        run.model.to(run.device)  # bitsandbytes quantizes the weights as they move to the GPU
        run.placed = True


    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        # whether NF4 layers keep their input and which dtype they dequantize from is the calibration's to set
        value = config.quantization
        if value is Q.NONE:
            return {}
        nf4 = value is Q.NF4 and (SimulatedLinear4bit.keeps_input, SimulatedLinear4bit.quantized_from)
        return {"quantization": (value.value, nf4)}

    def compute_slowdown(self, config: Config) -> float:
        return SLOWDOWN.get(config.quantization, 1.0)

    def resident_bytes(self, module: nn.Module) -> int | None:
        """A simulated quantized layer's packed weight and constants (NF4's; or int8 and an fp32 scale a row),
        where the stand-in holds the original."""
        if not isinstance(module, SimulatedLinear4bit):
            return None
        w = module.weight
        return int(INT8_BYTES * w.numel()) + 4 * w.shape[0] if isinstance(module, SimulatedLinear8bit) \
            else int(nf4_bytes() * w.numel())

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if config.quantization is Q.NONE or fmt != "trainer":  # autofit.prepare quantizes for the other formats
            return []
        return [f"# Load the base weights quantized ({config.quantization}) with transformers.BitsAndBytesConfig, "
                "then peft.prepare_model_for_kbit_training(model)."]


def unavailable_reason(target: "Target") -> str | None:
    """Why 4/8-bit base weights cannot be used on `target`, or None when they can."""
    if not target.has("bitsandbytes"):
        return "quantized base weights need bitsandbytes, which is not installed: pip install 'autofit[bnb]'"
    if not target.has("peft"):
        return "quantized base weights train LoRA adapters through peft, which is not installed: pip install 'autofit[peft]'"
    if not target.cuda:
        return f"bitsandbytes 4/8-bit base weights need CUDA; the target is {target.name}"
    return None


def quantizable_layers(model: nn.Module) -> list[str]:
    """Names of the layers 4/8-bit weights replace: every `nn.Linear` and transformers `Conv1D` (GPT-2's
    projections: a linear layer with its weight stored transposed), but the output head; in a model that
    trains only part of itself (its own adapters), the frozen ones only."""
    head = output_head(model)
    names = [name for name, module in model.named_modules() if name and name != head and _is_projection(module)]
    if partly_trainable(model):
        return [name for name in names if not model.get_submodule(name).weight.requires_grad]
    return names


def quantize_linears(model: nn.Module, value: Q) -> int:
    """Replace every layer of `quantizable_layers` by a frozen bitsandbytes 4-bit NF4 ("nf4") or 8-bit
    ("int8") one, in place; the weights are quantized when the model moves to CUDA. Returns the number of
    layers replaced (0: nothing was quantized, and the model is not marked) and marks the model as
    peft's `prepare_model_for_kbit_training` expects."""
    names = quantizable_layers(model)
    if not names:
        return 0
    bnb = _import_bnb()
    for name in names:
        _replace(model, name, _quantized(bnb, as_linear(model.get_submodule(name)), value))
    setattr(model, "is_loaded_in_4bit" if value is Q.NF4 else "is_loaded_in_8bit", True)
    return len(names)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` in `model` at the dotted `name`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def as_linear(module: nn.Module) -> nn.Linear:
    """`module` as an `nn.Linear`: itself, or a transformers `Conv1D` with its (in, out) weight transposed to
    (out, in), as transformers does before quantizing one (integrations/bitsandbytes.py:
    `if issubclass(module.source_cls, Conv1D): value = value.T`). Shares nothing it must not: the copy is new."""
    if type(module) is nn.Linear:
        return module
    in_features, out_features = module.weight.shape
    linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device="meta")
    linear.weight = nn.Parameter(module.weight.detach().t().contiguous(), module.weight.requires_grad)
    if module.bias is not None:
        linear.bias = nn.Parameter(module.bias.detach().clone(), module.bias.requires_grad)
    return linear


def _is_projection(module: nn.Module) -> bool:
    if type(module) is nn.Linear:
        return True
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return False
    return type(module) is Conv1D


def _trains_part(spec: "TrainSpec") -> str | None:
    """Why a model that trains only part of its parameters is not quantized here, or None: autofit
    quantizes a whole base and trains its own LoRA adapters over it."""
    if not spec.model.trains_part:
        return None
    return (f"{spec.model.name} trains {spec.model.trained()} (its own adapters or a frozen part); autofit "
            "quantizes a fully trainable base under its own LoRA adapters: load the base quantized yourself "
            "(bitsandbytes, peft's prepare_model_for_kbit_training) before adding adapters")


def _nothing_to_quantize(spec: "TrainSpec") -> str | None:
    """Why quantization would change nothing in `spec`'s model (no layer to replace), or None. A Hugging
    Face model is made of linear (or Conv1D) projections: it is not built again to count them (a 70B
    build, even on the meta device, takes many seconds)."""
    from autofit.strategies.lora import _inspectable

    if spec.model.is_hf or quantizable_layers(_inspectable(spec.model_factory)):
        return None
    return (f"{spec.model.name} has no linear layer to quantize (nn.Linear or transformers Conv1D) besides its "
            "output head: 4/8-bit base weights would change nothing")


def _quantized(bnb: Any, linear: nn.Linear, value: Q) -> nn.Module:
    has_bias = linear.bias is not None
    if value is Q.NF4:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                                  compute_dtype=torch.bfloat16, compress_statistics=DOUBLE_QUANT, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=DOUBLE_QUANT,
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


BNB_MINIMUM = "0.43.2"  # earlier releases keep every quantized layer's input for backward (`SimulatedLinear4bit`)
# Bytes per NF4 weight (bitsandbytes/functional.py `quantize_4bit`, blocks of 64): 4 bits and an fp32 absmax
# per block; double quantization (`compress_statistics=True`, as QLoRA and autofit quantize) stores the
# absmax in 8 bits instead, itself in blocks of 256 with an fp32 absmax each.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_BYTES_PLAIN = 0.5 + 4 / 64
DOUBLE_QUANT = True  # autofit's `_quantized`; the calibration sets False for runs quantized without it


def nf4_bytes() -> float:
    """Bytes per weight of an NF4 layer, as `DOUBLE_QUANT` quantizes it."""
    return NF4_BYTES if DOUBLE_QUANT else NF4_BYTES_PLAIN


def _import_bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError as exc:
        raise MissingExtraError("bitsandbytes", "bnb", "4/8-bit base weights") from exc
    version = getattr(bitsandbytes, "__version__", "0")
    if keeps_inputs(version):
        raise UsageError(f"bitsandbytes {version} keeps every quantized layer's input for backward (fixed in "
                         f"{BNB_MINIMUM}, bitsandbytes#1270): pip install -U 'autofit[bnb]'")
    return bitsandbytes


def keeps_inputs(version: str) -> bool:
    """Whether bitsandbytes `version` predates `BNB_MINIMUM` (its pre-releases included)."""
    from packaging.version import Version

    return Version(version) < Version(BNB_MINIMUM)


# -- what the estimator simulates in place of bitsandbytes --------------------------------------------------
def simulate_quantized(model: nn.Module, value: Q) -> None:
    """Replace every layer of `quantizable_layers` by bitsandbytes' layer for `value` as the estimator's
    fake-tensor step runs it (`SimulatedLinear4bit`, `SimulatedLinear8bit`), in place (LoRA's adapters go on
    them as peft puts them on bitsandbytes' layers)."""
    layer = {Q.NF4: SimulatedLinear4bit, Q.INT8: SimulatedLinear8bit}[value]
    for name in quantizable_layers(model):
        _replace(model, name, layer(as_linear(model.get_submodule(name))))


def _needs_lora(c: Config, t: "Target") -> str | None:
    if c.quantization is not Q.NONE and not c.lora:
        return (f"quantization={c.quantization.value} freezes the base weights: without LoRA adapters "
                "nothing is trained")
    return None


class SimulatedLinear4bit(nn.Module):
    """The memory a bitsandbytes NF4 `Linear4bit` uses while LoRA trains beside it, for a step under fake
    tensors (bitsandbytes cannot run there: fake tensors have no data to quantize). As
    `Linear4bit.forward` (bitsandbytes/nn/modules.py) does: the input is cast to the compute dtype (a copy
    where it differs), `MatMul4Bit` (bitsandbytes/autograd/_functions.py) dequantizes the whole weight to a
    16-bit copy for the matmul, forward and again backward, freed after it, and the output is cast back to
    the input's dtype. The packed weight itself is counted by the estimator's NF4 formula; here the layer
    holds the original parameter, which the simulation does not count.

    `keeps_input`: bitsandbytes before 0.43.2 kept each input for backward (`ctx.tensors = (A, B)`, a plain
    attribute that activation checkpointing cannot drop) though a frozen weight needs no input; 0.43.2
    stopped (bitsandbytes-foundation/bitsandbytes#1270, "delete useless buffered activation"; its changelog:
    10.1 GB per sequence of 1,024 tokens on a 70B model). autofit requires 0.43.2 or later, so False; the
    calibration sets it for runs measured with older releases.

    `quantized_from`: the dtype each weight was quantized from, which `dequantize_4bit` returns
    (`QuantState.dtype`, bitsandbytes/functional.py) before `MatMul4Bit` casts it to the compute dtype: two
    copies at once where they differ (an fp32 model's layer dequantizes to fp32, then to bf16). None: the
    weight's own dtype, as 0.43.0 and later quantize it (`Params4bit._quantize`: `self.data.contiguous()
    .to(device)`) and as autofit's `_quantized` hands it over. Earlier releases quantized from fp16
    (`Params4bit.cuda`: `self.data.contiguous().half()`); the calibration sets that for runs measured so."""

    keeps_input = False
    quantized_from: torch.dtype | None = None

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features  # as Linear4bit has
        self.weight = linear.weight
        self.bias = linear.bias
        for param in self.parameters():
            param.requires_grad_(False)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        stored = type(self).quantized_from or self.weight.dtype
        return _MatMul4bit.apply(x.to(self.compute_dtype), self.weight, stored, bias, type(self).keeps_input).to(dtype)


class _MatMul4bit(torch.autograd.Function):
    """bitsandbytes' `MatMul4Bit` as memory: a dequantized 16-bit weight per matmul; the input kept only
    where `keeps_input` (releases before 0.43.2)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, stored: torch.dtype, bias: torch.Tensor | None,
                keeps_input: bool) -> torch.Tensor:
        ctx.weight, ctx.stored = weight, stored
        ctx.kept = x if keeps_input and ctx.needs_input_grad[0] else None
        return F.linear(x, _dequantized(weight, stored, x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad_x = grad @ _dequantized(ctx.weight, ctx.stored, grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


class SimulatedLinear8bit(SimulatedLinear4bit):
    """The memory bitsandbytes' LLM.int8 `Linear8bitLt` (frozen int8 weights, `has_fp16_weights=False`) uses
    while LoRA trains beside it, for a step under fake tensors. `MatMul8bitLt` (bitsandbytes/autograd/
    _functions.py; the `double_quant` code and its `int8_vectorwise_quant` rewrite alike) quantizes its input
    to int8 from an fp16 copy, multiplies in int8 and returns the input's dtype; for backward it keeps its input
    (`ctx.tensors = (CAt, subA, A)`: a plain attribute, which no checkpointing drops; the rewrite's fast path
    for frozen weights makes no CAt, `CAt = SCAt = None`, and the few outlier columns subA are left out) and
    multiplies the gradient with the weight copied to the input's dtype (`state.CB.to(ctx.dtype_A,
    copy=True)`). The int8 weight itself is counted by the estimator's int8 formula."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MatMul8bit.apply(x, self.weight, self.bias)


class _MatMul8bit(torch.autograd.Function):
    """`MatMul8bitLt` as memory: the fp16 copy of the input and its int8 quantization made and freed, the output
    in the input's dtype, the input kept for backward; there, the weight's copy in the input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.weight, ctx.kept = weight, x if ctx.needs_input_grad[0] else None
        quantized = x.to(torch.float16).to(torch.int8)
        out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        del quantized
        return out if bias is None else out + bias.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        dtype = ctx.kept.dtype
        return grad.to(dtype) @ ctx.weight.to(dtype), None, None


def _dequantized(weight: torch.Tensor, stored: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """What `dequantize_4bit(B, quant_state).to(dtype)` allocates: the weight in the dtype it was quantized
    from (`stored`), then, where `dtype` differs, a copy in `dtype` made while the first is alive."""
    return torch.empty(weight.shape, dtype=stored, device=weight.device).to(dtype)
