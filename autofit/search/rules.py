"""The rules between knobs: which combinations cannot run, and why. One table (`rules()`: the joint rules
below and those each strategy contributes, `Strategy.rules`), applied once where the space is built
(`autofit.search.space`); every combination a rule excludes is recorded with its reason and never probed.

A rule looks at a candidate's knobs and its `Target` and returns the reason it cannot run, or None.
Most rules read level knobs; a rule that reads the accumulation (the optimizer step in backward) is
applied at every micro-batch size too (`Space.sizes_at`).
`Rule.knobs` names the fields the rule reads, so an excluded combination is recorded once per
distinct value of those fields, not once per level.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from autofit.config import Config, Engine, Offload, Optimizer, Precision, Quantization, Sharding
from autofit.strategies import completed, plugins
from autofit.strategies.base import Rule

if TYPE_CHECKING:
    from autofit.job.target import Target


def _offload_needs_engine(c: Config, t: "Target") -> str | None:
    if c.offloads and c.engine is Engine.TORCH:
        return (f"offload={c.offload.value} moves states through an engine: it needs ZeRO or FSDP2 sharding "
                "(on one GPU too)")
    return None


def _nvme_needs_zero3(c: Config, t: "Target") -> str | None:
    if c.offload is Offload.NVME and c.zero_stage != 3:
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


def _quantization_unsharded(c: Config, t: "Target") -> str | None:
    if c.quantization is not Quantization.NONE and c.sharding is not Sharding.NONE:
        return (f"bitsandbytes {c.quantization.value} base weights are not sharded by ZeRO/FSDP2 here: "
                "QLoRA runs on one rank, or as plain data parallelism")
    return None


def _one_rank_shards_nothing(c: Config, t: "Target") -> str | None:
    if c.sharding is not Sharding.NONE and c.num_gpus < 2 and not c.offloads:
        return (f"{c.sharding.value} over one rank shards nothing; on one GPU an engine only serves the "
                "offload rung")
    return None


def _pure_bf16_needs_torch(c: Config, t: "Target") -> str | None:
    if c.pure_bf16 and c.engine is not Engine.TORCH:
        return (f"{c.sharding.value} keeps fp32 master weights under its own bf16 mode (that is precision=bf16); "
                "pure bf16 trains bf16 weights with torch's optimizer")
    return None


def _in_backward_needs_one_torch_rank(c: Config, t: "Target") -> str | None:
    if c.steps_in_backward and (c.engine is not Engine.TORCH or c.num_gpus > 1):
        return ("the optimizer step in backward needs each parameter's final gradient in its hook; an engine or "
                "several ranks reduce gradients after the hook has fired")
    return None


def _in_backward_accumulation(c: Config, t: "Target") -> str | None:
    if c.steps_in_backward and c.grad_accum_steps > 1:
        return (f"the optimizer step in backward is exact only at accumulation 1: at {c.grad_accum_steps} it "
                "would step once per micro-batch")
    return None


def _in_backward_global_view(c: Config, t: "Target") -> str | None:
    if c.steps_in_backward and c.precision is Precision.FP16:
        return "fp16's GradScaler checks every gradient for inf/NaN before any step; in backward none is whole"
    if c.steps_in_backward and c.optimizer is Optimizer.USER:
        return "your own optimizer may couple parameters; the step in backward runs one optimizer per parameter"
    return None


def _hierarchy_needs_nodes(c: Config, t: "Target") -> str | None:
    if c.sharding.hierarchical and c.nodes < 2:
        return (f"{c.sharding.value} shards or partitions within a node and across the others; on one node it is "
                "sharding over every GPU, without the hierarchy")
    return None


def _hierarchy_keeps_weights_on_gpu(c: Config, t: "Target") -> str | None:
    if c.sharding.hierarchical and c.engine is Engine.DEEPSPEED and c.offloads:
        # DeepSpeed allocates the secondary partition on the parameters' device (partition_parameters.py
        # `_partition_param_sec`: `device=self.remote_device`), the host under parameter offload
        return (f"{c.sharding.value}'s secondary partition of the weights is there for the backward's gathers over "
                f"the node's links; with offload={c.offload.value} DeepSpeed keeps it on the host, so they would "
                "cross PCIe instead: offload with zero3")
    return None


def _quantized_collectives_half(c: Config, t: "Target") -> str | None:
    if c.sharding is Sharding.ZERO3_HPZ_QUANTIZED and not c.half_precision:
        return ("ZeRO++ quantizes the 16-bit weights and gradients DeepSpeed communicates under bf16/fp16; in fp32 "
                "use zero3_hpz")
    return None


JOINT = (
    Rule("offload needs an engine", ("offload", "sharding"), _offload_needs_engine),
    Rule("NVMe needs ZeRO-3", ("offload", "sharding"), _nvme_needs_zero3),
    Rule("ZeRO-Offload steps with CPU Adam", ("offload", "sharding", "optimizer"), _zero_offload_optimizer),
    Rule("8-bit states cannot step on the host", ("offload", "optimizer"), _offload_eight_bit),
    Rule("Adafactor cannot step FSDP2 shards", ("sharding", "optimizer"), _fsdp_adafactor),
    Rule("quantized weights are not sharded", ("quantization", "sharding"), _quantization_unsharded),
    Rule("one rank shards nothing", ("sharding", "num_gpus", "offload"), _one_rank_shards_nothing),
    Rule("pure bf16 trains with torch", ("precision", "sharding"), _pure_bf16_needs_torch),
    Rule("step in backward on one torch rank", ("optimizer_step", "sharding", "num_gpus"),
         _in_backward_needs_one_torch_rank),
    Rule("step in backward at accumulation 1", ("optimizer_step", "grad_accum_steps"), _in_backward_accumulation),
    Rule("step in backward needs no global view", ("optimizer_step", "precision", "optimizer"),
         _in_backward_global_view),
    Rule("hierarchical sharding needs several nodes", ("sharding", "nodes"), _hierarchy_needs_nodes),
    Rule("ZeRO++'s node partition stays on the GPU", ("sharding", "offload"), _hierarchy_keeps_weights_on_gpu),
    Rule("ZeRO++ quantizes 16-bit collectives", ("sharding", "precision"), _quantized_collectives_half),
)


# The order the rules are checked in, by name (the first a combination breaks gives its reason): the
# joint ones and the strategies' own; a rule not listed (a plug-in's) after these, in rung order.
ORDER = ("offload needs an engine", "NVMe needs ZeRO-3", "ZeRO-Offload steps with CPU Adam",
         "8-bit states cannot step on the host", "Adafactor cannot step FSDP2 shards", "quantization needs LoRA",
         "quantized weights are not sharded", "flash-attention needs half precision", "one rank shards nothing",
         "pure bf16 trains with torch", "step in backward on one torch rank", "step in backward at accumulation 1",
         "step in backward needs no global view", "activation offload with none or full checkpointing",
         "hierarchical sharding needs several nodes", "ZeRO++'s node partition stays on the GPU",
         "ZeRO++ quantizes 16-bit collectives")


def rules() -> tuple[Rule, ...]:
    """Every rule between knobs, in `ORDER`: the joint ones (`JOINT`) and those of every built-in and plug-in
    strategy (`Strategy.rules`)."""
    return _rules(tuple(type(s) for s in plugins()))


@functools.lru_cache(maxsize=8)
def _rules(plugin_classes: tuple[type, ...]) -> tuple[Rule, ...]:
    found = [*JOINT, *(rule for strategy in completed() for rule in strategy.rules())]
    return tuple(sorted(found, key=lambda r: ORDER.index(r.name) if r.name in ORDER else len(ORDER)))


def violation(config: Config, target: "Target") -> tuple[Rule, str] | None:
    """The first rule `config` breaks on `target`, with its reason; None when it can run."""
    for rule in rules():
        reason = rule.check(config, target)
        if reason:
            return rule, reason
    return None
