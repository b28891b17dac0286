"""Estimate: a candidate's peak memory per device, predicted without running it and without a GPU.

    peak = params + grads + optimizer states   (formulas: precision, ZeRO, FSDP2, 8-bit states, LoRA, NF4, offload)
         + gathered                            (ZeRO-3 / FSDP2: full weights of the blocks in use)
         + activations                         (the real forward + backward under fake tensors, tracked)
         + overhead                            (CUDA context, allocator rounding and fragmentation, buckets)

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3): with mixed precision
under DeepSpeed, 2 bytes of fp16/bf16 parameters, 2 of gradients and K = 12 of fp32 master weights and
Adam moments per parameter, each partitioned over N GPUs by its stage. Without ZeRO, autofit trains
with autocast: the weights as the model stores them (fp32: 4 bytes; a bf16 model: 2), gradients and the
optimizer's states in the same dtype; DDP's gradients are bucket views, live for the whole step. FSDP2
shards all three over N and gathers blocks in the mixed-precision policy's dtype.

Activations are measured, not guessed (`autofit.estimate.simulate`): the model is built on the meta device,
materialised as fake tensors (shapes, no data), and one forward + backward runs under a dispatch mode
that counts every storage alive, as `autofit.probe.memory.CpuBudget` does for real tensors. Weight gradients are dropped as
soon as they are made, so the curve is activations alone; the bytes of gradients made so far are
recorded beside it. Deep Hugging Face models are simulated at 2 and 4 blocks and extrapolated linearly
in depth (blocks are identical), and at micro-batch 1 and 2, extrapolated linearly in the micro-batch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn

from autofit.config import Checkpointing, Config, Engine, Offload, Optimizer, Quantization, Sharding
from autofit.export.deepspeed import buffers_for, deepspeed_elements
from autofit.estimate.facts import ModelFacts, formula_activations, meta_model, model_facts  # noqa: F401 (re-exported)
from autofit.estimate.facts import depth_key as _depth_key, rebuild as _rebuild
from autofit.estimate import cuda_attention
from autofit.estimate.engines import EngineMemory, engine_memory
from autofit.estimate.simulate import ALLOCATOR_ROUNDING, ActivationPeak, simulate_step  # noqa: F401 (re-exported)
from autofit.estimate.simulate import is_adapted, within_block
from autofit.strategies.quantization import NF4_BYTES, nf4_bytes  # noqa: F401 (NF4_BYTES re-exported)

if TYPE_CHECKING:
    from autofit.spec.train import TrainSpec
    from autofit.strategies.base import Strategy

MIB = 1024**2
# Overhead terms on a CUDA device, each documented where the peak is assembled (`_overhead`).
# The CUDA context of a training process: the driver context plus every kernel module the step loads
# lazily (cuBLAS, attention, the optimizer's foreach kernels). Measured in a probe on one H100, torch
# 2.11 + CUDA 13 (bench/results/estimate-cuda-2026-11-22.json): 790-796 MiB beyond the allocator on tiny
# models. A bare context before any kernel loads is smaller: 287 MB (CUDA 11.7, pytorch/pytorch#86509),
# 426 MiB (torch 2.10 + CUDA 13, RTX 6000 Ada, unslothai/unsloth-zoo#1053); the larger figure is kept, an
# over-count being a margin and an under-count a promised fit that runs out of memory.
CUDA_CONTEXT_BYTES = 800 * MIB
CUBLAS_WORKSPACE_BYTES = 32 * MIB  # cuBLAS workspace per stream (Hopper default, 4 MiB x 8)
FRAGMENTATION = 0.05  # reserved-but-free share of the transient bytes where the step is not simulated
# Simulations expected to take this long (the first one's time x their count) pay for worker processes,
# each of which first imports torch and transformers (~7 s on a 2-core x86_64 machine).
SPREAD_AFTER_S = 15.0
SIM_DEPTHS = (1, 2)  # blocks simulated for deep models; (k, 2k) when every k-th block is checkpointed
INT8_BYTES = 1.0  # LLM.int8 weights; the fp32 per-row scales are counted per output row
NF4_PACKED_BYTES = 0.5  # two 4-bit weights a byte: the parameter's data (`quant_storage` is only its dtype)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Bytes per device, by what holds them."""

    params: int  # the partitioned (or whole) weights and the buffers: with grads and optimizer, the model states
    grads: int
    optimizer: int  # states and the optimizer step's temporaries
    activations: int
    overhead: int
    gathered: int = 0  # ZeRO-3 / FSDP2: full weights gathered for the blocks in use (and their unsharded grads)

    @property
    def total(self) -> int:
        """Sum of the parts (bytes)."""
        return self.params + self.grads + self.optimizer + self.activations + self.overhead + self.gathered

    def to_dict(self) -> dict[str, int]:
        """JSON form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A predicted peak per device (bytes), its parts, host RAM needed (bytes, all ranks), and how it was made."""

    breakdown: Breakdown
    peak_bytes: int  # the parts are not all live at the peak moment: peak <= breakdown.total
    cpu_bytes: int  # host RAM for offloaded states (all ranks on one node) and offloaded activations; 0 without
    reason: str  # one line: how activations were obtained and which parts are formulas only
    terms: tuple[tuple[str, int], ...] = ()  # the overhead, term by term
    method: str = ""  # how the activations were obtained (one phrase, the first part of `reason`)
    simulated: bool = True  # False: the step could not be simulated and activations come from a formula
    error_bound: float = 0.0  # relative error the peak may carry upwards: the formula's measured bound (0 when simulated)

    @property
    def upper_bytes(self) -> int:
        """The peak at its error bound (bytes): what a verdict resting on a formula must fit."""
        return int(self.peak_bytes * (1 + self.error_bound))
    offloaded_activations: int = 0  # bytes of saved activations copied to the host and back per micro-step
    kernels: int = 0  # kernels one micro-step's forward + backward launches (simulated; 0 from a formula)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"peak_bytes": self.peak_bytes, "cpu_bytes": self.cpu_bytes, "reason": self.reason,
                "breakdown": self.breakdown.to_dict(), "overhead_terms": dict(self.terms),
                "activations": "simulated" if self.simulated else "formula", "error_bound": self.error_bound}


