"""dry_run: predicted plans for GPUs that are not here, on fake tensors only."""

import dataclasses
import json

import psutil
import pytest
import torch
from transformers import LlamaConfig

import autofit
from autofit.estimate.cost_model import step_seconds
from autofit.devices.gpus import Layout
from autofit.pipelines.dry_run import DryRunReport, _spec, dry_run
from autofit.search.decision import level_of
from autofit.estimate.estimator import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, Estimator
from autofit.estimate.tolerance import FAMILY_BOUNDS
from autofit.devices.gpus import get_gpu
from autofit.errors import UsageError
from autofit.job.train_spec import DEFAULT_SAFETY_MARGIN
from autofit.strategies import (ActivationOffloading, FusedAttention, ChunkedLoss, MicroBatch, OptimizerInBackward, MixedPrecision,
                                PureBf16, default_strategies)

GIB = 1024**3
MIB = 1024**2


def above_overhead(mib: int, bound: str = "decoder/fused") -> str:
    """A card whose fit limit leaves `mib` MiB beyond the CUDA context and cuBLAS workspace the estimator counts,
    at the error bound of `bound` (`FAMILY_BOUNDS`: a fit is decided at its bound, which widens all but the
    context, `Estimate.upper_bytes`)."""
    bound = 1 + FAMILY_BOUNDS[bound][0]
    fit = CUDA_CONTEXT_BYTES // MIB + (CUBLAS_WORKSPACE_BYTES // MIB + mib) * bound
    return f"{int(fit / (1 - DEFAULT_SAFETY_MARGIN))}MiB"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# ~40 M parameters: compute-bound on a T4 at 512 tokens, its states per optimizer hundreds of MiB apart
WIDE_LLAMA = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, max_position_embeddings=512)


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=512)


@pytest.fixture(scope="module")
def report():
    return dry_run(tiny_llama(), seq_len=256, global_batch_size=16, gpu="a100-80gb", gpu_memory="1GiB", num_gpus=2)


def test_70b_preset_plans_with_nothing_allocated():
    rss = psutil.Process().memory_info().rss
    # the rungs that decide where 70B fits (precision, checkpointing, optimizer states, sharding, offload)
    rungs = [s for s in default_strategies() if not isinstance(s, (FusedAttention, ActivationOffloading, ChunkedLoss,
                                                                   OptimizerInBackward, PureBf16))]
    result = autofit.dry_run("llama-2-70b", seq_len=4096, global_batch_size=64, gpu="a100-80gb", num_gpus=8,
                             strategies=rungs)
    assert psutil.Process().memory_info().rss - rss < 4 * GIB  # 70B fp32 weights alone would be 280 GB
    assert result.fits and result.chosen.config.shards_parameters  # 70B needs every state sharded on 8 GPUs
    assert result.chosen.peak_bytes <= result.fit_limit
    # 16 bytes/param cannot fit 80 GB: the unsharded levels' states alone are over, and once a level fits they
    # could be neither chosen nor the closest to fitting: none is predicted (`_closest_over`)
    assert not any(not c.config.shards_optimizer and not c.config.lora for c in result.candidates)
    fsdp = [c for c in result.candidates if c.config.sharding.value == "fsdp_full" and not c.config.offloads]
    assert fsdp and all(c.estimate.breakdown.gathered > 0 for c in fsdp)  # FSDP2 is modelled, not deferred


def test_chosen_heads_the_fits_and_candidates_are_ordered(report):
    fitting = [c for c in report.candidates if c.fits]
    assert report.chosen is fitting[0]  # the table's first row, whatever --top shows
    assert [c.step_seconds for c in fitting[1:]] == sorted(c.step_seconds for c in fitting[1:])
    rest = [c.peak_bytes for c in report.candidates if not c.fits]
    assert rest == sorted(rest)
    assert report.candidates[:len(fitting)] == tuple(fitting)


def test_every_candidate_keeps_the_global_batch_and_its_tier(report):
    for candidate in report.candidates:
        assert candidate.config.global_batch_size == 16
        assert candidate.tier <= 1  # lora (tier 2) is not allowed by default
        parts = candidate.estimate.breakdown
        assert candidate.peak_bytes <= parts.total  # not every part is live at the peak


