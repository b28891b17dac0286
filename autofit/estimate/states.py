"""Estimate, model states: the bytes of parameters, gradients and optimizer states per device for a
configuration, and the other terms that follow from the model's facts alone (FSDP2's gathered weights,
gradients held unsharded, the optimizer step's temporaries), all by formula, without a simulation; and how
they join a simulated step's activations into the step's transient bytes (`step_transient`).

This is the one joint module (DESIGN.md): precision, ZeRO and FSDP2 sharding, offload, 8-bit and
factored optimizer states, quantized base weights, LoRA and the step in backward each change what the
others' bytes are, so their model-state formulas live here together rather than in each strategy's `memory`
hook. Everything else a technique does to memory the simulated step measures (`Strategy.apply` shapes it).
The rules between knobs that belong to no one technique live here too (`JOINT_RULES`, which
`autofit.search.rules` checks beside each strategy's own `Strategy.rules`): an engine's limits on knobs it
shares with the others, and the step in backward's with fp16 and your own optimizer.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3): with mixed precision
under DeepSpeed, 2 bytes of fp16/bf16 parameters, 2 of gradients and K = 12 of fp32 master weights and
Adam moments per parameter, each partitioned over N GPUs by its stage. Without ZeRO, autofit trains
with autocast: the weights as the model stores them (fp32: 4 bytes; a bf16 model: 2), gradients and the
optimizer's states in the same dtype. FSDP2 shards all three over N and gathers blocks in the
mixed-precision policy's dtype.

Over several nodes N is every GPU, but for hybrid FSDP2, which shards within a node (N = its GPUs,
`Config.shard_ranks`) and replicates across nodes; ZeRO++ hpZ adds a secondary partition of the 16-bit
weights over a node's GPUs beside ZeRO-3's own. Host memory for offload is per node.
"""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING, Any

from autofit.config import Config, Engine, Offload, Optimizer, Precision, Quantization, Sharding
from autofit.estimate.facts import ModelFacts
from autofit.strategies.base import Rule
from autofit.strategies.quantization import INT8_BYTES, nf4_bytes
from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.job.target import Target
    from autofit.estimate.simulation.step import ActivationPeak

NF4_PACKED_BYTES = 0.5  # two 4-bit weights a byte: the parameter's data (`quant_storage` is only its dtype)


@dataclasses.dataclass(frozen=True)
class States:
    """Model-state bytes per device, and on the host (all ranks) when offloaded."""

    params: int
    grads: int
    optimizer: int
    cpu: int = 0


def optimizer_bytes(facts: ModelFacts, optimizer: Optimizer, trainable: int, state_bytes: float = 4.0) -> float:
    """Optimizer-state bytes for `trainable` parameters (no master weights): AdamW two moments of
    `state_bytes` each (torch keeps them in the weights' dtype: 8 per fp32 parameter), 8-bit AdamW 2
    (+ an fp32 absmax per 2048-element block per state), Adafactor its factored moments; a user's own
    optimizer as measured on stand-ins (`facts.own_optimizer`: torch's keep their states in the weights'
    dtype), or as AdamW where that could not be measured (a fallback, which `state_notes` says)."""
    if optimizer is Optimizer.USER and facts.own_optimizer is not None:
        return facts.own_optimizer.states * state_bytes * trainable
    if optimizer.eight_bit:
        return trainable * (2 + 2 * 4 / 2048)
    if optimizer is Optimizer.ADAFACTOR:
        share = trainable / facts.trainable_params if facts.trainable_params else 1.0
        return state_bytes * facts.factored_params * share
    return 2 * state_bytes * trainable


def model_states(facts: ModelFacts, config: Config) -> States:
    """Parameters (with the model's buffers, `buffers_on_device`), gradients and optimizer states per
    device for `config` (`_states`)."""
    states = _states(facts, config)
    return dataclasses.replace(states, params=states.params + buffers_on_device(facts, config))


