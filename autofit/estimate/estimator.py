"""Estimate: a candidate's peak memory per device, predicted without running it and without a GPU.

    peak = params + grads + optimizer states   (formulas: precision, ZeRO, 8-bit states, LoRA, NF4, offload)
         + activations                         (the real forward + backward under fake tensors, tracked)
         + overhead                            (CUDA context, allocator rounding and fragmentation, buckets)

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3): with mixed precision
under DeepSpeed, 2 bytes of fp16/bf16 parameters, 2 of gradients and K = 12 of fp32 master weights and
Adam moments per parameter, each partitioned over N GPUs by its stage. Without ZeRO, autofit trains
with autocast: fp32 weights (4 bytes), fp32 gradients (4) and the optimizer's states.

Activations are measured, not guessed (`autofit.estimate.simulate`): the model is built on the meta device,
materialised as fake tensors (shapes, no data), and one forward + backward runs under a dispatch mode
that counts every storage alive, as `autofit.probe.memory.CpuBudget` does for real tensors. Weight gradients are dropped as
soon as they are made, so the curve is activations alone; the bytes of gradients made so far are
recorded beside it. Deep Hugging Face models are simulated at 2 and 4 blocks and extrapolated linearly
in depth (blocks are identical), and at micro-batch 1 and 2, extrapolated linearly in the micro-batch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from autofit.config import Checkpointing, Config, Engine, Offload, Optimizer, Quantization
from autofit.estimate.simulate import ALLOCATOR_ROUNDING, ActivationPeak, simulate_step  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from autofit.spec.train import TrainSpec
    from autofit.strategies.base import Strategy

MIB = 1024**2
# Overhead terms on a CUDA device, each documented where the peak is assembled (`_overhead`).
CUDA_CONTEXT_BYTES = 512 * MIB  # driver context + kernels with lazy loading: typically 300-600 MiB (not measured here)
CUBLAS_WORKSPACE_BYTES = 32 * MIB  # cuBLAS workspace per stream (Hopper default, 4 MiB x 8)
FRAGMENTATION = 0.05  # reserved-but-free share of the transient bytes (activations, optimizer temporaries)
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce/allgather bucket size (elements)
ZERO3_MAX_LIVE_ELEMENTS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default
SIM_DEPTHS = (1, 2)  # blocks simulated for deep models; (k, 2k) when every k-th block is checkpointed
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits + 8-bit absmax per 64 + fp32 second-level absmax per 256 blocks
INT8_BYTES = 1.0  # LLM.int8 weights; the fp32 per-row scales are counted per output row


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Bytes per device, by what holds them."""

    params: int
    grads: int
    optimizer: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        """Sum of the parts (bytes)."""
        return self.params + self.grads + self.optimizer + self.activations + self.overhead

    def to_dict(self) -> dict[str, int]:
        """JSON form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A predicted peak per device (bytes), its parts, host RAM needed (bytes, all ranks), and how it was made."""

    breakdown: Breakdown
    peak_bytes: int  # the parts are not all live at the peak moment: peak <= breakdown.total
    cpu_bytes: int  # host RAM for offloaded states, all ranks on one node (0 without offload)
    reason: str  # one line: how activations were obtained and which parts are formulas only
    terms: tuple[tuple[str, int], ...] = ()  # the overhead, term by term
    method: str = ""  # how the activations were obtained (one phrase, the first part of `reason`)
    simulated: bool = True  # False: the step could not be simulated and activations come from a formula
    error_bound: float = 0.0  # relative error the peak may carry upwards: the formula's measured bound (0 when simulated)

    @property
    def upper_bytes(self) -> int:
        """The peak at its error bound (bytes): what a verdict resting on a formula must fit."""
        return int(self.peak_bytes * (1 + self.error_bound))

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"peak_bytes": self.peak_bytes, "cpu_bytes": self.cpu_bytes, "reason": self.reason,
                "breakdown": self.breakdown.to_dict(), "overhead_terms": dict(self.terms),
                "activations": "simulated" if self.simulated else "formula", "error_bound": self.error_bound}