def test_largest_fitting_micro_batch_per_level(report):
    from autofit.pipelines.dry_run import _Planner

    chosen = report.chosen.config
    assert chosen.micro_batch_size == 8  # the whole per-rank batch fits 1 GiB for this tiny model
    tight = dry_run(tiny_llama(), seq_len=256, global_batch_size=16, gpu="a100-80gb", gpu_memory=above_overhead(32))
    assert tight.fits and min(c.config.micro_batch_size for c in tight.candidates if c.fits) < 16
    assert all(c.peak_bytes <= tight.fit_limit for c in tight.candidates if c.fits)
    assert isinstance(_Planner, type)


def test_json_document(report):
    data = json.loads(json.dumps(report.to_dict()))
    first = data["candidates"][0]
    assert {"config", "peak_bytes", "fits", "reason", "breakdown", "cpu_bytes"} <= set(first)
    assert set(first["breakdown"]) == {"params", "grads", "optimizer", "activations", "overhead", "gathered"}
    assert data["chosen"] == data["candidates"][data["chosen_index"]]
    # every row says which memory it predicts, its error bound and what that rests on, and its fit at the bound
    assert data["memory"] == "reserved + context"
    for row in data["candidates"]:
        assert row["memory"] == "reserved + context" and row["error_bound"] > 0 and row["bound_basis"]
        assert row["fit"] in ("fits", "near the limit", "over", "unknown")
        assert row["fits"] == (row["fit"] == "fits") and row["near_limit"] == (row["fit"] == "near the limit")


def test_nothing_fits_names_the_smallest_and_what_to_allow():
    # the spec of test_the_new_rungs_are_listed_with_predicted_peaks but 8 MiB: one file's simulations serve both
    result = dry_run(tiny_llama(), seq_len=256, global_batch_size=4, gpu="rtx-4090", gpu_memory="8MiB")
    assert not result.fits and result.chosen is None
    assert "No candidate fits" in result.reason and "the smallest needs" in result.reason
    from autofit.strategies.lora import Lora

    # allow= opens LoRA's levels to the table (the rungs that make them, to keep it short)
    allowed = dry_run(tiny_llama(), seq_len=256, global_batch_size=4, gpu="rtx-4090", gpu_memory="8MiB",
                      allow={"lora"}, strategies=[s for s in default_strategies() if isinstance(s, (MicroBatch, Lora))])
    assert any(c.config.lora for c in allowed.candidates)


def test_the_states_floor_is_under_every_candidates_need(report):
    # a level whose model states alone are over the limit is predicted at one size, and left out of what an
    # allow= would open (`_Planner.states_over`): the floor must bound every prediction from below
    spec, _ = _spec(tiny_llama(), None, get_gpu("a100-80gb").with_memory(GIB), Layout(1, 2), 16, 256, None, "adamw", None,
                    0.1, 64)
    estimator = Estimator(spec, target="cuda")
    assert all(estimator.states_floor(c.config) <= c.estimate.need_bytes for c in report.candidates)
    assert {c.config.offload for c in report.candidates} > {"none"}  # offloaded states too


def test_what_an_allow_would_open_is_named_and_a_level_over_the_limit_is_not_predicted(monkeypatch):
    from autofit.strategies.lora import Lora

    rungs = [s for s in default_strategies() if isinstance(s, (MicroBatch, Lora))]
    plan = dict(seq_len=64, global_batch_size=2, gpu="rtx-4090", allow=0, strategies=rungs)
    opened = dry_run(tiny_llama(), gpu_memory=above_overhead(8), **plan)
    assert not opened.fits and "Pass allow={'lora'}" in opened.reason
    assert "lora=r16 is predicted to fit" in opened.reason
    shortfall = opened.shortfall  # the same as fields, said in the command line's words by autofit dry-run
    assert (shortfall.remedy, shortfall.tier, shortfall.gpu) == ("allow", 2, "rtx-4090") and shortfall.opened.lora
    assert opened.reason == shortfall.words() and "Pass --allow lora (LoRA adapters" in shortfall.words(cli=True)
    assert opened.to_dict()["shortfall"]["opened_peak"] == shortfall.opened_peak
    predicted = []
    real = Estimator.predict
    monkeypatch.setattr(Estimator, "predict", lambda self, config: predicted.append(config) or real(self, config))
    closed = dry_run(tiny_llama(), gpu_memory="8MiB", **plan)  # the CUDA context alone is over it
    assert "use a GPU with more memory" in closed.reason
    assert predicted and not any(config.lora for config in predicted)  # LoRA's states are over it too