def buffers_on_device(facts: ModelFacts, config: Config) -> int:
    """Bytes of the model's buffers on each device: every rank holds them all (DDP broadcasts them, FSDP
    and ZeRO-3 shard parameters only, offload moves states only); floating ones in 16 bits where the model
    itself is cast (pure bf16, DeepSpeed's fp16/bf16 engine: `module.half()` / `module.bfloat16()`)."""
    return facts.half_buffer_bytes if model_cast_to_half(config) else facts.buffer_bytes


def model_cast_to_half(config: Config) -> bool:
    """Whether `config` casts the whole model to 16 bits on the device: pure bf16, and DeepSpeed's fp16/bf16
    engine (`module.half()` / `module.bfloat16()`), where only the trained weights keep an fp32 master copy."""
    return config.pure_bf16 or (config.half_precision and config.zero_stage > 0)


def _states(facts: ModelFacts, config: Config) -> States:
    """Parameters, gradients and optimizer states per device for `config` (ZeRO paper accounting).

    - torch (one GPU, DDP): the weights as the model stores them (fp32 under autocast: 4 bytes; a bf16
      model 2), gradients and states in the same dtype; nothing is partitioned.
    - ZeRO 1/2/3 with fp16/bf16: 2 bytes of half weights and grads; fp32 master weights + states (K)
      partitioned over N by stage 1, grads too by stage 2, weights too by stage 3.
    - FSDP2: the weights, gradients and states of the torch case, all sharded over N (`_fsdp_states`).
    - offload "cpu"/"nvme": master weights and optimizer states leave the GPU (stages 2 and 3: the gradient
      partitions too; stage 3: weights too).
    - LoRA: base weights frozen (as stored, or NF4/int8 when quantized); only the adapters train.
    """
    if config.adapters:
        return _sharded(_adapter_states(facts, config), config, quantization_constants(facts, config))
    if config.engine is Engine.FSDP:
        return _fsdp_states(facts, config)
    n = max(config.num_gpus, 1)
    wb = facts.weight_bytes
    trainable = facts.trainable_params
    frozen = facts.num_params - trainable
    if config.pure_bf16:
        return _pure_bf16_states(facts, config)
    if config.zero_stage == 0:  # a sparse gradient holds the rows looked up: added from the simulation
        return States(int(wb * facts.num_params), int(wb * (trainable - facts.sparse_params)),
                      int(optimizer_bytes(facts, config.optimizer, trainable, wb)))
    half = 2 if config.half_precision else 4
    master = 4 * trainable  # fp32 copies the optimizer updates: a clone even in fp32 (stage_1_and_2.py l.570)
    k_bytes = master + optimizer_bytes(facts, config.optimizer, trainable)
    params = half * trainable / (n if config.zero_stage >= 3 else 1) + wb * frozen + secondary_partition(facts, config)
    grads = half * trainable / (n if config.zero_stage >= 2 else 1)
    optimizer = k_bytes / n
    if not config.offloads:
        return States(int(params), int(grads), int(optimizer))
    # Host RAM over a node's ranks: each rank's K-byte partition plus its fp32 gradient partition for CPU Adam.
    to_host = config.offload is Offload.CPU
    cpu = (k_bytes + 4 * trainable) / config.nodes if to_host else 0
    if config.zero_stage == 2:
        # Stage 2 with an offloaded optimizer copies each reduced gradient into the host's fp32 partition and
        # frees it (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`, "clear_grad_attribute(param)  #offload
        # only", stage_1_and_2.py, DeepSpeed 0.19.8): no gradient partition stays on the GPU. Stage 1 keeps
        # its gradients whole until the boundary's reduce.
        grads = 0
    if config.zero_stage >= 3:
        cpu += half * trainable / config.nodes if to_host else 0
        # Stage 3 with an offloaded optimizer (to the CPU or NVMe) makes its gradient partitions on the host:
        # `grad_partitions_flat_buffer` on `self.device`, which is the CPU then (stage3.py, DeepSpeed 0.19.8),
        # in the accumulation dtype (the model's, `engine.get_data_types`); the GPU holds a partition only
        # while it is copied there (`partition_grads`).
        params, grads = wb * frozen, 0
        cpu += half * trainable / config.nodes
    return States(int(params), int(grads), 0, int(cpu))


