"""End to end on CPU under a real CPU budget: autofit.autofit as a user calls it."""

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from models import make_gpt2, make_mlp, make_mlp_batch, mlp_loss

import autofit
from autofit import Config, ProbeStatus, UsageError
from autofit.config import Checkpointing
from autofit.probe.outcome import Skip, Source
from autofit.probe.run import run_probe
from autofit.job.train_spec import make_spec
from autofit.strategies import default_strategies

FAST = dict(warmup_steps=1, timed_steps=2, device="cpu")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def baseline_peak(model, batch, global_batch, **kwargs):
    """Measured peak of fp32, no checkpointing, full micro-batch, AdamW."""
    spec = make_spec(model, batch, global_batch_size=global_batch, memory_budget="4GiB", **FAST, **kwargs)
    attention = "sdpa" if spec.model.is_hf else "default"
    result = run_probe(spec, Config(attention=attention, micro_batch_size=global_batch), default_strategies())
    assert result.fits
    return result.peak_bytes


def check_plan(plan, budget, global_batch):
    assert plan.fits, plan.reason
    assert plan.peak_memory <= budget
    assert plan.config.micro_batch_size * plan.config.grad_accum_steps * plan.config.num_gpus == global_batch
    assert any(p.status is ProbeStatus.OOM for p in plan.probes)
    fits = [p for p in plan.probes if p.fits]
    assert plan.config in {p.config for p in fits}
    confirmed = plan.confirmation
    assert confirmed is not None and confirmed.winner.config == plan.config
    # the figure the choice was made on; at one torch thread the rounds count CPU time, and the plan keeps the
    # chosen probe's wall figure
    assert plan.throughput == (confirmed.winner.probed if confirmed.on_cpu_clock else confirmed.winner.median)
    # the fastest fit as probed was among the finalists re-measured back to back
    assert max(fits, key=lambda p: p.samples_per_s).config in {f.config for f in confirmed.finalists}
    assert plan.probes_run <= 25


def test_plain_model_at_half_the_baseline_peak():
    budget = baseline_peak(make_mlp, make_mlp_batch, 8, loss_fn=mlp_loss) // 2
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, memory_budget=budget,
                           loss_fn=mlp_loss, **FAST)
    check_plan(plan, budget, 8)


def test_predictions_save_probes():
    budget = baseline_peak(make_mlp, make_mlp_batch, 8, loss_fn=mlp_loss) // 2
    args = dict(global_batch_size=8, memory_budget=budget, loss_fn=mlp_loss, **FAST)
    probed = autofit.autofit(make_mlp, make_mlp_batch, predict=False, **args)
    predicted = autofit.autofit(make_mlp, make_mlp_batch, **args)
    assert predicted.fits and predicted.peak_memory <= budget
    assert predicted.probes_saved > 0 and predicted.probes_run < probed.probes_run
    saved = [p for p in predicted.probes if p.skip is Skip.PREDICTED]
    assert all(p.status is ProbeStatus.SKIPPED and "predicted to need" in p.reason for p in saved)
    # what it skipped really does not fit: probing it runs out of memory
    spec = make_spec(make_mlp, make_mlp_batch, memory_budget=budget, loss_fn=mlp_loss, global_batch_size=8, **FAST)
    assert run_probe(spec, saved[0].config, default_strategies()).status is ProbeStatus.OOM


def test_tiny_gpt2_at_half_the_baseline_peak():
    budget = baseline_peak(make_gpt2, None, 8) // 2
    plan = autofit.autofit(make_gpt2, global_batch_size=8, memory_budget=budget, **FAST)
    check_plan(plan, budget, 8)
    assert plan.config.attention == "sdpa"
    assert plan.tokens_per_second == pytest.approx(plan.throughput * 64)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_cpu_budget_beyond_the_machines_ram_is_refused_before_any_probe(ranks):
    """CPU probes allocate what they count: with a budget past the RAM, a large candidate was killed by the
    operating system (the notebook running the search with it) instead of running out of the budget."""
    import psutil

    budget = psutil.virtual_memory().total * 2 // (3 if ranks > 1 else 1)  # over the RAM in all
    with pytest.raises(UsageError, match=r"exceeds this machine's .* of RAM: CPU probes allocate what they count.*"
                                         r"Give at most .* \(free now\), or plan for a larger card"):
        autofit.autofit(make_mlp, make_mlp_batch, loss_fn=mlp_loss, device="cpu", memory_budget=budget,
                        num_gpus=ranks, global_batch_size=8)


