"""Rung 6, DeepSpeed ZeRO stage 1, 2, 3 through `deepspeed.initialize` with the generated config.

Stage 1 shards the optimizer states over the ranks, stage 2 the gradients too, stage 3 the parameters
too. Buys: each rank holds 1/num_gpus of those states. Costs: communication (stage 3 gathers every
layer's parameters in forward and backward); same math (tier 0). The probe trains with exactly the dict
that `autofit.strategies.deepspeed_config.deepspeed_config` writes for the launcher, with bf16/fp16 as DeepSpeed
configures them, so what was measured is what runs. On one GPU ZeRO is the base of the offload rung.
Needs DeepSpeed (`pip install 'autofit[deepspeed]'`); probes run in the ranks `autofit.probe.launch`
launches, never in the caller's process.

Over several nodes, ZeRO++ (Wang et al. 2023) is offered beside ZeRO-3 over every GPU: "zero3_hpz" keeps a
secondary partition of the 16-bit weights within each node (`zero_hpz_partition_size`: the node's GPUs),
which the backward gathers from over the node's own links; "zero3_hpz_quantized" adds its quantized
collectives (`zero_quantized_weights`: the forward gathers int8 weights; `zero_quantized_gradients`:
gradients cross nodes as int4), a numerics change (tier 1): the fp32 master weights and the optimizer
are untouched, only what is communicated is quantized. Those run on CUDA kernels only.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import TYPE_CHECKING, Any, Sequence

from autofit.config import Config, Engine, Optimizer, Sharding
from autofit.strategies.base import Option, Rule, Strategy, set_nested
from autofit.strategies.run import DEFAULT_GRADIENT_CLIPPING
from autofit.strategies.costs import summed, times
from autofit.strategies.deepspeed_config import (FILENAME, Buffers, buffers_for, deepspeed_config, deepspeed_elements,
                                                 half_bytes)
from autofit.strategies.deepspeed_install import installed_version, version_problem
from autofit.strategies.memory import EngineFacts, EngineMemory
from autofit.strategies.sharding import ShardingEngine

if TYPE_CHECKING:
    from autofit.job.target import Target
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.costs import StepFacts
    from autofit.strategies.run import TrainRun

QUANTIZED_WEIGHT_BYTES = 1  # ZeRO++ qwZ gathers int8 weights (block scales neglected)
QUANTIZED_GRAD_SHARE = 0.25  # ZeRO++ qgZ reduces int4 gradients: a quarter of 16-bit ones'


class Zero(ShardingEngine):
    """ZeRO stage 1, 2, 3 (and no sharding)."""

    engine = Engine.DEEPSPEED
    offered = (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3)
    hierarchical = (Sharding.ZERO3_HPZ, Sharding.ZERO3_HPZ_QUANTIZED)
    label = "ZeRO"
    order = 0  # rung 6: ZeRO, FSDP2, then the rank count
    nvme_path: str | None = None  # the plan's NVMe folder, where this instance is a plan's (`recorded`)
    buffers: Buffers | None = None  # DeepSpeed's buffers sized for the plan's model and budget (`recorded`)

    def not_installed(self) -> str | None:
        if installed_version() is None:
            return ("engine='deepspeed' but DeepSpeed is not installed: pip install 'autofit[deepspeed]', "
                    "or use engine='fsdp' (torch's own FSDP2).")
        return None

    def options(self, spec: "TrainSpec") -> list[Option]:
        """ZeRO's stages, and over several nodes ZeRO++; its quantized collectives need CUDA."""
        if spec.target.cuda:
            return super().options(spec)
        return [dataclasses.replace(o, available=False, reason="ZeRO++'s quantized collectives run on DeepSpeed's "
                                    f"CUDA kernels; {spec.target.name} is not a CUDA device")
                if o.value is Sharding.ZERO3_HPZ_QUANTIZED and o.available else o for o in super().options(spec)]

    def rules(self) -> tuple[Rule, ...]:
        """ZeRO-Offload's optimizer, and ZeRO++'s partition and quantized collectives."""
        return (Rule("ZeRO-Offload steps with CPU Adam", ("offload", "sharding", "optimizer"), _zero_offload_optimizer),
                Rule("ZeRO++'s node partition stays on the GPU", ("sharding", "offload"), _hierarchy_keeps_weights_on_gpu),
                Rule("ZeRO++ quantizes 16-bit collectives", ("sharding", "precision"), _quantized_collectives_half))

    def tier(self, value: Sharding) -> int:
        return 1 if value is Sharding.ZERO3_HPZ_QUANTIZED else 0

    def across_nodes(self, value: Sharding, nodes: int, per_node: int) -> str:
        quantized = (": int8 weights gathered, int4 gradients across nodes (numerics)"
                     if value is Sharding.ZERO3_HPZ_QUANTIZED else "")
        return (f"ZeRO++ ({value.value}): ZeRO-3 over {nodes * per_node} ranks, the 16-bit weights also partitioned "
                f"within each node of {per_node} for the backward's gathers{quantized}")

    def unavailable_reason(self, spec: "TrainSpec") -> str | None:
        if spec.target.live:
            problem = version_problem(installed_version(), "ZeRO")
            if problem:
                return problem
        elif not spec.target.has("deepspeed"):
            return "ZeRO needs DeepSpeed: pip install 'autofit[deepspeed]'"
        return super().unavailable_reason(spec)

    def recorded(self, settings: dict[str, Any], summary: dict[str, Any]) -> "Zero":
        """ZeRO as the plan's exports need it: its NVMe folder and buffers (`Plan.spec`)."""
        rebuilt = Zero()
        rebuilt.nvme_path = summary.get("nvme_path")
        rebuilt.buffers = buffers_for(summary)
        return rebuilt

    def half_gradients(self, config: Config) -> bool:
        """DeepSpeed's bf16/fp16 mode trains 16-bit weights and reduces 16-bit gradients."""
        return self.owns(config)

    def collective_seconds(self, config: Config, step: "StepFacts") -> tuple[float, float] | None:
        """ZeRO++ hpZ (several nodes): the gradients over every rank (int4 under qgZ), the forward's weights
        gathered over every rank (int8 under qwZ) and the backward's within the node, from its secondary
        partition; other stages as every engine (`ShardingEngine.collective_seconds`)."""
        if not self.owns(config) or not config.sharding.hierarchical:
            return super().collective_seconds(config, step)
        n, micro, links = config.num_gpus, config.grad_accum_steps, step.links
        if n < 2:
            return summed([])
        quantized = config.sharding is Sharding.ZERO3_HPZ_QUANTIZED
        forward = step.weight_bytes * (QUANTIZED_WEIGHT_BYTES / 2 if quantized else 1)
        return summed([times(2, links.ring(n, step.grad_bytes * (QUANTIZED_GRAD_SHARE if quantized else 1), True)),
                       times(micro, links.ring(n, forward, True)),
                       times(micro, links.ring(config.gpus_per_node, step.weight_bytes, False))])

    def engine_memory(self, config: Config, engine: EngineFacts) -> EngineMemory | None:
        """DeepSpeed's buffers (from the same config dict the probe and the export use), ZeRO-3's gathered
        parameters and a tied weight's gradient (`zero_memory`)."""
        if not self.owns(config):
            return None
        return zero_memory(config, engine, deepspeed_elements(config, buffers_for(engine.summary)))

    def host_ops(self, config: Config, step: "StepFacts") -> int:
        """A Python hook per trainable parameter copies its gradient into the reduce bucket
        (deepspeed/runtime/zero/stage_1_and_2.py `reduce_independent_p_g_buckets_and_remove_grads`:
        `new_grad_tensor.copy_(...)`; stage 3 likewise), and with CPU offload to the host as well."""
        return (3 if config.offloads else 2) * step.tensors if self.owns(config) else 0

    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        if not self.owns(config):
            return {}
        if fmt == "trainer":  # the DeepSpeed file the export writes beside (`autofit.export.deepspeed`)
            return {"deepspeed": FILENAME}
        if fmt == "torchrun":
            return {"AUTOFIT_DEEPSPEED_CONFIG": FILENAME}
        if fmt == "accelerate":
            section = accelerate_section(config, self.nvme_path)
            if config.nodes > 1:  # a torchrun per node, as the other formats launch (not DeepSpeed's pdsh)
                section["deepspeed_multinode_launcher"] = "standard"
            return {"distributed_type": "DEEPSPEED", "deepspeed_config": section}
        if fmt == "deepspeed":  # beside the builder's own document
            return hierarchy_keys(config)
        return {}

    def launcher_files(self, config: Config, fmt: str, strategies: Sequence[Strategy]) -> dict[str, dict[str, Any]]:
        """The deepspeed format's deepspeed.json (`FILENAME`): `deepspeed_config` with the plan's NVMe folder,
        buffers and strategies (every config: ZeRO stage 0 is DeepSpeed's data parallelism)."""
        if fmt != "deepspeed":
            return {}
        return {FILENAME: deepspeed_config(config, nvme_path=self.nvme_path, buffers=self.buffers,
                                           strategies=strategies)}

    def refuses(self, config: Config, fmt: str) -> str | None:
        if fmt == "accelerate" and config.sharding.hierarchical and self.owns(config):
            return (f"accelerate's DeepSpeed section has no key for ZeRO++'s partitions within a node "
                    f"(sharding={config.sharding.value}); export deepspeed, trainer or torchrun, whose "
                    "deepspeed.json carries them")
        return None

    def apply(self, run: "TrainRun") -> None:
        if self.shaped_elsewhere(run):
            return
        if self.owns(run.config):
            run.scaler = None  # DeepSpeed scales fp16 losses itself (the config's fp16 section)
            # DeepSpeed places the model itself: cast on the CPU, then moved (stages 1-2), or partitioned
            # tensor by tensor (stage 3). Moving the fp32 model first would put all of it on the GPU.
            run.placed = True
            run.engine_factory = build_engine


