"""The training configuration a plan chooses: one frozen, JSON-serialisable value.

Each knob is declared with what it buys and what it costs. `micro_batch_size * grad_accum_steps *
num_gpus` is the global batch, always.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from autofit.errors import UsageError


class Precision(str, enum.Enum):
    """Compute precision of the forward/backward pass (weights and optimizer stay fp32)."""

    FP32 = "fp32"
    BF16 = "bf16"  # autocast: ~half activation memory, faster matmuls on tensor cores
    FP16 = "fp16"  # autocast + GradScaler, where bf16 is unsupported (pre-Ampere GPUs)


class Optimizer(str, enum.Enum):
    """Optimizer implementation; all but ADAMW shrink optimizer-state memory."""

    ADAMW = "adamw"  # torch AdamW: 8 bytes of state per parameter
    ADAMW8BIT = "adamw8bit"  # bitsandbytes: 2 bytes of state per parameter
    PAGED_ADAMW8BIT = "paged_adamw8bit"  # bitsandbytes, states in unified memory paged out under pressure
    ADAFACTOR = "adafactor"  # factored second moment, no first moment: ~O(rows + cols) per matrix
    USER = "user"  # the optimizer the user gave, kept as is


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the decision tree. Unknown keys are rejected by `from_dict`."""

    precision: str = Precision.FP32.value  # bf16/fp16 halve activations; costs numerics (tier 1)
    attention: str = "default"  # "sdpa"/"flash_attention_2": O(n) attention memory, no cost; "eager"; "default" = model's own
    checkpointing: str = "none"  # "every_k": recompute every k-th block, "full": all blocks; saves activations, costs ~20-35% compute
    micro_batch_size: int = 1  # samples per forward/backward on one device; activations scale with it
    grad_accum_steps: int = 1  # micro-batches summed per optimizer step; keeps the global batch exact
    optimizer: str = Optimizer.ADAMW.value  # see Optimizer
    zero_stage: int = 0  # DeepSpeed ZeRO stage (0 = off): shards states over GPUs, costs communication
    # FSDP2 (torch-native sharding, the alternative to ZeRO; not combined with it): "shard_grad_op" shards
    # grads + optimizer states (~ZeRO-2), "full_shard" parameters too (~ZeRO-3). Buys per-GPU memory
    # 1/num_gpus of the sharded states; costs an all-gather per block (full_shard: twice per step).
    fsdp: str = "none"
    offload: str = "none"  # "none" | "cpu" | "nvme": model states leave the GPU, 2-10x slower
    quantization: str = "none"  # "none" | "nf4" | "int8" base weights (with LoRA, tier 2)
    lora: int = 0  # LoRA rank (0 = full fine-tuning); trains adapters only (tier 2)
    num_gpus: int = 1  # data-parallel ranks

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.num_gpus

    def replace(self, **changes: Any) -> "Config":
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """Inverse of `to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(
                f"Unknown configuration keys {unknown}; known keys are {sorted(known)}. "
                "Was the plan written by a newer autofit? Upgrade autofit or remove the keys."
            )
        return cls(**data)

    def describe(self) -> str:
        """One line naming the knobs that differ from the defaults, e.g. "bf16, ckpt=full, mb=4x2"."""
        parts = [self.precision]
        if self.attention != "default":
            parts.append(f"attn={self.attention}")
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing}")
        parts.append(f"mb={self.micro_batch_size}x{self.grad_accum_steps}")
        parts.append(f"opt={self.optimizer}")
        if self.zero_stage:
            parts.append(f"zero={self.zero_stage}")
        if self.fsdp != "none":
            parts.append(f"fsdp={self.fsdp}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.quantization != "none":
            parts.append(f"quant={self.quantization}")
        if self.lora:
            parts.append(f"lora=r{self.lora}")
        if self.num_gpus > 1:
            parts.append(f"gpus={self.num_gpus}")
        return ", ".join(parts)
