"""The cost model: predicted seconds per optimizer step of a candidate on a GPU profile, which ranks the
dry-run's fitting candidates (`autofit.pipelines.dry_run`; `autofit tune` measures instead).

On one GPU's figures:
- compute: 6 FLOPs per parameter per position (forward 2, backward 4; 4 with a frozen LoRA base) plus
  12 * layers * seq^2 * hidden per sample for attention, at `MFU` of the GPU's peak TFLOP/s for the
  precision, times a utilisation `t / (t + HALF_SATURATION_TOKENS)` of the micro-batch's t positions,
  and never faster than the peak itself. Positions per sample are what the model processes
  (`autofit.estimate.workload`): tokens, image patches (197 for ViT-B/16 at 224 px), speech frames
  (1,500 for Whisper), or an encoder-decoder's source tokens through the encoder plus its target tokens
  through the decoder;
- recomputation: full checkpointing adds one forward (+2 FLOPs per parameter-token), every k-th block 1/k of that;
- quantized base weights: dequantization slows NF4 by `NF4_SLOWDOWN`, LLM.int8 by `INT8_SLOWDOWN`;
- communication: a ring all-reduce / reduce-scatter of the gradients per step, and the parameter
  all-gathers of ZeRO-3 / FSDP2 full_shard in every micro-step's forward and backward, each collective
  charged to the slowest link it crosses (`collective_seconds`): the GPU interconnect within a node, the
  network's share of each GPU across nodes (a ring over several nodes runs at the slower of the two).
  Hybrid FSDP2 gathers within a node and all-reduces only a node's shard of the gradients across nodes;
  ZeRO++ hpZ gathers across nodes in the forward and within a node in the backward, qwZ halving that
  forward gather (int8) and qgZ quartering the gradients' bytes (int4);
- offload over PCIe: gradients down and parameters up per step (ZeRO-3: parameters every micro-step),
  plus CPU Adam at `CPU_ADAM_PARAMS_PER_S`; offloaded activations out and back every micro-step;
- chunked loss: the head's forward once more (2 * vocabulary * hidden FLOPs per token); op-level
  checkpointing recomputes no matmul, so it adds nothing here; pure bf16 runs at the bf16 rate;
- a floor for small models: a step never runs faster than the host issues its operations, at
  `SECONDS_PER_KERNEL` each (`host_seconds`): the kernels counted in each simulated forward + backward
  (recomputation and activation-offload copies included), a sharding engine's per-parameter or per-unit
  work (`engine_host_ops`) and the optimizer step's ops (`optimizer_host_ops`). Eager PyTorch spends
  ~5-25 us of host work per op before its kernel runs (Python, autograd, the dispatcher,
  `cudaLaunchKernel`); `python bench/measurements/host_ops.py` measures it on the host at hand, and counts the ops
  FSDP2 and the optimizers add.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autofit.config import Config, Engine, Loss, Offload, Optimizer, Quantization, Sharding
from autofit.estimate.facts import ModelFacts
from autofit.devices.gpus import GpuProfile
from autofit.estimate.workload import Workload, workload
from autofit.strategies import completed

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec

MFU = 0.5  # achievable share of peak tensor-core TFLOP/s in training
HALF_SATURATION_TOKENS = 512  # tokens per micro-batch at which a GPU reaches half its utilisation
NF4_SLOWDOWN, INT8_SLOWDOWN = 1.25, 2.0
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed CPU Adam, parameters updated per second per rank
SECONDS_PER_KERNEL = 10e-6  # host time to issue one op of an eager training step (bench/measurements/host_ops.py)
# Ops FSDP2 dispatches per unit and micro-step on one rank beside the model's: copies in and out of the
# gathered and reduced buffers, `chunk_cat`, and its `record_function` markers (bench/measurements/host_ops.py, torch 2.13)
# (hybrid: full_shard's, and the all-reduce across nodes is one more transfer per unit: `engine_host_ops`)
FSDP_OPS_PER_UNIT = {Sharding.FSDP_FULL: 26, Sharding.FSDP_GRAD_OP: 22, Sharding.FSDP_HYBRID: 26}
QUANTIZED_WEIGHT_BYTES = 1  # ZeRO++ qwZ gathers int8 weights (block scales neglected)
QUANTIZED_GRAD_SHARE = 0.25  # ZeRO++ qgZ reduces int4 gradients: a quarter of 16-bit ones'


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one optimizer step, by what they are spent on."""

    compute: float  # every micro-step's arithmetic, and activation copies to the host and back
    within_node: float  # collectives over the GPUs' interconnect (NVLink, PCIe) inside a node
    across_nodes: float  # collectives that cross the network between nodes
    offload: float  # model states over PCIe and CPU Adam
    host: float = 0.0  # the host's floor: issuing every op of the step (`host_seconds`)

    @property
    def seconds(self) -> float:
        """The step: its parts in sequence, never under the host's floor."""
        return max(self.compute + self.within_node + self.across_nodes + self.offload, self.host)