# -- model states --------------------------------------------------------------------------------------
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
    optimizer is counted as AdamW (a fallback: its states are unknown)."""
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
    if config.pure_bf16 or (config.half_precision and config.zero_stage > 0):
        return facts.half_buffer_bytes
    return facts.buffer_bytes


def _states(facts: ModelFacts, config: Config) -> States:
    """Parameters, gradients and optimizer states per device for `config` (ZeRO paper accounting).

    - torch (one GPU, DDP): the weights as the model stores them (fp32 under autocast: 4 bytes; a bf16
      model 2), gradients and states in the same dtype; nothing is partitioned.
    - ZeRO 1/2/3 with fp16/bf16: 2 bytes of half weights and grads; fp32 master weights + states (K)
      partitioned over N by stage 1, grads too by stage 2, weights too by stage 3.
    - FSDP2: the weights, gradients and states of the torch case, all sharded over N (`_fsdp_states`).
    - offload "cpu"/"nvme": master weights and optimizer states leave the GPU (stage 3: weights too).
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
    if config.zero_stage == 0:
        return States(int(wb * facts.num_params), int(wb * trainable),
                      int(optimizer_bytes(facts, config.optimizer, trainable, wb)))
    half = 2 if config.half_precision else 4
    master = 4 * trainable  # fp32 copies the optimizer updates: a clone even in fp32 (stage_1_and_2.py l.570)
    k_bytes = master + optimizer_bytes(facts, config.optimizer, trainable)
    params = half * trainable / (n if config.zero_stage >= 3 else 1) + wb * frozen
    grads = half * trainable / (n if config.zero_stage >= 2 else 1)
    optimizer = k_bytes / n
    if not config.offloads:
        return States(int(params), int(grads), int(optimizer))
    # Host RAM over all N ranks: each rank's K-byte partition plus its fp32 gradient partition for CPU Adam.
    to_host = config.offload is Offload.CPU
    cpu = k_bytes + 4 * trainable if to_host else 0
    if config.zero_stage >= 3:
        cpu += half * trainable if to_host else 0
        params = wb * frozen
    return States(int(params), int(grads), 0, int(cpu))


def _fsdp_states(facts: ModelFacts, config: Config) -> States:
    """FSDP2 (`fully_shard` on each block and the root) keeps each parameter as a 1/N shard in its own
    dtype, its gradient shard in the same dtype (the reduce-scatter output) and the optimizer's states on
    the shards: everything over N, at every sharding mode (the modes differ in what is gathered, see
    `Estimator._gathered`). `CPUOffloadPolicy` keeps all three in host memory. Pure bf16 casts the
    weights to bf16 before they are sharded."""
    n = max(config.num_gpus, 1)
    wb, trainable = 2.0 if config.pure_bf16 else facts.weight_bytes, facts.trainable_params
    states = States(int(wb * facts.num_params / n), int(wb * trainable / n),
                    int(optimizer_bytes(facts, config.optimizer, trainable, wb) / n))
    if config.offload is Offload.CPU:
        return States(0, 0, 0, n * (states.params + states.grads + states.optimizer))
    return states


def _sharded(states: States, config: Config, resident: int = 0) -> States:
    """Adapter states under a sharding engine: FSDP2 shards all three (or keeps them on the host with CPU
    offload); ZeRO by its stage. `states` are one rank's unsharded states, of whose weights `resident`
    bytes are no parameter's data and stay whole on every device (`quantization_constants`)."""
    n = max(config.num_gpus, 1)
    fsdp = config.engine is Engine.FSDP
    if fsdp and config.offload is Offload.CPU:  # CPUOffloadPolicy: every state on the host
        return States(resident, 0, 0, states.params - resident + states.grads + states.optimizer)
    if n == 1 or config.sharding.stage == 0:
        return states
    return States((states.params - resident) // (n if fsdp or config.shards_parameters else 1) + resident,
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
    """LoRA: the frozen base as stored (or NF4/int8 where quantized), the adapters (`adapter_weights`)
    with gradients and states in their dtype."""
    adapters, size = adapter_weights(facts, config)
    base, wb = facts.num_params - (adapters if own_adapters(facts, config) else 0), facts.weight_bytes
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


# -- simulations kept for the process --------------------------------------------------------------------
class _Simulations:
    """Simulated steps kept for the life of the process, least recently used dropped past `size`: a second
    dry-run or tune of the same model and batch (another GPU, budget or rank count, in a notebook or a
    script planning several) simulates nothing again. Keyed by `workload_key` and the simulation key."""

    def __init__(self, size: int = 20_000):
        self.size = size
        self.kept: collections.OrderedDict[tuple, tuple[ActivationPeak | None, str]] = collections.OrderedDict()

    def get(self, key: tuple) -> tuple[ActivationPeak | None, str] | None:
        found = self.kept.get(key)
        if found is not None:
            self.kept.move_to_end(key)
        return found

    def put(self, key: tuple, value: tuple[ActivationPeak | None, str]) -> None:
        self.kept[key] = value
        self.kept.move_to_end(key)
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)