# -- model facts ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """Parameter counts the state formulas need (elements, not bytes), read from a meta build."""

    num_params: int
    trainable_params: int
    linear_params: int = 0  # weights of the Linear layers inside the blocks: what NF4/int8 quantize, LoRA adapts
    linear_rows: int = 0  # output rows of those layers (int8 keeps one fp32 scale per row)
    lora_params_per_rank: int = 0  # sum of (in + out) over those layers: LoRA rank r adds r times this
    factored_params: int = 0  # Adafactor state elements: rows + cols per matrix, numel per vector
    largest_param: int = 0
    block_params: int = 0  # parameters of one repeated block
    num_blocks: int = 0


def model_facts(model: nn.Module) -> ModelFacts:
    """`ModelFacts` of a built model (meta or real)."""
    from autofit.spec.model_info import find_blocks

    params = list(model.parameters())
    _, blocks = find_blocks(model)
    linears = [m for block in blocks for m in block.modules() if _is_linear(m)]
    shapes = [_in_out(m) for m in linears]
    factored = sum(sum(p.shape[-2:]) if p.dim() >= 2 else p.numel() for p in params if p.requires_grad)
    return ModelFacts(
        num_params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        linear_params=sum(i * o for i, o in shapes), linear_rows=sum(o for _, o in shapes),
        lora_params_per_rank=sum(i + o for i, o in shapes), factored_params=factored,
        largest_param=max((p.numel() for p in params), default=0),
        block_params=sum(p.numel() for p in blocks[0].parameters()) if blocks else 0, num_blocks=len(blocks))


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's transposed Linear


def _in_out(module: nn.Module) -> tuple[int, int]:
    rows, cols = module.weight.shape
    return (cols, rows) if isinstance(module, nn.Linear) else (rows, cols)


# -- model states --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class States:
    """Model-state bytes per device, and on the host (all ranks) when offloaded."""

    params: int
    grads: int
    optimizer: int
    cpu: int = 0


def optimizer_bytes(facts: ModelFacts, optimizer: Optimizer, trainable: int) -> float:
    """Optimizer-state bytes for `trainable` parameters (no master weights): AdamW 8 per parameter,
    8-bit AdamW 2 (+ an fp32 absmax per 2048-element block per state), Adafactor its factored moments;
    a user's own optimizer is counted as AdamW (a fallback: its states are unknown)."""
    if optimizer.eight_bit:
        return trainable * (2 + 2 * 4 / 2048)
    if optimizer is Optimizer.ADAFACTOR:
        share = trainable / facts.trainable_params if facts.trainable_params else 1.0
        return 4 * facts.factored_params * share
    return 8.0 * trainable


def model_states(facts: ModelFacts, config: Config) -> States:
    """Parameters, gradients and optimizer states per device for `config` (ZeRO paper accounting).

    - ZeRO 0 (autocast, DDP): fp32 weights, fp32 grads, optimizer states; nothing is partitioned.
    - ZeRO 1/2/3 with fp16/bf16: 2 bytes of half weights and grads; fp32 master weights + states (K)
      partitioned over N by stage 1, grads too by stage 2, weights too by stage 3.
    - offload "cpu"/"nvme": master weights and optimizer states leave the GPU (stage 3: weights too).
    - LoRA: base weights frozen (fp32, or NF4/int8 when quantized); only the adapters train.
    """
    n = max(config.num_gpus, 1)
    if config.adapters:
        return _adapter_states(facts, config)
    trainable = facts.trainable_params
    frozen = facts.num_params - trainable
    if config.zero_stage == 0:
        return States(4 * facts.num_params, 4 * trainable, int(optimizer_bytes(facts, config.optimizer, trainable)))
    half = 2 if config.half_precision else 4
    master = 4 * trainable if half == 2 else 0  # fp32 copies the optimizer updates
    k_bytes = master + optimizer_bytes(facts, config.optimizer, trainable)
    params = half * trainable / (n if config.zero_stage >= 3 else 1) + 4 * frozen
    grads = half * trainable / (n if config.zero_stage >= 2 else 1)
    optimizer = k_bytes / n
    if not config.offloads:
        return States(int(params), int(grads), int(optimizer))
    # Host RAM over all N ranks: each rank's K-byte partition plus its fp32 gradient partition for CPU Adam.
    to_host = config.offload is Offload.CPU
    cpu = k_bytes + 4 * trainable if to_host else 0
    if config.zero_stage >= 3:
        cpu += half * trainable if to_host else 0
        params = 4 * frozen
    return States(int(params), int(grads), 0, int(cpu))


