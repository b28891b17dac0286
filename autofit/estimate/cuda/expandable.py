"""The CUDA caching allocator with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, replayed: what
`torch.cuda.max_memory_reserved` shows for a sequence of allocations and frees when the allocator maps
pages into one growing segment per pool instead of taking a `cudaMalloc` segment per request.

The rules, from c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch @ 001074d2; its Note [Expandable
Segments]), on one stream:

- requests are rounded (`round_size`) and pooled (small: up to 1 MiB) as without expandable segments;
- each pool has one segment, a range of virtual addresses with physical pages mapped into it as needed:
  2 MiB pages for the small pool, 20 MiB pages for the large pool (`find_expandable_block`:
  `kSmallBuffer`, `kLargeBuffer`); the reserved bytes are the pages mapped;
- a request is served by the smallest free mapped block that fits, except that a free block followed by
  unmapped pages counts as its size plus theirs, so a block that could only grow the segment is passed
  over for the next larger free one where that is smaller so counted (`get_free_block`);
- else pages are mapped at the lowest address where free and unmapped space together fit the request:
  behind the free block at the end of what is mapped, whose bytes are used first (`try_allocate_expandable_block`,
  `map_block`: the mapped range rounded up to whole pages);
- every block is split where at least 512 bytes remain, in either pool (`should_split`);
- a freed block merges with its free neighbours; pages stay mapped until the allocator runs out of memory,
  when every whole page inside a free block is unmapped and the request retried (`release_blocks`,
  `unmap_block`). So at a limit the segment holds little more than its allocated bytes: the partial pages
  at the edges of the free blocks, not whole free segments.
- Under a per-process limit a request is refused where the reserved bytes plus the segment the default
  allocator would take for it (`get_allocation_size`, `segment_size` here) pass the limit (`alloc_block`
  checks `p.alloc_size` before mapping anything).

`ExpandableAllocator` has `CachingAllocator`'s interface (`malloc`, `free`, the peaks, `capacity`, `stop`,
`pause`, `copy`), so `allocator.Calls` replays and bisects either alike.
"""

from __future__ import annotations

import bisect
from typing import Any

from autofit.estimate.cuda.allocator import (LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, OutOfMemory, Paused,
                                             round_size, segment_size)

_PAGES = 1 << 20  # pages of address space a pool's segment spans (the card's memory and an eighth, in torch)
_BASE = {False: 1 << 52, True: 2 << 52}  # the large and the small pool's segment, apart


def page_size(small: bool) -> int:
    """The bytes one mapping adds to a pool's expandable segment: 2 MiB (small pool) or 20 MiB (large)."""
    return SMALL_BUFFER if small else LARGE_BUFFER


class _Block:
    """A block of a pool's segment in address order: allocated, free (mapped) or unmapped."""

    __slots__ = ("address", "size", "small", "free", "mapped", "prev", "next")

    def __init__(self, address: int, size: int, small: bool, mapped: bool = True) -> None:
        self.address, self.size, self.small, self.mapped = address, size, small, mapped
        self.free, self.prev, self.next = True, None, None


