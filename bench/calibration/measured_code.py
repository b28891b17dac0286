"""The code the sources measured, where it differs from what autofit simulates by default.

A published peak is the memory of the source's own code: litgpt's model and loss for litgpt's tables,
transformers 4.38's loss for AnswerDotAI's fsdp_qlora benchmarks (Feb-Mar 2024). Simulating today's
transformers classes instead measures another program (README.md, "What the misses have in common").
This module rebuilds those programs for the estimator, which accepts any `nn.Module` factory and loss.

litgpt is not a dependency of autofit: its package is looked for in `VENDOR` (install it there with
`bench/calibration/install_measured_code.sh`, which never touches the environment). Without it, the
litgpt rows fall back to the transformers classes of their architecture and their result says so.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
VENDOR = Path(os.environ.get("AUTOFIT_CALIBRATION_VENDOR", HERE / "vendor"))
# The litgpt release whose model and LoRA code matches the measured runs: the resource tables were
# measured at lit-gpt commit 8641822 (Oct 2023) and the config-hub table at litgpt commit 03ffc55 (spring
# 2024). 0.3.1 and 0.4.0 have byte-identical litgpt/model.py and litgpt/lora.py; the LoRA module of both
# is the one of the Oct 2023 lit_gpt/lora.py (LoRAQKVLinear: zero_pad + conv1d on the fused qkv).
LITGPT_VERSION = "0.4.0"


def litgpt_missing() -> str | None:
    """None when litgpt can be imported from `VENDOR` (put on sys.path), else why not and how to install it."""
    for folder in (VENDOR / f"litgpt-{LITGPT_VERSION}", VENDOR / "lightning"):
        if folder.is_dir() and str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    try:
        import litgpt.lora  # noqa: F401
        import litgpt.utils  # noqa: F401
    except ImportError as exc:
        return (f"litgpt {LITGPT_VERSION} not importable from {VENDOR} ({exc}); run "
                "bench/calibration/install_measured_code.sh to simulate litgpt's own model code")
    return None


# -- bitsandbytes ---------------------------------------------------------------------------------------
# The release each source's QLoRA runs used; every one predates 0.43.2, whose fix stopped `MatMul4Bit`
# keeping its input (autofit.strategies.quantization.SimulatedLinear4bit).
BITSANDBYTES = {
    "litgpt-rt-": "0.41.1",  # the resource tables' own header: "bitsandbytes 0.41.1"
    "litgpt-hub-": "0.42.0",  # litgpt 0.3.1 and 0.4.0 pin bitsandbytes==0.42.0 (their `all` extra)
    "fsdpqlora-": "0.43.0",  # FSDP + QLoRA needs `quant_storage`, new in 0.43.0; benchmarks Feb-Mar 2024
}


def bitsandbytes_of(row_id: str) -> str | None:
    """The bitsandbytes release a row was measured with, or None where the source names none."""
    return next((version for prefix, version in BITSANDBYTES.items() if row_id.startswith(prefix)), None)


def bitsandbytes_release(version: str | None) -> Any:
    """Simulate NF4 layers as bitsandbytes `version` ran them: releases before 0.43.2 kept every
    layer's input for backward (`SimulatedLinear4bit.keeps_input`), releases before 0.43.0 quantized every
    weight from fp16 (`SimulatedLinear4bit.quantized_from`; so does Lightning's `_Linear4bit._quantize_weight`,
    lightning/fabric/plugins/precision/bitsandbytes.py: `weight.contiguous().to(device="cuda",
    dtype=torch.half)`, whatever the model's dtype). A context manager."""
    from packaging.version import Version

    from autofit.strategies.quantization import SimulatedLinear4bit, keeps_inputs

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(SimulatedLinear4bit, "keeps_input",
                                          version is not None and keeps_inputs(version)))
    if version is not None and Version(version) < Version("0.43.0"):
        stack.enter_context(mock.patch.object(SimulatedLinear4bit, "quantized_from", torch.float16))
    return stack