_SIMULATIONS = _Simulations()


def workload_key(meta: nn.Module, spec: "TrainSpec", sim_device: str, adapted: frozenset[str],
                 adapter_dropout: float = 0.0) -> str:
    """What a simulated step depends on besides its config: the model (class, modules and their shapes,
    a Hugging Face config in full), the batch's structure, shapes and dtypes, the loss function's code,
    the simulating device, the layers LoRA adapts and whether its adapters drop out their inputs."""
    hf = getattr(meta, "config", None)
    described = {k: v for k, v in hf.to_dict().items() if k != "_name_or_path"} if hasattr(hf, "to_dict") else {}
    parts = [type(meta).__module__, type(meta).__qualname__, repr(meta), json.dumps(described, sort_keys=True, default=str),
             _structure(spec.batch_factory(1)), _code(spec.loss_fn), sim_device, sorted(adapted), adapter_dropout > 0]
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


def _structure(value: Any) -> str:
    """Shapes and dtypes of every tensor in a batch, keys and nesting kept; other leaves by type."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_structure(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[" + ",".join(_structure(v) for v in value) + "]"
    return type(value).__qualname__


def _code(fn: Any) -> str:
    """A loss function by its code (a partial by its function and arguments); None is the default loss."""
    if fn is None:
        return "default"
    if isinstance(fn, functools.partial):
        return f"partial({_code(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    code = getattr(fn, "__code__", None)
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    return name + (hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest() if code else repr(fn))


# -- the estimator ---------------------------------------------------------------------------------------
class Estimator:
    """Predicts `Estimate`s for the configurations of one spec, caching each simulated forward + backward
    by (precision, attention, checkpointing, micro-batch).

    `target` is the device type predicted for: "cuda" adds the CUDA overhead terms and simulates CUDA
    kernels where this torch build has CUDA (else CPU kernels stand in, and the reason says so);
    "cpu" predicts what `autofit.probe.memory.CpuBudget` measures.

    `deferred_sync`: the training loop reduces gradients on the last micro-batch of each step only
    (accelerate's `accumulate()` and the Trainer without `sync_each_batch`, Lightning's
    `no_backward_sync`, FSDP1's `no_sync`). Under FSDP that keeps every gradient unsharded between
    micro-batches (`_held_grads`). False: autofit's loop and its exports, which reduce every micro-batch.
    """

    def __init__(self, spec: "TrainSpec", target: str | None = None, extrapolate_batch: bool = False,
                 strategies: Sequence["Strategy"] = (), deferred_sync: bool = False):
        self.spec = spec
        self.deferred_sync = deferred_sync
        self.strategies = tuple(strategies)
        self.buffers = buffers_for(spec.summary())  # DeepSpeed's buffer sizes, as the probe and the export set them
        self.target = target or spec.device.type
        # True: simulate micro-batches 1 and 2 only and extrapolate linearly (fast, for planning many
        # sizes; checkpointed runs come out a few percent low). False: simulate each micro-batch.
        self.extrapolate_batch = extrapolate_batch
        self.sim_device = "cuda" if self.target == "cuda" and torch.cuda.is_available() else "cpu"
        # CPU kernels standing in for CUDA run attention as CUDA's kernel for that GPU would (Ampere or
        # later where no GPU profile says otherwise); None where the kernels are the target's own.
        self.cuda_ampere = (spec.target.bf16 if spec.target.cuda else True) \
            if self.target == "cuda" and self.sim_device == "cpu" else None
        self._meta = meta_model(spec.model_factory)
        targets = _lora_targets(self._meta, self.strategies)
        self.facts = model_facts(self._meta, targets)
        # LoRA simulates the base frozen and these layers' weights trained: like the adapters beside
        # them, they keep their inputs for backward (their paths inside a block: `simulate.is_adapted`).
        self._adapted = frozenset(within_block(name) for name in (targets or _block_linears(self._meta)))
        self._adapted_params = _weights_of(self._meta, self._adapted)
        self._adapter_dropout = _lora_dropout(self.strategies)
        self._depth_key = _depth_key(self._meta, self.facts)
        self._cache: dict[tuple, tuple[ActivationPeak, str]] = {}
        self._workload = workload_key(self._meta, spec, self.sim_device + cuda_attention.describe(self.cuda_ampere),
                                      self._adapted, self._adapter_dropout)
        self._failed: set[tuple] = set()  # cache keys whose simulation failed (activations by formula)

    # -- activations ---------------------------------------------------------------------------------
    def activations(self, config: Config) -> tuple[ActivationPeak, str]:
        """The `ActivationPeak` at `config`'s micro-batch and how it was obtained (one phrase)."""
        mb = config.micro_batch_size
        if self._sizes(config) == (mb,):
            return self._at_batch(config, mb)
        (one, how), (two, _) = self._at_batch(config, 1), self._at_batch(config, 2)
        line = one.extrapolate(two, mb, 1, 2)
        return dataclasses.replace(line, fragmentation=_free_at_peak(one, two, line)), \
            f"{how}, micro-batch 1 and 2 extrapolated to {mb}"

    def simulated(self, config: Config) -> bool:
        """Whether `config`'s activations were simulated (False: by formula, the simulation failed)."""
        self.activations(config)
        return not any(self._key(config, mb) in self._failed for mb in self._sizes(config))

    def prefetch(self, configs: Iterable[Config]) -> None:
        """Simulate now what predicting `configs` will need, shared with worker processes when the
        simulations are slow and CPUs are spare (`autofit.estimate.workers`): the first one runs here and
        is timed; if the rest would take `SPREAD_AFTER_S` or more at its pace, they are shared out. The
        predictions are the same either way."""
        todo = {self._key(c, mb): (c, mb) for c in configs for mb in self._sizes(c)}
        todo = [job for key, job in todo.items() if key not in self._cache]
        if not todo:
            return
        from autofit.estimate import workers  # here: `python -m autofit.estimate.workers` imports this module

        started = time.perf_counter()
        self._at_batch(*todo[0])
        rest = todo[1:]
        if len(rest) < 2 or (time.perf_counter() - started) * len(rest) < SPREAD_AFTER_S:
            return  # cheap: the rest are simulated when predicted
        helpers = min(workers.spare_cpus(), len(rest) // 2)  # samples the CPUs for 0.2 s
        if helpers < 1:
            return  # no CPU to spare
        shares = [rest[i::helpers + 1] for i in range(helpers + 1)]
        running = workers.start(self.spec, self.strategies, self.target, shares[1:])
        try:
            for config, mb in shares[0] if running else rest:
                self._at_batch(config, mb)
        except BaseException:  # an interrupt (or a bug) here: the workers' results are not waited for
            if running:
                running.close()
            raise
        for (config, mb), found in running.collect() if running else ():
            self._keep(config, mb, found)

    def _sizes(self, config: Config) -> tuple[int, ...]:
        """The micro-batches simulated for `config`: its own, or 1 and 2 to extrapolate from."""
        mb = config.micro_batch_size
        return (mb,) if mb <= 2 or not self.extrapolate_batch else (1, 2)

    def _key(self, config: Config, mb: int) -> tuple:
        return (*_simulation_key(config, mb), config.adapters, own_adapters(self.facts, config),
                _implementation_key(config))

    def _at_batch(self, config: Config, mb: int) -> tuple[ActivationPeak, str]:
        key = self._key(config, mb)
        if key not in self._cache:
            self._keep(config, mb, _SIMULATIONS.get((self._workload, key)) or self.simulate(config, mb))
        return self._cache[key]

    def _keep(self, config: Config, mb: int, found: tuple[ActivationPeak | None, str]) -> None:
        """Keep a simulation's result (for the process too); a failed one's activations come by formula."""
        key = self._key(config, mb)
        if key in self._cache:
            return
        _SIMULATIONS.put((self._workload, key), found)
        peak, how = found
        if peak is None:
            self._failed.add(key)
            peak = self._formula(config, mb)
        self._cache[key] = (peak, how)

    def simulate(self, config: Config, mb: int) -> tuple[ActivationPeak | None, str]:
        """One simulated forward + backward of `config` at micro-batch `mb` (extrapolated in depth for deep
        models) and how it was obtained; (None, why) when it cannot be simulated."""
        where = "CUDA" if self.sim_device == "cuda" else \
            (f"CPU kernels standing in for CUDA (this torch build has no CUDA{cuda_attention.describe(self.cuda_ampere)})"
             if self.target == "cuda" else "CPU")
        k = config.checkpoint_every
        depths = tuple(k * d for d in SIM_DEPTHS)
        try:
            if not self._depth_key or self.facts.num_blocks <= depths[-1]:
                depths = (None,)
            peaks = [self._run(config, mb, depth) for depth in depths]
        except Exception as exc:  # noqa: BLE001 - an op without a fake kernel: fall back to the formula
            return None, (f"simulation failed ({type(exc).__name__}: {str(exc)[:80]}), activations by formula "
                          f"(up to {FORMULA_UNDER_PREDICTION:.1f}x under the simulation where both ran)")
        if len(peaks) == 1:
            return peaks[0], f"activations simulated under fake tensors on {where}"
        total = self.facts.num_blocks
        # What the allocator's cache holds free at the peak is one block's transients and the loss's
        # reused or not, not a sum over blocks: the deeper simulation's, not a line through both.
        deep = dataclasses.replace(peaks[0].extrapolate(peaks[1], total, *depths), fragmentation=peaks[1].fragmentation)
        return (deep,
                f"activations simulated under fake tensors on {where} at {depths[0]} and {depths[1]} "
                f"of {total} blocks, extrapolated")

    def _run(self, config: Config, mb: int, depth: int | None) -> ActivationPeak:
        if depth is None:
            model = meta_model(self.spec.model_factory)
        else:
            model = _rebuild(self._meta, self._depth_key, depth)
        batch = self.spec.batch_factory(mb)
        return simulate_step(model, batch, self.spec.loss_fn, config, device=self.sim_device,
                             half_weights=_half_weights(config),
                             adapted=self._adapted if config.adapters and not own_adapters(self.facts, config) else None,
                             adapter_dropout=self._adapter_dropout, cuda_ampere=self.cuda_ampere)

    def _formula(self, config: Config, mb: int) -> ActivationPeak:
        """The fallback when the step cannot be simulated: `formula_activations` (its error bound is
        `FORMULA_ERROR_BOUND`, measured against the simulation)."""
        total = formula_activations(self.spec.model.hf_config, self.facts, self.spec.tokens_per_sample, mb, config)
        return ActivationPeak(total, total, 0, 0, total, 0)

    def states_floor(self, config: Config) -> int:
        """Bytes per device that `config` holds whatever its activations: weights and optimizer states
        (a lower bound of its peak, from formulas alone; no simulation)."""
        states = model_states(self.facts, config)
        return states.params + states.optimizer

    # -- the peak -------------------------------------------------------------------------------------
    def predict(self, config: Config) -> Estimate:
        """The predicted peak per device of training `config` (bytes), its breakdown and its reason."""
        states = model_states(self.facts, config)
        act, how = self.activations(config)
        notes = [how]
        act = self._adjusted(act, config, notes)
        gathered = self._gathered(config, notes)
        temp = self._optimizer_temporaries(config)
        # DeepSpeed's buffers, ZeRO-3's gathered weights and a tied weight's gradient, by phase (engines.py)
        engine = engine_memory(self.facts, config, deepspeed_elements(config, self.buffers))
        held = self._held_grads(config, states, notes)
        if config.steps_in_backward:  # each parameter steps in its gradient's hook, inside backward
            states, held, temp = dataclasses.replace(states, grads=0), 0, self._step_in_backward(config)
            notes.append("optimizer step in backward: one parameter's gradient and step live at a time")
            transient = max(act.largest, act.at_grad + temp)
        elif config.grad_accum_steps > 1 or _ddp(config) or engine.grads_held:
            # the gradients of earlier micro-batches are live throughout; so are DDP's gradient buckets
            # (gradient_as_bucket_view=True: the gradients are views into buckets allocated up front)
            transient = held + act.largest
        else:  # gradients appear as activations are freed
            transient = act.with_grads(states.grads)
        transient = max(transient + engine.backward, states.grads + temp + engine.step)  # backward, the step
        terms = self._overhead(config, act, temp)
        overhead = sum(b for _, b in terms) + engine.held
        terms += [t for t in engine.terms if t[1]]
        notes += [engine.note] if engine.note else []
        peak = states.params + gathered + states.optimizer + transient + overhead
        breakdown = _parts(dataclasses.replace(states, grads=held), temp, act.largest, overhead, gathered, engine, peak)
        for strategy in self.strategies:  # plug-in techniques say what they do to memory
            changed = strategy.memory(config, breakdown)
            peak, breakdown = peak + changed.total - breakdown.total, changed
        notes += _state_notes(config, states)
        if config.offloads_activations:
            notes.append(f"activation offload: {_size(act.offloaded)} of saved tensors in pinned host memory")
        simulated = self.simulated(config)
        bound = 0.0 if simulated else (FORMULA_UNDER_PREDICTION - 1) * breakdown.activations / max(peak, 1)
        return Estimate(breakdown, int(peak), states.cpu + act.offloaded, "; ".join(notes), tuple(terms),
                        method=notes[0], simulated=simulated, error_bound=round(bound, 4),
                        offloaded_activations=act.offloaded, kernels=act.kernels)

    def unsharded_grads(self, config: Config) -> int:
        """Bytes of the whole model's gradients as FSDP holds them when the reduce waits for the last
        micro-batch: unsharded, in the reduce dtype (FSDP2's `set_requires_gradient_sync(False)`:
        `FSDPParam.to_accumulated_grad_if_needed` upcasts to it, torch/distributed/fsdp/_fully_shard/
        _fsdp_param.py; FSDP1's `no_sync` keeps the flat parameter's unsharded gradient,
        fully_sharded_data_parallel.py): fp32 under autofit's bf16/fp16 policy (`reduce_dtype=torch.float32`)
        and for adapters, else the weights' dtype (bf16 under pure bf16)."""
        facts = self.facts
        if config.adapters:
            adapters, size = adapter_weights(facts, config)
            return int((4 if config.half_precision else size) * adapters)
        if config.pure_bf16:
            return 2 * facts.trainable_params
        return int((4 if config.half_precision else facts.weight_bytes) * facts.trainable_params)

    def _held_grads(self, config: Config, states: States, notes: list[str]) -> int:
        """Gradient bytes live through a backward after the first micro-batch: `unsharded_grads` under FSDP
        with `deferred_sync` (every micro-batch but the last skips the reduce-scatter), else those of
        `states`."""
        if not (self.deferred_sync and config.needs_sync_each_micro_batch):
            return states.grads
        held = self.unsharded_grads(config)
        notes.append(f"gradient reduction deferred to the last micro-batch: {_size(held)} of unsharded "
                     "gradients held")
        return held

    def _adjusted(self, act: ActivationPeak, config: Config, notes: list[str]) -> ActivationPeak:
        """What the simulation cannot see: bitsandbytes' quantized matmuls use no 16-bit copy that autocast
        keeps of an fp32 weight (2 bytes each). NF4 layers are simulated as bitsandbytes' (no such copy)
        but the adapted ones, which the simulation trains in place of their adapters; int8 layers are not
        simulated at all."""
        if own_adapters(self.facts, config):
            notes.append("the model's own adapters trained beside its quantized base")
        elif config.adapters:
            notes.append("LoRA simulated as its frozen base with the adapted layers' inputs kept" +
                         (" (dropped-out copies)" if self._adapter_dropout else ""))
        if config.quantization is Quantization.NF4:
            notes.append("nf4 layers simulated as bitsandbytes' Linear4bit (a 16-bit weight dequantized per matmul)")
        if config.quantization is Quantization.NONE or not config.half_precision or self.facts.weight_bytes <= 2:
            return act
        if config.quantization is Quantization.INT8:
            notes.append("int8 kernels not simulated: 16-bit weight copies removed by formula")
        copies = 2 * (self._adapted_params if config.quantization is Quantization.NF4 else self.facts.linear_params)
        return dataclasses.replace(act, forward=max(0, act.forward - copies), peak=max(0, act.peak - copies),
                                   joint=max(0, act.joint - copies))

    def _gathered(self, config: Config, notes: list[str]) -> int:
        """Full weights gathered from their shards while in use (`Breakdown.gathered`, apart from the
        partitioned model states). ZeRO-3: two blocks (current + prefetch) and the largest tensor, at most
        `stage3_max_live_parameters`, in 16 bits. FSDP2: `_fsdp_gathered`."""
        if config.engine is Engine.FSDP:
            notes.append("FSDP2 gathered weights by formula")
            return self._fsdp_gathered(config)
        return 0  # ZeRO-3's gathered weights are live in the backward only: `engines.zero3_gathered`

    def _fsdp_gathered(self, config: Config) -> int:
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
        facts = self.facts
        size = 2 if config.half_precision else facts.weight_bytes
        root = facts.num_params - facts.num_blocks * facts.block_params
        blocks = min(2 if config.sharding is Sharding.FSDP_FULL else facts.num_blocks, facts.num_blocks)
        block = size * facts.block_params
        packed = {Quantization.NF4: NF4_PACKED_BYTES, Quantization.INT8: INT8_BYTES}.get(config.quantization)
        if packed is not None and facts.num_blocks:  # a quantized block gathers its linear layers packed
            block -= (size - packed) * facts.linear_params / facts.num_blocks
        if config.adapters and not own_adapters(facts, config) and facts.num_blocks:  # autofit's, in the blocks
            adapters, adapter_size = adapter_weights(facts, config)
            block += (2 if config.half_precision else adapter_size) * adapters / facts.num_blocks
        staged = 0 if config.adapters else facts.block_trainable_params * (size + (4 if size < 4 else 0))
        return int(size * root + blocks * block + staged)

    def _step_in_backward(self, config: Config) -> int:
        """Temporaries of one parameter's optimizer step inside backward, for the largest parameter: torch's
        foreach path (CUDA) one tensor of its size, the single-tensor path (CPU) two."""
        element = 2 if config.pure_bf16 else 4
        return (1 if self.target == "cuda" else 2) * element * self.facts.largest_param

    def _optimizer_temporaries(self, config: Config) -> int:
        """Bytes the optimizer step allocates beyond its states. torch's foreach AdamW/Adafactor (the CUDA
        default; also DeepSpeed's torch_adam over its fp32 partition) builds one list the size of the
        trainable weights it updates, in their dtype (`exp_avg_sq_sqrt = torch._foreach_sqrt(...)` in
        torch/optim/adam.py `_multi_tensor_adam`); under FSDP2 those are the 1/N shards. The single-tensor
        path (CPU) makes two temporaries of the largest tensor; bitsandbytes and DeepSpeed's CPU Adam
        (offload) update in place."""
        if config.optimizer.eight_bit or config.zero_stage or \
                (config.engine is Engine.FSDP and config.offload is Offload.CPU):
            return 0  # ZeRO: DeepSpeed is configured with torch's fused AdamW (or its CPU Adam with offload)
        if config.adapters:
            trainable, size = adapter_weights(self.facts, config)
        else:
            trainable, size = self.facts.trainable_params, 4.0 if config.zero_stage else self.facts.weight_bytes
            size = 2.0 if config.pure_bf16 else size  # the temporaries take the parameters' dtype
        if self.target != "cuda":
            return int(2 * size * min(self.facts.largest_param, trainable))
        shards = max(config.num_gpus, 1) if config.shards_optimizer else 1
        return int(size * trainable / shards)

    def _overhead(self, config: Config, act: ActivationPeak, temp: int) -> list[tuple[str, int]]:
        """Overhead terms on CUDA (none on the CPU, where the budget counts tensors only). Fragmentation:
        what the caching allocator reserves beyond its most allocated bytes when the simulated step is
        replayed through it (`autofit.estimate.allocator`; the optimizer step's temporaries reuse the
        blocks the backward freed), else `FRAGMENTATION` of the transient bytes."""
        if self.target != "cuda":
            return []
        fragmentation = act.fragmentation if self.simulated(config) else int(FRAGMENTATION * (act.largest + temp))
        terms = [("cuda_context", CUDA_CONTEXT_BYTES), ("cublas_workspace", CUBLAS_WORKSPACE_BYTES),
                 ("fragmentation", fragmentation)]
        return terms  # DeepSpeed's buffers: `autofit.estimate.engines`, on every device


def _parts(states: States, temp: int, activations: int, overhead: int, gathered: int, engine: EngineMemory,
           peak: int) -> Breakdown:
    """The peak's parts, each at its own most (not every part is live at the peak, so they sum to at
    least the peak): DeepSpeed's phase buffers beside the overhead, ZeRO-3's gathered weights beside
    FSDP2's, and transient bytes the backward holds beyond the activations' peak (its last gradients'
    inputs, a hook's step) counted as activations."""
    buffers = dict(engine.terms)
    gathered += buffers.pop("zero3_gathered", 0)
    overhead += sum(buffers.values()) - engine.held
    parts = Breakdown(states.params, states.grads, states.optimizer + temp, activations, overhead, gathered)
    return dataclasses.replace(parts, activations=activations + max(0, peak - parts.total))


def _free_at_peak(one: ActivationPeak, two: ActivationPeak, line: ActivationPeak) -> int:
    """What the allocator's cache holds free at the peak of a micro-batch extrapolated from 1 and 2
    (`line`): the smaller share of the transients it was at 1 and 2, of the line's transients, never below
    either simulated value. Small and uneven at 1 and 2, a line through those values is wrong by gigabytes
    far out; their share of the transients holds. Simulated (MiB free / MiB of transients at the peak):
    ResNet-50 at 224 x 224 in fp16 under ZeRO-1, 22 / 47 at 1, 12 / 89 at 2, 1,401 / 10,927 at 256, where
    the line through 1 and 2 reads 22 and the share about 1,490; with operator checkpointing, 7 / 34,
    27 / 63, 1,820 / 7,963 (line 5,107, share about 1,520); GPT-2 at 1,024 tokens with full checkpointing,
    200 / 805, 293 / 1,537, 5,506 / 23,486 at 32 (line 3,083, share about 4,480); fsdp_qlora's Llama-2-7B
    QLoRA at 2,048 tokens, 2.06 GiB free at 6 and 3.43 at 10 (line 2.35 and 3.95, share 2.11 and 3.51).
    Where they fall from 1 to 2 and rise again (a Whisper-small step: 213, 45, 91, 217 MiB at 1, 2, 4, 8),
    the larger simulated value stands."""
    shares = [peak.fragmentation / peak.largest for peak in (one, two) if peak.largest]
    share = min(shares) if shares else 0.0
    return max(int(share * line.largest), one.fragmentation, two.fragmentation)


def _simulation_key(config: Config, mb: int) -> tuple:
    """What a simulated forward + backward depends on: one simulation serves every config with the same
    key. Weights in 16 bits run without autocast whatever the precision's name (ZeRO's bf16, pure bf16);
    autocast to fp16 and to bf16 cast the same ops to types of the same size (one list per device,
    AT_FORALL_LOWER_PRECISION_FP in aten/src/ATen/autocast_mode.h, cast to the autocast dtype read at run
    time; CPU kernels simulate fp16 as bf16); every fused attention is simulated as SDPA."""
    attention = "fused" if config.attention.fused else config.attention
    return (config.half_precision, attention, config.checkpointing, config.checkpoint_every, mb,
            _half_weights(config), config.activation_offload, config.loss)


def _implementation_key(config: Config) -> tuple:
    """What a simulation depends on besides the config, in the libraries' behaviour it simulates: whether
    bitsandbytes keeps each NF4 layer's input and which dtype it dequantizes to, whether checkpointing
    re-enters (all set by the calibration to simulate runs of older releases and other modes)."""
    from autofit.strategies import checkpointing
    from autofit.strategies.quantization import SimulatedLinear4bit

    nf4 = config.quantization is Quantization.NF4 and (SimulatedLinear4bit.keeps_input,
                                                        SimulatedLinear4bit.quantized_from)
    return nf4, config.checkpointing is not Checkpointing.NONE and checkpointing.REENTRANT


def _half_weights(config: Config) -> bool:
    """DeepSpeed (ZeRO) trains 16-bit weights without autocast, FSDP2's MixedPrecisionPolicy computes on
    16-bit gathered weights without autocast, and pure bf16 trains bf16 weights; torch AMP keeps fp32 weights."""
    return config.pure_bf16 or (config.half_precision and (config.zero_stage > 0 or config.engine is Engine.FSDP))


def _ddp(config: Config) -> bool:
    """Whether `config` trains under DistributedDataParallel (several ranks, no sharding engine)."""
    return config.num_gpus > 1 and config.sharding is Sharding.NONE


def _block_linears(model: nn.Module) -> list[str]:
    """Names of the linear layers inside the model's repeated blocks (LoRA's default without a strategy)."""
    from autofit.spec.model_info import find_blocks

    path, blocks = find_blocks(model)
    return [name for block in blocks for name, m in block.named_modules() if isinstance(m, nn.Linear)
            or type(m).__name__ == "Conv1D"]


def _weights_of(model: nn.Module, adapted: frozenset[str]) -> int:
    """Elements of the weights of the linear layers `adapted` names (`simulate.is_adapted`)."""
    from autofit.strategies.quantization import quantizable_layers

    return sum(model.get_submodule(name).weight.numel() for name in quantizable_layers(model)
               if is_adapted(name, adapted))


def _lora_dropout(strategies: Sequence["Strategy"]) -> float:
    """The planned LoRA strategy's adapter dropout (0 without one)."""
    from autofit.strategies.lora import Lora

    return next((s.dropout for s in strategies if isinstance(s, Lora)), 0.0)


def _lora_targets(model: nn.Module, strategies: Sequence["Strategy"]) -> list[str] | None:
    """The linear layers the planned LoRA strategy adapts (its `target_modules`), or None without one."""
    from autofit.strategies.lora import Lora

    lora = next((s for s in strategies if isinstance(s, Lora)), None)
    return lora.targets(model) if lora is not None else None


def _size(nbytes: int) -> str:
    from autofit.units import format_size

    return format_size(nbytes)


def _state_notes(config: Config, states: States) -> list[str]:
    from autofit.units import format_size

    notes = []
    if config.optimizer is not Optimizer.ADAMW:
        notes.append(f"{config.optimizer.value} states by formula")
    if config.zero_stage:
        notes.append(f"ZeRO-{config.zero_stage} states by formula")
    if config.offloads:
        notes.append(f"offload to {config.offload.value}: {format_size(states.cpu)} of host RAM")
    return notes


# Relative error allowed to a predicted peak before it prunes a candidate: the estimator's measured
# worst over-prediction (a prune is wrong only when the true peak is lower than predicted).
# CPU: worst error against the CPU budget's measured peak 4.1% over 24 points (under-predicted; the worst
# over-prediction is 0.9%): bench/results/estimate-cpu-2026-11-22.json.
# CUDA: against 40 published GPU training peaks (bench/calibration/results/calibration.json, like compared
# with like: allocated vs reserved, each simulated with the code its source ran), the worst
# over-prediction is +4.96%; against 32 peaks measured on an H100 and predicted without CUDA, as a dry-run
# predicts (bench/results/estimate-replay-estimate-cuda-2026-11-22-2026-11-22.json), +3.1%. So a
# candidate predicted more than 5% over the limit is skipped. The estimator still under-predicts some
# published runs (median |error| 3.6%, down to -21%: FSDP1 and QLoRA) and the H100's by up to -9.0%
# (allocator segments across steps, bench/allocator_steps.py): an under-prediction never prunes, it
# makes a probe that runs out of memory, which the tuner records and steps back from.
PREDICTION_TOLERANCE = {"cpu": 0.05, "cuda": 0.05}

# The activation formula's worst under-prediction of the simulated activations (simulated / formula),
# over preset models x sequence lengths x checkpointing: bench/calibration/formula_bound.py, results in
# bench/calibration/results/formula-bound.json. A peak resting on the formula is reported with this bound.
FORMULA_UNDER_PREDICTION = 4.1


# Several ranks with an engine (ZeRO, FSDP2) on CPU ranks: measured against probes on 2 and 4 CPU ranks of
# three models (issue 12's note, docs/heavy-rungs.md, bench/results/sharded-cpu-*.json); see ENGINE_TOLERANCE.
ENGINE_TOLERANCE = {"cpu": 0.10, "cuda": 0.25}


def tolerance_for(device: torch.device, config: Config | None = None) -> float:
    """The estimator's measured relative error on `device`'s kind (see PREDICTION_TOLERANCE), for
    `config` when given: configs with a sharding engine have their own (ENGINE_TOLERANCE)."""
    if config is not None and config.engine is not Engine.TORCH:
        return ENGINE_TOLERANCE.get(device.type, 0.25)
    return PREDICTION_TOLERANCE.get(device.type, 0.25)


def predictor_for(spec: "TrainSpec", strategies: Sequence["Strategy"] = ()) -> Callable[[Config], int | None]:
    """`predict(config)`: the predicted peak bytes of `config` on `spec.device`, or None where the
    estimator cannot tell (a failed simulation, whose formula is too coarse to prune by: the probe decides). One estimator per spec, so each (precision, attention,
    checkpointing, micro-batch) is simulated once."""
    estimator: list[Estimator] = []

    def predict(config: Config) -> int | None:
        try:
            if not estimator:
                estimator.append(Estimator(spec, strategies=strategies))
            estimate = estimator[0].predict(config)
            return estimate.peak_bytes if estimate.simulated else None
        except Exception:  # noqa: BLE001 - a prediction only saves probes; without one, probe
            return None

    return predict


_ESTIMATORS: dict[int, tuple[weakref.ref, Estimator]] = {}


def predict_peak(spec: "TrainSpec", config: Config) -> Estimate:
    """The predicted peak of `config` on `spec.device` (an `Estimate`). Estimators are cached per spec,
    so predicting many configs simulates each (precision, attention, checkpointing) once."""
    entry = _ESTIMATORS.get(id(spec))
    if entry is None or entry[0]() is not spec:
        entry = (weakref.ref(spec), Estimator(spec))
        _ESTIMATORS[id(spec)] = entry
    return entry[1].predict(config)
