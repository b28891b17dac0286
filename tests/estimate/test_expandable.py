"""The CUDA caching allocator with expandable segments, replayed (autofit/estimate/cuda/expandable.py): the
rules of c10/cuda/CUDACachingAllocator.cpp's expandable segments, beside the default allocator's, and the
estimate's reserve term under each."""

import dataclasses
import random

import torch
from models import WideMlp

from autofit.config import Config
from autofit.estimate.cuda.allocator import CachingAllocator, Replay
from autofit.estimate.cuda.expandable import ExpandableAllocator, page_size
from autofit.estimate.cuda.training_replay import least_reserve, reserve
from autofit.estimate.estimator import Estimator
from autofit.job.train_spec import make_spec
from autofit.strategies import default_strategies

MIB = 1 << 20


def test_pages_are_mapped_in_the_pool_s_size():
    assert (page_size(True), page_size(False)) == (2 * MIB, 20 * MIB)
    allocator = ExpandableAllocator()
    allocator.malloc("a", 30 * MIB)  # two 20 MiB pages of the large pool
    assert (allocator.allocated, allocator.reserved) == (30 * MIB, 40 * MIB)
    for key in range(100):
        allocator.malloc(key, 3000)  # one 2 MiB page of the small pool
    assert allocator.reserved == 42 * MIB


def test_a_free_block_is_used_before_the_segment_grows_and_grows_it_by_what_it_lacks():
    allocator = ExpandableAllocator()
    allocator.malloc("a", 30 * MIB)  # pages [0, 40): a, then 10 MiB free
    allocator.malloc("b", 30 * MIB)  # the 10 MiB free and one more page: [30, 60)
    assert allocator.reserved == 60 * MIB
    allocator.malloc("c", 5 * MIB)  # [60, 65) of a new page
    allocator.malloc("d", 15 * MIB)  # the 15 MiB left of that page: nothing mapped
    assert (allocator.reserved, allocator.allocated) == (80 * MIB, 80 * MIB)


def test_freed_neighbours_merge_across_what_default_segments_keep_apart():
    def run(allocator):
        allocator.malloc("a", 30 * MIB)
        allocator.malloc("b", 30 * MIB)
        allocator.free("a")
        allocator.free("b")
        allocator.malloc("c", 55 * MIB)
        return allocator.peak_reserved

    assert run(CachingAllocator()) == (30 + 30 + 56) * MIB  # two cached segments, neither holds 55 MiB
    assert run(ExpandableAllocator()) == 60 * MIB  # one free block of 60 MiB serves it


def test_at_capacity_free_pages_are_unmapped_where_a_split_segment_could_not_be_released():
    # the default allocator gives back whole free segments only: a segment that holds a live block stays
    default = CachingAllocator(capacity=40 * MIB)
    default.malloc("a", 30 * MIB)
    default.malloc("s", MIB + 512)  # a 20 MiB segment: 30 + 20 > 40, nothing whole to release
    assert default.out_of_memory
    expandable = ExpandableAllocator(capacity=40 * MIB)
    expandable.malloc("a", 30 * MIB)
    expandable.malloc("s", MIB + 512)  # from the 10 MiB left free on a's second page
    assert not expandable.out_of_memory and expandable.reserved == 40 * MIB

    allocator = ExpandableAllocator(capacity=100 * MIB)
    allocator.malloc("x", 50 * MIB)  # pages [0, 60)
    allocator.malloc("y", 10 * MIB)  # [50, 60)
    allocator.free("x")  # [0, 50) free, mapped
    allocator.malloc("z", 70 * MIB)  # 60 + 70 > 100: [0, 40) unmapped first (whole pages), then [60, 140)
    assert (allocator.reserved, allocator.allocated, allocator.out_of_memory) == (100 * MIB, 80 * MIB, False)
    allocator.malloc("w", 39 * MIB)  # no room left for another 40 MiB mapping: out of memory
    assert allocator.out_of_memory


