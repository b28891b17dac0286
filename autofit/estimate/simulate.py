"""Simulate one training step's forward + backward under fake tensors and measure its transient memory.

The model is built on the meta device, materialised as fake tensors (shapes and dtypes, no data) on the
target device type, and run under a dispatch mode that counts every live storage, as
`autofit.probe.memory.CpuBudget` counts real tensors. Nothing real is allocated. `autofit.estimate.estimator` turns the
result into a predicted peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from autofit.config import Attention, Checkpointing, Config, Engine, Loss, Optimizer, Precision, Quantization
from autofit.estimate import cuda_attention, cuda_autocast, cuda_dropout, deepen, kept, sized_kernels, stand_in_losses
from autofit.estimate.allocator import MICRO_STEPS_REPLAYED, ROUND_LARGE, CachingAllocator, Calls, Event, Replay
from autofit.estimate.healthy_checks import healthy_checks, transformers_checks_off
from autofit.estimate.known_values import KnownValues
from autofit.probe.memory import SPARSE_PARTS, StorageCounter, storages_of
from autofit.strategies.lora import DEFAULT_RANK

# peft keeps LoRA's adapters in fp32 beside a 16-bit base (`get_peft_model(..., autocast_adapter_dtype=True)`,
# its default) and casts each input to their dtype; releases before that made them in the base's dtype (the
# calibration's fsdp_qlora runs, on PEFT 0.10, set this so: `bench/calibration/measured_code.py`)
PEFT_UPCASTS_ADAPTERS = True
ADAPTERS = ("lora_A", "lora_B")  # the parameters `_add_adapters` makes, named as peft's modules
LORA_SCALING = 2.0  # peft's lora_alpha / r; any constant costs the same multiply
ALLOCATOR_ROUNDING = 512  # the CUDA caching allocator rounds every block up to 512 bytes (applied per tensor)
aten = torch.ops.aten
# Ops that launch no kernel beside views (`OpOverload.is_view`): allocations without a fill.
_NO_KERNEL = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                        aten.new_empty_strided.default, aten.lift_fresh.default})


def launches_kernel(func: Any) -> bool:
    """Whether the op `func` launches a kernel on a GPU: not a view, not a bare allocation."""
    return not getattr(func, "is_view", False) and func not in _NO_KERNEL and func is not torch.ops.prim.device.default


# -- activations ---------------------------------------------------------------------------------------
_NOT_LINEAR = ("replay", "history", "whole_depth")  # ActivationPeak's fields that are not peaks read on a line


@dataclasses.dataclass(frozen=True)
class ActivationPeak:
    """Transient bytes of one forward + backward: activations, autocast weight copies, temporaries."""

    forward: int  # most bytes live during the forward (and the loss)
    peak: int  # most bytes live during the backward, weight gradients excluded
    grads_at_peak: int  # weight-gradient bytes made before that moment (fp32 for full fine-tuning)
    tail: int  # bytes live when the last weight gradient was made (end of backward)
    joint: int = 0  # most of (bytes live + weight-gradient bytes made so far) in the backward
    grads_at_joint: int = 0  # the gradient bytes at that moment
    at_grad: int = 0  # most bytes live when a weight gradient is complete, that gradient included (its hook)
    offloaded: int = 0  # bytes of saved tensors moved to host memory in the forward (activation offload)
    fragmentation: int = 0  # what the CUDA caching allocator reserves beyond its most allocated (`allocator`);
    # not linear in depth (replayed at the whole depth: `autofit.estimate.deepen`)
    least_fragmentation: int = 0  # the least of it the step runs in where the allocator must release its
    # cache to stay under a limit (`least_reserve`): what a fit needs, where `fragmentation` is what a roomy card shows
    kernels: int = 0  # not bytes: operations of the forward + backward that launch a kernel (views and bare
    # allocations left out); linear in depth, the same at every micro-batch
    sparse_grads: int = 0  # bytes of the sparse weight gradients made (`nn.EmbeddingBag(sparse=True)`: the rows
    # looked up), which accumulation concatenates: counted by `Estimator.predict`, not in `ModelFacts`' dense grads
    replay: Replay | None = dataclasses.field(default=None, compare=False, repr=False)  # the events replayed
    # what training holds beside the step, for a configuration whose allocator replays it (`replays_training`),
    # whichever configuration was simulated: `Replay.training`'s (resident, states, temporaries, micro-steps)
    history: tuple | None = dataclasses.field(default=None, compare=False, repr=False)
    # the whole model's step read from a simulation of two of its units (`replay_depth`); not a peak
    whole_depth: bool = dataclasses.field(default=False, compare=False)

    # Each field is a peak within one phase, so each is linear in depth and micro-batch where the
    # model's blocks are identical; their maximum is not, and is taken only after extrapolating.
    @property
    def largest(self) -> int:
        """Most activation bytes live at once, in either phase."""
        return max(self.forward, self.peak)

    def extrapolate(self, other: "ActivationPeak", at: float, here: float, there: float) -> "ActivationPeak":
        """The line through self (at `here`) and other (at `there`), read at `at`; never below zero."""
        def line(a: int, b: int) -> int:
            return max(0, round(a + (b - a) * (at - here) / (there - here)))
        return ActivationPeak(**{f.name: line(getattr(self, f.name), getattr(other, f.name))
                                 for f in dataclasses.fields(self) if f.name not in _NOT_LINEAR})

    def replayed_at(self, other: "ActivationPeak", at: float, here: float, there: float) -> "ActivationPeak":
        """`extrapolate`, with the allocator's reserve replayed from the events read on the same line
        (`Replay.scaled`): where both were simulated alike; else the line alone, its reserve for the caller."""
        line = self.extrapolate(other, at, here, there)
        scaled = self.replay.scaled(other.replay, at, here, there) if self.replay and other.replay else None
        return line if scaled is None else dataclasses.replace(line, **reserve(scaled))

    def reserve_of(self, other: "ActivationPeak") -> "ActivationPeak":
        """This peak with `other`'s reserve beyond the allocated bytes (`fragmentation`, `least_fragmentation`)."""
        return dataclasses.replace(self, fragmentation=other.fragmentation,
                                   least_fragmentation=other.least_fragmentation, replay=other.replay,
                                   history=other.history)

    def replayed_for(self, config: Config) -> Replay | None:
        """The events `config` replays through the caching allocator where they are not those this peak's
        reserve was replayed from: with its training history and micro-steps where it replays one
        (`replays_training`), else the step alone. None where they are the same (or nothing was replayed).
        One simulation serves every optimizer, engine and accumulation of its key."""
        if self.replay is None:
            return None
        history = self.history if replays_training(config) else None
        if history is not None:
            history = (*history[:-1], min(config.grad_accum_steps, MICRO_STEPS_REPLAYED))
        if _micro_steps(history) == _micro_steps(self.replay.training):
            return None
        return dataclasses.replace(self.replay, training=history)

    def with_grads(self, grads: int) -> int:
        """Most transient bytes live in a backward whose weight gradients total `grads` bytes when kept:
        the activation peak, the joint peak (gradients scaled down to `grads`), or all gradients at the end."""
        return max(self.forward, self.peak + min(self.grads_at_peak, grads),
                   self.joint - self.grads_at_joint + min(self.grads_at_joint, grads),
                   grads + self.tail)