def _zero_offload_optimizer(c: Config, t: "Target") -> str | None:
    if c.offloads and c.engine is Engine.DEEPSPEED and c.optimizer is not Optimizer.ADAMW:
        return (f"ZeRO-Offload steps on the host with DeepSpeed's CPU Adam; DeepSpeed refuses "
                f"optimizer={c.optimizer.value} there")
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
    if c.sharding is Sharding.ZERO3_HPZ_QUANTIZED and half_bytes(c) == 4:
        return ("ZeRO++ quantizes the 16-bit weights and gradients DeepSpeed communicates under bf16/fp16; in fp32 "
                "use zero3_hpz")
    return None


def hierarchy_keys(config: Config) -> dict[str, Any]:
    """ZeRO++'s keys of the DeepSpeed config for `config` (dotted): the secondary partition within a node
    (hpZ) and the quantized collectives (qwZ, qgZ); none for the other values."""
    if not config.sharding.hierarchical or config.engine is not Engine.DEEPSPEED:
        return {}
    keys: dict[str, Any] = {"zero_optimization.zero_hpz_partition_size": config.gpus_per_node}
    if config.sharding is Sharding.ZERO3_HPZ_QUANTIZED:
        keys.update({"zero_optimization.zero_quantized_weights": True,
                     "zero_optimization.zero_quantized_gradients": True})
    return keys