def _adapter_states(facts: ModelFacts, config: Config) -> States:
    rank = config.lora or 16  # quantization without a rank: QLoRA's usual r=16
    adapters = rank * facts.lora_params_per_rank
    base = facts.num_params
    if config.quantization is Quantization.NF4:
        base_bytes = NF4_BYTES * facts.linear_params + 4 * (base - facts.linear_params)
    elif config.quantization is Quantization.INT8:
        base_bytes = INT8_BYTES * facts.linear_params + 4 * facts.linear_rows + 4 * (base - facts.linear_params)
    else:
        base_bytes = 4 * base
    return States(int(base_bytes + 4 * adapters), 4 * adapters, int(optimizer_bytes(facts, config.optimizer, adapters)))


# -- the estimator ---------------------------------------------------------------------------------------
class Estimator:
    """Predicts `Estimate`s for the configurations of one spec, caching each simulated forward + backward
    by (precision, attention, checkpointing, micro-batch).

    `target` is the device type predicted for: "cuda" adds the CUDA overhead terms and simulates CUDA
    kernels where this torch build has CUDA (else CPU kernels stand in, and the reason says so);
    "cpu" predicts what `autofit.probe.memory.CpuBudget` measures.
    """

    def __init__(self, spec: "TrainSpec", target: str | None = None, extrapolate_batch: bool = False,
                 strategies: Sequence["Strategy"] = ()):
        self.spec = spec
        self.strategies = tuple(strategies)
        self.target = target or spec.device.type
        # True: simulate micro-batches 1 and 2 only and extrapolate linearly (fast, for planning many
        # sizes; checkpointed runs come out a few percent low). False: simulate each micro-batch.
        self.extrapolate_batch = extrapolate_batch
        self.sim_device = "cuda" if self.target == "cuda" and torch.cuda.is_available() else "cpu"
        self._meta = meta_model(spec.model_factory)
        self.facts = model_facts(self._meta)
        self._depth_key = _depth_key(self._meta, self.facts)
        self._cache: dict[tuple, tuple[ActivationPeak, str]] = {}
        self._failed: set[tuple] = set()  # cache keys whose simulation failed (activations by formula)

    # -- activations ---------------------------------------------------------------------------------
    def activations(self, config: Config) -> tuple[ActivationPeak, str]:
        """The `ActivationPeak` at `config`'s micro-batch and how it was obtained (one phrase)."""
        mb = config.micro_batch_size
        if mb <= 2 or not self.extrapolate_batch:
            return self._at_batch(config, mb)
        (one, how), (two, _) = self._at_batch(config, 1), self._at_batch(config, 2)
        return one.extrapolate(two, mb, 1, 2), f"{how}, micro-batch 1 and 2 extrapolated to {mb}"

    def simulated(self, config: Config) -> bool:
        """Whether `config`'s activations were simulated (False: by formula, the simulation failed)."""
        self.activations(config)
        sizes = (config.micro_batch_size,) if config.micro_batch_size <= 2 or not self.extrapolate_batch else (1, 2)
        return not any(self._key(config, mb) in self._failed for mb in sizes)

    def _key(self, config: Config, mb: int) -> tuple:
        return (config.precision, config.attention, config.checkpointing, config.checkpoint_every, mb,
                _half_weights(config))

    def _at_batch(self, config: Config, mb: int) -> tuple[ActivationPeak, str]:
        key = self._key(config, mb)
        if key not in self._cache:
            self._cache[key] = self._simulated(config, mb)
            if self._cache[key][0] is None:
                self._failed.add(key)
                self._cache[key] = (self._formula(config, mb), self._cache[key][1])
        return self._cache[key]

    def _simulated(self, config: Config, mb: int) -> tuple[ActivationPeak | None, str]:
        where = "CUDA" if self.sim_device == "cuda" else \
            ("CPU kernels standing in for CUDA (this torch build has no CUDA)" if self.target == "cuda" else "CPU")
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
        return (peaks[0].extrapolate(peaks[1], total, *depths),
                f"activations simulated under fake tensors on {where} at {depths[0]} and {depths[1]} "
                f"of {total} blocks, extrapolated")

    def _run(self, config: Config, mb: int, depth: int | None) -> ActivationPeak:
        if depth is None:
            model = meta_model(self.spec.model_factory)
        else:
            model = _rebuild(self._meta, self._depth_key, depth)
        batch = self.spec.batch_factory(mb)
        return simulate_step(model, batch, self.spec.loss_fn, config, device=self.sim_device,
                             half_weights=_half_weights(config))

    def _formula(self, config: Config, mb: int) -> ActivationPeak:
        """The fallback when the step cannot be simulated: `formula_activations` (its error bound is
        `FORMULA_ERROR_BOUND`, measured against the simulation)."""
        total = formula_activations(self.spec.model.hf_config, self.facts, self.spec.tokens_per_sample, mb, config)
        return ActivationPeak(total, total, 0, 0, total, 0)

    # -- the peak -------------------------------------------------------------------------------------
    def predict(self, config: Config) -> Estimate:
        """The predicted peak per device of training `config` (bytes), its breakdown and its reason."""
        states = model_states(self.facts, config)
        act, how = self.activations(config)
        notes = [how]
        act = self._adjusted(act, config, notes)
        params = states.params + self._gathered(config, notes)
        temp = self._optimizer_temporaries(config)
        if config.grad_accum_steps > 1:  # the gradients of earlier micro-batches are live throughout
            transient = states.grads + act.largest
        else:  # gradients appear as activations are freed
            transient = act.with_grads(states.grads)
        transient = max(transient, states.grads + temp)  # the optimizer step
        terms = self._overhead(config, act.largest + temp)
        overhead = sum(b for _, b in terms)
        peak = params + states.optimizer + transient + overhead
        breakdown = Breakdown(params, states.grads, states.optimizer + temp, act.largest, overhead)
        for strategy in self.strategies:  # plug-in techniques say what they do to memory
            changed = strategy.memory(config, breakdown)
            peak, breakdown = peak + changed.total - breakdown.total, changed
        notes += _state_notes(config, states)
        if config.engine is Engine.FSDP:
            notes.append("FSDP2 sharding not modelled yet: states predicted unsharded (an upper bound)")
        simulated = self.simulated(config)
        bound = 0.0 if simulated else (FORMULA_UNDER_PREDICTION - 1) * breakdown.activations / max(peak, 1)
        return Estimate(breakdown, int(peak), states.cpu, "; ".join(notes), tuple(terms), method=notes[0],
                        simulated=simulated, error_bound=round(bound, 4))

    def _adjusted(self, act: ActivationPeak, config: Config, notes: list[str]) -> ActivationPeak:
        """What the simulation of full fine-tuning cannot see: bitsandbytes' quantized matmuls keep the
        packed weights for backward, not the 16-bit copies autocast saves (2 bytes per weight)."""
        if config.adapters:
            notes.append("LoRA adapters not simulated: full fine-tuning's activations (adapters save the same inputs)")
        if config.quantization is not Quantization.NONE and config.half_precision:
            notes.append(f"{config.quantization.value} kernels not simulated: 16-bit weight copies removed by formula")
            copies = 2 * self.facts.linear_params
            return dataclasses.replace(act, forward=max(0, act.forward - copies), peak=max(0, act.peak - copies),
                                       joint=max(0, act.joint - copies))
        return act

    def _gathered(self, config: Config, notes: list[str]) -> int:
        """ZeRO-3 gathers each block's full weights before using them: two blocks (current + prefetch)
        and the largest tensor, at most `stage3_max_live_parameters`, in 16 bits."""
        if config.zero_stage < 3 or config.adapters:
            return 0
        live = min(ZERO3_MAX_LIVE_ELEMENTS, 2 * self.facts.block_params + self.facts.largest_param)
        notes.append("ZeRO-3 gathered weights by formula")
        return 2 * live

    def _optimizer_temporaries(self, config: Config) -> int:
        """Bytes the optimizer step allocates beyond its states. torch's foreach AdamW/Adafactor (the CUDA
        default) builds one fp32 list the size of the trainable weights (sqrt of the second moment); the
        single-tensor path (CPU) two temporaries of the largest tensor; bitsandbytes and DeepSpeed's
        fused/CPU Adam update in place."""
        if config.zero_stage or config.optimizer.eight_bit:
            return 0
        trainable = (config.lora or 16) * self.facts.lora_params_per_rank if config.adapters else self.facts.trainable_params
        if self.target == "cuda":
            return 4 * trainable
        return 2 * 4 * min(self.facts.largest_param, trainable)

    def _overhead(self, config: Config, transient: int) -> list[tuple[str, int]]:
        """Overhead terms on CUDA (none on the CPU, where the budget counts tensors only)."""
        if self.target != "cuda":
            return []
        terms = [("cuda_context", CUDA_CONTEXT_BYTES), ("cublas_workspace", CUBLAS_WORKSPACE_BYTES),
                 ("fragmentation", int(FRAGMENTATION * transient))]
        trainable = self.facts.trainable_params
        if config.num_gpus > 1 and config.zero_stage == 0 and not config.adapters:
            terms.append(("ddp_buckets", 4 * trainable))  # DDP copies gradients into buckets (no bucket views)
        if config.zero_stage in (1, 2):
            half = 2 if config.half_precision else 4
            buckets = 2 if config.zero_stage == 2 else 1  # allgather bucket (+ reduce bucket at stage 2)
            terms.append(("deepspeed_buckets", buckets * half * min(DEEPSPEED_BUCKET_ELEMENTS, trainable)))
        return terms