@dataclasses.dataclass(frozen=True)
class Links:
    """What a collective may cross, in B/s each GPU sends: its interconnect within a node, and its share of
    the network across nodes (None on one node)."""

    within: float
    across: float | None
    nodes: int = 1

    def ring(self, ranks: int, nbytes: float, spans_nodes: bool) -> tuple[float, float]:
        """(within-node, across-node) seconds of one ring all-gather or reduce-scatter of `nbytes` over
        `ranks` GPUs: each sends (ranks - 1) / ranks of it, at the slowest link the ring crosses."""
        if ranks < 2:
            return 0.0, 0.0
        share = (ranks - 1) / ranks * nbytes
        if spans_nodes and self.nodes > 1:
            return 0.0, share / min(self.within, self.across or self.within)
        return share / self.within, 0.0
# Ops of one optimizer step on the weights' device as CUDA's default runs it (foreach): (fixed, per
# trainable tensor, a one-tensor step), counted on the CPU with foreach=True (bench/measurements/host_ops.py, torch
# 2.13). bitsandbytes' 8-bit step loops over the parameters in Python: one fused update and a
# `torch.cuda.synchronize()` each (bitsandbytes/optim/optimizer.py `Optimizer8bit.step`, @ 51294d90).
OPTIMIZER_OPS = {Optimizer.ADAMW: (8, 0, 8), Optimizer.USER: (8, 0, 8), Optimizer.ADAFACTOR: (23, 4, 20),
                 Optimizer.ADAMW8BIT: (0, 2, 2), Optimizer.PAGED_ADAMW8BIT: (0, 2, 2)}


def step_seconds(spec: "TrainSpec", config: Config, gpu: GpuProfile, facts: ModelFacts,
                 work: Workload | None = None, offloaded_activations: int = 0, kernels: int = 0) -> float:
    """Predicted seconds per optimizer step of `config` on `gpu` (the module docstring; `step_cost` has the
    parts)."""
    return step_cost(spec, config, gpu, facts, work, offloaded_activations, kernels).seconds


def step_cost(spec: "TrainSpec", config: Config, gpu: GpuProfile, facts: ModelFacts,
              work: Workload | None = None, offloaded_activations: int = 0, kernels: int = 0) -> StepCost:
    """Predicted seconds per optimizer step of `config` on `gpu`, by part (the module docstring).
    `work` is the model's per-sample arithmetic (`autofit.estimate.workload`), found from `spec` when None;
    `offloaded_activations`: bytes of saved tensors copied to the host and back in each micro-step;
    `kernels`: kernels one micro-step launches (`Estimate.kernels`; 0: no launch floor). The compute part
    never implies more than the card's peak FLOP/s. The network between nodes is `spec.target`'s."""
    work = work or workload(spec, facts.num_params, facts.num_blocks)
    adapters = config.adapters
    recomputed = sum(strategy.recomputes(config) for strategy in completed())  # share of the forward run again
    per_position = (4 if adapters else 6) + 2 * recomputed
    flops = config.micro_batch_size * work.flops(per_position, recomputed)
    hf = spec.model.hf_config
    if config.loss is Loss.CHUNKED and hf is not None:  # the head's forward again, chunk by chunk
        tokens = spec.tokens_per_sample or 1
        flops += config.micro_batch_size * 2 * getattr(hf, "vocab_size", 0) * getattr(hf, "hidden_size", 0) * tokens
    positions = config.micro_batch_size * work.positions
    compute = spec.model.computes_in(config.precision)  # a model given in bf16 computes in bf16 at "fp32"
    peak = gpu.tflops(compute) * 1e12
    rate = peak * MFU * positions / (positions + HALF_SATURATION_TOKENS)
    slowdown = {Quantization.NF4: NF4_SLOWDOWN, Quantization.INT8: INT8_SLOWDOWN}.get(config.quantization, 1.0)
    pcie_copies = 2 * offloaded_activations / (gpu.pcie_gbps * 1e9)  # out and back
    micro = max(flops / rate * slowdown, flops / peak) + pcie_copies
    n, pcie = config.num_gpus, gpu.pcie_gbps * 1e9
    inter = spec.target.inter_node_gbps
    links = Links(gpu.interconnect_gbps * 1e9, inter * 1e9 if inter else None, config.nodes)
    trained = (config.lora or 16) * facts.lora_params_per_rank if adapters else facts.trainable_params
    half = 4 if compute == "fp32" else 2
    grad_bytes = (half if config.zero_stage or config.pure_bf16 or spec.model.half_weights else 4) * trained
    within, across = collective_seconds(config, links, grad_bytes, half * facts.num_params)
    offload = 0.0
    if config.offload is not Offload.NONE:
        offload = 2 * half * trained / n / pcie + trained / n / CPU_ADAM_PARAMS_PER_S
        if config.shards_parameters:
            offload += config.grad_accum_steps * 2 * half * facts.num_params / n / pcie
    return StepCost(config.grad_accum_steps * micro, within, across, offload, host_seconds(config, facts, kernels))


