"""The CUDA caching allocator, replayed: what `torch.cuda.max_memory_reserved` shows for a sequence of
allocations and frees, beside `max_memory_allocated`.

PyTorch keeps freed blocks cached in the segments it took from `cudaMalloc` and serves later requests
from them; a request that no cached block fits takes a new segment, so the reserved bytes exceed the
allocated ones by whatever the cache cannot reuse. The rules, from c10/cuda/CUDACachingAllocator.cpp
in its default configuration (no `max_split_size_mb`, no expandable segments, one stream):

- every request is rounded up to a multiple of 512 bytes (`round_size`);
- requests up to 1 MiB come from the small pool, larger ones from the large pool (`get_pool`);
- a request is served by the smallest cached block of its pool that fits, the lowest address first
  (`get_free_block`: `lower_bound` over blocks ordered by size, then address);
- else a new segment is taken (`get_allocation_size`): 2 MiB for a small request, 20 MiB for a request
  under 10 MiB, the request rounded up to 2 MiB above that;
- the block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB (large
  pool) (`should_split`); the rest stays cached;
- a freed block merges with free neighbours in its segment (`free_block`, `try_merge_blocks`); segments
  are never given back (only on an out-of-memory retry or `empty_cache`).
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import hashlib
import itertools
from typing import Any, Iterator, Sequence

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
_SEGMENT_SPACING = 1 << 48  # addresses: segments apart, in the order they were taken


def round_size(nbytes: int) -> int:
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK if nbytes > MIN_BLOCK else MIN_BLOCK


def segment_size(size: int) -> int:
    """The bytes `cudaMalloc` is asked for when no cached block fits a rounded request of `size`."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    """A block of a segment: free or allocated, between its neighbours in the segment (a plain class with
    slots: replays make hundreds of thousands)."""

    __slots__ = ("address", "size", "small", "free", "prev", "next")

    def __init__(self, address: int, size: int, small: bool, prev: "_Block | None" = None,
                 next: "_Block | None" = None) -> None:  # noqa: A002 - the segment's order, as the C++ names it
        self.address, self.size, self.small, self.free, self.prev, self.next = address, size, small, True, prev, next


class CachingAllocator:
    """Replays `malloc(key, nbytes)` / `free(key)` and keeps the allocated and reserved bytes and their peaks.

    `capacity`: the most bytes `cudaMalloc` can give (the card less what the process holds outside the
    allocator). A new segment that would pass it first releases every cached block that is a whole
    segment and retries, as `release_cached_blocks` does before the allocator gives up (its first
    fallback, `release_available_cached_blocks`, does nothing without `max_split_size_mb`); if it still
    passes, the replay has run out of memory (`out_of_memory`): it raises `OutOfMemory` where `stop`,
    else goes on as if it had not. With `pause`, a segment past the capacity raises `Paused` before
    anything is released: the allocator stands as every replay under a larger capacity stands there
    (`Calls.until`)."""

    def __init__(self, capacity: int | None = None, stop: bool = False, pause: bool = False) -> None:
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # pool -> sorted (size, address)
        self._at: dict[int, _Block] = {}  # address -> free block
        self._used: dict[int, _Block] = {}  # key -> allocated block
        self._segments = 0
        self.capacity, self.stop, self.pause = capacity, stop, pause
        self.out_of_memory = False
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, key: Any, nbytes: int) -> None:
        # `round_size`, the best-fit cached block and the split written out: a dry-run makes ~10^7 of these calls
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK if nbytes > MIN_BLOCK else MIN_BLOCK
        small = size <= SMALL_SIZE
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1))
        block = self._at.pop(pool.pop(index)[1]) if index < len(pool) else self._segment(small, size)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            after = block.next
            rest = _Block(block.address + size, remaining, small, block, after)
            if after is not None:
                after.prev = rest
            block.next, block.size = rest, size
            bisect.insort(pool, (remaining, rest.address))
            self._at[rest.address] = rest
        block.free = False
        self._used[key] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated

    def free(self, key: Any) -> None:
        block = self._used.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        pool, at = self._free[block.small], self._at
        before, after = block.prev, block.next
        if before is not None and before.free:  # uncached and merged with its free neighbours, written out
            del pool[bisect.bisect_left(pool, (before.size, before.address))]
            del at[before.address]
            before.size += block.size
            before.next = after
            if after is not None:
                after.prev = before
            block = before
        if after is not None and after.free:
            del pool[bisect.bisect_left(pool, (after.size, after.address))]
            del at[after.address]
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
        bisect.insort(pool, (block.size, block.address))
        at[block.address] = block

    def _segment(self, small: bool, size: int) -> _Block:
        nbytes = segment_size(size)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            if self.pause:
                raise Paused
            self._release_cached()
            self.out_of_memory |= self.reserved + nbytes > self.capacity
            if self.out_of_memory and self.stop:
                raise OutOfMemory
        self._segments += 1
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(self._segments * _SEGMENT_SPACING, nbytes, small)

    def copy(self, capacity: int | None, stop: bool = False) -> "CachingAllocator":
        """This allocator as it stands, apart (its blocks copied, each segment's order kept), to go on under
        `capacity`."""
        blocks = {id(b): _Block(b.address, b.size, b.small) for b in (*self._used.values(), *self._at.values())}
        for block in (*self._used.values(), *self._at.values()):
            copied = blocks[id(block)]
            copied.free = block.free
            copied.prev = None if block.prev is None else blocks[id(block.prev)]
            copied.next = None if block.next is None else blocks[id(block.next)]
        clone = CachingAllocator(capacity, stop)
        clone._free = {pool: list(free) for pool, free in self._free.items()}
        clone._at = {address: blocks[id(block)] for address, block in self._at.items()}
        clone._used = {key: blocks[id(block)] for key, block in self._used.items()}
        clone._segments, clone.out_of_memory = self._segments, self.out_of_memory
        clone.allocated, clone.reserved = self.allocated, self.reserved
        clone.peak_allocated, clone.peak_reserved = self.peak_allocated, self.peak_reserved
        return clone

    def _release_cached(self) -> None:
        """Give back every cached block that is a whole segment (`release_cached_blocks`)."""
        for block in [b for b in self._at.values() if b.prev is None and b.next is None]:
            self._uncache(block)
            self.reserved -= block.size

    def _uncache(self, block: _Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]
        del self._at[block.address]


class OutOfMemory(Exception):
    """A replay under a capacity ran out of memory (`CachingAllocator(stop=True)`)."""


class Paused(Exception):
    """A replay reached a segment past its capacity, and nothing was released (`CachingAllocator(pause=True)`)."""


# -- a step's events, replayed alone or as training replays them ------------------------------------------
# ("malloc", key, nbytes), ("free", key), and ("grad", key, nbytes, param): `param`'s gradient, the storage
# `key` (or a new one, when no event made it), which training keeps until the optimizer step is done.
Event = tuple
HISTORY_STEPS = 2  # optimizer steps replayed; the reserve stops growing after the second (GPT-2 small at full
# depth: 2, 3, 5 and 8 steps replay the same reserve; one step, 13% .. 42% of it). Two and three predict every
# measured H100/H200 peak, fit threshold and dry-run row of the README's GPT-2 the same, one published row 0.1
# point apart (fsdp_qlora's DDP LoRA); with two, a dry-run's AdamW rows take 20% less time
MICRO_STEPS_REPLAYED = 3  # micro-steps after the second meet the cache the second left: the same blocks again


def replay(events: Sequence[Event], allocator: Any = None, before: Sequence[Sequence[Event]] = ()) -> Any:
    """One step's allocations and frees alone, gradients dropped as they come (the activations' own cache),
    after the steps `before` (shorter batches' events: `varied_lengths`). `allocator`: one to replay into (a
    `CachingAllocator`, or `Calls` to record the calls), else a roomy one."""
    allocator = CachingAllocator() if allocator is None else allocator
    earlier = itertools.count(-1, -1)  # the earlier steps' allocations: keys apart from the step's own
    for made in before:
        keys: dict[Any, int] = {}
        for event in made:
            if event[0] == "malloc":
                keys[event[1]] = key = next(earlier)
                allocator.malloc(key, event[2])
            elif event[0] == "free" and event[1] in keys:
                allocator.free(keys.pop(event[1]))
        for key in keys.values():  # what the step left is gone before the next one
            allocator.free(key)
    for event in events:
        if event[0] == "malloc":
            allocator.malloc(event[1], event[2])
        elif event[0] == "free":
            allocator.free(event[1])
    return allocator


def replay_training(events: Sequence[Event], resident: Sequence[int], states: Sequence[int],
                    temporaries: Sequence[int], micro_steps: int, steps: int = HISTORY_STEPS,
                    allocator: Any = None, before: Sequence[Sequence[Event]] = ()) -> Any:
    """`steps` optimizer steps of `micro_steps` micro-steps each, replayed as a training process allocates
    them: `resident` first (the weights and buffers, moved to the card one by one), then every micro-step's
    `events` with each gradient kept (the first micro-step's; later ones add into it and are freed), the
    optimizer's `states` made at its first step, its `temporaries` made and freed at every step, and the
    gradients freed after it (`zero_grad`). On an H100 this history, not one step's activations, is what
    sets the reserved bytes above the allocated ones: the weights and states take cached blocks the next
    step's activations wanted (bench/README.md#allocator-history). `before`: optimizer steps of other
    events replayed first, alike (shorter batches: `varied_lengths`). `allocator`: as `replay`'s."""
    allocator = CachingAllocator() if allocator is None else allocator
    fresh = itertools.count()
    for nbytes in resident:
        allocator.malloc(next(fresh), nbytes)
    for step, made in enumerate((*before, *[events] * steps)):
        grads: dict[Any, Any] = {}
        for _ in range(min(micro_steps, MICRO_STEPS_REPLAYED)):
            _micro_step(allocator, made, grads, fresh)
        for nbytes in states if step == 0 else ():
            allocator.malloc(next(fresh), nbytes)
        made = [next(fresh) for _ in temporaries]
        for key, nbytes in zip(made, temporaries):
            allocator.malloc(key, nbytes)
        for key in [*made, *grads.values()]:
            allocator.free(key)
    return allocator


def _micro_step(allocator: Any, events: Sequence[Event], grads: dict, fresh: Iterator[int]) -> None:
    """One micro-step's events under fresh keys (numbers from `fresh`, as every allocation of the replay:
    ints hash fastest); gradients kept in `grads` (param -> key) past the step."""
    keys: dict[Any, Any] = {}
    kept = set(grads.values())
    for event in events:
        if event[0] == "malloc":
            keys[event[1]] = key = next(fresh)
            allocator.malloc(key, event[2])
        elif event[0] == "free":
            key = keys.pop(event[1], None)
            if key is not None and key not in kept:
                allocator.free(key)
        else:  # a gradient: kept on the first micro-step, added into the kept one (and freed) after
            _, storage, nbytes, param = event
            key = keys.pop(storage, None)
            if param in grads:
                if key is not None:
                    allocator.free(key)
                continue
            if key is None:
                key = next(fresh)
                allocator.malloc(key, nbytes)
            grads[param] = key
            kept.add(key)


class Calls:
    """A replay's calls to the allocator in order, recorded once (`replay(..., allocator=Calls())`) and
    replayed at any capacity: `key`, and the bytes of a malloc or -1 for a free. `kind`: the allocator they
    are replayed through (`CachingAllocator`, or `expandable.ExpandableAllocator`: the same interface)."""

    def __init__(self, kind: type = CachingAllocator) -> None:
        self.keys, self.sizes = array.array("q"), array.array("q")
        self.kind = kind

    def malloc(self, key: int, nbytes: int) -> None:
        self.keys.append(key)
        self.sizes.append(nbytes)

    def free(self, key: int) -> None:
        self.keys.append(key)
        self.sizes.append(-1)

    def replayed(self, capacity: int | None = None, stop: bool = False) -> Any:
        """The calls replayed through an allocator of `capacity` bytes; None where `stop` and it ran out."""
        return self._fed(self.kind(capacity, stop))

    def until(self, capacity: int, start: tuple[Any, int] | None = None) -> tuple[Any, int] | None:
        """The replay paused at its first segment past `capacity` (`CachingAllocator(pause=True)`), and the
        call it paused at: every replay under a capacity of at least `capacity` is the same up to there
        (the roomy replay's reserve only grows, and none of them has released anything yet). None where it
        never passes `capacity`. `start`: a replay paused at a capacity of at most `capacity` (`replayed_past`),
        gone on from (copied) instead of from the first call: it stands as this one stands there."""
        allocator, first = (self.kind(capacity), 0) if start is None else (start[0].copy(capacity), start[1])
        allocator.pause = True
        malloc, free = allocator.malloc, allocator.free
        for index, key, size in zip(itertools.count(first), itertools.islice(self.keys, first, None),
                                    itertools.islice(self.sizes, first, None)):
            try:
                free(key) if size < 0 else malloc(key, size)
            except Paused:
                return allocator, index
        return None

    def replayed_past(self, floor: int) -> tuple[Any, tuple[Any, int] | None]:
        """The roomy replay (`replayed()`), and the replay as it stood at its first segment past `floor` bytes
        (a copy, with the index of the call it paused at: `until`), None where it never passed `floor`. With
        `floor` at most the roomy replay's allocated peak (`floor()`), `until` at that peak goes on from
        there: the calls before it are replayed once."""
        passed = self.until(floor)
        if passed is None:
            return self.replayed(), None
        allocator, index = passed
        kept = allocator.copy(floor)
        allocator.capacity, allocator.pause = None, False
        return self._fed(allocator, index), (kept, index)

    def floor(self) -> int:
        """The most bytes live at once in these calls, each allocation rounded as the allocator rounds it
        (`round_size`), a key allocated again before it is freed kept as the allocator keeps it: at most any
        replay's allocated peak (a block holds at least its rounded request)."""
        live: dict[int, int] = {}
        current = most = 0
        for key, nbytes in zip(self.keys, self.sizes):
            if nbytes < 0:
                current -= live.pop(key, 0)
                continue
            live[key] = size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK if nbytes > MIN_BLOCK else MIN_BLOCK
            current += size
            if current > most:
                most = current
        return most

    def resumed(self, paused: tuple[Any, int], capacity: int) -> Any:
        """The replay under `capacity` (at least the one `paused` was made under) from where it paused;
        None where it runs out of memory."""
        allocator, index = paused
        return self._fed(allocator.copy(capacity, stop=True), index)

    def _fed(self, allocator: Any, start: int = 0) -> Any:
        malloc, free = allocator.malloc, allocator.free
        try:
            for key, size in zip(itertools.islice(self.keys, start, None), itertools.islice(self.sizes, start, None)):
                if size < 0:
                    free(key)
                else:
                    malloc(key, size)
        except OutOfMemory:
            return None
        return allocator


def allocations(events: Sequence[Event]) -> Iterator[tuple[int, Event]]:
    """A step's events, each storage named by the allocation it belongs to, numbered in the order they
    were made (storage ids are reused once freed): (index in `events`, event). A free of a storage made
    before the step is left out; a gradient no event made names None."""
    live: dict[Any, int] = {}
    made = itertools.count()
    for index, event in enumerate(events):
        if event[0] == "malloc":
            live[event[1]] = key = next(made)
            yield index, ("malloc", key, event[2])
        elif event[0] == "free":
            if event[1] in live:
                yield index, ("free", live.pop(event[1]))
        else:  # kept by training (`_micro_step`), or freed by the next event
            yield index, ("grad", live.get(event[1]), *event[2:])


_OPS = ("malloc", "free", "grad")
_FREE = _OPS.index("free")


def _order_frees(ops: bytearray, keys: array.array) -> None:
    """Put each run of frees in a row in the order of their allocations. Frees in a row replay alike in any
    order (a freed block merges with its free neighbours either way, and frees make no peak), but the order
    tensors die in may differ between two simulations of one step (a model's own classes: two of its
    storages freed together), which would replay, and be kept (`Replay.digest`), as two."""
    start = 0
    while start < len(ops):
        if ops[start] != _FREE:
            start += 1
            continue
        end = start
        while end < len(ops) and ops[end] == _FREE:
            end += 1
        keys[start:end] = array.array("q", sorted(keys[start:end]))
        start = end


def _aligned(mine: bytes, theirs: bytes) -> tuple[int, int]:
    """How many events two replays' `ops` share from the start, and then from the end (of what is left)."""
    import torch

    count = min(len(mine), len(theirs))
    if not count:
        return 0, 0
    a, b = (torch.frombuffer(bytearray(ops), dtype=torch.uint8) for ops in (mine, theirs))
    differ = (a[:count] != b[:count]).nonzero()
    start = int(differ[0]) if len(differ) else count
    left = count - start
    if not left:
        return start, 0
    differ = (a[len(mine) - left:].flip(0) != b[len(theirs) - left:].flip(0)).nonzero()
    return start, int(differ[0]) if len(differ) else left


@dataclasses.dataclass(frozen=True, eq=False)
class Replay:
    """A simulated step's events, kept compact, with what training holds beside them: replayed at any
    capacity (`run`) and read at another micro-batch (`scaled`). Each allocation is named by the order it
    was made in (storage ids are reused), each gradient's parameter by the order it first appears."""

    ops: bytes  # an index into _OPS per event
    keys: array.array  # the allocation each event names (-1: a gradient no event made)
    sizes: array.array  # bytes (a malloc's, a gradient's), 0 for a free
    params: array.array  # a gradient's parameter, -1 elsewhere
    training: tuple | None = None  # (resident, states, temporaries, micro_steps): `replay_training`; None: `replay`
    # the allocator replays them with expandable segments (`expandable.ExpandableAllocator`), else fixed ones
    expandable: bool = False
    before: tuple["Replay", ...] = ()  # steps of shorter batches replayed first (`varied_lengths.after_shorter`)

    @classmethod
    def of(cls, events: Sequence[Event], training: tuple | None = None) -> "Replay":
        params: dict[Any, int] = {}
        ops, keys, sizes, owners = bytearray(), array.array("q"), array.array("q"), array.array("q")
        for _, event in allocations(events):
            ops.append(_OPS.index(event[0]))
            keys.append(-1 if event[1] is None else event[1])
            sizes.append(event[2] if event[0] != "free" else 0)
            owners.append(params.setdefault(event[3], len(params)) if event[0] == "grad" else -1)
        _order_frees(ops, keys)
        return cls(bytes(ops), keys, sizes, owners, training)

    def valid(self) -> bool:
        """Whether the arrays hold events as `of` makes them (read back from a file: `memo.decode_peak`): one
        entry each per event, a malloc and a free of an allocation, a gradient of a parameter, no size
        below zero."""
        count = len(self.ops)
        if not len(self.keys) == len(self.sizes) == len(self.params) == count:
            return False
        if not count:
            return True
        import torch  # whole arrays at once: a 7B step's events are ~10^4 an entry, ~10^5 a dry-run

        ops = torch.frombuffer(bytearray(self.ops), dtype=torch.uint8)
        keys, sizes, params = (torch.frombuffer(values, dtype=torch.int64) for values in (self.keys, self.sizes, self.params))
        grad = ops == _OPS.index("grad")
        return bool((ops < len(_OPS)).all() and (sizes >= 0).all() and (keys >= torch.where(grad, -1, 0)).all()
                    and (params[grad] >= 0).all() and (params[~grad] == -1).all())

    def digest(self) -> str:
        """The events and the history beside them, as one hash: two replays of the same digest replay alike."""
        digest = hashlib.sha256(self.ops)
        for values in (self.keys, self.sizes, self.params):
            digest.update(values.tobytes())
        digest.update(repr(self.training).encode())
        if self.expandable:
            digest.update(b"expandable segments")
        for earlier in self.before:
            digest.update(earlier.digest().encode())
        return digest.hexdigest()

    def events(self) -> list[Event]:
        """The events, as `replay` and `replay_training` read them."""
        made: list[Event] = []
        for op, key, size, param in zip(self.ops, self.keys, self.sizes, self.params):
            made.append(("malloc", key, size) if op == 0 else ("free", key) if op == 1 else
                        ("grad", ("grad", param) if key < 0 else key, size, param))
        return made

    def run(self, capacity: int | None = None) -> CachingAllocator:
        """The step replayed through an allocator of `capacity` bytes (None: unlimited)."""
        found = self.calls().replayed(capacity)
        assert found is not None  # without `stop` a replay goes on
        return found

    def calls(self, kind: type = CachingAllocator) -> Calls:
        """The calls this replay makes of the allocator (`Calls`: replayed at many capacities, resumed
        where they part, through an allocator of `kind`), recorded once from the events."""
        calls, events, before = Calls(kind), self.events(), [earlier.events() for earlier in self.before]
        if self.training is None:
            replay(events, allocator=calls, before=before)
        else:
            resident, states, temporaries, micro_steps = self.training
            replay_training(events, resident, states, temporaries, micro_steps, allocator=calls, before=before)
        return calls

    def scaled(self, other: "Replay", at: float, here: float, there: float) -> "Replay | None":
        """The step at micro-batch `at` from this one (at `here`) and `other` (at `there`, the template): its
        events, each size on the line through the two where the events align (the same kinds of event from
        the start and from the end: the loss decomposes a little differently at micro-batch 1), between
        them scaled with the batch; never below zero. None where the two hold different weights or steps."""
        if self.training != other.training:
            return None
        import torch  # whole arrays at once, each number as Python's float arithmetic and round() make it

        if not other.ops:
            return dataclasses.replace(other, sizes=array.array("q"))
        theirs_sizes = torch.frombuffer(other.sizes, dtype=torch.int64)
        scaled = torch.round(theirs_sizes.double() * at / there)
        mine, theirs = len(self.ops), len(other.ops)
        start, end = _aligned(self.ops, other.ops)
        if start or end:
            own = torch.frombuffer(self.sizes, dtype=torch.int64) if mine else torch.zeros(0, dtype=torch.int64)
            for a, b in ((slice(0, start), slice(0, start)), (slice(mine - end, mine), slice(theirs - end, theirs))):
                line = own[a].double() + (theirs_sizes[b] - own[a]).double() * (at - here) / (there - here)
                scaled[b] = torch.round(line).clamp(min=0)
        sizes = array.array("q", scaled.to(torch.int64).tolist())
        return dataclasses.replace(other, sizes=sizes)
