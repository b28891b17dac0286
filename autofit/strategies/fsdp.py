"""Rung 6 (torch-native), FSDP2: `torch.distributed.fsdp.fully_shard` on each block and the root.

"fsdp_grad_op" (FSDP shard_grad_op) keeps each block's parameters gathered from forward to backward (`reshard_after_forward
=False`) and shards gradients and optimizer states (~ZeRO-2); "fsdp_full" (full_shard) reshards them after forward
too (~ZeRO-3). Buys: each rank holds 1/num_gpus of the sharded states. Costs: an all-gather per block in
forward (and again in backward for full_shard) and a reduce-scatter of gradients: communication, same
math (tier 0). Mixed precision goes through `MixedPrecisionPolicy` (bf16/fp16 compute, fp32 gradient
reduction); `offload="cpu"` adds `CPUOffloadPolicy` (parameters, gradients and optimizer step on the
host). The alternative to DeepSpeed ZeRO when DeepSpeed is not installed or not wanted.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import Config, Engine, Offload, Sharding
from autofit.models.info import find_blocks
from autofit.strategies.sharding import ShardingEngine

if TYPE_CHECKING:
    from autofit.strategies.run import TrainRun


class Fsdp(ShardingEngine):
    """FSDP2 shard_grad_op (~ZeRO-2), full_shard (~ZeRO-3) (and no sharding)."""

    engine = Engine.FSDP
    offered = (Sharding.FSDP_GRAD_OP, Sharding.FSDP_FULL)
    label = "FSDP2"

    def apply(self, run: "TrainRun") -> None:
        if self.shaped_elsewhere(run) or not self.owns(run.config):
            return
        # Sharded last, once every strategy has applied (LoRA adapters must exist before sharding),
        # and placed by `shard` itself (with CPU offload the full model never visits the GPU).
        run.placed = True
        run.engine_factory = functools.partial(shard, reshard_after_forward=run.config.sharding is Sharding.FSDP_FULL)


    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        if not self.owns(config):
            return {}
        if fmt == "accelerate":
            return {"distributed_type": "FSDP", "fsdp_config": accelerate_section(config)}
        if fmt != "trainer":
            return {}
        keys: dict[str, Any] = {"fsdp": True, "fsdp_config": {
            "version": 2, "reshard_after_forward": config.shards_parameters, "cpu_offload": config.offload is Offload.CPU,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}
        if config.needs_sync_each_micro_batch:  # as measured; the Trainer defers the reduce-scatter otherwise
            keys["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
        return keys

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if fmt != "accelerate" or not config.needs_sync_each_micro_batch:
            return []
        return ["# FSDP2 with accumulation, measured reducing gradients on every micro-batch: build the accelerator",
                "# with Accelerator(gradient_accumulation_plugin=prepared.gradient_accumulation_plugin()); a plain",
                "# Accelerator() defers the reduce to the last micro-batch and holds every gradient unsharded "
                "until then."]

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
    mesh = _mesh(run.device)
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


def _mesh(device: torch.device) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))
