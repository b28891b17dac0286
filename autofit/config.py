"""The training configuration a plan chooses: one frozen, JSON-serialisable value, and a type per knob.

Each knob is a str-enum (JSON-serialisable as it is) declared with what it buys and what it costs; the
`Config` checks every value when it is built, so `Config(precision="bf61")` raises `UsageError` naming
the allowed values. Code outside a knob's strategy reads derived properties (`config.engine`,
`config.shards_parameters`, `config.half_precision`, ...), never raw strings.
`micro_batch_size * grad_accum_steps * num_gpus` is the global batch, always.

Which knobs may combine is not the Config's business: the rules between knobs live in one table
(`autofit.search.rules`), applied once where the search space is built.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, Mapping

from autofit.errors import UsageError, did_you_mean


class Knob(str, enum.Enum):
    """A closed choice: subclassing str makes every value JSON-serialisable as it is."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)  # messages and a Config's repr read "precision='bf16'"

    @classmethod
    def parse(cls, value: Any, name: str) -> "Knob":
        """`value` as a member of this knob, or `UsageError` naming the value and the allowed ones."""
        if isinstance(value, cls):
            return value  # already checked: the search builds many configs from members
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise UsageError(f"{name}={value!r} is not known{did_you_mean(value, (m.value for m in cls))}; "
                             f"use one of {allowed}.") from None


class Precision(Knob):
    """Precision of the forward/backward pass; under autocast (bf16, fp16) weights and optimizer states
    stay fp32, under pure bf16 they are bf16 too."""

    FP32 = "fp32"  # the baseline
    BF16 = "bf16"  # autocast: ~half activation memory, faster matmuls on tensor cores; numerics (tier 1)
    FP16 = "fp16"  # autocast + GradScaler, where bf16 is unsupported (pre-Ampere GPUs); numerics (tier 1)
    # Weights, gradients and optimizer states in bf16, no autocast: halves the model states mixed precision
    # keeps in fp32 (16 -> 8 bytes per parameter with AdamW); costs update precision (tier 1).
    PURE_BF16 = "pure_bf16"

    @property
    def half(self) -> bool:
        """Whether the forward/backward computes in a 16-bit type."""
        return self is not Precision.FP32

    @property
    def pure(self) -> bool:
        """Whether the weights themselves (and so gradients and optimizer states) are 16-bit."""
        return self is Precision.PURE_BF16


class Attention(Knob):
    """Attention implementation of a Hugging Face model (`attn_implementation`)."""

    DEFAULT = "default"  # the model's own (every non-Hugging Face model)
    SDPA = "sdpa"  # fused scaled-dot-product attention: O(n) attention memory, no cost
    FLASH_ATTENTION_2 = "flash_attention_2"  # flash-attention kernels: O(n), fp16/bf16 only
    EAGER = "eager"  # materialises the attention matrix: O(n^2), where nothing fused is supported

    @property
    def fused(self) -> bool:
        """Whether attention memory is linear in the sequence length."""
        return self in (Attention.SDPA, Attention.FLASH_ATTENTION_2)


class Checkpointing(Knob):
    """Activation checkpointing mode; `Config.checkpoint_every` is its frequency."""

    NONE = "none"  # keep every activation
    # Every block, op by op: matmul and attention outputs are kept, pointwise ops (activations, norms,
    # dropout) recomputed; saves their share of the activations for almost no extra FLOPs.
    OPS = "ops"
    EVERY_K = "every_k"  # recompute every k-th block (selective): saves ~1/k of the full saving
    FULL = "full"  # recompute every block: 50-70% of activation memory for ~20-35% more compute


class ActivationOffload(Knob):
    """Where the tensors autograd saves for backward live between forward and backward."""

    NONE = "none"  # on the device
    # Pinned host memory (`torch.autograd.graph.save_on_cpu`): the activations leave the GPU (with full
    # checkpointing: the blocks' inputs), each copied out in forward and back in backward over PCIe.
    CPU = "cpu"


