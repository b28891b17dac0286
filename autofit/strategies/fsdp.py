"""Rung 6 (torch-native), FSDP2: `torch.distributed.fsdp.fully_shard` on each block and the root.

"fsdp_grad_op" (FSDP shard_grad_op) keeps each block's parameters gathered from forward to backward (`reshard_after_forward
=False`) and shards gradients and optimizer states (~ZeRO-2); "fsdp_full" (full_shard) reshards them after forward
too (~ZeRO-3). Buys: each rank holds 1/num_gpus of the sharded states. Costs: an all-gather per block in
forward (and again in backward for full_shard) and a reduce-scatter of gradients: communication, same
math (tier 0). Mixed precision goes through `MixedPrecisionPolicy` (bf16/fp16 compute, fp32 gradient
reduction); `offload="cpu"` adds `CPUOffloadPolicy` (parameters, gradients and optimizer step on the
host). The alternative to DeepSpeed ZeRO when DeepSpeed is not installed or not wanted.

Over several nodes, "fsdp_hybrid" (HSDP) shards over a 2-D device mesh: full_shard within each node,
replicated across nodes, so every gather stays on the node's own links and only the reduced gradient shard
crosses the network (an all-reduce among a shard's replicas). Each GPU holds 1/gpus-per-node of the states,
which is why one node measures a hybrid plan's memory: a probe run on one node shards over its GPUs alone.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import Config, Engine, Offload, Sharding
from autofit.models.info import find_blocks
from autofit.strategies.costs import summed, times
from autofit.strategies.memory import EngineFacts, EngineMemory
from autofit.strategies.sharding import WHAT, ShardingEngine

if TYPE_CHECKING:
    from autofit.strategies.costs import StepFacts
    from autofit.strategies.run import TrainRun

# Ops FSDP2 dispatches per unit and micro-step on one rank beside the model's: copies in and out of the
# gathered and reduced buffers, `chunk_cat`, and its `record_function` markers (bench/measurements/host_ops.py, torch 2.13)
# (hybrid: full_shard's, and the all-reduce across nodes is one more transfer per unit: `Fsdp.host_ops`)
FSDP_OPS_PER_UNIT = {Sharding.FSDP_FULL: 26, Sharding.FSDP_GRAD_OP: 22, Sharding.FSDP_HYBRID: 26}


class Fsdp(ShardingEngine):
    """FSDP2 shard_grad_op (~ZeRO-2), full_shard (~ZeRO-3) (and no sharding)."""

    engine = Engine.FSDP
    offered = (Sharding.FSDP_GRAD_OP, Sharding.FSDP_FULL)
    hierarchical = (Sharding.FSDP_HYBRID,)
    label = "FSDP2"
    order = 1  # rung 6: ZeRO, FSDP2, then the rank count

    def across_nodes(self, value: Sharding, nodes: int, per_node: int) -> str:
        return (f"FSDP2 hybrid ({value.value}): {WHAT[3]} sharded within each node of {per_node} GPUs, replicated "
                f"across {nodes} nodes (a {nodes} x {per_node} mesh): no gather crosses a node")

    def collective_seconds(self, config: Config, step: "StepFacts") -> tuple[float, float] | None:
        """Hybrid: the gradients reduced within the node, a node's shard all-reduced across the nodes (each
        shard's replicas), and the gathers within the node; other stages as every engine."""
        if config.sharding is not Sharding.FSDP_HYBRID:
            return super().collective_seconds(config, step)
        per_node, links = config.gpus_per_node, step.links
        return summed([times(2, links.ring(per_node, step.grad_bytes, False)),
                       times(2, links.ring(config.nodes, step.grad_bytes / per_node, True)),
                       times(2 * config.grad_accum_steps, links.ring(per_node, step.weight_bytes, False))])

    def engine_memory(self, config: Config, engine: EngineFacts) -> EngineMemory | None:
        """A tied weight's gradient through a checkpointed backward: the root's gradients are reduced at the
        end of the backward (the estimator models FSDP2's shards and gathered blocks itself)."""
        if not self.owns(config):
            return None
        tied = engine.tied_grad(4)
        return EngineMemory(backward=tied, terms=(("tied_grad_in_recompute", tied),))

    def host_ops(self, config: Config, step: "StepFacts") -> int:
        """FSDP2 works per unit (each block and the root): `FSDP_OPS_PER_UNIT` as counted on one rank, plus
        an all-gather per gather and a reduce-scatter over several GPUs, as many copies across PCIe with CPU
        offload, and the replicas' all-reduce across nodes under hybrid sharding."""
        if not self.owns(config):
            return 0
        transfers = (2 if config.shards_parameters else 1) + 1  # gathers in forward (and backward), one reduce
        across = config.sharding is Sharding.FSDP_HYBRID and config.nodes > 1  # the replicas' all-reduce
        per_unit = FSDP_OPS_PER_UNIT[config.sharding] + transfers * ((config.num_gpus > 1) + config.offloads) + across
        return per_unit * (step.facts.num_blocks + 1)

    def apply(self, run: "TrainRun") -> None:
        if self.shaped_elsewhere(run) or not self.owns(run.config):
            return
        # Sharded last, once every strategy has applied (LoRA adapters must exist before sharding),
        # and placed by `shard` itself (with CPU offload the full model never visits the GPU).
        run.placed = True
        run.engine_factory = functools.partial(shard, reshard_after_forward=run.config.sharding.reshards_after_forward)


    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        if not self.owns(config):
            return {}
        if fmt == "accelerate":
            keys = {"distributed_type": "FSDP", "fsdp_config": accelerate_section(config)}
            if config.sharding is Sharding.FSDP_HYBRID:  # accelerate's 2-D mesh: replicate x shard
                keys["parallelism_config"] = {"parallelism_config_dp_replicate_size": config.nodes,
                                              "parallelism_config_dp_shard_size": config.gpus_per_node}
            return keys
        if fmt != "trainer":
            return {}
        keys: dict[str, Any] = {"fsdp": True, "fsdp_config": {
            "version": 2, "reshard_after_forward": config.shards_parameters, "cpu_offload": config.offload is Offload.CPU,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}
        if config.needs_sync_each_micro_batch:  # as measured; the Trainer defers the reduce-scatter otherwise
            keys["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
        return keys

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if fmt == "trainer" and config.sharding is Sharding.FSDP_HYBRID:
            # TrainingArguments takes the mesh as an object, which its JSON cannot hold: the script sets it
            return [f"# FSDP2 hybrid sharding: {config.gpus_per_node} GPUs of a node shard, {config.nodes} nodes replicate",
                    "from accelerate import ParallelismConfig",
                    f"args.parallelism_config = ParallelismConfig(dp_replicate_size={config.nodes}, "
                    f"dp_shard_size={config.gpus_per_node})"]
        if fmt != "accelerate" or not config.needs_sync_each_micro_batch:
            return []
        return ["# FSDP2 with accumulation, measured reducing gradients on every micro-batch: build the accelerator",
                "# with Accelerator(gradient_accumulation_plugin=prepared.gradient_accumulation_plugin()); a plain",
                "# Accelerator() defers the reduce to the last micro-batch and holds every gradient unsharded "
                "until then."]

    def accumulation_kwargs(self, config: Config) -> dict[str, Any]:
        # measured reducing gradients on every micro-batch: accumulate() otherwise defers the reduce-scatter
        return {"sync_each_batch": True} if config.needs_sync_each_micro_batch else {}

    def refuses(self, config: Config, fmt: str) -> str | None:
        if fmt == "deepspeed" and self.owns(config):
            return (f"the plan shards with FSDP2 ({config.sharding.value}), not DeepSpeed; export accelerate, "
                    "trainer or torchrun instead")
        return None


def accelerate_section(config: Config) -> dict[str, Any]:
    """accelerate's FSDP2 keys: full_shard reshards parameters after forward (~ZeRO-3), shard_grad_op
    keeps them gathered until backward (~ZeRO-2); offload="cpu" is FSDP2's CPUOffloadPolicy."""
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": config.shards_parameters,
        "fsdp_offload_params": config.offload is Offload.CPU,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # the model's repeated blocks, as probed
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
    }


def shard(run: "TrainRun", reshard_after_forward: bool) -> None:
    """Apply `fully_shard` to each block, then the root, with the run's precision and offload as policies.
    Returns None: training stays torch's backward and optimizer step, over the sharded parameters."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("FSDP2 probes run in the ranks autofit launches (autofit.probe.launch); "
                           "no process group here")
    dtype = run.autocast_dtype  # the precision strategy's 16-bit type, which the policy computes in instead
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if run.config.offload is Offload.CPU else OffloadPolicy()
    mesh = mesh_for(run.config, run.device)
    # The model stays on the CPU: `fully_shard` moves each block's states to the mesh's device and
    # shards them (torch/distributed/fsdp/_fully_shard/_fsdp_init.py `_move_states_to_device`), so one
    # block at a time is whole on the GPU, never the model. With CPUOffloadPolicy nothing visits the GPU.
    model = run.model
    for block in find_blocks(model)[1]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                offload_policy=offload)
    if dtype is not None:
        run.autocast_dtype = None  # the policy casts parameters; autocast on top would cast twice
    if run.scaler is not None:  # fp16: the scaler must see every rank's gradient shards
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        run.scaler = ShardedGradScaler(run.device.type)


def mesh_shape(config: Config, world: int) -> tuple[int, ...]:
    """The device mesh `config` shards over with `world` ranks running: (replicas, shards) for hybrid
    sharding where the ranks of several nodes run (every node, or a rehearsal of them on one machine), else
    one dimension of every rank (a probe on one node of a hybrid plan shards as each node does)."""
    per_node = config.gpus_per_node
    if config.sharding is Sharding.FSDP_HYBRID and world > per_node:
        if world % per_node:
            raise RuntimeError(f"{world} ranks cannot form nodes of {per_node} ({config.describe()})")
        return (world // per_node, per_node)
    return (world,)


def mesh_for(config: Config, device: torch.device) -> Any:
    """The device mesh of `mesh_shape` over the ranks of the running process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(config, dist.get_world_size())
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)
