"""Batches of varied length: the caching allocator's reserve after a run of shorter steps.

A job whose batches are each padded to their own longest sample, up to the sequence length the user
gives (`TrainSpec.varied_lengths`: the dry-run's `--varied-lengths`), allocates other sizes at every
step. `torch.cuda.max_memory_reserved` is then the reserve of the whole run, not of one step at the
longest length: the caching allocator never gives a segment back unless a `cudaMalloc` fails
(`allocator.CachingAllocator`), and a block cached by a shorter step serves a longer step's request
only where it is large enough (best fit: the smallest cached block of at least the rounded size).

Which history to replay follows from those rules. Steps from longest to shortest reserve no more than
the longest step alone: each later request of a shorter step finds a cached block at least its size.
Steps from shortest to longest make each step's large transients (the large pool above 1 MiB: segments
of the request rounded up to 2 MiB from 10 MiB on) larger than the blocks the step before cached for the
same tensors, so they take new segments and the earlier ones stay, reused only by smaller requests. The
replay is that ascending history: `rungs_for` optimizer steps at 1/n, 2/n, ... of the length (n - 1 of
them), then the training history at the full length (`allocator.replay_training`'s two optimizer steps;
the step alone where training is not replayed); the prediction keeps the larger of its reserve and the
one-length one (the longest batch first). It is not a bound: other orders split and merge blocks
across steps in ways the ascending one does not, and shuffled orders of the same lengths reserved up to
a few points more on the calibration's rows (bench/calibration/README.md, "Varied lengths", measured with
`bench/calibration/varied_lengths.py`); a run that sorts its batches from long to short reserves less.

The shorter steps' events are read on the line through two simulated micro-batches at the full length
(`Replay.scaled`, as the dry-run extrapolates micro-batches), at the micro-batch holding as many tokens:
a tensor linear in the tokens (every activation of a fused-attention transformer, its logits, its
dropout masks) has the size it has at the shorter length; a weight's copy, a gradient or an optimizer
state does not scale, and stays. Eager attention's scores grow with the square of the length: read so,
they are n / k times as large as at step k, so the replay caches larger blocks than a real history
would and can reserve less than it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autofit.estimate.cuda.allocator import ROUND_LARGE, Replay
from autofit.estimate.cuda.training_replay import reserve

MOST_RUNGS = 64  # the most steps of the ascending history replayed (each a training step replayed: time)


def rungs_for(low: Replay, high: Replay, micro_batch: int, at_low: int, at_high: int) -> int | None:
    """How many steps the ascending history takes: as many as the largest tensor that grows with the tokens
    has 2 MiB roundings of the large pool (`allocator.ROUND_LARGE`) between no tokens and the step's, so that
    from one step to the next no tensor grows by more than one rounding (a finer history takes the same
    segments), at most `MOST_RUNGS`. None where the two steps differ beyond their sizes."""
    import torch

    full, empty = (low.scaled(high, at, at_low, at_high) for at in (micro_batch, 0))
    if full is None or empty is None or not len(full.sizes):
        return None
    grows = torch.frombuffer(full.sizes, dtype=torch.int64) - torch.frombuffer(empty.sizes, dtype=torch.int64)
    return max(2, min(MOST_RUNGS, -(-int(grows.max()) // ROUND_LARGE)))


def fractions(rungs: int) -> tuple[float, ...]:
    """The shorter steps' lengths as fractions of the longest, ascending: 1/`rungs` .. (`rungs` - 1)/`rungs`."""
    return tuple(k / rungs for k in range(1, rungs))


def shorter_steps(low: Replay, high: Replay, micro_batch: int, at_low: int, at_high: int,
                  rungs: int | None = None) -> tuple[Replay, ...] | None:
    """The steps of `fractions(rungs)` of the length at `micro_batch` samples (`rungs`: `rungs_for`'s where
    None), ascending: each read on the line through `low` (simulated at micro-batch `at_low`) and `high`
    (at `at_high`), at the micro-batch holding as many tokens (`micro_batch` x the fraction). None where
    the two steps differ beyond their sizes (`Replay.scaled`)."""
    rungs = rungs or rungs_for(low, high, micro_batch, at_low, at_high)
    if rungs is None:
        return None
    steps = []
    for fraction in fractions(rungs):
        step = low.scaled(high, micro_batch * fraction, at_low, at_high)
        if step is None:
            return None
        steps.append(dataclasses.replace(step, before=()))
    return tuple(steps)


def after_shorter(final: Replay, shorter: tuple[Replay, ...]) -> Replay:
    """`final`'s replay with the `shorter` steps replayed first, each as one optimizer step of `final`'s
    training (its micro-steps; the weights and the optimizer's states made once, before and at the first)."""
    return dataclasses.replace(final, before=shorter)


def reserve_after_shorter(peak: Any, low: Replay | None, high: Replay | None, micro_batch: int, at_low: int,
                          at_high: int) -> tuple[dict[str, int], str]:
    """`peak`'s (`ActivationPeak`) reserve fields (`fragmentation`, `least_fragmentation`, bytes) for batches of
    varied length, and a phrase saying how they were replayed: the larger of `peak`'s own (the longest
    batch first leaves the one-length reserve) and those of its replay after the shorter steps read on the
    line through `low` and `high` (`shorter_steps`); `peak`'s own where they cannot be read."""
    shorter = shorter_steps(low, high, micro_batch, at_low, at_high) if low and high else None
    fields = ("fragmentation", "least_fragmentation")
    if shorter is None:
        return ({field: getattr(peak, field) for field in fields},
                "; one length replayed (the shorter batches' steps could not be read on the micro-batch line)")
    after = reserve(after_shorter(peak.replay, shorter))
    return ({field: max(getattr(peak, field), after[field]) for field in fields},
            f"; the allocator's reserve after {len(shorter)} shorter batches")