# Rows quantized without double quantization: litgpt's `--quantize bnb.nf4` is Lightning's `_NF4Linear`,
# `compress_statistics=False` (lightning/fabric/plugins/precision/bitsandbytes.py; `bnb.nf4-dq` is the
# double-quantized one). fsdp_qlora's `Linear4bit` keeps bitsandbytes' default, True.
PLAIN_NF4 = ("litgpt-",)


def nf4_double_quant(row_id: str) -> Any:
    """Count NF4 weights as `row_id`'s source quantized them (`autofit.strategies.quantization.DOUBLE_QUANT`).
    A context manager."""
    from autofit.strategies import quantization

    return mock.patch.object(quantization, "DOUBLE_QUANT", not row_id.startswith(PLAIN_NF4))


def peft_adapters(row_id: str) -> Any:
    """Simulate LoRA's adapters in the dtype `row_id`'s PEFT made them: fsdp_qlora ran PEFT 0.10 (Feb-Mar
    2024), which made them in the base's dtype (bf16; its LoRA rows' adapters are built into the model, as
    `build` does); later releases keep them in fp32 (`autofit.strategies.lora.PEFT_UPCASTS_ADAPTERS`).
    A context manager."""
    from autofit.strategies import lora

    return mock.patch.object(lora, "PEFT_UPCASTS_ADAPTERS", not row_id.startswith("fsdpqlora-"))


def reentrant_checkpointing(on: bool) -> Any:
    """Simulate activation checkpointing in torch's re-entrant mode where the source ran it so
    (`autofit.strategies.checkpointing.REENTRANT`). A context manager."""
    from autofit.strategies import checkpointing

    return mock.patch.object(checkpointing, "REENTRANT", on)


# -- litgpt ---------------------------------------------------------------------------------------------
# A source's LoRA target names -> litgpt's `lora_*` switches (litgpt/lora.py Config).
LITGPT_SWITCHES = {"q": "lora_query", "k": "lora_key", "v": "lora_value", "proj": "lora_projection",
                   "mlp": "lora_mlp", "head": "lora_head"}
LM_HEAD_CHUNK = 128  # litgpt/finetune/lora.py: `logits = model(input_ids, lm_head_chunk_size=128)`


class LitgptStep(nn.Module):
    """litgpt's GPT called as its fine-tuning script calls it, through Lightning Fabric: finetune/lora.py
    chunks the lm head (`lm_head_chunk_size=128`, a list of logit chunks), finetune/full.py does not; and
    Fabric's module wrapper hands back every floating output converted to the default dtype, fp32
    (lightning/fabric/wrappers.py `_FabricModule.forward`: `precision.convert_output(output)`; each
    precision plugin's `convert_output`, bf16-true's `HalfPrecision`, `FSDPPrecision` and
    `BitsandbytesPrecision` alike, `apply_to_collection(..., dst_type=torch.get_default_dtype())`, in
    Lightning 2.1 of the resource tables as in 2.6). So the script's `logits` are fp32 copies of the bf16
    logits, and the loss's log-softmax runs in fp32."""

    def __init__(self, gpt: nn.Module, lm_head_chunk_size: int, previous_step: bool = False):
        super().__init__()
        self.gpt, self.lm_head_chunk_size, self.previous_step = gpt, lm_head_chunk_size, previous_step

    def extra_repr(self) -> str:  # in the repr, so the estimator's cache of simulations tells them apart
        return f"lm_head_chunk_size={self.lm_head_chunk_size}, previous_step={self.previous_step}"

    def forward(self, input_ids: torch.Tensor) -> Any:
        with _previous_step(self, input_ids) if self.previous_step else contextlib.nullcontext():
            if self.lm_head_chunk_size:
                logits = self.gpt(input_ids, lm_head_chunk_size=self.lm_head_chunk_size)
                return [_fabric_output(chunk) for chunk in logits]
            return _fabric_output(self.gpt(input_ids))


