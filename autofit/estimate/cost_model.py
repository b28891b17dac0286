"""The cost model: predicted seconds per optimizer step of a candidate on a GPU profile, which ranks the
dry-run's fitting candidates (`autofit.pipelines.dry_run`; `autofit tune` measures instead).

On one GPU's figures, with each technique's term supplied by its strategy (`autofit.strategies.base`'s
step-time hooks, combined over `completed()` strategies, so that this module names no technique):
- compute: 6 FLOPs per parameter per position (forward 2, backward 4; 4 where a strategy's `trains` says the
  base is frozen, LoRA's) plus 12 * layers * seq^2 * hidden per sample for attention, at `MFU` of the GPU's
  peak TFLOP/s for the compute dtype (`Strategy.compute_dtype`; none given: the model's own weights'),
  times a utilisation `t / (t + HALF_SATURATION_TOKENS)` of the micro-batch's t positions, and never faster
  than the peak itself. Positions per sample are what the model processes (`autofit.estimate.workload`):
  tokens, image patches (197 for ViT-B/16 at 224 px), speech frames (1,500 for Whisper), or an
  encoder-decoder's source tokens through the encoder plus its target tokens through the decoder;
- recomputation: `Strategy.recomputes`, the share of the forward run again (full checkpointing one forward,
  +2 FLOPs per parameter-token; every k-th block 1/k of that; op-level checkpointing recomputes no matmul);
- extra FLOPs per sample: `Strategy.extra_flops` (a chunked loss runs the head's forward once more,
  2 * vocabulary * hidden FLOPs per token);
- a slower rate: `Strategy.compute_slowdown` (quantized base weights are dequantized in every matmul);
- communication: `Strategy.collective_seconds` of the sharding engine that runs the step (the parameter
  all-gathers of ZeRO-3 / FSDP2 full_shard in every micro-step's forward and backward; hybrid FSDP2 and
  ZeRO++ hpZ as their strategies say), else a ring all-reduce of the gradients per step over several GPUs;
  each collective charged to the slowest link it crosses (`autofit.strategies.costs.Links`): the GPU
  interconnect within a node, the network's share of each GPU across nodes. The gradients are 16-bit where
  the compute dtype is and a strategy says so (`Strategy.half_gradients`) or the model's weights are;
- offload over PCIe: `Strategy.offload_seconds` (gradients down, parameters up, the host's optimizer step);
  offloaded activations out and back every micro-step (`offloaded_activations`, counted by the simulation);
- a floor for small models: a step never runs faster than the host issues its operations, at
  `SECONDS_PER_KERNEL` each (`host_seconds`): the kernels counted in each simulated forward + backward
  (recomputation and activation-offload copies included), what a strategy adds per micro-step
  (`Strategy.host_ops`: a sharding engine's per-parameter or per-unit work, `engine_host_ops`) and per
  optimizer step (`Strategy.step_ops`: the optimizer's, `optimizer_host_ops`). Eager PyTorch spends
  ~5-25 us of host work per op before its kernel runs (Python, autograd, the dispatcher,
  `cudaLaunchKernel`); `python bench/measurements/host_ops.py` measures it on the host at hand, and counts the ops
  FSDP2 and the optimizers add.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from autofit.config import Config
from autofit.devices.gpus import DTYPE_RATES, GpuProfile
from autofit.estimate.facts import ModelFacts
from autofit.estimate.workload import Workload, workload
from autofit.strategies import completed
from autofit.strategies.costs import Links, StepFacts, summed, times

if TYPE_CHECKING:
    import torch

    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy

__all__ = ["Links", "StepCost", "collective_seconds", "engine_host_ops", "host_seconds", "optimizer_host_ops",
           "step_cost", "step_seconds"]

MFU = 0.5  # achievable share of peak tensor-core TFLOP/s in training
HALF_SATURATION_TOKENS = 512  # tokens per micro-batch at which a GPU reaches half its utilisation
SECONDS_PER_KERNEL = 10e-6  # host time to issue one op of an eager training step (bench/measurements/host_ops.py)
DTYPE_NAMES = DTYPE_RATES  # a dtype as `GpuProfile.tflops` names its rate (the GPU catalogue's fact)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one optimizer step, by what they are spent on."""

    compute: float  # every micro-step's arithmetic, and activation copies to the host and back
    within_node: float  # collectives over the GPUs' interconnect (NVLink, PCIe) inside a node
    across_nodes: float  # collectives that cross the network between nodes
    offload: float  # model states over PCIe and the host's optimizer step
    host: float = 0.0  # the host's floor: issuing every op of the step (`host_seconds`)

    @property
    def seconds(self) -> float:
        """The step: its parts in sequence, never under the host's floor."""
        return max(self.compute + self.within_node + self.across_nodes + self.offload, self.host)


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
    strategies = completed()
    step = step_facts(spec, config, gpu, facts, strategies)
    frozen = any(s.trains(config, facts) is not None for s in strategies)
    recomputed = sum(strategy.recomputes(config) for strategy in strategies)  # share of the forward run again
    per_position = (4 if frozen else 6) + 2 * recomputed
    flops = config.micro_batch_size * work.flops(per_position, recomputed)
    flops += config.micro_batch_size * sum((s.extra_flops(config, step) for s in strategies), 0)
    positions = config.micro_batch_size * work.positions
    peak = gpu.tflops(computes_in(spec, config, strategies)) * 1e12
    rate = peak * MFU * positions / (positions + HALF_SATURATION_TOKENS)
    slowdown = 1.0
    for strategy in strategies:
        slowdown *= strategy.compute_slowdown(config)
    pcie_copies = 2 * offloaded_activations / step.pcie  # out and back
    micro = max(flops / rate * slowdown, flops / peak) + pcie_copies
    within, across = _collectives(config, step, strategies)
    offload = sum((s.offload_seconds(config, step) for s in strategies), 0.0)
    return StepCost(config.grad_accum_steps * micro, within, across, offload,
                    host_seconds(config, facts, kernels, step, strategies))