def secondary_partition(facts: ModelFacts, config: Config) -> float:
    """ZeRO++ hpZ's secondary partition: the 16-bit trainable weights partitioned over a node's GPUs
    (`zero_hpz_partition_size`), on each GPU beside ZeRO-3's primary partition over every GPU, so the
    backward gathers within the node (deepspeed/runtime/zero/partition_parameters.py `_partition_param_sec`:
    `tensor_size // num_ranks_in_param_group` elements of the parameter's dtype); 0 for other shardings."""
    if not (config.sharding.hierarchical and config.engine is Engine.DEEPSPEED):
        return 0.0
    return (2 if config.half_precision else 4) * facts.trainable_params / config.gpus_per_node


def _fsdp_states(facts: ModelFacts, config: Config) -> States:
    """FSDP2 (`fully_shard` on each block and the root) keeps each parameter as a 1/N shard in its own
    dtype, its gradient shard in the same dtype (the reduce-scatter output) and the optimizer's states on
    the shards: everything over N, at every sharding mode (the modes differ in what is gathered, see
    `Estimator._gathered`). `CPUOffloadPolicy` keeps all three in host memory (a node's ranks' on its
    host). Pure bf16 casts the weights to bf16 before they are sharded. N: the GPUs sharding (`shard_ranks`:
    a node's under hybrid sharding)."""
    n = max(config.shard_ranks, 1)
    wb, trainable = 2.0 if config.pure_bf16 else facts.weight_bytes, facts.trainable_params
    states = States(int(wb * facts.num_params / n), int(wb * trainable / n),
                    int(optimizer_bytes(facts, config.optimizer, trainable, wb) / n))
    if config.offload is Offload.CPU:
        return States(0, 0, 0, config.gpus_per_node * (states.params + states.grads + states.optimizer))
    return states