@contextlib.contextmanager
def _previous_step(step: LitgptStep, input_ids: torch.Tensor) -> Any:
    """What litgpt's loop still holds of the previous iteration while the model runs the next one, at the
    same shapes (the previous batch as long as this one). Its `fit()` (finetune/lora.py and full.py of
    0.4.0) binds `logits = model(...)` each iteration, so the previous iteration's fp32 logits stay alive
    until the next call returns, and with them its autograd graph. The graph's saved tensors were freed by
    its backward, but not what a custom Function keeps as a plain attribute: bitsandbytes' `MatMul4Bit`
    before 0.43.2 keeps its input (`ctx.tensors = (A, B)`, bitsandbytes/autograd/_functions.py), so each
    quantized layer's input of the previous step is alive too (`SimulatedLinear4bit.keeps_input`). Held
    here as allocations of their sizes, made as the next forward reaches each layer (their sum is the same
    by its end, where the forward peaks) and freed when the model returns."""
    from autofit.strategies.quantization import SimulatedLinear4bit

    batch, tokens = input_ids.shape
    held = [torch.empty(batch, tokens, step.gpt.config.padded_vocab_size, dtype=torch.get_default_dtype(),
                        device=input_ids.device)]
    kept: set[int] = set()

    def hold_input(_layer: nn.Module, args: tuple) -> None:
        storage = args[0].untyped_storage()
        if args[0].requires_grad and id(storage) not in kept:  # as `MatMul4Bit` keeps it: under a grad only
            kept.add(id(storage))
            held.append(torch.empty(storage.nbytes(), dtype=torch.uint8, device=input_ids.device))

    hooks = [layer.register_forward_pre_hook(hold_input) for layer in step.modules()
             if isinstance(layer, SimulatedLinear4bit) and SimulatedLinear4bit.keeps_input]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        held.clear()


def _fabric_output(tensor: torch.Tensor) -> torch.Tensor:
    """What Fabric's `convert_output` makes of a model output (lightning/fabric/plugins/precision/utils.py
    `_convert_fp_tensor`): a floating tensor in the default dtype."""
    return tensor.to(torch.get_default_dtype()) if torch.is_floating_point(tensor) else tensor


def fsdp1_flat_root(model: nn.Module, blocks: str) -> nn.Module:
    """`model` with FSDP1's root unit as it trains: every parameter outside the wrapped blocks (the
    modules under `blocks`) lives in one flat parameter (torch/distributed/fsdp/_flat_param.py
    `FlatParamHandle`), and before each forward the modules get views of it made by one `torch.split`
    (`_get_unflat_views_unaligned`, `_use_unsharded_views`). Autograd then holds each view's gradient
    until the last one arrives (the embedding's, at the end of backward) and concatenates them into the
    flat gradient: the measured excess of FSDP1 over FSDP2 (results/fsdp1-vs-fsdp2-cpu.json), simulated as
    the mechanism it is. Sharding itself is the estimator's (its FSDP formulas); this is the root's
    backward alone."""
    root = [(name, p) for name, p in model.named_parameters() if not name.startswith(blocks + ".")]
    trains = {p.requires_grad for _, p in root}
    if len(trains) != 1:  # one flat parameter trains or not as a whole
        raise ValueError(f"the root unit outside {blocks!r} mixes frozen and trainable parameters")
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for _, p in root]), requires_grad=trains.pop())
    views = []
    for name, p in root:
        path, _, attr = name.rpartition(".")
        del model.get_submodule(path)._parameters[attr]
        views.append((path, attr, tuple(p.shape)))
    model.register_parameter("fsdp1_flat_root", flat)
    model.fsdp1_views = views  # read by the hook from the module it runs on, so a deep copy keeps working
    model.register_forward_pre_hook(_use_unsharded_views)
    _use_unsharded_views(model, ())  # the attributes exist between forwards too, as FSDP1 keeps them
    return model