def computes_in(spec: "TrainSpec", config: Config, strategies: Sequence["Strategy"]) -> str:
    """The dtype `config`'s step computes in, as `GpuProfile.tflops` names it ("fp32", "bf16", "fp16"): the
    first a strategy names (`Strategy.compute_dtype`), else the model's own (a model given in bf16 computes
    in bf16 where no strategy casts it)."""
    dtype: "torch.dtype | None" = next((d for s in strategies if (d := s.compute_dtype(config)) is not None), None)
    if dtype is not None:
        return DTYPE_NAMES[str(dtype).removeprefix("torch.")]
    return DTYPE_NAMES[spec.model.weights_dtype] if spec.model.half_weights else "fp32"


def step_facts(spec: "TrainSpec", config: Config, gpu: GpuProfile, facts: ModelFacts,
               strategies: Sequence["Strategy"] | None = None) -> StepFacts:
    """The figures of `config`'s step on `gpu` that the strategies' step-time hooks read (`StepFacts`)."""
    strategies = completed() if strategies is None else strategies
    inter = spec.target.inter_node_gbps
    links = Links(gpu.interconnect_gbps * 1e9, inter * 1e9 if inter else None, config.nodes)
    trained, tensors = _trained(config, facts, strategies)
    half = 4 if computes_in(spec, config, strategies) == "fp32" else 2
    half_grads = spec.model.half_weights or any(s.half_gradients(config) for s in strategies)
    return StepFacts(facts=facts, links=links, pcie=gpu.pcie_gbps * 1e9, half=half, trained=trained,
                     tensors=tensors, grad_bytes=(half if half_grads else 4) * trained,
                     weight_bytes=half * facts.num_params, hf=spec.model.hf_config,
                     tokens=spec.tokens_per_sample or 1)


def _trained(config: Config, facts: ModelFacts, strategies: Sequence["Strategy"]) -> tuple[int, int]:
    """(parameters, tensors) that train: what a strategy trains instead (`Strategy.trains`), else the model's."""
    own = (facts.trainable_params, facts.trainable_tensors)
    return next((t for s in strategies if (t := s.trains(config, facts)) is not None), own)


def collective_seconds(config: Config, links: Links, grad_bytes: float, weight_bytes: float,
                       facts: ModelFacts | None = None) -> tuple[float, float]:
    """(within-node, across-node) seconds of one optimizer step's collectives (the module docstring): those
    of the strategy that runs them (`Strategy.collective_seconds`), else data parallelism's all-reduce of the
    gradients (`grad_bytes`) once per step; `weight_bytes`: the 16-bit weights a sharded step gathers."""
    step = StepFacts(facts=facts, links=links, pcie=0.0, half=2, trained=0, tensors=0, grad_bytes=grad_bytes,
                     weight_bytes=weight_bytes)
    return _collectives(config, step, completed())


def _collectives(config: Config, step: StepFacts, strategies: Sequence["Strategy"]) -> tuple[float, float]:
    found = next((c for s in strategies if (c := s.collective_seconds(config, step)) is not None), None)
    if found is not None:
        return found
    n = config.num_gpus
    return summed([times(2, step.links.ring(n, step.grad_bytes, True))] if n > 1 else [])


def host_seconds(config: Config, facts: ModelFacts, kernels: int, step: StepFacts | None = None,
                 strategies: Sequence["Strategy"] | None = None) -> float:
    """Seconds the host needs to issue one optimizer step's ops, the GPU's floor (0 without a simulated
    kernel count): every micro-step's kernels and what the strategies add to each (`engine_host_ops`), then
    the optimizer step's (`optimizer_host_ops`)."""
    if not kernels:
        return 0.0
    micro = kernels + engine_host_ops(config, facts, step, strategies)
    return (config.grad_accum_steps * micro + optimizer_host_ops(config, facts, step, strategies)) * SECONDS_PER_KERNEL


def optimizer_host_ops(config: Config, facts: ModelFacts, step: StepFacts | None = None,
                       strategies: Sequence["Strategy"] | None = None) -> int:
    """Ops of one optimizer step, as the strategies count them (`Strategy.step_ops`: the optimizer's)."""
    strategies = completed() if strategies is None else strategies
    step = step or _bare_step(config, facts, strategies)
    return sum(s.step_ops(config, step) for s in strategies)


def engine_host_ops(config: Config, facts: ModelFacts, step: StepFacts | None = None,
                    strategies: Sequence["Strategy"] | None = None) -> int:
    """Host operations the strategies add to each micro-step beside the model's kernels (`Strategy.host_ops`:
    a sharding engine's per-parameter hooks or per-unit copies and collectives)."""
    strategies = completed() if strategies is None else strategies
    step = step or _bare_step(config, facts, strategies)
    return sum(s.host_ops(config, step) for s in strategies)


def _bare_step(config: Config, facts: ModelFacts, strategies: Sequence["Strategy"]) -> StepFacts:
    """`StepFacts` with what the host's count reads (the model's facts and the tensors that train) alone."""
    trained, tensors = _trained(config, facts, strategies)
    return StepFacts(facts=facts, links=Links(1.0, None), pcie=0.0, half=2, trained=trained, tensors=tensors,
                     grad_bytes=0.0, weight_bytes=0.0)