def _sharded(states: States, config: Config, resident: int = 0) -> States:
    """Adapter states under a sharding engine: FSDP2 shards all three (or keeps them on the host with CPU
    offload); ZeRO by its stage. `states` are one rank's unsharded states, of whose weights `resident`
    bytes are no parameter's data and stay whole on every device (`quantization_constants`)."""
    n = max(config.shard_ranks, 1)
    fsdp = config.engine is Engine.FSDP
    if fsdp and config.offload is Offload.CPU:  # CPUOffloadPolicy: every state on the host
        return States(resident, 0, 0, states.params - resident + states.grads + states.optimizer)
    if n == 1 or config.sharding.stage == 0:
        return states
    secondary = (states.params - resident) // config.gpus_per_node if config.sharding.hierarchical and not fsdp else 0
    return States((states.params - resident) // (n if fsdp or config.shards_parameters else 1) + resident + secondary,
                  states.grads // (n if fsdp or config.shards_gradients else 1),
                  states.optimizer // n, states.cpu)


def _pure_bf16_states(facts: ModelFacts, config: Config) -> States:
    """Pure bf16 (torch engine): 2-byte weights and gradients; AdamW moments and Adafactor's factored
    moments follow the parameter dtype (half of `optimizer_bytes`), 8-bit states are 8-bit anyway."""
    trainable = facts.trainable_params
    return States(2 * facts.num_params, 2 * trainable, int(optimizer_bytes(facts, config.optimizer, trainable, 2)))


def own_adapters(facts: ModelFacts, config: Config) -> bool:
    """Whether `config` quantizes the base of a model that brings its own adapters: no LoRA rank, and the
    model trains only part of itself (the estimator's case; the planner does not offer it)."""
    return config.quantization is not Quantization.NONE and not config.lora and facts.trains_part


def adapter_weights(facts: ModelFacts, config: Config) -> tuple[int, float]:
    """(elements, bytes each) of the weights that train beside a frozen base: autofit's LoRA adapters, fp32
    (peft upcasts adapters of a 16-bit base: `autocast_adapter_dtype=True`), r=16 where quantization names
    no rank (QLoRA's usual); or the model's own adapters as it stores them (`own_adapters`)."""
    if own_adapters(facts, config):
        return facts.trainable_params, facts.trainable_bytes
    return (config.lora or 16) * facts.lora_params_per_rank, 4.0


def _adapter_states(facts: ModelFacts, config: Config) -> States:
    """LoRA: the frozen base as stored (in 16 bits where the model is cast, `model_cast_to_half`; NF4/int8 where
    quantized), the adapters (`adapter_weights`) with gradients and states in their dtype."""
    adapters, size = adapter_weights(facts, config)
    base = facts.num_params - (adapters if own_adapters(facts, config) else 0)
    wb = min(facts.weight_bytes, 2) if model_cast_to_half(config) else facts.weight_bytes
    if config.quantization is Quantization.NF4:
        base_bytes = nf4_bytes() * facts.linear_params + wb * (base - facts.linear_params)
    elif config.quantization is Quantization.INT8:
        base_bytes = INT8_BYTES * facts.linear_params + 4 * facts.linear_rows + wb * (base - facts.linear_params)
    else:
        base_bytes = wb * base
    return States(int(base_bytes + size * adapters), int(size * adapters),
                  int(optimizer_bytes(facts, config.optimizer, adapters, size)))


def quantization_constants(facts: ModelFacts, config: Config) -> int:
    """Bytes of NF4's quantization constants (the absmax of every 64 weights, double-quantized or not):
    bitsandbytes keeps them in each layer's `quant_state`, beside the parameter whose data holds the packed
    4-bit weights, so a sharding engine that flattens parameters neither shards nor offloads them; every
    rank keeps them all on its GPU (bitsandbytes/nn/modules.py `fix_4bit_weight_quant_state_from_module`:
    "the quant state got lost when the parameter got converted. This happens for example for fsdp")."""
    if config.quantization is not Quantization.NF4:
        return 0
    return int((nf4_bytes() - NF4_PACKED_BYTES) * facts.linear_params)


def unsharded_grads(facts: ModelFacts, config: Config) -> int:
    """Bytes of the whole model's gradients as FSDP holds them when the reduce waits for the last
    micro-batch: unsharded, in the reduce dtype (FSDP2's `set_requires_gradient_sync(False)`:
    `FSDPParam.to_accumulated_grad_if_needed` upcasts to it, torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py; FSDP1's `no_sync` keeps the flat parameter's unsharded gradient,
    fully_sharded_data_parallel.py): fp32 under autofit's bf16/fp16 policy (`reduce_dtype=torch.float32`)
    and for adapters, else the weights' dtype (bf16 under pure bf16)."""
    if config.adapters:
        adapters, size = adapter_weights(facts, config)
        return int((4 if config.half_precision else size) * adapters)
    if config.pure_bf16:
        return 2 * facts.trainable_params
    return int((4 if config.half_precision else facts.weight_bytes) * facts.trainable_params)


def fsdp_gathered(facts: ModelFacts, config: Config) -> int:
    """FSDP2 all-gathers a block's weights in the policy's dtype (16 bits under bf16/fp16, else as
    stored) before its forward and backward. The root (embeddings, final norm, head) stays gathered
    across the step; full_shard (`reshard_after_forward=True`) holds two blocks (the current one and the
    prefetched next), shard_grad_op keeps every block gathered from its forward to its backward.
    A quantized block gathers its linear layers packed (their constants stay whole on every rank:
    `quantization_constants`), the rest of the block and the root as stored; autofit's LoRA adapters
    are gathered with their block. Each block's unsharded gradient (policy dtype) and its fp32 copy for
    the reduce-scatter are staged one block at a time (torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py), for the weights that train only: a frozen weight (LoRA's base, built into
    the model or not) has none."""
    size = 2 if config.half_precision else facts.weight_bytes
    root = facts.num_params - facts.num_blocks * facts.block_params
    blocks = min(2 if config.sharding.reshards_after_forward else facts.num_blocks, facts.num_blocks)
    block = size * facts.block_params
    packed = {Quantization.NF4: NF4_PACKED_BYTES, Quantization.INT8: INT8_BYTES}.get(config.quantization)
    if packed is not None and facts.num_blocks:  # a quantized block gathers its linear layers packed
        block -= (size - packed) * facts.linear_params / facts.num_blocks
    if config.adapters and not own_adapters(facts, config) and facts.num_blocks:  # autofit's, in the blocks
        adapters, adapter_size = adapter_weights(facts, config)
        block += (2 if config.half_precision else adapter_size) * adapters / facts.num_blocks
    staged = 0 if config.adapters else facts.block_trainable_params * (size + (4 if size < 4 else 0))
    return int(size * root + blocks * block + staged)


def step_in_backward(facts: ModelFacts, config: Config, target: str) -> int:
    """Temporaries of one parameter's optimizer step inside backward, for the largest parameter: torch's
    foreach path (CUDA) one tensor of its size, the single-tensor path (CPU) two."""
    element = 2 if config.pure_bf16 else 4
    return (1 if target == "cuda" else 2) * element * facts.largest_param


def optimizer_temporaries(facts: ModelFacts, config: Config, target: str) -> int:
    """Bytes the optimizer step allocates beyond its states. torch's foreach AdamW/Adafactor (the CUDA
    default; also DeepSpeed's torch_adam over its fp32 partition) builds one list the size of the
    trainable weights it updates, in their dtype (`exp_avg_sq_sqrt = torch._foreach_sqrt(...)` in
    torch/optim/adam.py `_multi_tensor_adam`); under FSDP2 those are the 1/N shards. The single-tensor
    path (CPU) makes two temporaries of the largest tensor; bitsandbytes and DeepSpeed's CPU Adam
    (offload) update in place. A user's own optimizer: its temporaries on each path as measured on
    stand-ins (`facts.own_optimizer`), else AdamW's."""
    if config.optimizer.eight_bit or config.zero_stage or \
            (config.engine is Engine.FSDP and config.offload is Offload.CPU):
        return 0  # ZeRO: DeepSpeed is configured with torch's fused AdamW (or its CPU Adam with offload)
    if config.adapters:
        trainable, size = adapter_weights(facts, config)
    else:
        trainable, size = facts.trainable_params, 4.0 if config.zero_stage else facts.weight_bytes
        size = 2.0 if config.pure_bf16 else size  # the temporaries take the parameters' dtype
    own = facts.own_optimizer if config.optimizer is Optimizer.USER else None
    if target != "cuda":
        return int((own.single_temporaries if own else 2) * size * min(facts.largest_param, trainable))
    shards = max(config.shard_ranks, 1) if config.shards_optimizer else 1
    return int((own.foreach_temporaries if own else 1) * size * trainable / shards)


def state_notes(config: Config, states: States, facts: ModelFacts) -> list[str]:
    """Phrases for an estimate's reason: which model states rest on formulas or a fallback, and the host
    RAM offload needs."""
    notes = []
    if config.optimizer is Optimizer.USER:
        own = facts.own_optimizer
        notes.append(f"your optimizer's states {own.describe()}" if own else
                     "your optimizer's states counted as AdamW's, 2x the trained weights (a fallback: its steps "
                     "could not be measured on stand-ins)")
    elif config.optimizer is not Optimizer.ADAMW:
        notes.append(f"{config.optimizer.value} states by formula")
    if config.zero_stage:
        notes.append(f"ZeRO-{config.zero_stage} states by formula" +
                     (f", with ZeRO++'s partition within a node of {config.gpus_per_node}"
                      if secondary_partition(facts, config) else ""))
    if config.sharding is Sharding.FSDP_HYBRID:
        notes.append(f"FSDP2 states sharded over a node's {config.gpus_per_node} GPUs, replicated on {config.nodes} nodes")
    if config.offloads:
        notes.append(f"offload to {config.offload.value}: {format_size(states.cpu)} of host RAM")
    return notes


# -- how the model states join a simulated step ------------------------------------------------------------
def data_parallel(config: Config) -> bool:
    """Whether `config` trains under DistributedDataParallel (several ranks, no sharding engine)."""
    return config.num_gpus > 1 and config.sharding is Sharding.NONE


def sparse_grads(config: Config, per_micro_batch: int) -> int | None:
    """Bytes of the sparse gradients a step holds until its optimizer step (`nn.EmbeddingBag(sparse=True)`:
    the rows a micro-batch looks up, `per_micro_batch` bytes; `model_states` counts none for those weights),
    concatenated over the accumulation's micro-batches as autograd accumulates them; None under an engine."""
    return per_micro_batch * config.grad_accum_steps if config.engine is Engine.TORCH else None


def held_grads(facts: ModelFacts, config: Config, grads: int, deferred_sync: bool) -> tuple[int, str | None]:
    """Gradient bytes live through a backward after the first micro-batch, and a note where they differ from
    `grads` (the model states'): `unsharded_grads` under FSDP where the loop defers the reduce to the last
    micro-batch (`deferred_sync`: every micro-batch but the last skips the reduce-scatter)."""
    if not (deferred_sync and config.needs_sync_each_micro_batch):
        return grads, None
    held = unsharded_grads(facts, config)
    return held, (f"gradient reduction deferred to the last micro-batch: {format_size(held)} of unsharded "
                  "gradients held")


def gathered(facts: ModelFacts, config: Config) -> tuple[int, str | None]:
    """Full weights gathered from their shards while in use (`Breakdown.gathered`, apart from the partitioned
    model states), and a note: FSDP2's by `fsdp_gathered`. ZeRO-3's are live in the backward only
    (`autofit.strategies.zero.zero3_gathered`): 0 here."""
    if config.engine is Engine.FSDP:
        return fsdp_gathered(facts, config), "FSDP2 gathered weights by formula"
    return 0, None


def step_transient(facts: ModelFacts, config: Config, states: States, held: int, temp: int, act: "ActivationPeak",
                   engine: Any, target: str) -> tuple[States, int, int, int, str | None]:
    """The most transient bytes of the backward, the step and the engine's epilogue between them, with the
    states, held gradients and step temporaries they leave (and a note): with the step in backward each
    parameter's gradient and step live at a time; where earlier micro-batches' gradients (or DDP's buckets:
    `gradient_as_bucket_view=True` makes the gradients views into buckets allocated up front, or an engine's
    held gradients) are live throughout, they add to the activations; else gradients appear as activations
    are freed (`ActivationPeak.with_grads`). `engine`: `autofit.strategies.memory.EngineMemory`."""
    note = None
    if config.steps_in_backward:
        states, held, temp = dataclasses.replace(states, grads=0), 0, step_in_backward(facts, config, target)
        note = "optimizer step in backward: one parameter's gradient and step live at a time"
        transient = max(act.largest, act.at_grad + temp)
    elif config.grad_accum_steps > 1 or data_parallel(config) or engine.grads_held:
        transient = held + act.largest
    else:
        transient = act.with_grads(states.grads)
    transient = max(transient + engine.backward, states.grads + temp + engine.step, states.grads + engine.epilogue)
    return states, held, temp, transient, note


def cast_peak(facts: ModelFacts, config: Config, target: str) -> int:
    """The moment pure bf16 casts the model, on the CPU (0 elsewhere): the model is built in fp32 inside the
    budget and cast tensor by tensor, so its fp32 weights and buffers and the bf16 copy of the largest weight
    are live at once (a table trained with SGD holds little else: predicted a third under its probe). On a
    card the cast happens before the model is placed."""
    if target != "cpu" or not config.pure_bf16:
        return 0
    return int(facts.num_params * facts.weight_bytes) + facts.buffer_bytes + 2 * facts.largest_param


def simulated_layer_notes(facts: ModelFacts, config: Config, adapter_dropout: float) -> list[str]:
    """How the adapters and a quantized base were simulated: as peft's adapters (`autofit.strategies.lora`)
    over bitsandbytes' layers (`SimulatedLinear4bit`, `SimulatedLinear8bit`)."""
    notes = []
    if own_adapters(facts, config):
        notes.append("the model's own adapters trained beside its quantized base")
    elif config.adapters:
        notes.append("LoRA simulated as peft's adapters beside the frozen base" +
                     (" (their inputs dropped out)" if adapter_dropout else ""))
    if config.quantization is Quantization.NF4:
        notes.append("nf4 layers simulated as bitsandbytes' Linear4bit (a 16-bit weight dequantized per matmul)")
    if config.quantization is Quantization.INT8:
        notes.append("int8 layers simulated as bitsandbytes' Linear8bitLt (each keeps its input for backward)")
    return notes


# -- a report's bars ------------------------------------------------------------------------------------------
USUAL_OPTIMIZER_BYTES = {Optimizer.ADAMW: 8, Optimizer.ADAMW8BIT: 2, Optimizer.PAGED_ADAMW8BIT: 2,
                         Optimizer.ADAFACTOR: 0}  # per trained parameter
USUAL_WEIGHT_BYTES = {Quantization.INT8: 1, Quantization.NF4: 0.5}  # per parameter on the device, quantized


def usual_states(config: Config, num_params: int) -> tuple[float, float, float]:
    """Bytes of (weights, gradients, optimizer states) per device for `config` by the usual per-parameter counts,
    from the parameter count alone (a report's bars, beside a measured peak; the estimator's are
    `model_states`): fp32 weights and gradients and 8 bytes of AdamW state, all three halved by pure bf16,
    sharded by ZeRO over the ranks, gone from the device when offloaded; LoRA trains ~no full gradients or
    optimizer states."""
    ranks, half = max(config.num_gpus, 1), 0.5 if config.pure_bf16 else 1.0
    weights = num_params * USUAL_WEIGHT_BYTES.get(config.quantization, 4 * half) / (ranks if config.zero_stage >= 3 else 1)
    trained = 0 if config.lora else num_params
    grads = trained * 4 * half / (ranks if config.zero_stage >= 2 else 1)
    states = trained * USUAL_OPTIMIZER_BYTES.get(config.optimizer, 8) * half / (ranks if config.zero_stage >= 1 else 1)
    if config.offloads:
        states = 0.0
        weights = 0.0 if config.zero_stage >= 3 else weights
    return weights, grads, states


# -- the rules between knobs that belong to no one technique (`autofit.search.rules` checks them with the
# strategies' own, `Strategy.rules`): an engine's limits on the knobs it shares with others, and the step in
# backward's with precision and the optimizer.
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


JOINT_RULES = (
    Rule("quantized weights are not sharded", ("quantization", "sharding"), _quantization_unsharded),
    Rule("one rank shards nothing", ("sharding", "num_gpus", "offload"), _one_rank_shards_nothing),
    Rule("pure bf16 trains with torch", ("precision", "sharding"), _pure_bf16_needs_torch),
    Rule("step in backward on one torch rank", ("optimizer_step", "sharding", "num_gpus"),
         _in_backward_needs_one_torch_rank),
    Rule("step in backward needs no global view", ("optimizer_step", "precision", "optimizer"),
         _in_backward_global_view),
    Rule("hierarchical sharding needs several nodes", ("sharding", "nodes"), _hierarchy_needs_nodes),
)