def formula_activations(hf: Any, facts: ModelFacts, tokens: int | None, mb: int, config: Config) -> int:
    """Activation bytes by formula, for a step that cannot be simulated (an op without a fake kernel).

    Per block, Korthikanti et al. 2022, eq. 1: s*b*h*(34 + 5*a*s/h) bytes in 16 bits (the 5as/h term is
    the attention matrix, absent with fused attention), with the MLP's share (19 s*b*h for GPT's 4h MLP)
    rescaled to the model's intermediate width (gated MLPs keep three intermediate tensors, not two);
    checkpointed blocks keep their 16-bit input (2*s*b*h) and one block is recomputed at a time. Beside
    the blocks: the output logits (16-bit, their fp32 upcast and its gradient: 10 bytes per logit) and,
    under autocast of fp32 weights, the 16-bit copy of every block weight autocast keeps (2 bytes each).
    fp32 compute doubles the activation bytes. Error bound: `FORMULA_ERROR_BOUND`."""
    hidden = int(getattr(hf, "hidden_size", 0) or 0)
    heads = int(getattr(hf, "num_attention_heads", 1) or 1)
    s, b, blocks = _formula_tokens(hf, tokens), mb, max(facts.num_blocks, 1)
    inter = int(getattr(hf, "intermediate_size", 0) or getattr(hf, "n_inner", 0) or getattr(hf, "d_ff", 0)
                or 4 * hidden)
    gated = getattr(hf, "hidden_act", "") in ("silu", "swiglu") or bool(getattr(hf, "is_gated_act", False))
    mlp = 2 * hidden + (6 if gated else 4) * inter + inter // 4  # input + intermediates (+ a dropout mask)
    attention = 0 if config.attention.fused else 5 * heads * s
    layer = s * b * (15 * hidden + mlp + attention)  # 34 s*b*h when the MLP is GPT's
    share = config.checkpointed_share
    kept = (1 - share) * blocks * layer + share * blocks * 2 * s * b * hidden + (layer if share else 0)
    logits = 10 * s * b * int(getattr(hf, "vocab_size", 0) or 0)
    scale = 1 if config.half_precision else 2
    copies = 2 * facts.linear_params if config.half_precision and not _half_weights(config) else 0
    return int(scale * kept + logits + copies)