def test_nothing_fits_names_the_smallest_and_what_to_allow():
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, memory_budget="1MiB",
                           loss_fn=mlp_loss, allow=0, **FAST)
    assert not plan.fits and plan.config is None
    assert "No candidate fits 921.60 KiB" in plan.reason
    assert "the smallest needs" in plan.reason and "mb=1x8" in plan.reason
    assert "allow={'numerics'}" in plan.reason
    shortfall = plan.shortfall  # the same, as fields
    assert (shortfall.limit, shortfall.remedy, shortfall.tier) == (int(2**20 * 0.9), "allow", 1)
    assert shortfall.smallest.micro_batch_size == 1 and shortfall.need and shortfall.basis in ("predicted", "held")
    assert plan.reason == shortfall.words() and "Pass --allow numerics" in shortfall.words(cli=True)


def test_a_plan_keeps_why_nothing_fits_through_json(tmp_path):
    from autofit.search.shortfall import Basis, Remedy, Shortfall

    plan = autofit.Plan.load(FIXTURES / "plan-v0.1.json")  # written before plans kept it
    assert plan.shortfall is None
    shortfall = Shortfall(limit=2**20, capacity=2**21, margin=0.5, smallest=Config(micro_batch_size=1), need=2**22,
                          basis=Basis.HELD, remedy=Remedy.MORE_MEMORY)
    failed = dataclasses.replace(plan, fits=False, config=None, throughput=None, peak_memory=None,
                                 reason=shortfall.words(), shortfall=shortfall)
    again = autofit.Plan.load(failed.save(tmp_path / "plan.json"))
    assert again == failed and again.shortfall.basis is Basis.HELD
    assert again.reason.endswith("the smallest needs more than 4.00 MiB (fp32, mb=1x1, opt=adamw). Raise the budget, use "
                                 "more GPUs (num_gpus) or offload to go further.")
    assert again.shortfall.words(cli=True).endswith("use more GPUs (--num-gpus) or offload to go further.")
    with pytest.raises(ValueError, match="remedy='pray' is not known"):
        Shortfall(limit=1, capacity=2, margin=0.5, remedy="pray")


def test_find_the_batch_when_none_is_given():
    plan = autofit.autofit(make_mlp, make_mlp_batch, memory_budget="6MiB", loss_fn=mlp_loss,
                           max_micro_batch=64, allow=0, **FAST)
    assert plan.fits and plan.config.grad_accum_steps == 1
    assert plan.config.micro_batch_size in (1, 2, 4, 8, 16, 32, 64)
    assert any((p.status is ProbeStatus.OOM or p.skip is Skip.PREDICTED)
               and p.config.micro_batch_size > plan.config.micro_batch_size for p in plan.probes)


def snapshot(model):
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "hooks": [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()],
        "patched": [sorted(vars(m)) for m in model.modules()],
        "dtypes": [p.dtype for p in model.parameters()],
    }


def test_the_users_model_and_optimizer_are_unchanged():
    model = make_mlp()
    model.blocks[0].up.weight.requires_grad_(False)
    model.eval()
    model.head.register_forward_hook(lambda *args: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    before, opt_before = snapshot(model), copy.deepcopy(optimizer.state_dict())
    plan = autofit.autofit(model, make_mlp_batch(8), global_batch_size=8, memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer=optimizer, allow=0, **FAST)
    assert plan.fits and any(p.config.checkpointing is not Checkpointing.NONE for p in plan.probes if p.measured)
    after = snapshot(model)
    for key in before:
        if key == "state":
            assert all(torch.equal(before[key][k], after[key][k]) for k in before[key])
        else:
            assert before[key] == after[key], key
    assert optimizer.state_dict() == opt_before and optimizer.defaults["lr"] == 3e-4


def test_resumed_search_reprobes_nothing(tmp_path):
    storage = f"sqlite:///{tmp_path}/trials.db"
    args = dict(global_batch_size=8, memory_budget="3MiB", loss_fn=mlp_loss, allow=0, storage=storage, **FAST)
    first = autofit.autofit(make_mlp, make_mlp_batch, **args)
    second = autofit.autofit(make_mlp, make_mlp_batch, **args)
    assert first.probes_run > 0 and second.probes_run == 0
    assert {p.source for p in second.probes} <= {Source.STORED, Source.DECIDED}
    # the stored figures are re-confirmed in this session, never taken raw
    finalists = second.confirmation.finalists
    assert finalists and all(f.source is Source.STORED and f.rounds for f in finalists)
    assert second.config in {f.config for f in first.confirmation.finalists} | {first.config}
    confirmed = second.confirmation
    assert second.throughput == (confirmed.winner.probed if confirmed.on_cpu_clock else confirmed.winner.median)


def test_plan_round_trips(tmp_path):
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=4, memory_budget="8MiB",
                           loss_fn=mlp_loss, allow=0, **FAST)
    assert autofit.Plan.load(plan.save(tmp_path / "runs" / "plan.json")) == plan


