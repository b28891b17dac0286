"""Sharding at realistic proportions on CPU ranks over gloo: the estimator's per-rank prediction against
the probe's measured per-rank peak for ZeRO and FSDP2, and the issue's scenarios (a GPT-2 of 16.9M
parameters, exact fp32, a per-rank budget that plain data parallelism cannot meet).

The scenarios take minutes each on two cores, so they are `slow`-marked: `python -m pytest -m slow
tests/search/test_sharded.py`. Their last run is in the closing note of issue 12 and docs/benchmarks.md.
"""

import functools
import os
import subprocess
import sys

import pytest
import torch

import autofit
from autofit.config import Config, Engine
from autofit.estimate.estimator import Estimator
from autofit.estimate.tolerance import tolerance_for
from autofit.probe.outcome import ProbeStatus, Source
from autofit.batches.synthetic_batches import TokenBatches
from autofit.job.train_spec import make_spec
from autofit.strategies import Fsdp, MicroBatch, Zero
from autofit.strategies.zero import installed_version
from models import run_ranks

needs_deepspeed = pytest.mark.skipif(installed_version() is None, reason="DeepSpeed is not installed")


def make_gpt2(n_layer, n_embd, n_head, vocab, positions):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                                      n_positions=positions, bos_token_id=0, eos_token_id=0))


SMALL = functools.partial(make_gpt2, 2, 128, 2, 2048, 32)  # 0.66M parameters, 40% of them in the embeddings
# 16.9M parameters, 5% of them in the (tied) embedding, 64 tokens per sample. The proportions decide the
# 4-rank case: at 128 tokens FSDP2 full-shard peaked at 104.62 MiB per rank against a 104.29 MiB fit limit;
# with a 6,800-token vocabulary (15%) at 112.8 MiB (the tied embedding is gathered whole, and its head
# gradient lives whole through a checkpointed backward). Measured: the closing note of issue 12.
ISSUE = functools.partial(make_gpt2, 9, 384, 6, 2100, 256)
ISSUE_PARAMS = 16_875_648


@pytest.mark.parametrize("sharding, accumulation", [
    pytest.param("zero1", 1, marks=[needs_deepspeed, pytest.mark.slow]),
    pytest.param("zero1", 2, marks=[needs_deepspeed, pytest.mark.slow]),
    pytest.param("zero2", 1, marks=needs_deepspeed),
    # was 9% under: the earlier micro-batch's partition buffer lives beside the next one's (engines.py)
    pytest.param("zero2", 2, marks=needs_deepspeed),
    pytest.param("zero3", 1, marks=[needs_deepspeed, pytest.mark.slow]),
    pytest.param("fsdp_grad_op", 1, marks=pytest.mark.slow),
    ("fsdp_full", 1), pytest.param("none", 1, marks=pytest.mark.slow)])  # none: DDP
def test_measured_rank_peak_is_within_the_estimators_tolerance(sharding, accumulation, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # where DeepSpeed would compile its CPU ops
    spec = make_spec(SMALL, TokenBatches(2048, 32), device="cpu", num_gpus=2, global_batch_size=4,
                     memory_budget="1GiB", warmup_steps=2, timed_steps=1)
    config = Config(num_gpus=2, sharding=sharding, micro_batch_size=2 // accumulation, grad_accum_steps=accumulation)
    result = run_ranks(spec, config, [MicroBatch(), Zero(), Fsdp()], timeout=600)
    assert result.status is ProbeStatus.FIT, result.reason
    assert len(result.rank_peaks) == 2 and result.peak_bytes == max(result.rank_peaks)
    predicted = Estimator(spec).predict(config).peak_bytes
    assert abs(predicted / result.peak_bytes - 1) <= tolerance_for(spec.device, config), (predicted, result.rank_peaks)
    assert predicted >= 0.95 * result.peak_bytes, (predicted, result.rank_peaks)  # no promised fit 5% short
    assert not list(tmp_path.rglob("*.so"))  # gloo's collectives: no shared-memory kernel compiled for CPU ranks


def _issue_plan(ranks, fraction, **kwargs):
    return autofit.autofit(ISSUE, TokenBatches(2100, 64), global_batch_size=8, device="cpu", num_gpus=ranks,
                           allow=0, memory_budget=int(fraction * 16 * ISSUE_PARAMS), warmup_steps=2, timed_steps=1,
                           **kwargs)


@pytest.mark.slow
def test_two_ranks_at_85_percent_find_a_sharded_plan_within_8_probes():
    assert sum(p.numel() for p in ISSUE().parameters()) == ISSUE_PARAMS
    plan = _issue_plan(2, 0.85)
    probed = [p for p in plan.probes if p.source is Source.PROBED]
    first_fit = next(i for i, p in enumerate(probed, 1) if p.fits)
    print(plan.summary(), f"(first fit at probe {first_fit} of {len(probed)})")
    assert plan.fits, plan.reason
    assert plan.config.engine is not Engine.TORCH and first_fit <= 8  # then it looks for faster fits
    assert plan.peak_rank is not None and "set by rank" in plan.reason


@pytest.mark.slow
def test_four_ranks_at_45_percent_fit_fully_sharded():
    plan = _issue_plan(4, 0.45)
    print(plan.summary(), f"({plan.probes_run} probes)")
    assert plan.fits, plan.reason
    assert plan.config.shards_parameters and plan.config.num_gpus == 4


STDIN = """
import torch, autofit
from autofit.batches.synthetic_batches import TokenBatches
from transformers import GPT2Config, GPT2LMHeadModel
plan = autofit.autofit(lambda: GPT2LMHeadModel(GPT2Config(n_layer=9, n_embd=384, n_head=6, vocab_size=2100,
                                                          n_positions=256, bos_token_id=0, eos_token_id=0)),
                       lambda n: TokenBatches(2100, 64)(n), global_batch_size=8, device="cpu", num_gpus=2,
                       allow=0, memory_budget=int(0.85 * 16 * 16_875_648), warmup_steps=2, timed_steps=1)
print("FITS", plan.fits, plan.config.describe() if plan.fits else plan.reason)
"""


@pytest.mark.slow
def test_the_same_call_from_standard_input_with_lambda_factories_fits(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-"], input=STDIN, capture_output=True, text=True, env=env, timeout=3000,
                          cwd=tmp_path)
    print(done.stdout)
    assert "FITS True" in done.stdout, done.stdout + done.stderr[-3000:]