def _formula_tokens(hf: Any, tokens: int | None) -> int:
    """Positions per sample: the batch's sequence length, or a vision transformer's patches (+ class token)."""
    if tokens:
        return tokens
    image, patch = getattr(hf, "image_size", None), getattr(hf, "patch_size", None)
    if isinstance(image, int) and isinstance(patch, int) and patch > 0:
        return (image // patch) ** 2 + 1
    return 1


def _half_weights(config: Config) -> bool:
    """DeepSpeed (ZeRO) trains 16-bit weights without autocast; torch AMP keeps fp32 weights."""
    return config.zero_stage > 0 and config.half_precision


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


def meta_model(factory: Callable[[], nn.Module]) -> nn.Module:
    """A build of `factory`'s model on the meta device. A given module (the spec's deep-copy factory) is
    copied with its tensors replaced by meta ones, so no real copy is made; factories that cannot build
    on meta are built for real once and moved."""
    from autofit.spec.model_info import build_on_meta

    if isinstance(factory, functools.partial) and factory.func is copy.deepcopy \
            and isinstance(factory.args[0], nn.Module):
        module = factory.args[0]
        memo: dict[int, Any] = {}
        for tensor in (*module.parameters(), *module.buffers()):
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        return copy.deepcopy(module, memo)
    built = build_on_meta(factory)
    if built is None or any(t.device.type != "meta" for t in (*built.parameters(), *built.buffers())):
        built = (built or factory()).to("meta")
    return built


def _depth_key(model: nn.Module, facts: ModelFacts) -> str | None:
    """The config attribute that sets a Hugging Face model's depth, when the model can be rebuilt at
    another depth with identical blocks (decoder-only or encoder-only, every weight trainable)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(type(model), "_from_config"):
        return None
    if facts.trainable_params != facts.num_params:
        return None
    key = getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    return key if getattr(config, key, None) == facts.num_blocks else None


def _rebuild(model: nn.Module, key: str, depth: int) -> nn.Module:
    """`model`'s class built on the meta device from its config with `depth` blocks."""
    data = model.config.to_dict()
    data[key] = depth
    if isinstance(data.get("layer_types"), list):
        data["layer_types"] = data["layer_types"][:depth]
    config = type(model.config).from_dict(data)
    config._attn_implementation = model.config._attn_implementation
    with torch.device("meta"):
        return type(model)._from_config(config)


# Relative error allowed to a predicted peak before it prunes a candidate. CPU: the estimator's worst
# error against the CPU budget's measured peak is 4.1% over 24 points (under-predicted; the worst
# over-prediction is 0.9%): bench/results/estimate-cpu-2026-11-22.json. CUDA: not measured on a card
# yet, so generous.
PREDICTION_TOLERANCE = {"cpu": 0.05, "cuda": 0.25}

# The activation formula's worst under-prediction of the simulated activations (simulated / formula),
# over preset models x sequence lengths x checkpointing: bench/calibration/formula_bound.py, results in
# bench/calibration/results/formula-bound.json. A peak resting on the formula is reported with this bound.
FORMULA_UNDER_PREDICTION = 4.1


def tolerance_for(device: torch.device) -> float:
    """The estimator's measured relative error on `device`'s kind (see PREDICTION_TOLERANCE)."""
    return PREDICTION_TOLERANCE.get(device.type, 0.25)


def predictor_for(spec: "TrainSpec", strategies: Sequence["Strategy"] = ()) -> Callable[[Config], int | None]:
    """`predict(config)`: the predicted peak bytes of `config` on `spec.device`, or None where the
    estimator cannot tell (FSDP2 is not modelled yet; a failed simulation, whose formula is too coarse
    to prune by: the probe decides). One estimator per spec, so each (precision, attention,
    checkpointing, micro-batch) is simulated once."""
    estimator: list[Estimator] = []

    def predict(config: Config) -> int | None:
        if config.engine is Engine.FSDP:
            return None
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
