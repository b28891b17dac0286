"""What `training_replay.reserve` replays to find a step's reserve (autofit/estimate/cuda/training_replay.py,
allocator.py's `Calls`): the roomy replay, then `least_reserve`'s bisection from its pause, each call before
that pause replayed once, and the same figures as a bisection paused from the first call."""

import dataclasses

import pytest
from test_expandable import random_events

from autofit.estimate.cuda import training_replay
from autofit.estimate.cuda.allocator import CachingAllocator, Replay
from autofit.estimate.cuda.expandable import ExpandableAllocator
from autofit.estimate.simulation import disk_cache

MIB = 1 << 20
KINDS = (CachingAllocator, ExpandableAllocator)


def _training_replay(seed: int, count: int = 300) -> Replay:
    events = random_events(seed, count)
    history = ((200 * MIB, 90 * MIB, 5 * MIB), (80 * MIB, 80 * MIB), (40 * MIB,), 3)
    return Replay.of(events, history)


@pytest.mark.parametrize("kind", KINDS)
def test_the_floor_is_at_most_the_allocated_peak_and_the_pause_is_found_from_it(kind):
    for seed in range(8):
        calls = _training_replay(seed).calls(kind)
        roomy, passed = calls.replayed_past(calls.floor())
        whole = calls.replayed()
        assert calls.floor() <= whole.peak_allocated
        assert (roomy.peak_allocated, roomy.peak_reserved, roomy.reserved) == \
            (whole.peak_allocated, whole.peak_reserved, whole.reserved)
        alone, resumed = calls.until(whole.peak_allocated), calls.until(whole.peak_allocated, passed)
        assert (alone is None) == (resumed is None)
        if alone is not None:
            assert alone[1] == resumed[1]
            assert (alone[0].reserved, alone[0].allocated) == (resumed[0].reserved, resumed[0].allocated)
            for capacity in range(whole.peak_allocated, whole.peak_reserved + 40 * MIB, 7 * MIB):
                one, other = calls.resumed(alone, capacity), calls.resumed(resumed, capacity)
                assert (one is None) == (other is None)
                if one is not None:
                    assert (one.peak_reserved, one.reserved) == (other.peak_reserved, other.reserved)
        assert training_replay.least_reserve(calls, whole) == training_replay.least_reserve(calls, roomy, passed)


@pytest.mark.parametrize("kind", KINDS)
def test_a_reserve_replays_each_call_before_its_pause_once(kind, monkeypatch):
    monkeypatch.setattr(disk_cache, "RESERVES", disk_cache.Reserves(folder=None))
    made: list[int] = []
    real = kind.malloc
    monkeypatch.setattr(kind, "malloc", lambda self, key, nbytes: made.append(key) or real(self, key, nbytes))
    paused = 0
    for seed in range(8):
        replay = dataclasses.replace(_training_replay(seed), expandable=kind is ExpandableAllocator)
        calls = replay.calls(kind)
        roomy, passed = calls.replayed_past(calls.floor())
        if passed is None or calls.until(roomy.peak_allocated, passed) is None:
            continue
        # the calls before the roomy replay first passes the floor (the pause itself, on a step of a model:
        # a block holds its rounded request there, and the floor is the allocated peak)
        before = {key for key, nbytes in zip(calls.keys[:passed[1]], calls.sizes[:passed[1]]) if nbytes >= 0}
        made.clear()
        training_replay.reserve(replay)
        paused += 1
        assert sum(key in before for key in made) == len(before)  # the roomy replay's, and no other
    assert paused >= 3