def accelerate_section(config: Config, nvme_path: str | None) -> dict[str, Any]:
    """accelerate's flat DeepSpeed keys for `config` (it maps them to DeepSpeed's nested ones itself)."""
    device = config.offload.value if config.offloads else "none"
    section: dict[str, Any] = {
        "zero_stage": config.zero_stage,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "gradient_clipping": DEFAULT_GRADIENT_CLIPPING,
        "offload_optimizer_device": device,
        "offload_param_device": device if config.zero_stage == 3 else "none",
        "zero3_init_flag": config.zero_stage == 3,
    }
    if device == "nvme" and nvme_path:
        section["offload_optimizer_nvme_path"] = str(nvme_path)
        if config.zero_stage == 3:
            section["offload_param_nvme_path"] = str(nvme_path)
    if config.zero_stage == 3:
        section["zero3_save_16bit_model"] = True
    return section


class DeepSpeedEngine:
    """`TrainRun`'s engine over a DeepSpeed engine: the run weights each micro-batch's loss itself, so
    DeepSpeed must not divide by the accumulation steps again; DeepSpeed counts micro-steps in `step()`
    and applies the optimizer at the accumulation boundary, so it is stepped after every backward."""

    def __init__(self, engine: Any, run: "TrainRun | None" = None):
        self.engine = engine
        self.run = run

    def backward(self, loss: Any) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)
        if self.run is not None and self.engine.is_gradient_accumulation_boundary():
            self.run.phase = "step"  # what follows is the optimizer step: no activation is live
        self.engine.step()  # a micro-step; the optimizer steps on the last one of the accumulation

    def step(self) -> None:
        """Nothing left to do: the last micro-batch's `engine.step()` was the accumulation boundary."""