def test_loading_a_bad_plan_file(tmp_path):
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(autofit.UsageError, match="plan.json"):
        autofit.Plan.load(tmp_path / "plan.json")


def test_engine_pins_the_sharding_engine_and_rejects_unknown_ones(tmp_path):
    from autofit.errors import UsageError
    from autofit.pipelines.tune import engine_strategies
    from autofit.strategies import Fsdp, StateOffloading, Zero

    fsdp = engine_strategies(None, "fsdp")
    assert any(isinstance(s, Fsdp) for s in fsdp) and not any(isinstance(s, Zero) for s in fsdp)
    auto = engine_strategies(None, "auto")
    assert any(isinstance(s, Fsdp) for s in auto) and any(isinstance(s, Zero) for s in auto)
    assert [type(s) for s in engine_strategies([Zero(), Fsdp()], "deepspeed")] == [Zero]
    with pytest.raises(UsageError, match="engine='zero' is not known"):
        engine_strategies(None, "zero")
    offload = next(s for s in engine_strategies(None, "auto", tmp_path) if isinstance(s, StateOffloading))
    assert offload.nvme_path == str(tmp_path.resolve())


def test_progress_true_prints_each_probe_as_it_starts_and_lands(capsys):
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=4, loss_fn=mlp_loss, memory_budget="64MiB",
                           allow=0, max_probes=1, progress=True, **FAST)
    err = capsys.readouterr().err.splitlines()
    probed = [p for p in plan.probes if p.source is Source.PROBED]
    assert len(probed) == 1 and err[0].startswith(f"autofit probe 1: {probed[0].config.describe()} (")
    assert err[1].startswith(f"  {probed[0].status.value} {probed[0].config.describe()}, peak ")
    budget = [line for line in err if "past the probe budget" in line]
    assert len(budget) == 1 and sum(p.skip is Skip.BUDGET for p in plan.probes) > 1  # counted once, recorded each
    assert f"{sum(p.skip is Skip.BUDGET for p in plan.probes)} past the probe budget" in budget[0]


def test_progress_counts_the_skips_a_measured_result_implies_in_one_line(capsys):
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=4, loss_fn=mlp_loss, memory_budget="64MiB",
                           allow=0, max_probes=3, progress=True, **FAST)
    err = capsys.readouterr().err.splitlines()
    implied = [p for p in plan.probes if p.skip is Skip.IMPLIED]
    assert implied and not any(p.reason in line for p in implied for line in err)  # none listed
    counted = [int(m.group(1)) for m in map(re.compile(r"  skipped (\d+) implied by a measured result").match, err) if m]
    assert sum(counted) == len(implied)  # each counted once, the last ones too (flushed when the search ends)


def test_progress_says_the_search_is_predicting_while_it_simulates(capsys, monkeypatch):
    """Predicting peaks simulates training steps, minutes for a recurrent model before the first probe (a
    small Mamba sat 50 s silent): a line every `Heartbeat.EVERY_S` of predicting says so."""
    from autofit.search.walk import Heartbeat

    beat = Heartbeat()
    assert beat.heard(4.0) is None and beat.heard(5.0) is None
    assert beat.heard(1.5) == ("predicting peaks (3 predicted in 10 s: training steps simulated under fake tensors, "
                               "nothing trained)")
    assert beat.heard(9.0) is None  # quiet again since that line
    monkeypatch.setattr(Heartbeat, "EVERY_S", 0.0)  # a line for every prediction
    autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=4, loss_fn=mlp_loss, memory_budget="64MiB",
                    allow=0, max_probes=1, progress=True, **FAST)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("autofit: predicting peaks (1 predicted in ")


@pytest.mark.parametrize("progress", ["yes", print])
def test_progress_that_is_no_listener_is_a_usage_error(progress):
    with pytest.raises(autofit.UsageError, match=r"progress=.*pass True"):
        autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=4, loss_fn=mlp_loss, progress=progress, **FAST)


def test_the_callers_random_state_is_left_as_it_was():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                    loss_fn=mlp_loss, allow=0, max_probes=2)
    torch.testing.assert_close(torch.rand(3), expected)