def _use_unsharded_views(model: nn.Module, args: Any) -> None:
    sizes = [int(torch.Size(shape).numel()) for _, _, shape in model.fsdp1_views]
    for (path, attr, shape), view in zip(model.fsdp1_views, torch.split(model.fsdp1_flat_root, sizes)):
        setattr(model.get_submodule(path), attr, view.view(shape))


def build_litgpt(name: str, seq_len: int, lora: dict | None, fsdp1: bool = False,
                 previous_step: bool = False) -> nn.Module:
    """litgpt's model `name` (a litgpt config name or a hub name) as the script builds it: LoRA on the
    row's targets with its rank, alpha and dropout and only LoRA trainable (`mark_only_lora_as_trainable`),
    every weight in bf16 (`--precision bf16-true`), `max_seq_length` set to the longest sample (fit()).
    QLoRA rows quantize the frozen linear layers under it, as Lightning's `BitsandbytesPrecision` replaces
    every `nn.Linear` (the head's too; autofit's NF4 simulation does the same where a model names no
    output head: litgpt's GPT has no `get_output_embeddings`). `fsdp1`: the root unit as FSDP1 trains it
    (`fsdp1_flat_root`). `previous_step`: the previous iteration's logits and kept inputs held through the
    forward, as litgpt's loop holds them (`_previous_step`)."""
    import litgpt.lora as litgpt_lora
    import litgpt.model as litgpt_model

    if lora:
        switches = {switch: False for switch in LITGPT_SWITCHES.values()}
        switches.update({LITGPT_SWITCHES[t]: True for t in lora["targets"]})
        config = litgpt_lora.Config.from_name(name, lora_r=lora["rank"], lora_alpha=lora["alpha"],
                                              lora_dropout=lora["dropout"], **switches)
        gpt = litgpt_lora.GPT(config)
        litgpt_lora.mark_only_lora_as_trainable(gpt)
    else:
        gpt = litgpt_model.GPT(litgpt_model.Config.from_name(name))
    gpt.max_seq_length = seq_len
    step = LitgptStep(gpt.to(torch.bfloat16), LM_HEAD_CHUNK if lora else 0, previous_step)
    # litgpt's multi-GPU runs are Lightning's FSDPStrategy, FSDP1 wrapping each Block (finetune/full.py)
    return fsdp1_flat_root(step, "gpt.transformer.h") if fsdp1 else step


def litgpt_lora_loss(logits: list, batch: tuple) -> torch.Tensor:
    """litgpt/finetune/lora.py's training loss: the last logit chunk shifted, then `chunked_cross_entropy`
    over the chunks (bf16 logits, no upcast)."""
    from litgpt.utils import chunked_cross_entropy

    logits[-1] = logits[-1][..., :-1, :]
    return chunked_cross_entropy(logits, batch[1][..., 1:])


def litgpt_full_loss(logits: torch.Tensor, batch: tuple) -> torch.Tensor:
    """litgpt/finetune/full.py's training loss: `chunked_cross_entropy` over the shifted full logits."""
    from litgpt.utils import chunked_cross_entropy

    return chunked_cross_entropy(logits[..., :-1, :], batch[1][..., 1:])