def collective_seconds(config: Config, links: Links, grad_bytes: float, weight_bytes: float) -> tuple[float, float]:
    """(within-node, across-node) seconds of one optimizer step's collectives: the gradients' all-reduce
    (reduce-scatter and all-gather) once per step, and with sharded parameters two all-gathers of the
    16-bit weights (`weight_bytes`) in every micro-step, forward and backward. Over one node everything is
    within it; over several, a collective of every rank crosses the network, while hybrid FSDP2 keeps its
    gathers and a first reduce within the node and all-reduces a node's shard across nodes, and ZeRO++
    hpZ gathers the backward's weights within the node."""
    n, per_node, micro = config.num_gpus, config.gpus_per_node, config.grad_accum_steps
    steps: list[tuple[float, float]] = []  # (within, across) seconds of each collective, times its count
    if config.sharding is Sharding.FSDP_HYBRID:
        steps += [_times(2, links.ring(per_node, grad_bytes, False)),  # reduce within the node
                  _times(2, links.ring(config.nodes, grad_bytes / per_node, True)),  # a shard's replicas
                  _times(2 * micro, links.ring(per_node, weight_bytes, False))]
    elif n > 1:
        quantized = config.sharding is Sharding.ZERO3_HPZ_QUANTIZED
        steps.append(_times(2, links.ring(n, grad_bytes * (QUANTIZED_GRAD_SHARE if quantized else 1), True)))
        if config.sharding.hierarchical:  # forward over every rank (int8 under qwZ), backward within the node
            forward = weight_bytes * (QUANTIZED_WEIGHT_BYTES / 2 if quantized else 1)
            steps += [_times(micro, links.ring(n, forward, True)), _times(micro, links.ring(per_node, weight_bytes, False))]
        elif config.shards_parameters:
            steps.append(_times(2 * micro, links.ring(n, weight_bytes, True)))
    return sum(w for w, _ in steps), sum(a for _, a in steps)


def _times(count: float, seconds: tuple[float, float]) -> tuple[float, float]:
    return count * seconds[0], count * seconds[1]


def host_seconds(config: Config, facts: ModelFacts, kernels: int) -> float:
    """Seconds the host needs to issue one optimizer step's ops, the GPU's floor (0 without a simulated
    kernel count): every micro-step's kernels and its engine's work, then the optimizer step."""
    if not kernels:
        return 0.0
    micro = kernels + engine_host_ops(config, facts)
    return (config.grad_accum_steps * micro + optimizer_host_ops(config, facts)) * SECONDS_PER_KERNEL


def optimizer_host_ops(config: Config, facts: ModelFacts) -> int:
    """Ops of one optimizer step (`OPTIMIZER_OPS`): the whole model's foreach step, or with the step in
    backward one single-tensor step per trainable tensor."""
    fixed, per_tensor, single = OPTIMIZER_OPS[config.optimizer]
    tensors = facts.tensors_trained(config.adapters)
    return tensors * single if config.steps_in_backward else fixed + per_tensor * tensors


def engine_host_ops(config: Config, facts: ModelFacts) -> int:
    """Host operations a sharding engine adds to each micro-step beside the model's kernels.

    DeepSpeed ZeRO runs a Python hook per trainable parameter that copies its gradient into the reduce
    bucket (deepspeed/runtime/zero/stage_1_and_2.py `reduce_independent_p_g_buckets_and_remove_grads`:
    `new_grad_tensor.copy_(...)`; stage 3 likewise), and with CPU offload copies it to the host as well.
    FSDP2 works per unit (each block and the root): `FSDP_OPS_PER_UNIT` as counted on one rank, plus an
    all-gather per gather and a reduce-scatter over several GPUs, and with CPU offload as many copies
    across PCIe."""
    if config.engine is Engine.DEEPSPEED:
        return (3 if config.offloads else 2) * facts.tensors_trained(config.adapters)
    if config.engine is Engine.FSDP:
        transfers = (2 if config.shards_parameters else 1) + 1  # gathers in forward (and backward), one reduce
        across = config.sharding is Sharding.FSDP_HYBRID and config.nodes > 1  # the replicas' all-reduce
        per_unit = FSDP_OPS_PER_UNIT[config.sharding] + transfers * ((config.num_gpus > 1) + config.offloads) + across
        return per_unit * (facts.num_blocks + 1)
    return 0