class _Tracker(StorageCounter):
    """Records every storage made by an op (`autofit.probe.memory.StorageCounter`) as allocation events:
    mallocs, frees and weight gradients (`take_grad`: recorded, then dropped at once), which the step's
    peaks are read from (`curve`) and the CUDA caching allocator replays (`autofit.estimate.allocator`).
    Counts the kernels launched and the bytes offloaded beside them. Kernels whose outputs fake tensors
    cannot size run through `autofit.estimate.sized_kernels` (`cuda`: CPU kernels stand in for CUDA)."""

    def __init__(self, rounding: int, ties: dict[int, int], cuda: bool = False):
        super().__init__()
        self.rounding = rounding  # as the allocator rounds: a storage resized within its block makes no events
        self.ties = ties  # id(parameter) -> its weight (`fake_empty`): tied parameters are one weight
        self.cuda = cuda
        self.events: list[Event] = []
        self.offloaded = self.kernels = self.sparse_grads = 0
        self.backward_at: int | None = None  # the index in `events` where the backward began

    @property
    def backward(self) -> bool:
        """Whether the backward has begun."""
        return self.backward_at is not None

    def begin_backward(self) -> None:
        self.backward_at = len(self.events)

    def counts(self) -> tuple[int, int]:
        """(kernels, offloaded bytes) so far: linear in depth, repeated with each unit (`_Deep`)."""
        return self.kernels, self.offloaded

    def _before_op(self, func: Any) -> None:
        self.kernels += launches_kernel(func)

    def _run(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        return sized_kernels.run(func, args, kwargs, self.cuda)

    def _count(self, storage: Any) -> None:
        key = id(storage)
        before = self._live.get(key)
        super()._count(storage)
        after = self._live.get(key)
        if after is not None and after is not before and (before is None or before[1] != after[1]):
            # resized in place: the allocator frees and allocates. A storage of no bytes has no block: the
            # CUDA caching allocator hands out a null pointer for 0 bytes without allocating
            # (c10/cuda/CUDACachingAllocator.cpp, `NativeCachingAllocator::allocate`: `if (size != 0)`);
            # on CUDA such storages appear once, in the first checkpointed block only, and had made a deep
            # model's two blocks look unlike (`autofit.estimate.deepen`)
            if before is not None and before[1]:
                self.events.append(("free", key))
            if after[1]:
                self.events.append(("malloc", key, storage.nbytes()))

    def _forget(self, key: int) -> None:
        entry = self._live.get(key)
        super()._forget(key)
        if entry is not None and entry[1]:
            self.events.append(("free", key))

    def take_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate hook: record the gradient, then drop it."""
        grad = param.grad
        parts = storages_of(grad)  # a sparse gradient (`nn.EmbeddingBag(sparse=True)`'s): its indices and values
        sparse = grad.layout in SPARSE_PARTS
        nbytes = sum(part.nbytes() for part in parts) if sparse else grad.nbytes
        self.sparse_grads += nbytes if sparse else 0
        self.events.append(("grad", id(parts[-1]), nbytes, self.ties[id(param)]))
        param.grad = None


def curve(events: Sequence[Event], backward_at: int, rounding: int) -> dict[str, int]:
    """`ActivationPeak`'s byte fields of a step, read from its events (each allocation rounded up to
    `rounding`), the backward beginning at index `backward_at`: the most bytes live in the forward and in
    the backward (gradients dropped as they come), the gradient bytes made by then, the most of live plus
    gradient bytes, what is live when each gradient is complete (that gradient included) and after the
    last one is dropped."""
    live: dict[Any, int] = {}
    current = grads = forward = peak = grads_at_peak = joint = grads_at_joint = at_grad = tail = 0
    for index, event in enumerate(events):
        if event[0] == "free":
            current -= live.pop(event[1], 0)
        elif event[0] == "grad":  # counted apart from now on: dropped
            grads += event[2]
            at_grad, tail = max(at_grad, current), current - live.get(event[1], 0)
        else:
            nbytes = -(-event[2] // rounding) * rounding
            live[event[1]] = nbytes
            current += nbytes
            if index < backward_at:
                forward = max(forward, current)
                continue
            if current > peak:
                peak, grads_at_peak = current, grads
            if current + grads > joint:
                joint, grads_at_joint = current + grads, grads
    return {"forward": forward, "peak": peak, "grads_at_peak": grads_at_peak, "tail": tail, "joint": joint,
            "grads_at_joint": grads_at_joint, "at_grad": at_grad}


def simulate_step(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor], config: Config, *,
                  device: str, half_weights: bool = False, adapted: frozenset[str] | None = None,
                  adapter_dropout: float = 0.0, cuda_ampere: bool | None = None,
                  replay_depth: tuple[int, int] | None = None) -> ActivationPeak:
    """Run one forward + backward of `model` (built on the meta device; consumed) on `batch` under fake
    tensors on `device` ("cpu" or "cuda") with `config`'s precision, attention and checkpointing, and
    return its `ActivationPeak`. Nothing real is allocated.

    `half_weights`: the weights themselves are 16-bit and no autocast runs (DeepSpeed's bf16/fp16 mode,
    used with ZeRO); otherwise fp32 weights under autocast, which keeps a 16-bit copy of each weight.
    `adapted` (LoRA): the linear layers named so (`is_adapted`) get peft's adapters (`_add_adapters`, with
    `adapter_dropout`), and every other weight is frozen. NF4 base weights: the linear layers run as
    bitsandbytes' do (`autofit.strategies.quantization.SimulatedLinear4bit`).
    `cuda_ampere`: CPU kernels stand in for a CUDA GPU, Ampere or later (True) or older (False):
    attention, dropout and autocast keep what CUDA's would (`autofit.estimate.cuda_attention`,
    `autofit.estimate.cuda_dropout`, `autofit.estimate.cuda_autocast`); None: the kernels are the target's own.
    `replay_depth` = (unit, units): `model` holds two units of `unit` blocks, and the step is read as at
    `units` of them (`autofit.estimate.deepen`: its peaks, kernels and the caching allocator's replay;
    `whole_depth` says so) where the units are alike, else as simulated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.spec.batch import call_model, quiet_transformers
    from autofit.strategies.attention import implementations
    from autofit.strategies.checkpointing import enable

    # the model's config may be the caller's own object: it is set back
    with _configs_restored(model), quiet_transformers():
        precision, attention = config.precision, config.attention
        if attention is not Attention.DEFAULT and hasattr(model, "set_attn_implementation"):
            # flash-attention has no CPU kernel; SDPA's memory is the same O(n)
            model.set_attn_implementation(implementations(model, _fused_stand_in(model) if attention.fused
                                                          else attention.value))
        if config.pure_bf16:
            from autofit.strategies.pure_bf16 import enable as pure_bf16

            pure_bf16(model)  # bf16 weights, and the inputs cast as the probe casts them
        elif half_weights and precision.half:
            from autofit.strategies.pure_bf16 import cast_floating, cast_inputs

            # and float inputs (pixels, audio features) cast, as DeepSpeed's engine under autofit and FSDP2's
            # MixedPrecisionPolicy (`cast_forward_inputs`) cast them
            half = _half_dtype(precision, device)
            cast_inputs(cast_floating(model, half), half)
        if config.quantization is not Quantization.NONE:
            from autofit.strategies.quantization import simulate_quantized

            simulate_quantized(model, config.quantization)
        if adapted is not None:  # peft's fp32 adapters, or in the model's dtype where an engine casts it
            fp32 = PEFT_UPCASTS_ADAPTERS and (config.pure_bf16 or not half_weights)
            _add_adapters(model, adapted, config.lora or DEFAULT_RANK, adapter_dropout,
                          torch.float32 if fp32 else None)
        # the whole batch is live through the step, the label fields a stand-in loss drops too (a mask per object)
        batch_bytes = sum(x.nbytes for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor))
        batch, loss_fn = _without_data_dependent_steps(model, batch, loss_fn)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        # one process without an engine holds a tied weight once; the engines' terms add its lingering
        # gradient themselves (`engines._tied_grad`), measured against steps simulated untied
        ties = fake_empty(model, fake, device, tie=config.engine is Engine.TORCH and config.num_gpus <= 1)
        model.train()
        if adapted is not None:
            _freeze_all_but_adapters(model)
        if config.checkpointing is not Checkpointing.NONE:
            enable(model, config.checkpoint_every, ops=config.checkpointing is Checkpointing.OPS)
        if config.loss is Loss.CHUNKED:
            from autofit.strategies.chunked_loss import enable as chunk_loss

            chunk_loss(model)
        tracker = _Tracker(ALLOCATOR_ROUNDING if device == "cuda" else 1, ties, cuda=cuda_ampere is not None)
        tracker.ignore([*model.parameters(), *model.buffers()])
        hooks = [p.register_post_accumulate_grad_hook(tracker.take_grad) for p in model.parameters() if p.requires_grad]
        deep = _Deep(model, *replay_depth, tracker) if replay_depth else None
        hooks += deep.handles if deep else []
        try:
            half = torch.float16 if precision is Precision.FP16 else torch.bfloat16
            on_cuda = cuda_ampere is not None
            with fake, _fake_friendly_kernels(), healthy_checks(), transformers_checks_off(), \
                    cuda_attention.as_on_cuda(cuda_ampere, half), cuda_dropout.as_on_cuda(on_cuda), \
                    cuda_autocast.as_on_cuda(on_cuda and device == "cpu"):
                fake_batch = as_fake(fake, batch, device)
                known = KnownValues()
                known.know(fake_batch, batch)
                with known, tracker:
                    with _autocast(Precision.FP32 if half_weights else precision, device), \
                            _offloading(tracker, config.offloads_activations):
                        output = call_model(model, fake_batch)  # held through backward, as the probe's step holds it
                        loss = loss_fn(output, fake_batch)
                    tracker.begin_backward()
                    loss.backward()
                    del output, loss
        finally:
            for hook in hooks:
                hook.remove()
        for recorder in _RECORDERS:
            recorder.append(list(tracker.events))
        return _peak(tracker, model, config, ties, deep, batch_bytes)