class ExpandableAllocator:
    """Replays `malloc(key, nbytes)` / `free(key)` with expandable segments and keeps the allocated and
    reserved (mapped) bytes and their peaks. `capacity`, `stop` and `pause` as `CachingAllocator`'s."""

    def __init__(self, capacity: int | None = None, stop: bool = False, pause: bool = False) -> None:
        self.capacity, self.stop, self.pause = capacity, stop, pause
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # pool -> sorted (size, address)
        self._unmapped: dict[bool, list[int]] = {True: [], False: []}  # pool -> sorted addresses
        self._at: dict[int, _Block] = {}  # address -> free or unmapped block
        self._used: dict[Any, _Block] = {}  # key -> allocated block
        for small in (True, False):
            self._keep(_Block(_BASE[small], _PAGES * page_size(small), small, mapped=False))
        self.out_of_memory = False
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, key: Any, nbytes: int) -> None:
        # `round_size`, the best-fit free block (`get_free_block`), `_take`, `_link` and `_keep` written out:
        # a dry-run makes millions of these calls
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK if nbytes > MIN_BLOCK else MIN_BLOCK
        small = size <= SMALL_SIZE
        pool, at = self._free[small], self._at
        index = bisect.bisect_left(pool, (size, -1))
        if index < len(pool):
            block = at[pool[index][1]]
            after = block.next
            if after is not None and not after.mapped:  # only a block with an unmapped tail may be passed over
                while index + 1 < len(pool) and self._growable(pool[index + 1][1]) < self._growable(pool[index][1]):
                    index += 1
                block = at[pool[index][1]]
            del pool[index]
            del at[block.address]
        else:
            block = self._grown(small, size)
        remaining = block.size - size
        if remaining >= MIN_BLOCK:
            after = block.next
            rest = _Block(block.address + size, remaining, small)
            rest.prev, rest.next, block.next = block, after, rest
            if after is not None:
                after.prev = rest
            block.size = size
            bisect.insort(pool, (remaining, rest.address))
            at[rest.address] = rest
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
        if before is not None and before.free and before.mapped:  # `_merged` and `_keep`, written out
            del pool[bisect.bisect_left(pool, (before.size, before.address))]
            del at[before.address]
            before.size += block.size
            before.next = after
            if after is not None:
                after.prev = before
            block = before
        if after is not None and after.free and after.mapped:
            del pool[bisect.bisect_left(pool, (after.size, after.address))]
            del at[after.address]
            block.size += after.size
            block.next = following = after.next
            if following is not None:
                following.prev = block
        bisect.insort(pool, (block.size, block.address))
        at[block.address] = block

    # -- finding room ------------------------------------------------------------------------------------
    def _growable(self, address: int) -> int:
        block = self._at[address]
        after = block.next
        return block.size + (after.size if after is not None and not after.mapped else 0)

    def _grown(self, small: bool, size: int) -> _Block:
        """Pages mapped for a request no free block serves, after releasing the free pages where the limit
        is reached (`alloc_block`, `release_cached_blocks`)."""
        if self.capacity is not None and self.reserved + segment_size(size) > self.capacity:
            if self.pause:
                raise Paused
            self._release()
            self.out_of_memory |= self.reserved + segment_size(size) > self.capacity
            if self.out_of_memory and self.stop:
                raise OutOfMemory
        block = self._room(small, size)
        if not block.mapped:
            block = self._map(block, size)
        while block.size < size:  # a free block, followed by unmapped pages: map what it lacks
            block = self._map(block.next, size - block.size)
        return self._take(block)

    def _room(self, small: bool, size: int) -> _Block:
        """The lowest unmapped block, with the free block before it, that free and unmapped space behind
        it fits `size` (`find_expandable_block`)."""
        for address in self._unmapped[small]:
            block = self._at[address]
            if block.prev is not None and block.prev.free and block.prev.mapped:
                block = block.prev
            room, after = 0, block
            while after is not None and after.free and room < size:
                room, after = room + after.size, after.next
            if room >= size:
                return block
        raise AssertionError("an expandable segment spans more than any card holds")

    def _map(self, block: _Block, size: int) -> _Block:
        """Map whole pages at the start of the unmapped `block` for `size` bytes: the free block they make,
        merged with its free neighbours (`map_block`)."""
        page = page_size(block.small)
        mapped = min(block.size, -(-size // page) * page)
        self._drop(block)
        if mapped < block.size:
            rest = _Block(block.address + mapped, block.size - mapped, block.small, mapped=False)
            _link(rest, block, block.next)
            block.size = mapped
            self._keep(rest)
        block.mapped = True
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        merged = self._merged(block)
        self._keep(merged)
        return merged

    # -- giving pages back ------------------------------------------------------------------------------
    def _release(self) -> None:
        """Unmap every whole page inside a free block (`release_blocks`, `unmap_block`)."""
        for small in (True, False):
            for _, address in list(self._free[small]):
                self._unmap(self._at[address])

    def _unmap(self, block: _Block) -> None:
        page, base = page_size(block.small), _BASE[block.small]
        first = base + -(-(block.address - base) // page) * page
        last = base + (block.address + block.size - base) // page * page
        if first >= last:
            return
        self._drop(block)
        pieces = [(block.address, first - block.address, True), (first, last - first, False),
                  (last, block.address + block.size - last, True)]
        made = [_Block(address, size, block.small, mapped) for address, size, mapped in pieces if size]
        before = block.prev
        for piece in made:
            _link(piece, before, None)
            before = piece
        made[-1].next = block.next
        if block.next is not None:
            block.next.prev = made[-1]
        self.reserved -= last - first
        for piece in made:
            self._keep(piece if piece.mapped else self._merged(piece))

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _merged(self, block: _Block) -> _Block:
        """`block` merged with its free neighbours of the same mapping (`try_merge_blocks`)."""
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free and neighbour.mapped == block.mapped:
                self._drop(neighbour)
                first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
                first.size += second.size
                _link(first, first.prev, second.next)
                block = first
        return block

    def _keep(self, block: _Block) -> None:
        if block.mapped:
            bisect.insort(self._free[block.small], (block.size, block.address))
        else:
            bisect.insort(self._unmapped[block.small], block.address)
        self._at[block.address] = block

    def _drop(self, block: _Block) -> None:
        if block.mapped:
            pool = self._free[block.small]
            del pool[bisect.bisect_left(pool, (block.size, block.address))]
        else:
            pool = self._unmapped[block.small]
            del pool[bisect.bisect_left(pool, block.address)]
        del self._at[block.address]

    def _take(self, block: _Block) -> _Block:
        self._drop(block)
        return block

    def copy(self, capacity: int | None, stop: bool = False) -> "ExpandableAllocator":
        """This allocator as it stands, apart (every block copied in address order), to go on under `capacity`."""
        clone = ExpandableAllocator(capacity, stop)
        clone._free, clone._unmapped, clone._at, clone._used = {True: [], False: []}, {True: [], False: []}, {}, {}
        owners = {id(block): key for key, block in self._used.items()}
        for small in (True, False):
            block, before = self._head(small), None
            while block is not None:
                made = _Block(block.address, block.size, small, block.mapped)
                made.free = block.free
                _link(made, before, None)
                if made.free:
                    clone._keep(made)
                else:
                    clone._used[owners[id(block)]] = made
                block, before = block.next, made
        clone.out_of_memory = self.out_of_memory
        clone.allocated, clone.reserved = self.allocated, self.reserved
        clone.peak_allocated, clone.peak_reserved = self.peak_allocated, self.peak_reserved
        return clone

    def _head(self, small: bool) -> _Block:
        """The first block of a pool's segment (its lowest address)."""
        block = next(b for b in (*self._at.values(), *self._used.values()) if b.small is small)
        while block.prev is not None:
            block = block.prev
        return block


def _link(block: _Block, before: _Block | None, after: _Block | None) -> None:
    """Put `block` between `before` and `after` in its segment's address order."""
    block.prev, block.next = before, after
    if before is not None:
        before.next = block
    if after is not None:
        after.prev = block