class OptimizerStep(Knob):
    """When the optimizer updates the weights."""

    AFTER_BACKWARD = "after_backward"  # one step over all gradients once backward is done (the baseline)
    # Each parameter steps in a post-accumulate-grad hook as soon as its gradient is made, which is then
    # freed: the gradients never exist for the whole model at once. Same math only at accumulation 1 with
    # no clipping across parameters (rules); costs the optimizer's multi-tensor kernels.
    IN_BACKWARD = "in_backward"


class Loss(Knob):
    """How a causal language model's cross-entropy is computed from its output head."""

    FULL = "full"  # the model's own: logits of every token at once (gigabytes for a 128k vocabulary)
    # The head and the cross-entropy run chunk by chunk, each chunk recomputed in backward: only one
    # chunk's logits are ever live. Costs one more head matmul; same math (tier 0).
    CHUNKED = "chunked"


class Optimizer(Knob):
    """Optimizer implementation; all but ADAMW shrink optimizer-state memory."""

    ADAMW = "adamw"  # torch AdamW: 8 bytes of state per parameter
    ADAMW8BIT = "adamw8bit"  # bitsandbytes: 2 bytes of state per parameter (tier 1)
    PAGED_ADAMW8BIT = "paged_adamw8bit"  # bitsandbytes, states in unified memory paged out under pressure
    ADAFACTOR = "adafactor"  # factored second moment, no first moment: ~O(rows + cols) per matrix
    USER = "user"  # the optimizer the user gave, kept as is

    @property
    def eight_bit(self) -> bool:
        """Whether states are bitsandbytes 8-bit (blockwise quantized, 2 bytes per parameter)."""
        return self in (Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT)


class Engine(Knob):
    """Who runs backward and the optimizer step across ranks."""

    TORCH = "torch"  # plain torch (DDP over several ranks): every rank holds every state
    DEEPSPEED = "deepspeed"  # DeepSpeed ZeRO
    FSDP = "fsdp"  # torch-native FSDP2 (`fully_shard`)


class Sharding(Knob):
    """What is sharded over the data-parallel ranks, and by which engine (ZeRO or FSDP2, never both).

    Buys per-rank memory: 1/num_gpus of the sharded states. Costs communication; same math (tier 0).
    """

    NONE = "none"
    ZERO1 = "zero1"  # DeepSpeed: optimizer states
    ZERO2 = "zero2"  # DeepSpeed: + gradients
    ZERO3 = "zero3"  # DeepSpeed: + parameters (gathered per layer in forward and backward)
    FSDP_GRAD_OP = "fsdp_grad_op"  # FSDP2, reshard_after_forward=False: gradients + optimizer states (~ZeRO-2)
    FSDP_FULL = "fsdp_full"  # FSDP2, reshard_after_forward=True: + parameters (~ZeRO-3)
    # Several nodes (`Config.nodes`): the per-layer gathers stay on a node's own links.
    # FSDP2 on a 2-D mesh (HSDP): full_shard within each node, replicated across nodes. Buys: no gather
    # crosses a node; costs: each GPU holds 1/gpus-per-node of the states, not 1/num_gpus.
    FSDP_HYBRID = "fsdp_hybrid"
    # DeepSpeed ZeRO++ hpZ: ZeRO-3 over every GPU, plus a secondary copy of the 16-bit weights partitioned
    # within each node, which the backward gathers from. Buys: the backward's gathers stay in the node;
    # costs: that copy, 1/gpus-per-node of the 16-bit weights per GPU.
    ZERO3_HPZ = "zero3_hpz"
    # ZeRO++ whole (hpZ, qwZ, qgZ): the forward gathers int8 weights and gradients cross nodes as int4,
    # master weights staying fp32. Buys: a half and a quarter of the cross-node bytes; costs numerics (tier 1).
    ZERO3_HPZ_QUANTIZED = "zero3_hpz_quantized"

    @property
    def engine(self) -> Engine:
        """The engine that does the sharding."""
        if self is Sharding.NONE:
            return Engine.TORCH
        return Engine.FSDP if self.value.startswith("fsdp") else Engine.DEEPSPEED

    @property
    def stage(self) -> int:
        """ZeRO-paper stage of what is sharded: 0 nothing, 1 optimizer states, 2 + gradients, 3 + parameters."""
        return _STAGES[self]

    @property
    def hierarchical(self) -> bool:
        """Whether the sharding follows the nodes (a node's GPUs shard, or hold a secondary partition)."""
        return self in (Sharding.FSDP_HYBRID, Sharding.ZERO3_HPZ, Sharding.ZERO3_HPZ_QUANTIZED)

    @property
    def reshards_after_forward(self) -> bool:
        """Whether the parameters gathered for a block's forward are freed after it (gathered again in
        backward): ZeRO-3 and FSDP2's full and hybrid sharding."""
        return self.stage >= 3


