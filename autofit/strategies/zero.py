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
from typing import TYPE_CHECKING, Any

from autofit.config import Config, Engine, Sharding
from autofit.strategies.base import Option, set_nested
from autofit.strategies.deepspeed_config import FILENAME, accelerate_section
from autofit.strategies.deepspeed_install import installed_version, version_problem
from autofit.strategies.sharding import ShardingEngine

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.run import TrainRun



class Zero(ShardingEngine):
    """ZeRO stage 1, 2, 3 (and no sharding)."""

    engine = Engine.DEEPSPEED
    offered = (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3)
    hierarchical = (Sharding.ZERO3_HPZ, Sharding.ZERO3_HPZ_QUANTIZED)
    label = "ZeRO"
    order = 0  # rung 6: ZeRO, FSDP2, then the rank count
    nvme_path: str | None = None  # the plan's NVMe folder, where this instance is a plan's (`recorded`)

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
        """ZeRO as the plan's exports need it: its NVMe folder (`Plan.spec`)."""
        rebuilt = Zero()
        rebuilt.nvme_path = summary.get("nvme_path")
        return rebuilt

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

    from autofit.strategies.deepspeed_config import buffers_for, deepspeed_config
    from autofit.strategies.optimizer import hyperparameters

    clipping = {} if run.max_grad_norm is None else {"gradient_clipping": run.max_grad_norm}
    config = deepspeed_config(run.config, nvme_path=run.nvme_path, buffers=buffers_for(run.spec.summary()),
                              hyperparameters=hyperparameters(run.config.optimizer, run.spec.optimizer), **clipping)
    for dotted, value in hierarchy_keys(run.config).items():  # as the export writes them (`launcher_keys`)
        set_nested(config, dotted, value)
    if run.spec.device.type == "cpu":
        _gloo_collectives(deepspeed)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    if run.config.shards_parameters:
        partition(run.model, config)
    params = [p for p in run.model.parameters() if p.requires_grad]
    optimizer = None if "optimizer" in config else _factory(run)(params)
    engine, optimizer, _, _ = deepspeed.initialize(model=run.model, model_parameters=params, optimizer=optimizer,
                                                   config=config)
    dtype = _half_dtype(config)
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


def partition(model: Any, config: dict[str, Any]) -> None:
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

    dtype = _half_dtype(config)
    if dtype is not None:
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    deepspeed.zero.Init(module=model, config_dict_or_path=config, mem_efficient_linear=False)


def _half_dtype(config: dict[str, Any]) -> Any:
    """The 16-bit dtype DeepSpeed trains the weights in under `config` (bf16 or fp16 section), or None."""
    import torch

    return torch.bfloat16 if config.get("bf16", {}).get("enabled") else \
        torch.float16 if config.get("fp16", {}).get("enabled") else None


def _factory(run: "TrainRun") -> Any:
    import torch

    return run.optimizer_factory or (lambda ps: torch.optim.AdamW(ps))
