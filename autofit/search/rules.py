"""The rules between knobs: which combinations cannot run, and why. One table, applied once where the
space is built (`autofit.search.space`); every combination a rule excludes is recorded with its reason
and never probed.

A rule looks at a candidate's knobs and its `Target` and returns the reason it cannot run, or None.
`Rule.knobs` names the fields the rule reads, so an excluded combination is recorded once per
distinct value of those fields, not once per level.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from autofit.config import Attention, Config, Engine, Offload, Optimizer, Precision, Quantization, Sharding

if TYPE_CHECKING:
    from autofit.spec.target import Target


@dataclasses.dataclass(frozen=True)
class Rule:
    """A combination that cannot run: `check(config, target)` returns why, or None when it can."""

    name: str
    knobs: tuple[str, ...]  # the fields the rule reads
    check: Callable[[Config, "Target"], str | None]


def _offload_needs_engine(c: Config, t: "Target") -> str | None:
    if c.offloads and c.engine is Engine.TORCH:
        return (f"offload={c.offload.value} moves states through an engine: it needs ZeRO or FSDP2 sharding "
                "(on one GPU too)")
    return None


def _nvme_needs_zero3(c: Config, t: "Target") -> str | None:
    if c.offload is Offload.NVME and c.sharding is not Sharding.ZERO3:
        return (f"NVMe offload needs DeepSpeed ZeRO-3; with {c.sharding.value} DeepSpeed offloads to the CPU "
                "instead and FSDP2 offloads to the CPU only")
    return None


def _zero_offload_optimizer(c: Config, t: "Target") -> str | None:
    if c.offloads and c.engine is Engine.DEEPSPEED and c.optimizer is not Optimizer.ADAMW:
        return (f"ZeRO-Offload steps on the host with DeepSpeed's CPU Adam; DeepSpeed refuses "
                f"optimizer={c.optimizer.value} there")
    return None


def _offload_eight_bit(c: Config, t: "Target") -> str | None:
    if c.offloads and c.optimizer.eight_bit:
        return f"{c.optimizer.value} steps on the GPU; offloaded states step on the host"
    return None


def _fsdp_adafactor(c: Config, t: "Target") -> str | None:
    if c.engine is Engine.FSDP and c.optimizer is Optimizer.ADAFACTOR:
        # measured on 2 CPU ranks (torch 2.13): "aten.pow_.Scalar: in-place operations that require
        # placement changes are not supported" in torch.optim.Adafactor's factored row/column norms
        return "torch's Adafactor cannot step FSDP2's sharded (DTensor) parameters: its in-place norms fail"
    return None


def _quantization_needs_lora(c: Config, t: "Target") -> str | None:
    if c.quantization is not Quantization.NONE and not c.lora:
        return (f"quantization={c.quantization.value} freezes the base weights: without LoRA adapters "
                "nothing is trained")
    return None


def _quantization_unsharded(c: Config, t: "Target") -> str | None:
    if c.quantization is not Quantization.NONE and c.sharding is not Sharding.NONE:
        return (f"bitsandbytes {c.quantization.value} base weights are not sharded by ZeRO/FSDP2 here: "
                "QLoRA runs on one rank, or as plain data parallelism")
    return None


def _flash_needs_half(c: Config, t: "Target") -> str | None:
    if c.attention is Attention.FLASH_ATTENTION_2 and c.precision is Precision.FP32:
        return "flash-attention kernels run in fp16/bf16 only, not fp32"
    return None


def _one_rank_shards_nothing(c: Config, t: "Target") -> str | None:
    if c.sharding is not Sharding.NONE and c.num_gpus < 2 and not c.offloads:
        return (f"{c.sharding.value} over one rank shards nothing; on one GPU an engine only serves the "
                "offload rung")
    return None


RULES = (
    Rule("offload needs an engine", ("offload", "sharding"), _offload_needs_engine),
    Rule("NVMe needs ZeRO-3", ("offload", "sharding"), _nvme_needs_zero3),
    Rule("ZeRO-Offload steps with CPU Adam", ("offload", "sharding", "optimizer"), _zero_offload_optimizer),
    Rule("8-bit states cannot step on the host", ("offload", "optimizer"), _offload_eight_bit),
    Rule("Adafactor cannot step FSDP2 shards", ("sharding", "optimizer"), _fsdp_adafactor),
    Rule("quantization needs LoRA", ("quantization", "lora"), _quantization_needs_lora),
    Rule("quantized weights are not sharded", ("quantization", "sharding"), _quantization_unsharded),
    Rule("flash-attention needs half precision", ("attention", "precision"), _flash_needs_half),
    Rule("one rank shards nothing", ("sharding", "num_gpus", "offload"), _one_rank_shards_nothing),
)


def violation(config: Config, target: "Target") -> tuple[Rule, str] | None:
    """The first rule `config` breaks on `target`, with its reason; None when it can run."""
    for rule in RULES:
        reason = rule.check(config, target)
        if reason:
            return rule, reason
    return None
