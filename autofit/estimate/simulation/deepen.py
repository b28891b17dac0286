"""A deep model's allocation events, synthesized from a simulation of two of its blocks.

The estimator simulates a deep model at two blocks (two units of k under every-k checkpointing) and reads
the step as at its whole depth from the events that simulation holds: marked where each unit's forward and
backward begin and end (`watch`), the second unit's events are repeated once for every unit the model has
beyond the first (`deepen`), and each repeat's allocations and frees are told apart by the unit they belong
to. The peaks are read from those events (`autofit.estimate.simulation.step.curve`) and the CUDA caching allocator
replays them: what it reserves beyond the allocated bytes is not linear in depth (on an H100, GPT-2 small's
step with full checkpointing, replayed at 2, 8, 10 and 12 blocks, reserved 638, 304, 1,009 and 882 MiB
beyond its allocated bytes, 854 measured at 12: bench/README.md#allocator-steps), and nor is
the backward's most of live and gradient bytes (a line through one and two blocks of a tiny Llama with full
checkpointing read it 23% under a simulation of every block; the events repeated read it exactly).

A free names the unit its allocation belongs to relatively: in the second unit's forward, "mine" or
"the unit before mine" (its input, the first unit's output); after the last unit's forward, "the last
unit's" or "the one before"; in the second unit's backward, the gradient arriving from "the head"
becomes, for a unit with another after it, the gradient that unit's backward sent on (the one the first
unit's backward frees). A unit's events are taken as its own only where the two units allocated the
same sizes in the same order (identical blocks, as `autofit.models.depth.rebuild` rebuilds them);
anything else (Gemma's alternating layer kinds, a re-entrant checkpoint whose outputs hold no graph)
returns None: the caller then simulates one unit too and extrapolates each peak on the line through the
two, the allocator replayed at the two units as simulated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

from autofit.estimate.cuda.allocator import Event, allocations

# The segments of a two-unit step, in order: before the units (embeddings), the first unit's forward, the
# second's, between (the head, the loss and its backward), the second unit's backward, then the rest.
BEFORE, FIRST, SECOND, HEAD, BACK, REST = range(6)


@dataclasses.dataclass
class Marks:
    """Where in a step's events (indices into its list) the two units' forward and backward begin."""

    first: int | None = None  # the first unit's forward begins
    second: int | None = None  # the second unit's forward begins
    head: int | None = None  # the second unit's forward has returned
    back: int | None = None  # the gradient of the second unit's output has arrived: its backward begins
    rest: int | None = None  # the gradient of the first unit's output has arrived: the second's backward is done
    counts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # mark -> the counters there

    def unit_counts(self) -> tuple[int, ...]:
        """What the counters (`watch`'s) grew by in the second unit's forward and backward: one unit's share."""
        second, head, back, rest = (self.counts[name] for name in ("second", "head", "back", "rest"))
        return tuple(h - s + r - b for s, h, b, r in zip(second, head, back, rest))

    def bounds(self) -> list[int] | None:
        """The segments' start indices, or None when a mark is missing or out of order."""
        found = [0, self.first, self.second, self.head, self.back, self.rest]
        if any(mark is None for mark in found) or found != sorted(found):  # type: ignore[type-var]
            return None
        return found  # type: ignore[return-value]


def watch(blocks: Sequence[nn.Module], unit: int, events: list[Event], in_backward: Callable[[], bool],
          counters: Callable[[], tuple[int, ...]] = tuple) -> tuple[Marks, list[Any]]:
    """Mark, as `events` grows, where the first two units of `unit` blocks each begin and end their
    forward (module hooks, the first forward only: a checkpoint's recomputation runs it again in backward)
    and their backward (a hook on the gradient of each unit's output), and what `counters` read at each
    mark. Returns the marks and the hook handles to remove."""
    marks = Marks()

    def set_mark(name: str) -> None:
        if getattr(marks, name) is None:
            setattr(marks, name, len(events))
            marks.counts[name] = counters()

    def at(name: str) -> Callable[..., None]:
        def mark(*_: Any) -> None:
            if not in_backward():
                set_mark(name)
        return mark

    def grad_of_output(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if in_backward():
                return
            tensor = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda _grad: set_mark(name))
        return hook

    handles = [blocks[0].register_forward_pre_hook(at("first")),
               blocks[unit].register_forward_pre_hook(at("second")),
               blocks[2 * unit - 1].register_forward_hook(at("head")),
               blocks[2 * unit - 1].register_forward_hook(grad_of_output("back")),
               blocks[unit - 1].register_forward_hook(grad_of_output("rest"))]
    return marks, handles


class Deepened(NamedTuple):
    """A step's events as at the whole depth, and the index among them where its backward begins."""

    events: list[Event]
    backward: int


def deepen(events: Sequence[Event], marks: Marks, units: int, backward: int | None = None) -> Deepened | None:
    """`events` of a two-unit step as the same step at `units` units would make them: the second unit's
    forward and backward repeated, each repeat's allocations its own (keys `(allocation, unit)`) and its
    gradients those of its own parameters (`(param, unit)`); with the index where the backward begins,
    `backward` among `events` (None: it does not). None where the step's structure does not allow it (see
    the module's docstring)."""
    bounds = marks.bounds()
    if bounds is None or units < 2:
        return None
    steps = _Instances(events, bounds)
    return steps.deepened(units, len(events) if backward is None else backward) if steps.consistent() else None


class _Instances:
    """A step's events with each allocation named (`allocator.allocations`), the segment of each event and
    of each allocation, and the correspondences `deepened` needs."""

    def __init__(self, events: Sequence[Event], bounds: list[int]):
        self.events: list[tuple[int, Event]] = []  # (segment, event with allocations named: `allocations`)
        self.origin: dict[int, int] = {}  # allocation -> segment of its malloc
        # each segment's events, with their indices in `events`
        self.segments: list[list[tuple[int, Event]]] = [[] for _ in bounds]
        segment = 0
        for index, event in allocations(events):
            while segment + 1 < len(bounds) and index >= bounds[segment + 1]:
                segment += 1
            if event[0] == "malloc":
                self.origin[event[1]] = segment
            self.events.append((segment, event))
            self.segments[segment].append((index, event))
        self.mallocs = [[e[1] for _, e in events if e[0] == "malloc"] for events in self.segments]
        # the second unit's allocation at each of the first unit's forward allocations' places
        self.unit_twin = dict(zip(self.mallocs[FIRST], self.mallocs[SECOND]))
        # the head's allocations the second unit's backward takes (the gradient of its output), and the
        # second unit's allocations the rest takes (the gradient it sent on), in the order they are taken
        self.incoming = _taken(self.events, BACK, HEAD, self.origin)
        self.outgoing = _taken(self.events, REST, BACK, self.origin)
        self.sizes = {e[1]: e[2] for _, e in self.events if e[0] == "malloc"}
        # what each unit's forward made and something after the units frees for all of them at once (the
        # model's output holding every unit's, a selective checkpoint's kept outputs): freed in one segment
        freed = {e[1]: s for s, e in self.events if e[0] == "free"}
        self.together = {a for pair in self.unit_twin.items() if freed.get(pair[0], BEFORE) in (HEAD, REST)
                         and freed.get(pair[0]) == freed.get(pair[1]) for a in pair}

    def consistent(self) -> bool:
        """The two units allocated alike in their forwards, and the gradients passed between them match."""
        first, second = self.mallocs[FIRST], self.mallocs[SECOND]
        return (len(first) == len(second) and [self.sizes[a] for a in first] == [self.sizes[a] for a in second]
                and len(self.incoming) == len(self.outgoing)
                and [self.sizes[a] for a in self.incoming] == [self.sizes[a] for a in self.outgoing])

    def deepened(self, units: int, backward: int) -> Deepened:
        last = units - 1
        out: list[Event] = []
        begins = None  # where the backward begins: before the first event at or after `backward`
        for segment, repeats in ((BEFORE, [0]), (FIRST, [0]), (SECOND, range(1, units)), (HEAD, [last]),
                                 (BACK, range(last, 0, -1)), (REST, [0])):
            for unit in repeats:
                place = _Place(segment, unit, units, final=unit == repeats[-1])
                for index, event in self.segments[segment]:
                    if begins is None and index >= backward:
                        begins = len(out)
                    out.extend(self._at(event, place))
        return Deepened(out, len(out) if begins is None else begins)

    def _at(self, event: Event, place: "_Place") -> list[Event]:
        """`event` as the repeat at `place` makes it."""
        repeated = place.segment in (SECOND, BACK)
        if event[0] == "malloc":
            return [("malloc", (event[1], place.unit) if repeated else event[1], event[2])]
        keys = [None] if event[1] is None else self._keys(event[1], place)
        if event[0] == "free":
            return [("free", key) for key in keys]
        return [("grad", keys[0], event[2], (event[3], place.unit) if repeated else event[3])]

    def _keys(self, allocation: int, place: "_Place") -> list[Any]:
        """The keys `allocation` stands for, named from `place`: one; none where a repeat would free again
        what an earlier one freed (something every unit uses, made before them); every unit's where the
        units' forwards made it and a later segment frees it for all of them (`together`)."""
        origin, last = self.origin[allocation], place.units - 1
        if allocation in self.together:
            return [allocation] if origin == FIRST else [(allocation, unit) for unit in range(last, 0, -1)]
        if origin in (FIRST, SECOND, BACK):
            # the unit holding it stands as far from `place.unit` as the allocation's unit stood from the event's
            here = 0 if place.segment in (FIRST, REST) else 1
            holder = place.unit + (0 if origin == FIRST else 1) - here
            if origin == FIRST:
                return [allocation if holder == 0 else (self.unit_twin[allocation], holder)]
            return [(allocation, holder)]
        if origin == HEAD and place.segment == BACK:
            # the gradient of this unit's output: the head's for the last unit, else the one the next sent on
            return [allocation if place.unit == last else
                    (self.outgoing[self.incoming.index(allocation)], place.unit + 1)]
        return [allocation] if place.final or place.segment not in (SECOND, BACK) else []


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where a repeated event stands: its segment, its unit of `units`, and whether it is the segment's
    last repeat in time (`final`)."""

    segment: int
    unit: int
    units: int
    final: bool


def _taken(events: list[tuple[int, Event]], segment: int, source: int, origin: dict[int, int]) -> list[int]:
    """The allocations made in `source` that events of `segment` free or take, in the order they do."""
    taken: list[int] = []
    for event_segment, event in events:
        if event_segment == segment and event[0] != "malloc" and event[1] is not None \
                and origin.get(event[1]) == source and event[1] not in taken:
            taken.append(event[1])
    return taken