def test_gpu_without_bf16_plans_fp16():
    # the rungs that plan a precision; the others' levels add nothing to it
    rungs = [s for s in default_strategies() if isinstance(s, (MicroBatch, MixedPrecision, PureBf16))]
    result = dry_run(tiny_llama(), seq_len=128, global_batch_size=4, gpu="v100-16gb", strategies=rungs)
    assert {c.config.precision for c in result.candidates} == {"fp32", "fp16"}
    fp16 = next(c for c in result.candidates if c.config.precision == "fp16")
    fp32 = next(c for c in result.candidates if c.config == fp16.config.replace(precision="fp32"))
    spec, _ = _spec(tiny_llama(), None, get_gpu("v100-16gb"), Layout(1, 1), 4, 128, None, "adamw", None, 0.1, 64)
    facts, v100 = Estimator(spec).facts, get_gpu("v100-16gb")
    # where the arithmetic decides, fp16 runs at 8x the fp32 TFLOP/s; this 2-layer model at 128 tokens is
    # bound by the host issuing its kernels, and autocast's weight casts are kernels too
    assert step_seconds(spec, fp16.config, v100, facts) < step_seconds(spec, fp32.config, v100, facts) / 4
    assert fp32.estimate.kernels < fp16.estimate.kernels and result.chosen.config.precision == "fp32"
    strict = dry_run(tiny_llama(), seq_len=128, global_batch_size=4, gpu="v100-16gb", allow=0, strategies=rungs)
    assert {c.config.precision for c in strict.candidates} == {"fp32"}


def test_offload_rows_report_host_ram(report):
    offloaded = [c for c in report.candidates if c.config.offload == "cpu" and c.config.zero_stage]
    assert offloaded and all(c.estimate.cpu_bytes > 0 for c in offloaded)
    assert all(c.estimate.breakdown.optimizer == 0 for c in offloaded)


def test_cost_model_charges_recompute_and_offload(report):
    spec_like = report  # the same spec figures are reused through a fresh plan below
    base = next(c for c in report.candidates if c.config.checkpointing == "none" and c.config.zero_stage == 0
                and c.config.optimizer == "adamw" and not c.config.lora)
    full = base.config.replace(checkpointing="full")
    offload = base.config.replace(sharding="zero2", offload="cpu")
    gpu = get_gpu("a100-80gb")
    spec, _ = _spec(tiny_llama(), None, gpu, Layout(1, 2), 16, 256, None, "adamw", None, 0.1, 64)
    facts = Estimator(spec).facts
    assert step_seconds(spec, full, gpu, facts) > step_seconds(spec, base.config, gpu, facts)
    assert step_seconds(spec, offload, gpu, facts) > step_seconds(spec, base.config, gpu, facts)
    assert spec_like.num_gpus == 2


def test_bad_input_is_a_usage_error():
    with pytest.raises(UsageError, match="Unknown GPU"):
        dry_run(tiny_llama(), seq_len=128, global_batch_size=4, gpu="a200")
    with pytest.raises(UsageError, match="exceeds the model's maximum"):
        dry_run(tiny_llama(), seq_len=4096, global_batch_size=4)
    with pytest.raises(UsageError, match="did you mean"):
        dry_run("llama-2-7", seq_len=128, global_batch_size=4)


def test_the_new_rungs_are_listed_with_predicted_peaks():
    result = dry_run(tiny_llama(), seq_len=256, global_batch_size=4, gpu="rtx-4090", gpu_memory="256MiB")
    listed = {name: [c for c in result.candidates if test(c.config)] for name, test in (
        ("pure_bf16", lambda c: c.pure_bf16), ("activation_offload", lambda c: c.offloads_activations),
        ("optimizer_in_backward", lambda c: c.steps_in_backward), ("chunked_loss", lambda c: c.loss == "chunked"),
        ("ops", lambda c: c.checkpointing == "ops"))}
    for name, candidates in listed.items():
        assert candidates and all(c.peak_bytes > 0 for c in candidates), name
    assert all(c.config.grad_accum_steps == 1 for c in listed["optimizer_in_backward"])
    assert all(c.estimate.cpu_bytes > 0 for c in listed["activation_offload"])


