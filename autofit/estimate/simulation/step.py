"""Simulate one training step's forward + backward under fake tensors and measure its transient memory.

The model is built on the meta device, materialised as fake tensors (shapes and dtypes, no data) on the
target device type, and run under a dispatch mode that counts every live storage, as
`autofit.devices.memory.CpuBudget` counts real tensors. Nothing real is allocated. `autofit.estimate.estimator` turns the
result into a predicted peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from autofit.config import Config
from autofit.estimate.cuda import attention as cuda_attention
from autofit.estimate.cuda import autocast as cuda_autocast
from autofit.estimate.cuda import dropout as cuda_dropout
from autofit.estimate.simulation import deepen
from autofit.estimate.simulation import runnable as simulatable
from autofit.estimate.simulation import sized_kernels
from autofit.estimate.cuda import training_replay
from autofit.estimate.cuda.allocator import MICRO_STEPS_REPLAYED, Event, Replay
from autofit.estimate.simulation.healthy_checks import healthy_checks, transformers_checks_off
from autofit.estimate.simulation.known_values import KnownValues
from autofit.devices.memory import SPARSE_PARTS, StorageCounter, storages_of
from autofit.strategies.run import SimulatedRun

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
    # not linear in depth (replayed at the whole depth: `autofit.estimate.simulation.deepen`)
    least_fragmentation: int = 0  # the least of it the step runs in where the allocator must release its
    # cache to stay under a limit (`least_reserve`): what a fit needs, where `fragmentation` is what a roomy card shows
    kernels: int = 0  # not bytes: operations of the forward + backward that launch a kernel (views and bare
    # allocations left out); linear in depth, the same at every micro-batch
    sparse_grads: int = 0  # bytes of the sparse weight gradients made (`nn.EmbeddingBag(sparse=True)`: the rows
    # looked up), which accumulation concatenates: counted by `Estimator.predict`, not in `ModelFacts`' dense grads
    replay: Replay | None = dataclasses.field(default=None, compare=False, repr=False)  # the events replayed
    # what training holds beside the step, for a configuration whose allocator replays it
    # (`training_replay.replays_training`), whichever configuration was simulated: `Replay.training`'s (resident, states, temporaries, micro-steps)
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
        return line if scaled is None else dataclasses.replace(line, **training_replay.reserve(scaled))

    def reserve_of(self, other: "ActivationPeak") -> "ActivationPeak":
        """This peak with `other`'s reserve beyond the allocated bytes (`fragmentation`, `least_fragmentation`)."""
        return dataclasses.replace(self, fragmentation=other.fragmentation,
                                   least_fragmentation=other.least_fragmentation, replay=other.replay,
                                   history=other.history)

    def replayed_for(self, config: Config, training: bool | None = None) -> Replay | None:
        """The events `config` replays through the caching allocator where they are not those this peak's
        reserve was replayed from: with its training history and micro-steps where it replays one
        (`training_replay.replays_training`), else the step alone. None where they are the same (or nothing
        was replayed). One simulation serves every optimizer, engine and accumulation of its key. `training`:
        `replays_training(config)` where the caller knows it."""
        if self.replay is None:
            return None
        training = training_replay.replays_training(config) if training is None else training
        history = self.history if training else None
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


PEAK_FIELDS = tuple(f.name for f in dataclasses.fields(ActivationPeak) if f.name not in _NOT_LINEAR)  # its bytes
# and counts: integers, each read on a line (`ActivationPeak.extrapolate`)