def build_engine(run: "TrainRun") -> DeepSpeedEngine:
    """`deepspeed.initialize` over the run's model with `deepspeed_config(run.config)` and buffers sized
    for the spec's model and budget (what the export writes); the run's model becomes the engine. Only inside a rank that `autofit.probe.launch` launched (a process group exists)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("ZeRO probes run in the ranks autofit launches (autofit.probe.launch); "
                           "no process group here")
    import deepspeed

    from autofit.strategies import compute_dtype

    clipping = {} if run.max_grad_norm is None else {"gradient_clipping": run.max_grad_norm}
    config = deepspeed_config(run.config, nvme_path=run.nvme_path, buffers=buffers_for(run.spec.summary()),
                              hyperparameters=run.hyperparameters, **clipping)
    for dotted, value in hierarchy_keys(run.config).items():  # as the export writes them (`launcher_keys`)
        set_nested(config, dotted, value)
    if run.spec.device.type == "cpu":
        _gloo_collectives(deepspeed)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    dtype = compute_dtype(run.config)  # DeepSpeed's bf16/fp16 mode: the precision's section of `config`
    if run.config.shards_parameters:
        partition(run.model, config, dtype)
    params = [p for p in run.model.parameters() if p.requires_grad]
    optimizer = None if "optimizer" in config else _factory(run)(params)
    engine, optimizer, _, _ = deepspeed.initialize(model=run.model, model_parameters=params, optimizer=optimizer,
                                                   config=config)
    if dtype is not None:
        from autofit.strategies.run import cast_inputs

        # DeepSpeed's forward switches off an outer `torch.autocast` unless its config has a
        # `torch_autocast` section (deepspeed/runtime/torch_autocast.py `autocast_if_enabled`), and casts
        # inputs itself only for fp16 with `auto_cast` (engine.py `_cast_inputs_half`): without this, a
        # model taking float inputs (pixels, features) meets its bf16 weights with fp32 activations
        # ("mat1 and mat2 must have the same dtype"; seen on an H100).
        cast_inputs(engine, dtype)
    run.model, run.optimizer = engine, optimizer
    return DeepSpeedEngine(engine, run)


def _gloo_collectives(deepspeed: Any) -> None:
    """CPU ranks keep gloo's collectives. DeepSpeed's comm backend otherwise compiles its shared-memory
    all-reduce kernel (C++ and OpenMP, deepspeed/comm/torch.py `build_shm_op`) the first time it starts on
    a machine: 38 s of g++ on 2 idle cores here, an error where no compiler is installed. The kernel only
    speeds up CPU collectives, and CPU ranks are where probes measure memory, not speed. A release
    without the compatibility table has nothing to mark."""
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if compatible is not None:
        compatible["deepspeed_shm_comm"] = False  # ShareMemCommBuilder.NAME (deepspeed/ops/op_builder/cpu/comm.py)


def partition(model: Any, config: dict[str, Any], dtype: Any) -> None:
    """ZeRO-3: partition `model`'s parameters over the ranks from the CPU, one tensor at a time, so the
    whole model never sits on the GPU (with parameter offload, the partitions stay on the host).

    `deepspeed.zero.Init(module=...)` moves each parameter to the local device and partitions it
    (deepspeed/runtime/zero/partition_parameters.py `_convert_to_zero_parameters`; the `offload_param`
    device of the config overrides where partitions live). Parameters are cast to DeepSpeed's dtype first,
    on the CPU, as the engine would cast an unpartitioned model (engine.py `_cast_module_mixed_precision`:
    parameters only, buffers kept). `mem_efficient_linear=False`: no global patch of F.linear, as when a
    training script builds its model inside `zero.Init`.
    """
    import deepspeed

    if dtype is not None:
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    deepspeed.zero.Init(module=model, config_dict_or_path=config, mem_efficient_linear=False)


def _factory(run: "TrainRun") -> Any:
    import torch

    return run.optimizer_factory or (lambda ps: torch.optim.AdamW(ps))


# -- what ZeRO holds beyond the model-state formulas (`Zero.engine_memory`) ---------------------------------
# Sources (DeepSpeed 0.19.8, torch 2.13), checked against probes on CPU ranks (bench/measurements/engine_memory.py,
# bench/results/engine-memory-cpu-*.json). `P` is the trainable parameter count, `N` the ranks, `h` the bytes of
# a parameter in the compute dtype (2 in bf16/fp16, else 4):
# - ZeRO-1/2 (`runtime/zero/stage_1_and_2.py`): the parameters are flattened into one buffer (h P, the
#   model's parameters become views of it); the fp32 master partition is a clone even in fp32 (4 P/N, l.570);
#   the step reads an fp32 gradient partition (4 P/N). Gradients are reduced into a rank's partition buffer
#   (`grads_in_partition`), which holds whole every parameter touching the partition
#   (`zero_partition_elements`: P/N and the parameters across its boundaries). At stage 1 the gradients are
#   whole (h P) until the backward's end reduces them into that buffer. At stage 2 they are reduced during
#   the backward through a bucket of `reduce_bucket_size` elements (`setup_buckets`, one buffer without
#   overlap_comm), the partition buffer made at the first reduce; with accumulation, the earlier
#   micro-batches' buffer lives beside the next one's. A tied parameter (GPT-2's embedding and head) gets
#   its gradient twice: one extra copy of it lives in the backward (measured).
# - ZeRO-3 (`runtime/zero/stage3.py`): parameters, the fp32 master and a gradient partition buffer are
#   partitions (h + 4 + h) P/N, held with one reduce bucket; gathered parameters: see `zero3_gathered`.
def zero_memory(config: Config, engine: EngineFacts, elements: dict[str, int]) -> EngineMemory:
    """What ZeRO holds for `config` beyond the model states, by phase, with DeepSpeed's buffer sizes
    `elements` (flat name -> elements, `deepspeed_elements`)."""
    facts = engine.facts
    p, n, h = facts.trainable_params, max(config.num_gpus, 1), _half(config)
    bucket = h * min(elements.get("reduce_bucket_size", 0), p)
    fp32_grads = 0 if config.offloads else 4 * p // n  # with offload the step reads them on the host
    if config.zero_stage == 3:  # the gradient partition (the states' grads) is held from the start too
        gathered, tied = zero3_gathered(facts, config, elements), engine.tied_grad(h)
        # offloaded, a parameter's gradient partition is copied back to the GPU and cast to fp32 there on its
        # way to the host (`partition_grads`, `_offload_grad_partition_at_boundary`, stage3.py)
        copies = (h + (4 if h < 4 else 0)) * max(facts.trainable_sizes, default=0) // n if config.offloads else 0
        terms = (("deepspeed_reduce_bucket", bucket), ("zero3_gathered", gathered), ("tied_grad_in_recompute", tied),
                 ("zero_fp32_grad_partition", fp32_grads), ("zero3_offload_grad_copies", copies))
        return EngineMemory(held=bucket, backward=gathered + tied + copies, step=fp32_grads, grads_held=True,
                            terms=terms, note="ZeRO-3 gathered parameters and buffers from the DeepSpeed config")
    # A tied parameter's gradient arrives twice; the first is kept whole while the second is made.
    tied = h * facts.tied_params
    note = f"ZeRO-{config.zero_stage} buffers from the DeepSpeed config"
    if config.offloads:  # the gradients go to the host's partition
        bucket = bucket if config.zero_stage == 2 else 0
        # each in-partition gradient is cast to fp32 on the GPU on its way to the host
        # (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`): one parameter's at a time, the largest at most
        cast = 4 * max(facts.trainable_sizes, default=0) if h < 4 else 0
        terms = (("deepspeed_reduce_bucket", bucket), ("zero_tied_grad_copy", tied), ("zero_offload_fp32_cast", cast))
        return EngineMemory(backward=bucket + tied + cast, terms=terms, note=note)
    return _zero12(config, engine, bucket, fp32_grads, tied, note)


def _zero12(config: Config, engine: EngineFacts, bucket: int, fp32_grads: int, tied: int, note: str) -> EngineMemory:
    """ZeRO-1/2 without offload: the partition buffer, and the step's flattened copy of the partition."""
    facts = engine.facts
    p, n, h = facts.trainable_params, max(config.num_gpus, 1), _half(config)
    whole = h * zero_partition_elements(facts, n)
    # The step's first moment (`step`, stage_1_and_2.py): the gradients, still views of the partition buffer,
    # flattened into a copy of the partition, and that copy cast to fp32 in 16-bit training (in fp32 the
    # cast is the copy itself); beyond the states' gradients (whole at stage 1, a partition at stage 2).
    flatten = whole + h * p // n + (fp32_grads if h < 4 else 0) - engine.state_grads
    if config.zero_stage == 1:  # reduced after the backward, into the partition buffer, the gradients still whole
        terms = (("zero_tied_grad_copy", tied), ("zero1_partition_buffer", whole), ("zero_fp32_grad_partition", fp32_grads))
        return EngineMemory(backward=tied, step=fp32_grads, epilogue=max(whole, flatten), terms=terms, note=note)
    # ZeRO-2 (stage_1_and_2.py): the rank's gradient buffer holds whole every parameter touching its partition;
    # after the first micro-batch, the earlier ones' sum lives beside it through the backward
    # (`all_grad_tensors`, views of the last buffer). The backward's epilogue copies them into the step's
    # flat partition (`averaged_gradients`, the states' grads) while both buffers and the bucket still live.
    # At accumulation 1 the buffer is counted as gradients appearing while activations are freed, as the
    # estimator counts plain gradients (measured within 2% on a GPT-2 at two ranks; whole from the first
    # reduce on, the backward's peak came out 9% over).
    boundary = max(0, whole - h * p // n)
    accumulated = whole if config.grad_accum_steps > 1 else 0
    terms = (("deepspeed_reduce_bucket", bucket), ("zero_tied_grad_copy", tied), ("zero2_partition_boundary", boundary),
             ("zero2_accumulated_grads", accumulated), ("zero_fp32_grad_partition", fp32_grads))
    return EngineMemory(backward=bucket + tied + boundary + accumulated, step=fp32_grads, grads_held=accumulated > 0,
                        epilogue=max(whole + accumulated + bucket, flatten), terms=terms, note=note)


def zero_partition_elements(facts: Any, n: int) -> int:
    """The most gradient elements one rank's ZeRO-1/2 partition buffer holds (`facts`: the model's
    `ModelFacts`). DeepSpeed flattens the trainable parameters in order, pads the whole to a multiple of 2N
    and cuts it into N equal partitions; a rank's buffer (`grads_in_partition`, made at the backward's first
    reduce in `copy_grads_in_partition`) holds every parameter that touches its partition whole
    (`get_partition_info`): a parameter across a boundary counts on both sides (a GPT-2's embedding, a third
    of its weights, spans one from four ranks on)."""
    return _partition_elements(tuple(size for size in facts.trainable_sizes if size) or (facts.trainable_params,), n)


@functools.lru_cache(maxsize=64)
def _partition_elements(sizes: tuple[int, ...], n: int) -> int:
    align = 2 * n
    part = -(-sum(sizes) // align) * align // n
    spans = list(zip(itertools.accumulate(sizes, initial=0), sizes))
    return max(sum(size for start, size in spans if start < (rank + 1) * part and start + size > rank * part)
               for rank in range(n))


def zero3_gathered(facts: Any, config: Config, elements: dict[str, int]) -> int:
    """Bytes of parameters ZeRO-3 holds gathered in the backward, in the compute dtype. Measured on CPU
    ranks, DeepSpeed keeps what the forward gathered until the backward has used it again, up to
    `max_live_parameters` (never below the largest tensor, which is fetched whole): the whole model
    when it is under that bound, however short the reuse distance."""
    live = elements.get("max_live_parameters", facts.num_params)
    return _half(config) * min(facts.num_params, max(live, facts.largest_param))


def _half(config: Config) -> int:
    """Bytes of a parameter as DeepSpeed trains it: 16-bit under bf16/fp16, else fp32."""
    return half_bytes(config)