def test_fsdp2_with_accumulation_says_what_a_deferred_reduce_adds_and_plans_for_it_when_asked(monkeypatch):
    from transformers import LlamaForCausalLM

    from autofit.estimate import tolerance

    # what is held is the question here, not the bounds: sharded and unsharded rows at the same one (a tiny
    # model's peak is mostly the CUDA context, which the engines' wider bound would weigh against FSDP2)
    monkeypatch.setitem(tolerance.FAMILY_BOUNDS, "engine", tolerance.FAMILY_BOUNDS["decoder/fused"])

    from autofit.strategies import Fsdp, MicroBatch
    from autofit.units import format_size

    wide_vocab = LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=512)  # states decide: DDP is over
    result = dry_run(wide_vocab, seq_len=256, global_batch_size=64, gpu="a100-80gb", gpu_memory=above_overhead(239),
                     num_gpus=2, strategies=[MicroBatch(), Fsdp()])
    config = result.chosen.config
    assert config.needs_sync_each_micro_batch
    params = sum(p.numel() for p in LlamaForCausalLM(wide_vocab).parameters())
    assert result.chosen.estimate.breakdown.grads == 4 * params // 2  # fp32 shards, reduced every micro-batch
    assert f"holds every gradient unsharded: {format_size(4 * params - 4 * params // 2)} more per GPU" in result.reason
    deferred = dry_run(wide_vocab, seq_len=256, global_batch_size=64, gpu="a100-80gb", gpu_memory=above_overhead(239),
                       num_gpus=2, strategies=[MicroBatch(), Fsdp()], deferred_sync=True)
    assert not deferred.fits and "unsharded" not in deferred.reason  # the loop the user runs: over the limit
    assert deferred.candidates[0].estimate.breakdown.grads == 4 * params  # every gradient, unsharded


def test_a_numerics_change_is_chosen_only_when_predicted_clearly_faster():
    from autofit.pipelines.dry_run import Candidate, _chosen_reason, _decided
    from autofit.search.space import build_space
    from autofit.strategies import default_strategies

    gpu = get_gpu("a100-80gb")
    spec, _ = _spec(tiny_llama(), None, gpu, Layout(1, 1), 8, 128, None, "adamw", None, 0.1, 64)
    space = build_space(spec, default_strategies())
    exact = next(level for level in space.levels() if space.tier(level) == 0)
    numerics = next(level for level in space.levels() if space.tier(level) == 1)
    estimate = Estimator(spec, target="cuda").predict(exact)

    def candidate(config, seconds):
        return Candidate(config, estimate, True, "", space.tier(config), seconds, 8 / seconds)

    # the tuner's rule (autofit.search.decision.decide) on predicted speeds: a 10% margin for numerics
    near = [candidate(numerics, 0.95), candidate(exact, 1.0)]
    assert _decided(space, near).config == exact
    assert "is predicted 5.3% faster, under the 10% margin a numerics change must clear" in _chosen_reason(near[1], near)
    clear = [candidate(numerics, 0.85), candidate(exact, 1.0)]
    assert _decided(space, clear).config == numerics
    # a tie is not "slower": the fewest changes win it, and the reason says how many were as fast
    tied = [candidate(exact, 1.0), candidate(numerics, 1.0), candidate(numerics, 1.2)]
    assert _decided(space, tied).config == exact
    assert _chosen_reason(tied[0], tied).endswith("(2 other(s) fit: 1 predicted as fast, with more changes, 1 slower)")
    assert _chosen_reason(tied[0], [tied[0], tied[2]]).endswith("(1 other(s) fit, slower)")


def test_a_model_in_bf16_planned_at_fp32_is_said_to_run_in_bf16():
    def model():
        layers = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        return layers.to(torch.bfloat16)

    report = dry_run(model, lambda n: torch.randn(n, 256, dtype=torch.bfloat16), gpu="rtx-4090", global_batch_size=8,
                     allow=0, loss_fn=lambda out, batch: out.float().sum())
    assert report.chosen.config.precision == "fp32"
    assert "weights are bfloat16: fp32 here means no autocast" in report.reason