_STAGES = {Sharding.NONE: 0, Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3,
           Sharding.FSDP_GRAD_OP: 2, Sharding.FSDP_FULL: 3, Sharding.FSDP_HYBRID: 3, Sharding.ZERO3_HPZ: 3,
           Sharding.ZERO3_HPZ_QUANTIZED: 3}


class Offload(Knob):
    """Where model states live when they leave the GPU (through the sharding engine)."""

    NONE = "none"
    CPU = "cpu"  # optimizer states (stage 3 / FSDP2: parameters too) to host memory; PCIe-bound, 2-10x slower
    NVME = "nvme"  # as cpu, to a folder on a fast local disk (DeepSpeed ZeRO-3)


class Quantization(Knob):
    """Storage of the frozen base weights (with LoRA adapters; tier 2)."""

    NONE = "none"
    INT8 = "int8"  # LLM.int8: 1 byte per weight
    NF4 = "nf4"  # 4-bit NormalFloat, double quantization: ~0.5 byte per weight


class Allocator(Knob):
    """How the CUDA caching allocator takes memory from the driver (`PYTORCH_CUDA_ALLOC_CONF`)."""

    DEFAULT = "default"  # PyTorch's default: one cudaMalloc segment per request size class, kept cached
    # One segment per pool that grows by mapping pages (2 MiB small pool, 20 MiB large): freed blocks merge
    # across what would have been separate segments, and before an OOM every free page is unmapped, so the
    # allocator's reserve stops costing a fit. Same math (tier 0); costs a millisecond mapping when the
    # segment grows, and CUDA tensors cannot be shared with another process (IPC).
    EXPANDABLE = "expandable_segments"


# The names `allow=` (and `--allow`) takes for the knobs' exactness tiers -> the tier each opens; tier 0 (same
# math) is always open. The first name of a tier is the one messages suggest (`allow={'numerics'}`).
ALLOW_NAMES = {"numerics": 1, "lora": 2, "quantization": 2, "qlora": 2}  # qlora: LoRA over quantized weights
# What people type for a tier-1 knob's value, which `allow` does not take: its error says "numerics" opens them.
NUMERICS_WORDS = frozenset({"bf16", "fp16", "half", "mixed", "amp", "pure_bf16", "8bit", "adamw8bit", "adafactor"})


def tier_name(tier: int) -> str:
    """The name `allow` takes for exactness tier `tier` (1 or 2) in messages: "numerics", "lora"."""
    return next(name for name, opens in ALLOW_NAMES.items() if opens == tier)


# Knobs added by strategies outside this module (a plug-in technique): name -> (type, default).
_EXTENSIONS: dict[str, tuple[type[Knob], Knob]] = {}
_SIZES = frozenset({"micro_batch_size", "grad_accum_steps"})  # `Config.replace`'s quick copy