def test_a_free_block_that_could_only_grow_the_segment_is_passed_over_for_a_larger_one():
    # get_free_block: a free block followed by unmapped pages counts with them; the next larger free block,
    # smaller so counted, serves the request (`malloc` looks past the best fit only for such a block)
    allocator = ExpandableAllocator()
    allocator.malloc("a", 20 * MIB)  # [0, 20)
    allocator.malloc("h", 16 * MIB)  # [20, 36) of the pages [20, 40)
    allocator.malloc("b", 6 * MIB)  # [36, 42): one more page; [42, 60) free, unmapped pages behind it
    allocator.free("a")  # [0, 20) free, between nothing and h
    allocator.malloc("c", 17 * MIB)  # the 18 MiB at the end is passed over for the 20 MiB at the start
    assert (allocator._used["c"].address - allocator._used["h"].address, allocator.reserved) == (-20 * MIB, 60 * MIB)
    allocator.malloc("d", 19 * MIB + MIB // 2)  # only the end's 18 MiB and a new page hold it
    assert allocator.reserved == 80 * MIB


def test_a_request_is_refused_at_the_limit_by_the_segment_the_default_allocator_would_take():
    # alloc_block checks `total_allocated_memory + p.alloc_size` (get_allocation_size: 20 MiB for 1-10 MiB)
    allocator = ExpandableAllocator(capacity=30 * MIB, stop=True)
    allocator.malloc("a", 19 * MIB)  # one 20 MiB page, 1 MiB free: too small for the next
    try:
        allocator.malloc("b", 2 * MIB)  # 20 + 20 > 30, though one 20 MiB page would fit
    except Exception as exc:  # noqa: BLE001 - the replay's OutOfMemory
        assert type(exc).__name__ == "OutOfMemory"
    else:
        raise AssertionError("the request should have been refused")


def random_events(seed: int, count: int = 400) -> list:
    """A random run of mallocs and frees (`Replay.of` events), the same for a seed."""
    rng, live, events = random.Random(seed), [], []
    for key in range(count):
        if live and rng.random() < 0.45:
            events.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            events.append(("malloc", key, rng.choice([3000, 600_000, 3 * MIB, 12 * MIB, 33 * MIB + 7])))
            live.append(key)
    return events


def test_a_replay_resumed_where_it_paused_is_the_replay_run_whole_with_expandable_segments():
    for seed in range(3):
        calls = Replay.of(random_events(seed)).calls(ExpandableAllocator)
        roomy = calls.replayed()
        paused = calls.until(roomy.peak_allocated)
        if paused is None:
            continue
        for capacity in range(roomy.peak_allocated, roomy.peak_reserved + 40 * MIB, 3 * MIB):
            whole, resumed = calls.replayed(capacity, stop=True), calls.resumed(paused, capacity)
            assert (whole is None) == (resumed is None)
            if whole is not None:
                assert (whole.peak_reserved, whole.reserved, whole.allocated) == \
                    (resumed.peak_reserved, resumed.reserved, resumed.allocated)


def test_expandable_segments_need_no_more_than_fixed_ones_on_random_steps():
    # what a fit needs (the least reserve the replay runs in) is at most the default allocator's: its free
    # pages are unmapped before an OOM, where fixed segments are released only whole
    for seed in range(6):
        replay = Replay.of(random_events(seed))
        needs = []
        for expandable in (False, True):
            calls = dataclasses.replace(replay, expandable=expandable).calls(
                ExpandableAllocator if expandable else CachingAllocator)
            needs.append(least_reserve(calls, calls.replayed()))
        assert needs[1] <= needs[0] + 20 * MIB, (seed, needs)  # a page of the large pool at most above


def test_the_reserve_is_kept_apart_per_allocator():
    replay = Replay.of(random_events(1))
    fixed, grown = reserve(replay), reserve(dataclasses.replace(replay, expandable=True))
    assert replay.digest() != dataclasses.replace(replay, expandable=True).digest()
    assert fixed["fragmentation"] != grown["fragmentation"]


def test_the_estimate_replays_the_step_through_the_allocator_its_config_sets():
    from autofit.devices.gpus import get_gpu
    from autofit.job.target import Target

    spec = make_spec(WideMlp, lambda n: torch.randn(n, 300, 512), device="cpu", memory_budget="80GiB",
                     loss_fn=lambda output, batch: output.square().mean(),
                     target=Target.from_profile(get_gpu("a100-80gb"), 1))
    estimator = Estimator(spec, target="cuda", strategies=default_strategies())
    fixed, grown = Config(micro_batch_size=8), Config(micro_batch_size=8, allocator="expandable_segments")
    (plain, _), (expandable, _) = estimator.activations(fixed), estimator.activations(grown)
    assert plain.replay is not None and not plain.replay.expandable
    assert expandable.fragmentation == reserve(dataclasses.replace(plain.replay, expandable=True))["fragmentation"]
    assert dict(estimator.predict(grown).terms)["fragmentation"] == expandable.fragmentation
    assert estimator.activations(fixed)[0] == plain  # the default's replay is untouched
    # read on the line through micro-batches 1 and 2, the extrapolated step is replayed through it too
    lines = Estimator(spec, target="cuda", strategies=default_strategies(), extrapolate_batch=True)
    assert lines.activations(grown)[0].replay.expandable and not lines.activations(fixed)[0].replay.expandable