def test_a_model_in_bf16_at_fp32_is_predicted_at_bf16_speed():
    # The step computes in bf16 (no autocast on bf16 weights): the speed model had used the card's fp32
    # rate for it, predicting it ~8x slower than the same step planned as pure bf16.
    from transformers import GPT2Config, GPT2LMHeadModel

    def model(dtype):
        return lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=1024, n_head=8, vocab_size=512)).to(dtype)

    def speeds(dtype):  # wide enough for the compute, not the host's kernel launches, to set the pace
        report = dry_run(model(dtype), gpu="a100-80gb", seq_len=1024, global_batch_size=8, allow=1,
                         strategies=[MixedPrecision(), PureBf16(), MicroBatch()])
        return {(c.config.precision.value, c.config.micro_batch_size): c.samples_per_s for c in report.candidates}

    given_bf16, given_fp32 = speeds(torch.bfloat16), speeds(torch.float32)
    assert given_bf16[("fp32", 8)] == given_bf16[("pure_bf16", 8)]
    assert given_fp32[("fp32", 8)] < given_fp32[("pure_bf16", 8)] / 4  # an fp32 model at fp32: the fp32 rate


def test_a_fit_the_allocator_makes_by_releasing_its_cache_is_a_fit():
    # Under a limit below a roomy card's reserve the caching allocator gives back its cached segments and
    # retries before it fails: GPT-2 small trained on an H200 under 3,948 MiB, below the 4,074 it peaked at
    # on the roomy card (bench/results/fit-threshold-cuda-h200-2026-11-27.json). What a fit needs is the
    # replay's least reserve, not its roomy one; the tuner prunes on it too.
    import transformers

    from autofit.config import Config
    from autofit.pipelines.dry_run import _verdict
    from autofit.estimate.estimator import predictor_for
    from autofit.estimate.prediction import Fit
    from autofit.job.train_spec import make_spec

    def gpt2():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4,
                                                                    vocab_size=8000, n_positions=512))

    def batch(n):
        ids = torch.zeros(n, 512, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    spec = make_spec(gpt2, batch, device="cpu", memory_budget="1TiB")
    config = Config(checkpointing="full", micro_batch_size=2)
    estimator = Estimator(spec, target="cuda")
    estimate, (act, _) = estimator.predict(config), estimator.activations(config)
    assert estimate.release_slack == act.fragmentation - act.least_fragmentation > 0
    limit = (estimate.need_bytes + estimate.peak_bytes) // 2
    assert estimate.need_bytes <= limit < estimate.peak_bytes
    assert estimate.peak_under(limit) == limit and estimate.peak_under(2 * limit) == estimate.peak_bytes
    exact = dataclasses.replace(estimate, error_bound=0.0)  # the allocator's release alone, without a bound
    assert exact.fit_under(limit) is Fit.FITS
    assert "the caching allocator releasing its cache to stay under" in _verdict(exact, True, limit)
    # at its family's bound (4%: more than the release gives back here) the same limit is near, not a fit
    assert estimate.fit_under(limit) is Fit.NEAR_LIMIT
    assert "near the limit" in _verdict(estimate, False, limit) and "a probe decides" in _verdict(estimate, False, limit)
    assert predictor_for(dataclasses.replace(spec, device=torch.device("cuda")))(config) == estimate.need_bytes


def test_a_report_and_its_candidates_show_as_one_line_each(report):
    shown = repr(report)  # what a notebook cell shows for `autofit.dry_run(...)`
    assert "\n" not in shown and len(shown) < 1000
    assert f"candidates={len(report.candidates)} (" in shown and "on 2 x a100-80gb" in shown
    assert repr(report.chosen) in shown and report.chosen.config.describe() in repr(report.chosen)
    assert all(len(repr(c)) < 300 for c in report.candidates)


def test_progress_counts_the_simulations_to_the_last(monkeypatch):
    """`progress(done, total)` hears of every simulation the plan runs (the CLI shows it on a terminal: a
    recurrent model's dry-run simulates for minutes), in order, up to the total."""
    import autofit.estimate.estimator as estimator_module

    simulated, heard = [], []
    original = estimator_module.simulate_step
    monkeypatch.setattr(estimator_module, "simulate_step",
                        lambda *args, **kwargs: simulated.append(1) or original(*args, **kwargs))
    config = tiny_llama()
    config.vocab_size = 1013  # a model no other test simulates: nothing is recalled from the caches
    result = dry_run(config, seq_len=64, global_batch_size=4, gpu="a100-80gb",
                     strategies=[MixedPrecision(), MicroBatch()], progress=lambda done, total: heard.append((done, total)))
    assert result.fits and heard[-1] == (len(simulated), len(simulated)) and len(simulated) > 1
    assert [done for done, _ in heard] == list(range(1, len(simulated) + 1))


def test_progress_true_prints_the_count_on_stderr_and_a_wrong_value_is_refused(capsys):
    config = tiny_llama()
    config.vocab_size = 1019  # nothing recalled from the caches
    dry_run(config, seq_len=64, global_batch_size=4, gpu="a100-80gb", strategies=[MixedPrecision(), MicroBatch()],
            progress=True)
    err = capsys.readouterr().err
    assert "\r1 of " in err and err.endswith(" training steps simulated\n")
    with pytest.raises(UsageError, match="progress='yes'"):
        dry_run(config, seq_len=64, global_batch_size=4, gpu="a100-80gb", progress="yes")


def test_a_candidate_within_its_error_bound_of_the_limit_is_not_chosen_and_is_named_where_it_would_win():
    """Llama-3.1-8B at 4,096 tokens on one H100 was once chosen at 99% of its fit limit with nothing saying
    that the estimator's error bound reaches past it. Here a card just 2% over what the fastest needs: under
    its +4% bound it is near the limit, the next fit is chosen, and the reason names the one left to a probe."""
    from autofit.strategies import ActivationCheckpointing

    rungs = [MicroBatch(), ActivationCheckpointing()]
    roomy = dry_run(tiny_llama(), seq_len=256, global_batch_size=16, gpu="a100-80gb", gpu_memory="4GiB",
                    strategies=rungs)
    assert not roomy.chosen.near_limit and roomy.near_choice is None and "Near the limit" not in roomy.reason
    need = roomy.chosen.estimate.need_bytes  # the bound widens all but the context: 2% of the rest over it
    limit = need + (need - CUDA_CONTEXT_BYTES) * 0.02
    tight = dry_run(tiny_llama(), seq_len=256, global_batch_size=16, gpu="a100-80gb", strategies=rungs,
                    gpu_memory=int(limit / (1 - DEFAULT_SAFETY_MARGIN)) + 1)
    assert tight.near_choice is not None and tight.near_choice.config == roomy.chosen.config
    assert tight.near_choice.near_limit and not tight.near_choice.fits
    assert tight.chosen is not None and not tight.chosen.near_limit and tight.chosen.config != roomy.chosen.config
    assert f"Near the limit: {roomy.chosen.config.describe()} would be" in tight.reason
    assert f"({need / limit:.0%})" in tight.reason and "autofit tune on the card decides it" in tight.reason
    document = tight.to_dict()
    assert document["near_choice"]["near_limit"] and document["near_choice"]["fit"] == "near the limit"
    assert not document["chosen"]["near_limit"]


def test_candidates_that_fit_only_as_predicted_are_the_reports_near_limit_ones():
    from autofit.config import Config
    from autofit.estimate.prediction import Estimate
    from autofit.pipelines.dry_run import Candidate
    from autofit.strategies.memory import Breakdown

    def row(need: int) -> Candidate:
        estimate = Estimate(Breakdown(0, 0, 0, need, 0), need, 0, "simulated", error_bound=0.04,
                            bound_basis="decoder/fused: 54 calibration rows")
        return Candidate(Config(), estimate, False, f"verdict of {need}, ~1.0 samples/s", 0, 1.0, 1.0, limit=1000)

    near, over = row(970), row(1010)  # 1,008.8 at its bound; over as predicted
    assert near.near_limit and not near.fits and not over.near_limit
    report = DryRunReport("m", get_gpu("t4"), 1, None, 1000, (near, over), None, "nothing fits", 0.0)
    assert report.near_limit == (near,) and report.to_dict()["near_limit"] == 1


def test_knobs_that_only_relieve_memory_are_predicted_only_where_the_level_they_relieve_falls_short(monkeypatch):
    """Checkpointing, a chunked loss, activation offloading and expandable segments only lower memory, never
    faster at the same micro-batch (`Strategy.relieves`): they double no row where the level without them
    already fits at the largest micro-batch, and the choice is the one predicting every level gives. On one GPU
    state offloading is its engine's reason to be there: its level is predicted, and checkpointing it relieves
    that level."""
    import autofit.pipelines.levels as module
    from autofit.strategies import ActivationCheckpointing, StateOffloading, Zero
    from autofit.strategies.allocator import ExpandableSegments

    rungs = [MicroBatch(), ActivationCheckpointing(), ChunkedLoss(), ActivationOffloading(), ExpandableSegments(),
             Zero(), StateOffloading()]

    def plan(memory: str) -> "DryRunReport":
        return dry_run(tiny_llama(), seq_len=256, global_batch_size=16, gpu="a100-80gb", gpu_memory=memory,
                       strategies=rungs)

    def relieving(report: "DryRunReport") -> int:
        return sum(any(s.relieves(c.config) is not None for s in rungs if not isinstance(s, StateOffloading))
                   for c in report.candidates)

    roomy, tight = plan("4GiB"), plan("1000MiB")
    assert relieving(roomy) == 0 and relieving(tight) > 0
    assert any(c.config.offloads and c.fits for c in roomy.candidates)  # the engine's level, fitting at 16
    with monkeypatch.context() as patched:
        patched.setattr(module, "_may_win", lambda *args: True)  # every level predicted, as before
        every = plan("4GiB")
    assert relieving(every) > 0 and {c.config for c in roomy.candidates} < {c.config for c in every.candidates}
    assert roomy.chosen.config == every.chosen.config


def test_a_level_of_memory_only_knobs_slower_at_any_size_than_the_fit_it_relieves_is_left_out(monkeypatch):
    """Where the level they relieve fits only below its largest micro-batch, a level of memory-only knobs is
    predicted only where it could be faster at some size (`_Planner.fastest`, a lower bound): predicted anyway,
    each one left out is slower than that fit, and the choice is the same. Compute-bound: a larger micro-batch
    there gains little, and checkpointing's recomputation costs more."""
    import autofit.pipelines.levels as module
    from autofit.strategies import ActivationCheckpointing

    rungs = [MicroBatch(), ActivationCheckpointing(), ChunkedLoss(), ActivationOffloading()]

    def plan() -> "DryRunReport":
        return dry_run(WIDE_LLAMA, seq_len=512, global_batch_size=16, gpu="t4", gpu_memory="3GiB", strategies=rungs)

    fewer = plan()
    with monkeypatch.context() as patched:
        patched.setattr(module, "_may_win", lambda *args: True)
        every = plan()
    assert fewer.chosen.config == every.chosen.config
    levels = {level_of(c.config): c for c in every.candidates}
    left_out = {c.config for c in every.candidates} - {c.config for c in fewer.candidates}
    assert left_out
    for config in left_out:
        relieved = [levels[r] for r, _ in module._reliefs(level_of(config), rungs, set(levels))]
        assert any(r.fits and levels[level_of(config)].step_seconds >= r.step_seconds for r in relieved), config


def test_levels_whose_states_alone_are_over_are_predicted_only_where_one_could_be_the_closest(monkeypatch):
    """With nothing fitting (the CUDA context alone over the limit; ~200 M parameters, whose states per optimizer
    differ by hundreds of MiB), the shortfall names the same closest candidate and need as predicting every
    level does; a level whose states alone need more than a need already predicted is left out."""
    import autofit.pipelines.levels as module
    from autofit.strategies import ActivationCheckpointing, OptimizerStates

    wider = LlamaConfig(**{**WIDE_LLAMA.to_dict(), "hidden_size": 2048, "intermediate_size": 4096})
    rungs = [MicroBatch(), MixedPrecision(), ActivationCheckpointing(), OptimizerStates()]

    def plan() -> "DryRunReport":
        return dry_run(wider, seq_len=64, global_batch_size=4, gpu="a100-80gb", gpu_memory="850MiB",
                       strategies=rungs)

    fewer = plan()
    with monkeypatch.context() as patched:  # every level predicted at its smallest micro-batch, as before
        patched.setattr(module, "_closest_over", lambda planner, over, best, listener:
                        {level: planner.best_at(level) for level in over})
        every = plan()
    assert fewer.chosen is None and every.chosen is None
    assert fewer.shortfall == every.shortfall and fewer.shortfall.smallest is not None
    assert 0 < len(fewer.candidates) < len(every.candidates)
    least = min(c.estimate.need_bytes for c in every.candidates)
    spec, _ = _spec(wider, None, get_gpu("a100-80gb").with_memory(850 * MIB), Layout(1, 1), 4, 64, None,
                    "adamw", None, DEFAULT_SAFETY_MARGIN, 64)
    estimator = Estimator(spec, target="cuda")
    for candidate in set(every.candidates) - set(fewer.candidates):
        assert estimator.states_floor(candidate.config) >= least, candidate.config