# -- logits upcast to fp32 in the model: transformers 4.38, torchtune -----------------------------------
@functools.lru_cache(maxsize=None)
def upcast_logits(class_name: str) -> type:
    """The transformers `*ForCausalLM` class of `class_name`'s config whose forward returns fp32 logits,
    the bf16 ones freed, and with labels the loss of transformers 4.38 (src/transformers/models/llama/
    modeling_llama.py @ 002272831fba, LlamaForCausalLM.forward: `logits = self.lm_head(hidden_states);
    logits = logits.float()`, then `shift_logits = logits[..., :-1, :].contiguous()` and
    `CrossEntropyLoss()` on the flattened shift). The caller's `output` holds the fp32 logits through
    backward, as fsdp_qlora's train.py holds `output`. torchtune's TransformerDecoder upcasts the same
    way (`output = self.output(h).float()`); its recipe's loss is `torchtune_loss`. Today's transformers
    keeps the bf16 logits and upcasts inside the loss, without the shifted copy."""
    import transformers
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base = getattr(transformers, class_name.replace("Config", "ForCausalLM"))

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = nn.CrossEntropyLoss()(shift_logits.view(-1, self.config.vocab_size), shift_labels.view(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    return type(f"{base.__name__}UpcastLogits", (base,), {"forward": forward, "__module__": __name__})


def torchtune_loss(output: Any, batch: tuple) -> torch.Tensor:
    """torchtune's LoRA recipe loss (recipes/lora_finetune_single_device.py @ 0097adab, train()):
    `logits = logits[..., :-1, :].contiguous()`, `logits = logits.transpose(1, 2)`, `CrossEntropyLoss`
    on the fp32 logits its decoder returned (`upcast_logits`)."""
    logits = output.logits[..., :-1, :].contiguous().transpose(1, 2)
    return nn.functional.cross_entropy(logits, batch[1][..., 1:].contiguous())


# -- torchtune's model: a RoPE cache per layer, a template layer at build time ----------------------------
TORCHTUNE_MAX_SEQ_LEN = 4096  # llama2_7b's `max_seq_len` (torchtune/models/llama2/_model_builders.py)


def rope_cache_bytes(head_dim: int, max_seq_len: int = TORCHTUNE_MAX_SEQ_LEN) -> int:
    """Bytes of one torchtune `RotaryPositionalEmbeddings` (torchtune/modules/position_embeddings.py):
    `theta` (head_dim / 2 fp32, `.float()`) and `cache` ([max_seq_len, head_dim / 2, 2] fp32, cos and sin),
    both buffers."""
    return 4 * (head_dim // 2) * (1 + 2 * max_seq_len)


def torchtune_rope_caches(model: nn.Module, head_dim: int) -> nn.Module:
    """`model` (a transformers causal LM) with a torchtune RoPE cache as a buffer of each decoder layer:
    torchtune's builder gives the template layer's attention one `RotaryPositionalEmbeddings` and
    `TransformerDecoder` deep-copies that layer `num_layers` times (torchtune/modules/transformer.py
    `_get_clones`), so every layer holds its own cache. transformers computes cos / sin per forward."""
    for layer in model.get_decoder().layers:
        device = next(layer.parameters()).device
        cache = torch.empty(rope_cache_bytes(head_dim) // 4, dtype=torch.float32, device=device)
        layer.register_buffer("torchtune_rope", cache, persistent=False)
    return model


def torchtune_template_bytes(block_params: int, head_dim: int) -> int:
    """What torchtune's builder holds at its peak beside the model it returns: the template layer (bf16
    weights and adapters, its RoPE cache) that `TransformerDecoder` deep-copies `num_layers` times
    (`_get_clones`), freed when the builder returns. Its "peak memory allocation" after model init
    includes it."""
    return 2 * block_params + rope_cache_bytes(head_dim)


# -- LoRA adapters in the base's dtype: PEFT <= 0.10, torchtune ------------------------------------------
def bf16_adapters(model: nn.Module, lora: dict, targets: list[str]) -> nn.Module:
    """`model` with LoRA adapters in its own dtype (bf16), as PEFT made them before 0.11 (adapters moved
    to the base weight's device and dtype, `_move_adapter_to_device_of_base_layer`; fp32 upcasting by
    default came with huggingface/peft#1706, May 2024) and as torchtune builds them (every parameter in
    the recipe's `dtype: bf16`). Only the adapters train; their gradients and AdamW states are bf16 too.
    autofit's own LoRA rung runs today's PEFT (fp32 adapters), which its formulas count."""
    import peft

    config = peft.LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora.get("dropout") or 0.0,
                             target_modules=targets)
    dtype = next(model.parameters()).dtype
    # PEFT leaves adapters built on the meta device (the estimator's build) in fp32: cast them as PEFT 0.10
    # cast them on a real device
    return peft.get_peft_model(model, config, autocast_adapter_dtype=False).to(dtype)