def free_at_peak(one: ActivationPeak, two: ActivationPeak, line: ActivationPeak, field: str) -> int:
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
    the larger simulated value stands. `field`: "fragmentation" (a roomy card's) or "least_fragmentation"."""
    at_one, at_two = getattr(one, field), getattr(two, field)
    shares = [free / peak.largest for free, peak in ((at_one, one), (at_two, two)) if peak.largest]
    share = min(shares) if shares else 0.0
    return max(int(share * line.largest), at_one, at_two)


class _Tracker(StorageCounter):
    """Records every storage made by an op (`autofit.devices.memory.StorageCounter`) as allocation events:
    mallocs, frees and weight gradients (`take_grad`: recorded, then dropped at once), which the step's
    peaks are read from (`curve`) and the CUDA caching allocator replays (`autofit.estimate.cuda.allocator`).
    Counts the kernels launched and the bytes offloaded beside them. Kernels whose outputs fake tensors
    cannot size run through `autofit.estimate.simulation.sized_kernels` (`cuda`: CPU kernels stand in for CUDA)."""

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
            # model's two blocks look unlike (`autofit.estimate.simulation.deepen`)
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
                  device: str, adapted: frozenset[str] | None = None, adapter_dropout: float = 0.0,
                  cuda_ampere: bool | None = None, replay_depth: tuple[int, int] | None = None,
                  strategies: Sequence[Any] = ()) -> ActivationPeak:
    """Run one forward + backward of `model` (built on the meta device; consumed) on `batch` under fake
    tensors on `device` ("cpu" or "cuda") as `config` trains it, and return its `ActivationPeak`. Nothing real
    is allocated.

    Every strategy shapes the step as it shapes a probe's run (`Strategy.apply` on a `SimulatedRun`, in rung
    order: `strategies`, with every built-in and plug-in one they leave out), before the model is made of
    fake tensors: its dtypes, the autocast it runs under, its layers (stand-ins where bitsandbytes or a
    fused kernel cannot run on fake tensors), and contexts around the forward.
    `adapted`: the layers adapters go on (`autofit.estimate.simulation.adapters`, with `adapter_dropout`)
    where `config` trains adapters; None: none are added (the model brings its own).
    `cuda_ampere`: CPU kernels stand in for a CUDA GPU, Ampere or later (True) or older (False):
    attention, dropout and autocast keep what CUDA's would (`autofit.estimate.cuda.attention`,
    `autofit.estimate.cuda.dropout`, `autofit.estimate.cuda.autocast`); None: the kernels are the target's own.
    `replay_depth` = (unit, units): `model` holds two units of `unit` blocks, and the step is read as at
    `units` of them (`autofit.estimate.simulation.deepen`: its peaks, kernels and the caching allocator's replay;
    `whole_depth` says so) where the units are alike and the strategies let them repeat, else as simulated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.batches.batch import call_model, quiet_transformers

    # the model's config may be the caller's own object: it is set back
    with simulatable.configs_restored(model), quiet_transformers():
        run = _shaped(SimulatedRun(config=config, model=model, device_type=device, adapted=adapted,
                                   adapter_dropout=adapter_dropout), strategies)
        model = run.model
        # the whole batch is live through the step, the label fields a stand-in loss drops too (a mask per object)
        batch_bytes = sum(x.nbytes for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor))
        batch, loss_fn = simulatable.without_data_dependent_steps(model, batch, loss_fn)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        # one process without an engine holds a tied weight once; the engines' terms add its lingering
        # gradient themselves (`EngineFacts.tied_grad`), measured against steps simulated untied
        ties = fake_empty(model, fake, device, tie=run.tie_weights)
        model.train()
        tracker = _Tracker(ALLOCATOR_ROUNDING if device == "cuda" else 1, ties, cuda=cuda_ampere is not None)
        tracker.ignore([*model.parameters(), *model.buffers()])
        hooks = [p.register_post_accumulate_grad_hook(tracker.take_grad) for p in model.parameters() if p.requires_grad]
        deep = _Deep(model, *replay_depth, tracker) if replay_depth and run.repeatable else None
        hooks += deep.handles if deep else []
        try:
            on_cuda = cuda_ampere is not None
            with fake, simulatable.fake_friendly_kernels(), healthy_checks(), transformers_checks_off(), \
                    cuda_attention.as_on_cuda(cuda_ampere, run.attention_dtype), cuda_dropout.as_on_cuda(on_cuda), \
                    cuda_autocast.as_on_cuda(on_cuda and device == "cpu"):
                fake_batch = as_fake(fake, batch, device)
                known = KnownValues()
                known.know(fake_batch, batch)
                with known, tracker:
                    with _autocast(run.autocast_dtype, device), contextlib.ExitStack() as forward:
                        for context in run.forward_contexts:
                            forward.enter_context(context(tracker))
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


def _shaped(run: SimulatedRun, strategies: Sequence[Any]) -> SimulatedRun:
    """`run` as every strategy shapes it (`strategies` and every built-in and plug-in one they leave out, in
    rung order), its model in training mode."""
    from autofit.strategies import completed

    run.model.train()
    for strategy in completed(strategies):
        strategy.apply(run)
    return run


def _peak(tracker: _Tracker, model: nn.Module, config: Config, ties: dict[int, int], deep: "_Deep | None",
          batch_bytes: int) -> ActivationPeak:
    """The simulated step's `ActivationPeak`, the batch's bytes live throughout: at the whole depth where
    `deep` and its units allow (`_Deep.whole`), else as simulated."""
    whole = deep.whole(tracker) if deep else None
    events, backward_at, (kernels, offloaded) = whole or (tracker.events, tracker.backward_at, tracker.counts())
    fields = curve(events, len(events) if backward_at is None else backward_at, tracker.rounding)
    for name in ("forward", "peak", "tail", "joint", "at_grad"):
        fields[name] += batch_bytes
    history = training_replay.history(model, config, ties, deep if whole else None)
    replay = Replay.of(events, history if training_replay.replays_training(config) else None)
    return ActivationPeak(**fields, offloaded=offloaded, kernels=kernels, sparse_grads=tracker.sparse_grads,
                          whole_depth=whole is not None,
                          history=history, **training_replay.reserve(replay))


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
    """A two-unit simulation's marks (`autofit.estimate.simulation.deepen.watch`) and what it takes to read it at
    `units` units: the events deepened, the kernels and offloaded bytes of the second unit added once for
    each further unit, the weights of the second unit repeated."""

    def __init__(self, model: nn.Module, unit: int, units: int, tracker: _Tracker):
        from autofit.models.info import find_blocks

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


def _micro_steps(history: tuple | None) -> int:
    """The micro-steps a replay of `history` meets the step's events in (0: the step alone)."""
    return min(history[-1], MICRO_STEPS_REPLAYED) if history is not None else 0


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


def _autocast(dtype: torch.dtype | None, device: str) -> Any:
    """Autocast to `dtype` for the forward and loss (`SimulatedRun.autocast_dtype`), or none."""
    return torch.autocast(device, enabled=False) if dtype is None else torch.autocast(device, dtype=dtype)
