"""The dry-run's bisection told by floors (`Estimator.floor`: a micro-batch's need before its allocator replay):
the same plan, fewer replays of the caching allocator."""

import pytest
import torch
from transformers import LlamaConfig

from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.estimate.simulation import disk_cache as kept
from autofit.estimate.simulation import memo as simulations
from autofit.job.train_spec import make_spec
from autofit.pipelines.dry_run import dry_run
from autofit.strategies import FusedAttention, MicroBatch, MixedPrecision
from tests.pipelines.test_dry_run import above_overhead


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """One thread, and nothing simulated or replayed before (in the process or on disk)."""
    torch.set_num_threads(1)
    monkeypatch.setattr(simulations, "SIMULATIONS", simulations.Simulations(folder=None))
    monkeypatch.setattr(kept, "RESERVES", kept.Reserves(folder=None))


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=512)


def test_a_floor_is_at_most_its_prediction_at_the_same_bound():
    spec = make_spec(tiny_llama(), None, seq_len=128, device="cpu", global_batch_size=32, memory_budget="4GiB")
    estimator = Estimator(spec, target="cuda", extrapolate_batch=True)
    for precision in ("fp32", "bf16"):
        for mb in (4, 8, 32):
            config = Config(precision=precision, micro_batch_size=mb, grad_accum_steps=32 // mb)
            floor = estimator.floor(config)
            assert floor is not None  # the line is not replayed yet
            predicted = estimator.predict(config)
            assert floor.need_bytes <= predicted.need_bytes and floor.upper_bytes <= predicted.upper_bytes
            assert floor.error_bound == predicted.error_bound
            assert estimator.floor(config) is None  # replayed now: the prediction is as cheap
    assert estimator.floor(Config(micro_batch_size=2)) is None  # simulated as it is: nothing to spare
    assert Estimator(spec, target="cpu", extrapolate_batch=True).floor(Config(micro_batch_size=8)) is None


def test_the_plan_is_the_same_with_fewer_replays(monkeypatch, replays):
    # a card where the largest micro-batches do not fit: the bisection's probes above the best are over
    plan = dict(seq_len=256, global_batch_size=64, gpu="a100-80gb", gpu_memory=above_overhead(48),
                strategies=[MixedPrecision(), FusedAttention(), MicroBatch()])
    floored = dry_run(tiny_llama(), **plan)
    with_floors = len(replays)
    monkeypatch.setattr(simulations, "SIMULATIONS", simulations.Simulations(folder=None))
    monkeypatch.setattr(kept, "RESERVES", kept.Reserves(folder=None))
    monkeypatch.setattr(Estimator, "floor", lambda self, config: None)  # every probe of the bisection predicted
    replays.clear()
    full = dry_run(tiny_llama(), **plan)
    assert with_floors < len(replays)
    assert [(c.config, c.estimate.peak_bytes, c.estimate.need_bytes, c.fits) for c in floored.candidates] == \
        [(c.config, c.estimate.peak_bytes, c.estimate.need_bytes, c.fits) for c in full.candidates]
    assert floored.chosen.config == full.chosen.config and floored.reason == full.reason
    assert [c.config for c in floored.near_limit] == [c.config for c in full.near_limit]
    assert 1 < floored.chosen.config.micro_batch_size < 64  # the bisection had probes over the limit