def _peak(tracker: _Tracker, model: nn.Module, config: Config, ties: dict[int, int], deep: "_Deep | None",
          batch_bytes: int) -> ActivationPeak:
    """The simulated step's `ActivationPeak`, the batch's bytes live throughout: at the whole depth where
    `deep` and its units allow (`_Deep.whole`), else as simulated."""
    whole = deep.whole(tracker) if deep else None
    events, backward_at, (kernels, offloaded) = whole or (tracker.events, tracker.backward_at, tracker.counts())
    fields = curve(events, len(events) if backward_at is None else backward_at, tracker.rounding)
    for name in ("forward", "peak", "tail", "joint", "at_grad"):
        fields[name] += batch_bytes
    history = _history(model, config, ties, deep if whole else None)
    replay = Replay.of(events, history if replays_training(config) else None)
    return ActivationPeak(**fields, offloaded=offloaded, kernels=kernels, sparse_grads=tracker.sparse_grads,
                          whole_depth=whole is not None,
                          history=history, **reserve(replay))


_RECORDERS: list[list[list[Event]]] = []


def recording() -> bool:
    """Whether a caller is collecting the events of the steps simulated (`recorded_events`)."""
    return bool(_RECORDERS)


@contextlib.contextmanager
def recorded_events() -> Iterator[list[list[Event]]]:
    """Collect the allocation events of every step simulated inside, one list per simulation: for
    experiments on the allocator model (bench/calibration/fsdp1_wrap.py, length_history.py)."""
    found: list[list[Event]] = []
    _RECORDERS.append(found)
    try:
        yield found
    finally:
        _RECORDERS.remove(found)


