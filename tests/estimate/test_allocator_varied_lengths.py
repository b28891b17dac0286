"""Batches of varied length (autofit/estimate/cuda/varied_lengths.py): the caching allocator replayed after
shorter steps, ascending, as docs/dry-run.md ("Batches of varied length") says."""

import torch
from click.testing import CliRunner
from models import WideMlp

from autofit.cli.dry_run import dry_run_command
from autofit.config import Config
from autofit.estimate.cuda import varied_lengths
from autofit.estimate.cuda.allocator import CachingAllocator, Replay, replay, replay_training
from autofit.estimate.estimator import Estimator
from autofit.job.train_spec import make_spec

MIB = 1 << 20


def step(mib: int) -> list:
    """One step holding `mib` MiB of activations, then freed."""
    return [("malloc", "act", mib * MIB), ("free", "act")]


def test_shorter_steps_first_leave_segments_the_longest_cannot_use_longest_first_leaves_none():
    ascending = replay(step(40), before=[step(10), step(20), step(30)])
    # each step's request is larger than every block cached before it: a new segment each time
    assert (ascending.peak_allocated, ascending.peak_reserved) == (40 * MIB, 100 * MIB)
    descending = CachingAllocator()
    for mib in (40, 30, 20, 10):
        replay(step(mib), allocator=descending)
    assert descending.peak_reserved == replay(step(40)).peak_reserved == 40 * MIB  # as the longest alone


def test_a_training_replay_takes_the_shorter_steps_first_then_its_own_steps():
    calls = Replay.of(step(40), ([32 * MIB], [], [], 1))
    shorter = tuple(Replay.of(step(mib)) for mib in (10, 20, 30))
    recorded = varied_lengths.after_shorter(calls, shorter).calls()
    mallocs = [size // MIB for size in recorded.sizes if size >= 0]
    assert mallocs == [32, 10, 20, 30, 40, 40]  # the weights, the shorter steps ascending, two optimizer steps
    trained = replay_training(step(40), [32 * MIB], [], [], 1, before=[step(mib) for mib in (10, 20, 30)])
    assert trained.peak_reserved == (32 + 10 + 20 + 30 + 40) * MIB
    assert varied_lengths.after_shorter(calls, shorter).digest() != calls.digest()  # kept apart when cached


def test_the_history_steps_are_read_on_the_micro_batch_line_at_as_many_tokens():
    one = Replay.of([("malloc", "w", 4 * MIB), ("malloc", "a", 5 * MIB), ("free", "a")])
    two = Replay.of([("malloc", "w", 4 * MIB), ("malloc", "a", 10 * MIB), ("free", "a")])
    # at micro-batch 2 the activations grow by 10 MiB from no tokens: five 2 MiB roundings, five steps
    assert varied_lengths.rungs_for(one, two, 2, 1, 2) == 5
    assert varied_lengths.fractions(5) == (0.2, 0.4, 0.6, 0.8)
    shorter = varied_lengths.shorter_steps(one, two, 2, 1, 2)
    assert [list(s.sizes) for s in shorter] == [[4 * MIB, k * 2 * MIB, 0] for k in (1, 2, 3, 4)]  # the weight stays
    big, bigger = (Replay.of([("malloc", "a", mib * MIB), ("free", "a")]) for mib in (1000, 2000))
    assert varied_lengths.rungs_for(big, bigger, 1, 1, 2) == varied_lengths.MOST_RUNGS  # not 500


def estimator(varied: bool, target: str = "cuda") -> Estimator:
    spec = make_spec(WideMlp, lambda n: torch.randn(n, 300, 512), device="cpu", memory_budget="1TiB",
                     loss_fn=lambda output, batch: output.square().mean(), varied_lengths=varied)
    return Estimator(spec, target=target)


def test_varied_lengths_predict_at_least_the_one_length_reserve_and_say_so():
    config = Config(micro_batch_size=8)
    fixed, varied = estimator(False), estimator(True)
    (one, how_one), (many, how_many) = fixed.activations(config), varied.activations(config)
    assert many.fragmentation > one.fragmentation  # the activations' blocks of shorter steps stay cached
    assert many.least_fragmentation >= one.least_fragmentation
    assert many.peak == one.peak  # the allocated bytes are the longest step's
    assert varied.predict(config).peak_bytes > fixed.predict(config).peak_bytes
    assert "shorter batches" in how_many and "shorter batches" not in how_one


def test_without_cuda_nothing_changes():
    config = Config(micro_batch_size=8)
    assert estimator(True, "cpu").predict(config).peak_bytes == estimator(False, "cpu").predict(config).peak_bytes


def test_the_dry_run_takes_the_flag():
    result = CliRunner().invoke(dry_run_command, ["--help"])
    assert "--varied-lengths" in result.output and "longest sample" in result.output