def test_strategies_are_taken_by_name_class_or_instance():
    from autofit.strategies import (ActivationCheckpointing, DataParallel, Fsdp, MicroBatch, MixedPrecision, PureBf16,
                                    Zero, resolve_strategies)

    names = lambda given: [type(s).__name__ for s in resolve_strategies(given)]  # noqa: E731
    assert names(["precision", "Micro_Batch", "micro-batch"]) == ["MixedPrecision", "PureBf16", "MicroBatch"]  # once each
    assert names("checkpointing") == ["ActivationCheckpointing"] and names([MicroBatch, ActivationCheckpointing()]) == [
        "MicroBatch", "ActivationCheckpointing"]
    assert set(names(["sharding"])) == {Zero.__name__, Fsdp.__name__} and names("num_gpus") == [DataParallel.__name__]
    assert names(["pure_bf16"]) == [PureBf16.__name__] and names(["PRECISION"])[0] == MixedPrecision.__name__


def test_what_is_not_a_strategy_or_a_factory_is_named():
    with pytest.raises(UsageError, match=r"strategies: 'precison' is not a strategy \(did you mean 'precision'\?\)"):
        autofit.autofit(make_mlp, make_mlp_batch, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss,
                        strategies=["micro_batch", "precison"])
    with pytest.raises(UsageError, match="strategies: 3 is not a strategy"):
        autofit.autofit(make_mlp, make_mlp_batch, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss,
                        strategies=[3])

    class NeedsWidth(torch.nn.Module):
        def __init__(self, width):
            super().__init__()

    with pytest.raises(UsageError, match=r"model=NeedsWidth\(width\) is called with no arguments.*lambda: NeedsWidth\(\.\.\.\)"):
        autofit.autofit(NeedsWidth, make_mlp_batch, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss)
    forward = torch.nn.Linear(16, 4)  # a forward written out as a lambda: it has no name to suggest calling
    with pytest.raises(UsageError, match=r"model=<lambda>\(x\) is called with no arguments.*pass a built model "
                                         r"\(the nn.Module, which autofit calls on the batch\).*lambda: MyModel\(\)"):
        autofit.autofit(lambda x: forward(x).sum(), make_mlp_batch, device="cpu", memory_budget="1GiB")
    with pytest.raises(UsageError, match="max_probes must be an integer >= 1"):
        autofit.autofit(make_mlp, make_mlp_batch, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss, max_probes=0)


def test_a_model_in_bf16_is_trained_as_given_and_the_plan_says_what_fp32_means():
    # Tried as a new user: a model cast to bf16 came back "fp32, mb=16x1" with nothing said; the probes
    # train the model as given (no autocast at fp32), so its step ran in bf16.
    model = make_mlp().to(torch.bfloat16)

    def make_batch(n):
        x, y = make_mlp_batch(n)
        return x.to(torch.bfloat16), y

    plan = autofit.autofit(model, make_batch, global_batch_size=8, loss_fn=lambda out, b: mlp_loss(out.float(), b),
                           device="cpu", memory_budget="64MiB", allow=0, max_probes=2)
    assert plan.fits and plan.config.precision == "fp32"
    assert "weights are bfloat16: fp32 here means no autocast" in plan.reason
    assert next(model.parameters()).dtype is torch.bfloat16  # the user's model as it was
    fp32 = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, loss_fn=mlp_loss, device="cpu",
                           memory_budget="64MiB", allow=0, max_probes=2)
    assert "weights are" not in fp32.reason


def test_the_engine_is_a_closed_choice():
    from autofit.pipelines.tune import engine_strategies
    from autofit.strategies import ENGINES, EngineChoice, Fsdp, Zero

    assert ENGINES == (EngineChoice.AUTO, EngineChoice.DEEPSPEED, EngineChoice.FSDP) and "fsdp" in ENGINES
    chosen = engine_strategies(None, "fsdp")
    assert any(isinstance(s, Fsdp) for s in chosen) and not any(isinstance(s, Zero) for s in chosen)
    with pytest.raises(UsageError, match="engine='fdsp' is not known.*did you mean 'fsdp'.*use one of 'auto'"):
        engine_strategies(None, "fdsp")
    with pytest.raises(UsageError, match="engine='megatron' is not known"):
        autofit.autofit(make_mlp, make_mlp_batch, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss,
                        engine="megatron")


def test_a_strategy_writes_offloads_where_the_search_says_and_runs_where_installed(tmp_path):
    from autofit.strategies import Fsdp, MicroBatch, StateOffloading, Zero
    from autofit.strategies.zero import installed_version

    moved = StateOffloading().writing_to(str(tmp_path))
    assert isinstance(moved, StateOffloading) and moved.nvme_path == str(tmp_path.resolve())
    micro = MicroBatch()
    assert micro.writing_to(str(tmp_path)) is micro  # writes to no disk: itself
    assert Fsdp().not_installed() is None  # torch's own
    assert (Zero().not_installed() is None) == (installed_version() is not None)