def register_knob(name: str, kind: type[Knob], default: Knob) -> None:
    """Declare a knob that a strategy outside autofit's own adds (kept in `Config.extras`)."""
    if name in {f.name for f in dataclasses.fields(Config)}:
        raise ValueError(f"knob {name!r} is a Config field already")
    _EXTENSIONS[name] = (kind, kind(default))


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the decision tree, validated when built. Unknown keys are rejected by `from_dict`."""

    precision: Precision = Precision.FP32  # bf16/fp16 halve activations; costs numerics (tier 1)
    attention: Attention = Attention.DEFAULT  # fused: O(n) attention memory at no cost
    checkpointing: Checkpointing = Checkpointing.NONE  # saves activations, costs recomputation
    checkpoint_every: int = 1  # k of EVERY_K (>= 2): every k-th block is recomputed; 1 otherwise
    micro_batch_size: int = 1  # samples per forward/backward on one device; activations scale with it
    grad_accum_steps: int = 1  # micro-batches summed per optimizer step; keeps the global batch exact
    optimizer: Optimizer = Optimizer.ADAMW  # see Optimizer
    sharding: Sharding = Sharding.NONE  # see Sharding
    offload: Offload = Offload.NONE  # model states leave the GPU: PCIe traffic, 2-10x slower
    quantization: Quantization = Quantization.NONE  # 4/8-bit frozen base weights (with LoRA, tier 2)
    lora: int = 0  # LoRA rank (0 = full fine-tuning); trains adapters only (tier 2)
    num_gpus: int = 1  # data-parallel ranks, over every node
    nodes: int = 1  # machines the ranks span, num_gpus // nodes each; hierarchical sharding shards within one
    activation_offload: ActivationOffload = ActivationOffload.NONE  # saved activations to host: PCIe traffic
    optimizer_step: OptimizerStep = OptimizerStep.AFTER_BACKWARD  # in backward: no whole-model gradients
    loss: Loss = Loss.FULL  # chunked: one chunk of logits live at a time, one more head matmul
    allocator: Allocator = Allocator.DEFAULT  # expandable segments: little reserve beyond allocated bytes, CUDA only
    extras: tuple[tuple[str, str], ...] = ()  # knobs of plug-in strategies (`register_knob`), sorted by name

    _KNOBS: ClassVar[dict[str, type[Knob]]] = {
        "precision": Precision, "attention": Attention, "checkpointing": Checkpointing,
        "optimizer": Optimizer, "sharding": Sharding, "offload": Offload, "quantization": Quantization,
        "activation_offload": ActivationOffload, "optimizer_step": OptimizerStep, "loss": Loss,
        "allocator": Allocator}
    _COUNTS: ClassVar[dict[str, int]] = {  # integer knob -> its minimum
        "checkpoint_every": 1, "micro_batch_size": 1, "grad_accum_steps": 1, "lora": 0, "num_gpus": 1,
        "nodes": 1}

    def __post_init__(self) -> None:
        for name, kind in self._KNOBS.items():
            object.__setattr__(self, name, kind.parse(getattr(self, name), name))
        for name, minimum in self._COUNTS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise UsageError(f"{name} must be an integer >= {minimum}, but got {value!r}.")
        every, mode = self.checkpoint_every, self.checkpointing
        if (mode is Checkpointing.EVERY_K) != (every >= 2):
            raise UsageError(f"checkpointing={mode.value!r} with checkpoint_every={every}: every_k needs "
                             "checkpoint_every >= 2 (every k-th block), and the other modes take 1.")
        if self.num_gpus % self.nodes:
            raise UsageError(f"num_gpus={self.num_gpus} over nodes={self.nodes}: every node runs as many ranks, so "
                             "num_gpus must be a multiple of nodes (nodes x GPUs per node).")
        object.__setattr__(self, "extras", _checked_extras(self.extras))

    # -- derived facts: what code outside a knob's strategy reads --------------------------------------
    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.num_gpus

    @property
    def half_precision(self) -> bool:
        """Whether the forward/backward computes in 16 bits."""
        return self.precision.half

    @property
    def engine(self) -> Engine:
        """The engine that runs backward and the optimizer step (torch, DeepSpeed or FSDP2)."""
        return self.sharding.engine

    @property
    def zero_stage(self) -> int:
        """DeepSpeed ZeRO stage (0 when DeepSpeed is not the engine)."""
        return self.sharding.stage if self.engine is Engine.DEEPSPEED else 0

    @property
    def gpus_per_node(self) -> int:
        """Ranks on each node."""
        return self.num_gpus // self.nodes

    @property
    def shard_ranks(self) -> int:
        """Ranks each sharded state is split over: one node's under hybrid FSDP2 (replicated across nodes),
        every rank otherwise (ZeRO++ hpZ's primary partitions included)."""
        return self.gpus_per_node if self.sharding is Sharding.FSDP_HYBRID else self.num_gpus

    @property
    def shards_optimizer(self) -> bool:
        """Optimizer states are split over the ranks."""
        return self.sharding.stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """Gradients are split over the ranks."""
        return self.sharding.stage >= 2

    @property
    def shards_parameters(self) -> bool:
        """Parameters are split over the ranks (gathered per block when used)."""
        return self.sharding.stage >= 3

    @property
    def needs_sync_each_micro_batch(self) -> bool:
        """Whether the gradients must be reduced on every micro-batch, as autofit's loop does, to keep the
        measured memory: FSDP2 with accumulation. A loop that defers the reduce to the last micro-batch
        (accelerate's `accumulate()`, the Trainer) keeps the whole model's gradients unsharded until then."""
        return self.engine is Engine.FSDP and self.grad_accum_steps > 1

    @property
    def offloads(self) -> bool:
        """Model states leave the device."""
        return self.offload is not Offload.NONE

    @property
    def adapters(self) -> bool:
        """Only LoRA adapters train (the base weights are frozen, maybe quantized)."""
        return self.lora > 0 or self.quantization is not Quantization.NONE

    @property
    def checkpointed_share(self) -> float:
        """Share of the blocks whose activations are (wholly or op by op) recomputed: 0, 1/k, or 1."""
        if self.checkpointing is Checkpointing.NONE:
            return 0.0
        return 1.0 / self.checkpoint_every

    @property
    def recomputed_share(self) -> float:
        """Share of the forward's matmul FLOPs run again in backward: 0, 1/k, or 1 (op-level checkpointing
        recomputes pointwise ops only: 0)."""
        return 0.0 if self.checkpointing is Checkpointing.OPS else self.checkpointed_share

    @property
    def pure_bf16(self) -> bool:
        """Whether weights, gradients and optimizer states are bf16 (no fp32 copy anywhere)."""
        return self.precision.pure

    @property
    def steps_in_backward(self) -> bool:
        """Whether each parameter steps during backward (no whole-model gradients)."""
        return self.optimizer_step is OptimizerStep.IN_BACKWARD

    @property
    def offloads_activations(self) -> bool:
        """Whether the tensors saved for backward leave the device."""
        return self.activation_offload is not ActivationOffload.NONE

    # -- values ----------------------------------------------------------------------------------------
    def knob(self, name: str) -> Any:
        """The value of knob `name`: a field, or a plug-in strategy's knob (its default when unset)."""
        if name in _EXTENSIONS:
            kind, default = _EXTENSIONS[name]
            return kind(dict(self.extras).get(name, default))
        return getattr(self, name)

    def replace(self, **changes: Any) -> "Config":
        """A copy with `changes` applied (fields or plug-in knobs)."""
        if changes.keys() <= _SIZES and all(type(v) is int and v >= 1 for v in changes.values()):
            return self._sized(changes)  # a micro-batch and its accumulation: nothing else to check
        plugin = {k: v for k, v in changes.items() if k in _EXTENSIONS}
        if plugin:
            merged = {**dict(self.extras), **{k: str(_EXTENSIONS[k][0].parse(v, k)) for k, v in plugin.items()}}
            changes = {k: v for k, v in changes.items() if k not in plugin}
            changes["extras"] = tuple(sorted(merged.items()))
        return dataclasses.replace(self, **changes)

    def _sized(self, sizes: dict[str, int]) -> "Config":
        """A copy at other `sizes` (`_SIZES`, checked positive integers): what `__post_init__` checks of the
        rest holds already, and a plan makes thousands of these."""
        copy = object.__new__(Config)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(sizes)
        return copy

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (plug-in knobs flattened beside the fields)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extras"}
        data = {k: v.value if isinstance(v, Knob) else v for k, v in data.items()}
        if self.nodes == 1:  # one node: as plans were written before several could be planned
            del data["nodes"]
        return {**data, **dict(self.extras)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        """Inverse of `to_dict`; reads plans written by autofit 0.1 too (`zero_stage`/`fsdp` fields,
        "every_2" checkpointing). Unknown keys are an error naming them."""
        data = _upgraded(dict(data))
        known = {f.name for f in dataclasses.fields(cls)} - {"extras"}
        unknown = sorted(set(data) - known - set(_EXTENSIONS))
        if unknown:
            raise UsageError(
                f"Unknown configuration keys {unknown}; known keys are {sorted(known | set(_EXTENSIONS))}. "
                "Was the plan written by a newer autofit, or with a plug-in strategy not imported here? "
                "Upgrade autofit, import the plug-in, or remove the keys."
            )
        extras = tuple(sorted((k, str(v)) for k, v in data.items() if k in _EXTENSIONS))
        return cls(**{k: v for k, v in data.items() if k in known}, extras=extras)

    def describe(self) -> str:
        """One line naming the knobs that differ from the defaults, e.g. "bf16, ckpt=full, mb=4x2"."""
        parts = [self.precision.value]
        if self.attention is not Attention.DEFAULT:
            parts.append(f"attn={self.attention.value}")
        if self.checkpointing is Checkpointing.EVERY_K:
            parts.append(f"ckpt=every_{self.checkpoint_every}")
        elif self.checkpointing is not Checkpointing.NONE:
            parts.append(f"ckpt={self.checkpointing.value}")
        parts.append(f"mb={self.micro_batch_size}x{self.grad_accum_steps}")
        parts.append(f"opt={self.optimizer.value}")
        for name in ("sharding", "offload", "quantization", "activation_offload", "optimizer_step", "loss",
                     "allocator"):
            value = getattr(self, name)
            if value is not next(iter(type(value))):  # the first member of a knob is "no change"
                parts.append(f"{_SHORT[name]}={value.value}")
        if self.lora:
            parts.append(f"lora=r{self.lora}")
        for name, value in self.extras:
            if value != _EXTENSIONS[name][1].value:
                parts.append(f"{name}={value}")
        if self.nodes > 1:
            parts.append(f"gpus={self.nodes}x{self.gpus_per_node}")
        elif self.num_gpus > 1:
            parts.append(f"gpus={self.num_gpus}")
        return ", ".join(parts)


_SHORT = {"sharding": "shard", "offload": "offload", "quantization": "quant", "activation_offload": "act_offload",
          "optimizer_step": "step", "loss": "loss", "allocator": "alloc"}


def _checked_extras(extras: Any) -> tuple[tuple[str, str], ...]:
    pairs = dict(extras)
    unknown = sorted(set(pairs) - set(_EXTENSIONS))
    if unknown:
        raise UsageError(f"Unknown plug-in knobs {unknown}; registered ones are {sorted(_EXTENSIONS)}.")
    return tuple(sorted((k, str(_EXTENSIONS[k][0].parse(v, k))) for k, v in pairs.items()))


_LEGACY_FSDP = {"shard_grad_op": Sharding.FSDP_GRAD_OP, "full_shard": Sharding.FSDP_FULL}


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict of autofit 0.1 (`zero_stage` int, `fsdp` string, "every_k" checkpointing) in
    today's fields; today's dicts pass unchanged."""
    stage, fsdp = data.pop("zero_stage", None), data.pop("fsdp", None)
    if stage or (fsdp not in (None, "none")):
        if stage and fsdp not in (None, "none"):
            raise UsageError(f"zero_stage={stage} and fsdp={fsdp!r} are two sharding engines; pick one.")
        data["sharding"] = f"zero{stage}" if stage else _LEGACY_FSDP.get(fsdp, fsdp)
    mode = data.get("checkpointing")
    if isinstance(mode, str) and mode.startswith("every_") and mode != "every_k":
        data["checkpointing"], data["checkpoint_every"] = "every_k", int(mode.removeprefix("every_"))
    return data
