"""Activation offloading: unavailable on the CPU (already the host), the same gradients, paired with no
or full checkpointing by the rules, chosen by the planner where only it fits; on a GPU (`gpu`-marked)
chosen by the tuner and predicted within the CUDA tolerance."""

import pytest
import torch

import autofit
from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.estimate.tolerance import PREDICTION_TOLERANCE
from autofit.devices.gpus import get_gpu
from autofit.probe.launch import probe_placed
from autofit.search.rules import violation
from autofit.job.target import Target
from autofit.job.train_spec import make_spec
from autofit.strategies import ActivationOffloading, FusedAttention, ActivationCheckpointing, MicroBatch, default_strategies
from autofit.strategies.activation_offload import enable
from autofit.strategies.base import Placement
from models import long_gpt2


STRATEGIES = [FusedAttention(), ActivationCheckpointing(), ActivationOffloading(), MicroBatch()]


def test_unavailable_on_the_cpu_offered_for_a_gpu():
    cpu = ActivationOffloading().options(make_spec(long_gpt2, device="cpu", memory_budget="1GiB", seq_len=64))
    assert not cpu[1].available and "is the host" in cpu[1].reason
    gpu = ActivationOffloading().options(type("S", (), {"target": Target.from_profile(get_gpu("a100-80gb"), 1)})())
    assert gpu[1].available and gpu[1].tier == 0


def test_the_same_gradients_with_the_forward_under_save_on_cpu():
    batch = {"input_ids": torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]
    grads = []
    for model in (long_gpt2(), enable(long_gpt2())):
        torch.manual_seed(1)
        model(**batch).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    # The same math up to reduction order: a tensor comes back from the host as a contiguous copy, and a
    # matmul over it may sum in another order (bit for bit with 2 threads here, ~1e-6 of the largest
    # gradient apart with 1). A dropped or doubled term would be of the gradient's own size.
    for plain, offloaded in zip(*grads):
        assert (plain - offloaded).abs().max() <= 1e-5 * plain.abs().max()


def test_paired_with_none_or_full_checkpointing():
    target = Target.from_profile(get_gpu("a100-80gb"), 1)
    offload = Config(activation_offload="cpu")
    assert violation(offload, target) is None and violation(offload.replace(checkpointing="full"), target) is None
    assert "not with checkpointing=ops" in violation(offload.replace(checkpointing="ops"), target)[1]


def test_the_planner_chooses_it_where_only_it_fits(monkeypatch):
    import autofit.pipelines.levels as module

    with monkeypatch.context() as patched:  # every level predicted: where the plain one fits, offloading is not
        patched.setattr(module, "_may_win", lambda *args: True)
        wide = autofit.dry_run(long_gpt2, gpu="a100-80gb", seq_len=4096, global_batch_size=1, strategies=STRATEGIES)
    # what each needs at its error bound (a fit is decided there, `Estimate.fit_under`: within it, near the limit)
    offloaded = [c.estimate.upper_bytes for c in wide.candidates if c.config.offloads_activations]
    kept = [c.estimate.upper_bytes for c in wide.candidates if not c.config.offloads_activations]
    assert min(offloaded) < min(kept)
    memory = int((min(offloaded) + min(kept)) / 2 / 0.9)  # a fit limit between the two
    report = autofit.dry_run(long_gpt2, gpu="a100-80gb", gpu_memory=memory, seq_len=4096, global_batch_size=1,
                             strategies=STRATEGIES)
    assert report.fits and report.chosen.config.offloads_activations, report.reason
    assert report.chosen.estimate.cpu_bytes >= report.chosen.estimate.offloaded_activations > 0



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_tuner_chooses_it_and_the_estimator_predicts_it():
    # Each probe in a fresh process (CHILD): the peaks are a new process's, whatever tests ran in this
    # worker before (one that ran out of memory in the backward may have left tensors allocated). Measured
    # on an H200, 2026-11-27, one fresh process (bench/results/probe-residue-cuda-h200-2026-11-27.json):
    # 2,010 / 1,194 / 1,178 / 1,146 MiB, predicted 2,011 / 1,184 / 1,226 / 1,188.
    spec = make_spec(long_gpt2, global_batch_size=1, device="cuda", seq_len=4096, warmup_steps=1, timed_steps=1)
    peaks = {}
    for config in (Config(attention="sdpa"), Config(attention="sdpa", activation_offload="cpu"),
                   Config(attention="sdpa", checkpointing="full"),
                   Config(attention="sdpa", checkpointing="full", activation_offload="cpu")):
        result = probe_placed(spec, config, default_strategies(), Placement.CHILD)
        assert result.fits, result.reason
        predicted = Estimator(spec).predict(config).peak_bytes
        assert abs(predicted / result.peak_bytes - 1) <= PREDICTION_TOLERANCE["cuda"], (config, predicted, result)
        peaks[config] = result.peak_bytes
    # Alone, offloading saves every block's activations (hundreds of MiB here); on top of full
    # checkpointing only the block inputs (8 x 4 MiB), too close to the CUDA context's own variation to
    # set a budget between. Without the checkpointing rung, a budget between the two leaves it the one fit.
    kept, offloaded = peaks[Config(attention="sdpa")], peaks[Config(attention="sdpa", activation_offload="cpu")]
    assert kept - offloaded > 128 * 2**20, (kept, offloaded)
    budget = int((kept + offloaded) / 2 / 0.9)
    plan = autofit.autofit(long_gpt2, global_batch_size=1, device="cuda", seq_len=4096, memory_budget=budget,
                           strategies=[FusedAttention(), ActivationOffloading(), MicroBatch()], predict=False,
                           warmup_steps=1, timed_steps=1)
    assert plan.fits and plan.config.offloads_activations, plan.reason