class _Deep:
    """A two-unit simulation's marks (`autofit.estimate.deepen.watch`) and what it takes to read it at
    `units` units: the events deepened, the kernels and offloaded bytes of the second unit added once for
    each further unit, the weights of the second unit repeated."""

    def __init__(self, model: nn.Module, unit: int, units: int, tracker: _Tracker):
        from autofit.spec.model_info import find_blocks

        self.units = units
        blocks = find_blocks(model)[1]
        self.repeated = {id(p) for block in blocks[unit:2 * unit] for p in (*block.parameters(), *block.buffers())}
        self.marks, self.handles = deepen.watch(blocks, unit, tracker.events, lambda: tracker.backward,
                                                tracker.counts) if len(blocks) == 2 * unit else (deepen.Marks(), [])

    def whole(self, tracker: _Tracker) -> tuple[list[Event], int | None, tuple[int, ...]] | None:
        """The step at the whole depth: its events, the index where its backward begins, and its
        (kernels, offloaded bytes) (`_Tracker.counts`); None where the units differ."""
        deepened = deepen.deepen(tracker.events, self.marks, self.units, tracker.backward_at)
        if deepened is None:
            return None
        counts = tuple(total + (self.units - 2) * unit for total, unit in zip(tracker.counts(), self.marks.unit_counts()))
        return deepened.events, deepened.backward, counts

    def tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` in order, the second unit's repeated as each further unit holds its own."""
        at = next((i for i, t in enumerate(tensors) if id(t) in self.repeated), len(tensors))
        unit = [t for t in tensors[at:] if id(t) in self.repeated]
        return [*tensors[:at], *unit * (self.units - 1), *(t for t in tensors[at:] if id(t) not in self.repeated)]


def reserve(replay: Replay) -> dict[str, Any]:
    """`ActivationPeak`'s reserve fields from `replay`: beyond its allocated peak, what a roomy card
    reserves (`fragmentation`) and the least it runs in (`least_fragmentation`: `least_reserve`). Replayed
    once for the same events (`kept.RESERVES`, in the process and the cache's folder): a dry-run's AdamW
    rows replay two optimizer steps of training through a bisection, most of a second dry-run's time."""
    digest = replay.digest()
    found = kept.RESERVES.get(digest, shared=True)
    if found is None:
        calls = replay.calls()
        roomy = calls.replayed()
        found = {"fragmentation": roomy.peak_reserved - roomy.peak_allocated,
                 "least_fragmentation": least_reserve(calls, roomy) - roomy.peak_allocated}
        kept.RESERVES.put(digest, found, shared=True)
    return {**found, "replay": replay}


def least_reserve(calls: Calls, roomy: CachingAllocator) -> int:
    """The fewest bytes the caching allocator's segments may total for a replay to run without running out
    of memory (`calls`: `Replay.calls`): found by bisection between the allocated and the reserved peak of
    its `roomy` run (no capacity), to `LEAST_RESERVE_PRECISION` of the reserve, each run resumed where the
    roomy one first passes the allocated peak (`Calls.until`: all of them alike up to there, about half of
    a training history's calls). Under a limit below its
    roomy reserve the allocator releases its cached segments and retries (`CachingAllocator`): on an H200
    (bench/results/fit-threshold-cuda-h200-2026-11-27.json), GPT-2 small's full-checkpointing step in
    fp32 at micro-batch 1 trained with its segments capped between 3,125 and 3,188 MiB (the process's
    budget less the 760 MiB outside the allocator), under the 3,314 it reserved on the roomy card; this
    replay, 3,093 (3,260 roomy); in bf16 at micro-batch 4 between 5,389 and 5,518, the replay 5,451."""
    low, high = roomy.peak_allocated, roomy.peak_reserved
    step = max(ROUND_LARGE, int(LEAST_RESERVE_PRECISION * high))
    paused = calls.until(low) if high - low > step else None
    if paused is None or calls.resumed(paused, high - step) is None:
        return high  # most steps need about what they reserve: one replay says so
    high -= step
    while high - low > step:
        middle = (low + high) // 2
        low, high = (low, middle) if calls.resumed(paused, middle) is not None else (middle, high)
    return high


LEAST_RESERVE_PRECISION = 0.005  # of the reserve: 5 MiB of 1 GiB, 40 MiB of 8 GiB (a replay: 10-300 ms)


def _micro_steps(history: tuple | None) -> int:
    """The micro-steps a replay of `history` meets the step's events in (0: the step alone)."""
    return min(history[-1], MICRO_STEPS_REPLAYED) if history is not None else 0


def replays_training(config: Config) -> bool:
    """Whether the caching allocator replays `config`'s step as training runs it, weights, gradients and
    AdamW's states included (`allocator.replay_training`): where torch's AdamW steps whole gradients on the
    card. Else (engines' flat buffers, offloaded or 8-bit states, a step in backward) the step's own events
    are replayed alone."""
    return (config.optimizer is Optimizer.ADAMW and config.engine is Engine.TORCH and not config.offloads
            and not config.steps_in_backward)


def _history(model: nn.Module, config: Config, ties: dict[int, int], deep: _Deep | None = None) -> tuple:
    """What training holds beside the step, as `replay_training` takes it: the weights (`_resident`) and
    buffers, AdamW's states and its step's temporaries, and `config`'s micro-steps. `deep`: the events are
    its, at the whole depth, and so are the weights (`_Deep.tensors`)."""
    weights = list({ties[id(p)]: p for p in model.parameters()}.values())  # a tied weight once, as the card holds it
    buffers = list(model.buffers())
    if deep is not None:
        weights, buffers = deep.tensors(weights), deep.tensors(buffers)
    resident = [*_resident(model, weights), *(b.untyped_storage().nbytes() for b in buffers)]
    trained = [p.nbytes for p in weights if p.requires_grad]
    # AdamW: exp_avg and exp_avg_sq like each parameter (torch/optim/adamw.py `_init_group`); its foreach
    # step makes one more tensor per parameter (`_foreach_sqrt` of the second moments) and frees it
    states = [n for n in trained for _ in range(2)]
    return resident, states, trained, config.grad_accum_steps


def _resident(model: nn.Module, weights: list[torch.Tensor]) -> list[int]:
    """Bytes of each weight as training holds it on the card: a quantized layer's packed weight and constants
    (NF4's, or int8 and an fp32 scale a row), where the simulated layer holds the original
    (`SimulatedLinear4bit`, `SimulatedLinear8bit`)."""
    from autofit.estimate.states import INT8_BYTES
    from autofit.strategies.quantization import SimulatedLinear4bit, SimulatedLinear8bit, nf4_bytes

    def held(module: nn.Module) -> int:
        w = module.weight
        return int(INT8_BYTES * w.numel()) + 4 * w.shape[0] if isinstance(module, SimulatedLinear8bit) \
            else int(nf4_bytes() * w.numel())

    packed = {id(m.weight): held(m) for m in model.modules() if isinstance(m, SimulatedLinear4bit)}
    return [packed.get(id(w), w.untyped_storage().nbytes()) for w in weights]


def fake_empty(model: nn.Module, fake: Any, device: str, tie: bool = True) -> dict[int, int]:
    """Make `model` (on the meta device) of fake tensors of `fake` on `device`; return which weight each
    parameter is (id -> the id of the first parameter made for that weight). `Module.to_empty` makes a new
    tensor in every module, so a weight two modules share (GPT-2's embedding and head) becomes two: with
    `tie` they are made one again, as training holds them (one gradient, whose first part waits for the
    second through the backward: on an H100, GPT-2 small's reserve with checkpointing came out right only
    so); without, the step keeps them apart and the allocator's replay still counts one weight, gradient
    and AdamW states."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    with fake:
        model.to_empty(device=device)
    ties = {}
    for (first, name), *others in owners.values():
        weight = first._parameters[name]
        ties[id(weight)] = id(weight)
        for module, other in others:
            if tie:
                module._parameters[other] = weight
            ties[id(module._parameters[other])] = id(weight)
    return ties


def as_fake(fake: Any, batch: Any, device: str) -> Any:
    """`batch` with every tensor made a fake tensor of `fake` (a `FakeTensorMode`) on `device`."""
    return tree_map(lambda x: fake.from_tensor(x).to(device) if isinstance(x, torch.Tensor) else x, batch)


@contextlib.contextmanager
def _configs_restored(model: nn.Module) -> Any:
    """Set every Hugging Face config `model`'s modules hold (sub-configs included) back as it was on
    exit. A simulation sets the attention implementation and switches off random layer skips on the
    model's config, which is the caller's own object when a factory builds its model from one."""
    configs: dict[int, Any] = {}
    stack = [getattr(module, "config", None) for module in model.modules()]
    while stack:
        config = stack.pop()
        if config is None or id(config) in configs or not hasattr(config, "to_dict"):
            continue
        configs[id(config)] = (config, dict(vars(config)))
        stack.extend(value for value in vars(config).values() if hasattr(value, "to_dict"))
    try:
        yield
    finally:
        for config, saved in configs.values():
            vars(config).clear()
            vars(config).update(saved)


LAYERDROPS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
SPEC_AUGMENT_PROBABILITIES = ("mask_time_prob", "mask_feature_prob")  # SpecAugment's, per frame and per feature


def _without_data_dependent_steps(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> tuple:
    """The batch and loss a simulation runs for `model`: as given, but where the model's own training
    step has shapes that depend on the data, which fake tensors hold none of.

    LayerDrop (wav2vec2's and Parakeet's 0.1 by default) skips each layer at random (`torch.rand([]) <
    layerdrop`): switched off in the config and in every module that keeps its own, every layer runs, the
    most memory a step takes (a step that drops none). Waveform
    models (wav2vec2, HuBERT) mask random spans of their features in training (SpecAugment:
    `hidden_states[mask] = masked_spec_embed`, an in-place write through a boolean mask, whose backward
    fake tensors cannot size): switched off, by `apply_spec_augment` and by its probabilities (data2vec-audio
    has no such switch), which leaves out a boolean mask of batch x frames. Heads whose own loss has
    shapes that depend on the data (CTC's tensor lengths; DETR's and Mask2Former's matching with scipy on
    the host) run a stand-in that keeps what the loss keeps (`autofit.estimate.stand_in_losses`)."""
    from autofit.spec.batch import default_loss

    config = getattr(model, "config", None)
    for holder in (config, *model.modules()):  # read from the config (wav2vec2) or kept by a module (Parakeet)
        for name in LAYERDROPS:
            if isinstance(getattr(holder, name, None), float) and getattr(holder, name) > 0:
                setattr(holder, name, 0.0)
    if getattr(config, "apply_spec_augment", False):
        config.apply_spec_augment = False
    # data2vec-audio's config has no `apply_spec_augment` (its model reads a missing one as True): by these
    for name in SPEC_AUGMENT_PROBABILITIES:
        if isinstance(getattr(config, name, None), float) and getattr(config, name) > 0:
            setattr(config, name, 0.0)
    found = stand_in_losses.stand_in(model, batch) if loss_fn is default_loss else None
    return (batch, loss_fn) if found is None else found


FUSED_STAND_IN = "autofit_fused_memory"  # SDPA under a name of its own, soft-capping dropped: memory only


def _fused_stand_in(model: nn.Module) -> str:
    """The attention implementation a fused kernel (flash-attention, SDPA) is simulated with: SDPA, whose
    fused kernels keep what flash-attention keeps (the output and its log-sum-exp). A model that refuses
    SDPA for what only flash-attention's kernels do (Gemma-2's soft-capped attention scores:
    `_supports_sdpa = False`, and transformers' SDPA raises on `softcap`) gets SDPA registered under
    `FUSED_STAND_IN`, which drops the soft-capping: the memory is the fused kernel's, the numbers are
    not (fake tensors hold none)."""
    if getattr(type(model), "_supports_sdpa", True):
        return "sdpa"
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def fused(module: nn.Module, *args: Any, softcap: Any = None, **kwargs: Any) -> Any:
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register(FUSED_STAND_IN, fused)
    AttentionMaskInterface.register(FUSED_STAND_IN, sdpa_mask)
    return FUSED_STAND_IN


def _offloading(tracker: _Tracker, enabled: bool) -> Any:
    """What `torch.autograd.graph.save_on_cpu` does to device memory: a tensor saved for backward leaves
    the device (its device storage is freed unless something else holds it) and comes back in backward
    as a new device tensor. Its host copy is counted in `tracker.offloaded`, not on the device, and each
    way is one copy kernel (`save_on_cpu`: `packed.copy_(tensor)` out, `tensor.to(device)` back)."""
    if not enabled:
        return contextlib.nullcontext()

    def pack(tensor: torch.Tensor) -> tuple:
        tracker.offloaded += tensor.numel() * tensor.element_size()
        tracker.kernels += 1
        return tensor.shape, tensor.dtype, tensor.device

    def unpack(saved: tuple) -> torch.Tensor:
        shape, dtype, device = saved
        tracker.kernels += 1
        return torch.empty(shape, dtype=dtype, device=device)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _freeze_all_but_adapters(model: nn.Module) -> None:
    """Freeze every parameter but the adapters `_add_adapters` made."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.rpartition(".")[2] in ADAPTERS)


def _add_adapters(model: nn.Module, adapted: frozenset[str], rank: int, p: float,
                  dtype: torch.dtype | None) -> None:
    """Give each adapted layer peft's LoRA adapters (peft/tuners/lora/layer.py `Linear.forward`: `result +
    lora_B(lora_A(dropout(x))) * scaling`, cast back to the result's dtype): rank-`rank` factors in `dtype`
    (None: the layer's weight's), the input cast to it (`LoraLayer._cast_input_dtype`; bitsandbytes' 4-bit
    layer under autocast leaves it, peft/tuners/lora/bnb.py), with dropout `p` a dropped-out copy and its
    mask (`nn.functional.dropout`, as peft's `nn.Dropout` calls it). So the step keeps what peft's keeps:
    the adapters' inputs (an fp32 copy of a 16-bit input beside fp32 adapters), their matmuls' outputs under
    op-level checkpointing, and the adapters' own gradients and optimizer states. On the meta device,
    before the model is made of fake tensors."""
    from autofit.strategies.quantization import SimulatedLinear4bit

    def add(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if not (isinstance(module, SimulatedLinear4bit) and torch.is_autocast_enabled(x.device.type)):
            x = x.to(module.lora_A.dtype)
        x = nn.functional.dropout(x, p, True) if p else x
        # one expression, as peft's: the adapters' output is freed once scaled, not held through the sum
        return (out + nn.functional.linear(nn.functional.linear(x, module.lora_A), module.lora_B)
                * LORA_SCALING).to(out.dtype)

    for module in _adapted_layers(model, adapted):
        n_in, n_out = _features(module)
        made = dtype or module.weight.dtype
        module.lora_A = nn.Parameter(torch.empty(rank, n_in, dtype=made, device="meta"))
        module.lora_B = nn.Parameter(torch.empty(n_out, rank, dtype=made, device="meta"))
        module.register_forward_hook(add)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer: nn.Linear's and `SimulatedLinear4bit`'s attributes, a
    transformers Conv1D's (in, out) weight."""
    if hasattr(module, "in_features"):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)


def _adapted_layers(model: nn.Module, adapted: frozenset[str]) -> list[nn.Module]:
    """The linear layers (nn.Linear, transformers' Conv1D, a quantized layer simulated) `is_adapted` names."""
    from autofit.strategies.quantization import SimulatedLinear4bit  # SimulatedLinear8bit is one too

    return [module for name, module in model.named_modules() if is_adapted(name, adapted)
            and (isinstance(module, (nn.Linear, SimulatedLinear4bit)) or type(module).__name__ == "Conv1D")]


def within_block(name: str) -> str:
    """A layer's name as `is_adapted` reads it: its path inside its repeated block ('model.layers.5.self_attn.q_proj'
    -> 'self_attn.q_proj'), so that it names the same layer in a model rebuilt with fewer blocks; a name
    outside the blocks (no index in it) whole."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return name if index is None else ".".join(parts[index + 1:])


def is_adapted(name: str, adapted: frozenset[str]) -> bool:
    """Whether the module `name` is one of `adapted` (`within_block` names), matched as peft matches a target
    module: the whole name or a suffix after a dot. A wrapper's generic name ('attn.linear' beside
    'mlp.fc.linear') stays distinct."""
    return any(name == target or name.endswith("." + target) for target in adapted)


@contextlib.contextmanager
def _fake_friendly_kernels() -> Any:
    """Route mixture-of-experts layers to transformers' own grouped-matmul op while simulating.

    transformers' experts run `torch._grouped_mm`, whose fake (meta) kernel mirrors the CUDA checks and
    accepts bf16 inputs only, while under autocast the experts see fp32 master weights. transformers'
    fallback op (`transformers::grouped_mm_fallback`, transformers/integrations/moe.py) registers a fake
    kernel of the same output shape and saves the same two tensors (input, weight) for backward, so the
    memory it shows is the grouped kernel's."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def _autocast(precision: Precision, device: str) -> Any:
    if not precision.half:
        return torch.autocast(device, enabled=False)
    # fp16 and bf16 tensors have the same size; CPU autocast simulates fp16 with bf16.
    return torch.autocast(device, dtype=_half_dtype(precision, device))


def _half_dtype(precision: Precision, device: str) -> torch.dtype:
    return torch.float16 if precision is Precision.FP16 and device == "cuda" else torch.bfloat16
