"""The confirmation step: finalists, back-to-back re-measurement, and the decision between them.

Figures here come from named test doubles (a measurement that returns given samples/s per round, a card
whose allocator retries near its limit): the tests assert decisions, never timings.
"""

import dataclasses

import pytest
from models import make_mlp, make_mlp_batch, mlp_loss

import autofit
from autofit.config import Config, Optimizer
from autofit.plan import make_plan
from autofit.probe.outcome import ProbeResult, ProbeStatus, Source, decided, Skip
from autofit.search import confirm
from autofit.search.confirm import confirm as run_confirm, finalists, follow_near_limit, follow_numerics
from autofit.search.decision import LIVE_WINDOW, PROBE_WINDOW, Finalist, decide, possible_winners, unsettled
from autofit.search.space import build_space
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch, OptimizerStates, MixedPrecision as PrecisionStrategy

EXACT = Config(micro_batch_size=8)
ADAFACTOR = Config(micro_batch_size=8, optimizer="adafactor")
BF16 = Config(micro_batch_size=8, precision="bf16")


@pytest.fixture(scope="module")
def space():
    spec = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss)
    return build_space(spec, [PrecisionStrategy(), OptimizerStates(), MicroBatch()])


def fit(config, samples_per_s, source=Source.PROBED, retries=None):
    return ProbeResult(config, ProbeStatus.FIT, "fits: peak 1.00 MiB of 1.00 GiB (0%)", 2**20,
                       config.global_batch_size / samples_per_s, samples_per_s, source=source, alloc_retries=retries)


def finalist(config, rounds, tier=0, near_limit=False):
    return Finalist(config, tier, near_limit, Source.PROBED, rounds[0], tuple(rounds))


class GivenRounds:
    """A measurement double: each config's samples/s per round are given; records what it was asked."""

    def __init__(self, figures):
        self.figures, self.asked = figures, []

    def __call__(self, configs, rounds, more=lambda figures: False):
        self.asked.append(list(configs))

        def upto(count):
            return {c: self.figures[c] if isinstance(self.figures[c], str) else tuple(self.figures[c][:count])
                    for c in configs}

        count = rounds.least
        while count < rounds.most and more(upto(count)):
            count += 1
        self.rounds = count
        return upto(count)


# -- the decision ---------------------------------------------------------------------------------------
def test_a_numerics_change_a_few_percent_faster_does_not_replace_an_exact_fit():
    pool = [finalist(EXACT, [100] * 7), finalist(ADAFACTOR, [105] * 7, tier=1)]
    chosen, (comparison,) = decide(pool, exact_margin=0.10)
    assert chosen == 0 and not comparison.won and comparison.kind == "exactness"
    assert comparison.ratio.median == pytest.approx(1.05)


def test_a_numerics_change_clearly_faster_wins_and_the_margin_is_configurable():
    pool = [finalist(EXACT, [100] * 7), finalist(ADAFACTOR, [120, 118, 125, 119, 121, 122, 117], tier=1)]
    assert decide(pool, exact_margin=0.10)[0] == 1
    assert decide(pool, exact_margin=0.30)[0] == 0


def test_within_the_noise_the_simpler_configuration_stays():
    larger, smaller = Config(micro_batch_size=4, grad_accum_steps=2), Config(micro_batch_size=2, grad_accum_steps=4)
    assert decide([finalist(larger, [100] * 7), finalist(smaller, [102] * 7)], 0.1)[0] == 0
    # faster by the median, but in too few rounds: not clear either
    mixed = [130, 95, 96, 131, 99, 129, 128]
    assert decide([finalist(larger, [100] * 7), finalist(smaller, mixed)], 0.1)[0] == 0
    assert decide([finalist(larger, [100] * 7), finalist(smaller, [108, 107, 110, 106, 109, 108, 107])], 0.1)[0] == 1


def test_paired_rounds_cancel_a_load_that_comes_and_goes():
    # the machine slows down by half in rounds 3-5: both configs, back to back, feel it alike
    load = [1, 1, 0.5, 0.5, 0.5, 1, 1]
    a = finalist(EXACT, [100 * f for f in load])
    b = finalist(EXACT.replace(micro_batch_size=4, grad_accum_steps=2), [110 * f for f in load])
    chosen, (comparison,) = decide([a, b], 0.1)
    assert chosen == 1 and comparison.ratio.median == pytest.approx(1.1) and comparison.ratio.wins == 1


def test_a_fit_whose_allocator_retried_must_clear_its_margin():
    calm = Config(micro_batch_size=4, grad_accum_steps=2)
    pool = [finalist(calm, [100] * 7), finalist(EXACT, [106] * 7, near_limit=True)]
    chosen, (comparison,) = decide(pool, 0.1)
    assert chosen == 0 and comparison.kind == "near-limit"


# -- the finalists ----------------------------------------------------------------------------------------
def test_finalists_are_the_close_fits_and_the_best_safer_one(space):
    results = [fit(ADAFACTOR, 120), fit(BF16, 110), fit(EXACT, 99), fit(EXACT.replace(optimizer="adafactor",
               precision="bf16"), 50), decided(Config(micro_batch_size=1, grad_accum_steps=8), Skip.IMPLIED, "x")]
    picked = finalists(space, results, PROBE_WINDOW)
    # adafactor and bf16 are within 20% of the best; the best exact one (99) is the best of a safer class,
    # so the decision between them is taken on confirmed figures; 50 is out
    assert [r.config for r in picked] == [EXACT, BF16, ADAFACTOR]  # from the least change: exact first


def test_an_exact_fit_far_behind_is_still_re_measured_against_a_numerics_change(space):
    # one probe on a loaded machine can be off by a third: a numerics change replaces an exact fit only
    # on figures measured side by side, however far ahead it probed
    picked = finalists(space, [fit(ADAFACTOR, 200), fit(EXACT, 100)], PROBE_WINDOW)
    assert [r.config for r in picked] == [EXACT, ADAFACTOR]


def test_live_runs_re_measure_a_wider_window_than_whole_probes(space):
    results = [fit(BF16, 100), fit(ADAFACTOR, 70)]  # 1.43x apart as probed: noise on a loaded machine, or not
    assert [r.config for r in finalists(space, results, PROBE_WINDOW)] == [BF16]
    assert {r.config for r in finalists(space, results, LIVE_WINDOW)} == {BF16, ADAFACTOR}


def test_on_live_runs_one_walk_figure_does_not_keep_a_safer_class_fastest_fit_out():
    """A nanoGPT search once re-measured Adafactor against the one exact fit that probed fastest, while
    another exact fit (checkpointing every 2nd block) was faster side by side: the oracle put the change at
    1.09x over the best exact, under its 10% margin. Live runs re-measure each safer class's close fits."""
    from autofit.strategies import ActivationCheckpointing

    spec = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss)
    wider = build_space(spec, [PrecisionStrategy(), OptimizerStates(), ActivationCheckpointing(), MicroBatch()])
    checkpointed = EXACT.replace(checkpointing="full")
    results = [fit(ADAFACTOR, 120), fit(EXACT, 60), fit(checkpointed, 55), fit(EXACT.replace(
        checkpointing="full", optimizer="adafactor"), 20)]
    assert {r.config for r in finalists(wider, results, LIVE_WINDOW)} == {ADAFACTOR, EXACT, checkpointed}
    assert {r.config for r in finalists(wider, results, PROBE_WINDOW)} == {ADAFACTOR, EXACT}


def test_a_smaller_micro_batch_is_confirmed_against_its_levels_largest(space):
    small = EXACT.replace(micro_batch_size=2, grad_accum_steps=4)
    picked = finalists(space, [fit(small, 100), fit(EXACT, 60)], PROBE_WINDOW)
    assert [r.config for r in picked] == [EXACT, small]


def test_stored_figures_are_never_compared_raw_with_this_sessions(space):
    # an earlier session on a quiet machine measured 3x what this one does: both pick their own finalists
    results = [fit(ADAFACTOR, 300, Source.STORED), fit(EXACT, 100)]
    picked = finalists(space, results, PROBE_WINDOW)
    assert {r.config for r in picked} == {ADAFACTOR, EXACT}
    measure = GivenRounds({EXACT: [100] * 7, ADAFACTOR: [101] * 7})
    confirmation = run_confirm(space, results, measure, 7, 0.10, "probes")
    assert measure.asked == [[EXACT, ADAFACTOR]] and confirmation.winner.config == EXACT


def test_a_lone_stored_finalist_is_re_measured_and_a_lone_probed_one_is_not(space):
    measure = GivenRounds({EXACT: [90] * 3})
    stored = run_confirm(space, [fit(EXACT, 100, Source.STORED)], measure, 3, 0.1, "probes")
    assert measure.asked == [[EXACT]] and stored.winner.median == 90 and stored.method == "probes"
    fresh = run_confirm(space, [fit(EXACT, 100)], measure, 3, 0.1, "probes")
    assert len(measure.asked) == 1 and fresh.method == "none" and fresh.winner.median == 100


def test_a_lone_finalist_whose_steps_disagreed_is_re_measured(space):
    import dataclasses

    measure = GivenRounds({EXACT: [900] * 3})
    unsteady = dataclasses.replace(fit(EXACT, 20), step_spread=0.83)  # timed while the machine was busy
    confirmation = run_confirm(space, [unsteady], measure, 3, 0.1, "live runs")
    assert measure.asked == [[EXACT]] and confirmation.winner.median == 900


def test_a_finalist_that_fails_when_re_measured_is_dropped_with_why(space):
    measure = GivenRounds({EXACT: "oom when re-measured: CUDA out of memory", ADAFACTOR: [100] * 3})
    confirmation = run_confirm(space, [fit(EXACT, 100), fit(ADAFACTOR, 101)], measure, 3, 0.1, "probes")
    assert confirmation.winner.config == ADAFACTOR
    assert confirmation.dropped == ((EXACT.describe(), "oom when re-measured: CUDA out of memory"),)


def test_interleaved_rounds_rotate_the_order():
    order = []
    measure = confirm.interleaved(lambda c: order.append(c.micro_batch_size) or 1.0)
    a, b, c = (Config(micro_batch_size=m, grad_accum_steps=8 // m) for m in (8, 4, 2))
    out = measure([a, b, c], confirm.Rounds(3, 3, 0.0))
    assert order == [8, 4, 2, 4, 2, 8, 2, 8, 4] and out[a] == (1.0, 1.0, 1.0)


# -- the reason -------------------------------------------------------------------------------------------
def test_the_reason_says_plainly_that_the_optimizer_is_swapped_and_by_what_margin(space):
    results = [fit(EXACT, 100), fit(ADAFACTOR, 125)]
    measure = GivenRounds({EXACT: [100] * 7, ADAFACTOR: [125, 124, 126, 125, 123, 127, 125]})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    assert plan.config == ADAFACTOR and plan.throughput == 125
    assert "your optimizer adamw is replaced by adafactor" in plan.reason
    assert "1.25x" in plan.reason and "the 10% margin a numerics change must clear (exact_margin)" in plan.reason
    assert "7 interleaved rounds (live runs)" in plan.reason


def test_cpu_clock_rounds_rank_the_finalists_but_the_plan_keeps_the_probes_wall_figure(space):
    # At one torch thread the live rounds count the measuring thread's CPU time (`step_seconds`): on a busy
    # machine that is well above the wall throughput the job gets, so it ranks, and is named as what it is.
    results = [fit(EXACT, 40), fit(ADAFACTOR, 50)]
    measure = GivenRounds({EXACT: [100] * 7, ADAFACTOR: [125] * 7})
    at_one = run_confirm(space, results, measure, 7, 0.10, "live runs", threads=1)
    plan = make_plan(space, results, None, at_one)
    assert at_one.on_cpu_clock and plan.config == ADAFACTOR and plan.throughput == 50
    assert "125.00 samples per CPU second" in plan.reason and "1.25x" in plan.reason
    at_two = run_confirm(space, results, GivenRounds({EXACT: [100] * 7, ADAFACTOR: [125] * 7}), 7, 0.10,
                         "live runs", threads=2)
    plan = make_plan(space, results, None, at_two)
    assert not at_two.on_cpu_clock and plan.throughput == 125 and "125.00 samples/s" in plan.reason


def test_the_reason_says_why_a_faster_numerics_change_was_not_taken(space):
    results = [fit(EXACT, 100), fit(ADAFACTOR, 104)]
    measure = GivenRounds({EXACT: [100] * 7, ADAFACTOR: [104] * 7})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    assert plan.config == EXACT
    assert f"{ADAFACTOR.describe()} was 1.04x" in plan.reason and f"{EXACT.describe()} is kept" in plan.reason


def test_a_finalist_said_to_be_kept_and_then_beaten_is_said_to_be_beaten(space):
    # As the quickstart once read: bf16 cleared the exactness margin, a faster change did not clear noise's
    # ("bf16 ... is kept"), and the one after it did, unsaid: the reason ended on a finalist it did not choose.
    four = Config(micro_batch_size=4, grad_accum_steps=2, precision="bf16")
    two = Config(micro_batch_size=2, grad_accum_steps=4, precision="bf16")
    results = [fit(EXACT, 100), fit(BF16, 115), fit(four, 117), fit(two, 122)]
    measure = GivenRounds({EXACT: [100] * 7, BF16: [115] * 7, four: [117] * 7, two: [122] * 7})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    assert plan.config == two
    kept = f"{four.describe()} was 1.02x as fast as {BF16.describe()}"
    beaten = f"{two.describe()} is 1.06x as fast as {BF16.describe()}"
    assert kept in plan.reason and beaten in plan.reason and plan.reason.index(kept) < plan.reason.index(beaten)


def test_a_plain_win_on_the_noise_margin_goes_unsaid(space):
    results = [fit(BF16, 100), fit(Config(micro_batch_size=4, grad_accum_steps=2, precision="bf16"), 110)]
    measure = GivenRounds({r.config: [r.samples_per_s] * 7 for r in results})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    assert "mb=4x2" in plan.config.describe() and "margin of noise" not in plan.reason


def test_a_numerics_change_is_taken_when_nothing_exact_fits(space):
    results = [fit(ADAFACTOR, 100), ProbeResult(EXACT, ProbeStatus.OOM, "out of memory", oom_kind="cpu-budget")]
    plan = make_plan(space, results, None, run_confirm(space, results, GivenRounds({}), 7, 0.10, "live runs"))
    assert plan.config == ADAFACTOR and "because no exact configuration fits" in plan.reason
    assert plan.reason.startswith("the only finalist")


def test_exact_configurations_that_failed_with_an_error_are_named_beside_the_numerics_change(space):
    """fp32 failing where bf16 autocast runs (an in-place update of a tensor the fp32 backward needs, which
    autocast's bf16 copy steps around): not "nothing exact fits" alone, but the error, a likely fault."""
    error = ("RuntimeError: one of the variables needed for gradient computation has been modified by an inplace "
             "operation (at moco.py:17 in forward)")
    results = [fit(BF16, 100), ProbeResult(EXACT, ProbeStatus.ERROR, error)]
    plan = make_plan(space, results, None, run_confirm(space, results, GivenRounds({}), 7, 0.10, "live runs"))
    assert plan.config == BF16
    assert (f"because no exact configuration fits: 1 of those probed failed with an error, not out of memory "
            f"({EXACT.describe()}: {error}), which the change may only step around") in plan.reason


def test_a_confirmed_plan_round_trips(space, tmp_path):
    results = [fit(EXACT, 100), fit(ADAFACTOR, 125)]
    measure = GivenRounds({EXACT: [100] * 7, ADAFACTOR: [125] * 7})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    assert autofit.Plan.load(plan.save(tmp_path / "plan.json")) == plan


def test_a_bad_margin_is_a_usage_error():
    with pytest.raises(autofit.UsageError, match=r"exact_margin .* but got -0.1"):
        autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="8MiB",
                        loss_fn=mlp_loss, exact_margin=-0.1)


# -- near the limit ---------------------------------------------------------------------------------------
def test_the_next_smaller_micro_batch_of_a_fit_near_the_limit_is_probed(space):
    asked = []

    def probe(config, why):
        asked.append((config.micro_batch_size, why))
        return fit(config, 90, retries=2 if config.micro_batch_size == 4 else 0)

    four = EXACT.replace(micro_batch_size=4, grad_accum_steps=2)
    results = [fit(EXACT, 100, retries=3), decided(four, Skip.IMPLIED, "fits, but cannot be faster")]
    out = follow_near_limit(space, results, probe)
    assert [m for m, _ in asked] == [4, 2]  # 4 retried too, so 2 as well
    assert "hit 3 allocator retries" in asked[0][1]
    assert [r.config.micro_batch_size for r in out] == [8, 4, 2] and all(r.measured for r in out)


class FakeCard:
    """A CUDA test double of a card whose caching allocator retries near its limit: peak bytes grow with
    the micro-batch; past 80% of the fit limit every timed step retries (cudaFree + cudaMalloc) and runs
    slower, as the published 6.83 -> 4.91 samples/s from micro-batch 12 to 14 did. Answers probes."""

    def __init__(self, limit):
        self.limit, self.asked = limit, []

    def __call__(self, spec, config, strategies, placement, timeout=None, step_limit=None):
        self.asked.append(config.micro_batch_size)
        peak = int(config.micro_batch_size / 8.5 * self.limit)  # micro-batch 8: 94% of the limit
        if peak > self.limit:
            return ProbeResult(config, ProbeStatus.OOM, "CUDA out of memory", peak, oom_kind="cuda-allocator")
        retries = 4 if peak > 0.8 * self.limit else 0
        speed = 100 * (0.7 if retries else 1.0)
        return fit(config, speed, retries=retries)


def test_a_thrashing_fit_loses_to_the_next_smaller_micro_batch(monkeypatch):
    spec_args = dict(global_batch_size=8, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss)
    limit = make_spec(make_mlp, make_mlp_batch, **spec_args).fit_limit
    card = FakeCard(limit)  # micro-batch 8 peaks at 94% of the fit limit: retries; 4 is calm
    monkeypatch.setattr("autofit.pipelines.tune.probe_placed", card)
    monkeypatch.setattr("autofit.pipelines.tune.LIVE_SHARE", 0.0)  # re-measure through the card too
    plan = autofit.autofit(make_mlp, make_mlp_batch, strategies=[MicroBatch()], predict=False, **spec_args)
    assert card.asked[:2] == [8, 4]  # 8 fits but retries, so 4 is probed although it "cannot be faster"
    eight = next(p for p in plan.probes if p.config.micro_batch_size == 8)
    assert eight.near_limit
    assert plan.config.micro_batch_size == 4 and not next(
        p for p in plan.probes if p.config == plan.config).near_limit


def test_a_numerics_change_the_walk_only_implied_is_probed(space):
    asked = []

    def probe(config, why):
        asked.append((config, why))
        return fit(config, 150)

    results = [fit(EXACT, 100), decided(ADAFACTOR, Skip.IMPLIED, "fits, but cannot be faster than fp32 ...")]
    out = follow_numerics(space, results, probe)
    # Adafactor where AdamW fits: probed, since its step may do less work; bf16 was never decided, so not
    assert [c for c, _ in asked] == [ADAFACTOR] and "may do less work" in asked[0][1]
    assert {r.config: r.fits for r in out} == {EXACT: True, ADAFACTOR: True}
    assert follow_numerics(space, out, probe) == out and len(asked) == 1  # measured now: nothing more


def test_follow_up_probes_keep_to_the_probe_budget(monkeypatch):
    spec_args = dict(global_batch_size=8, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss)
    card = FakeCard(make_spec(make_mlp, make_mlp_batch, **spec_args).fit_limit)
    monkeypatch.setattr("autofit.pipelines.tune.probe_placed", card)
    monkeypatch.setattr("autofit.pipelines.tune.LIVE_SHARE", 0.0)
    plan = autofit.autofit(make_mlp, make_mlp_batch, strategies=[MicroBatch()], predict=False, max_probes=1,
                           **spec_args)
    assert card.asked[0] == 8 and plan.probes_run == 1  # the rest of the card's answers are re-measurements
    four = next(p for p in plan.probes if p.config.micro_batch_size == 4)
    assert four.skip is Skip.BUDGET and plan.config.micro_batch_size == 8


def test_numerics_follow_up_of_a_checkpointed_fit(tmp_path):
    # every_k checkpointing carries its frequency: the follow-up must not build checkpointing=none with it
    spec = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss)
    from autofit.strategies import ActivationCheckpointing

    space = build_space(spec, [ActivationCheckpointing(), OptimizerStates(), MicroBatch()])
    every2 = Config(checkpointing="every_k", checkpoint_every=2, micro_batch_size=8)
    results = [fit(every2, 100), decided(every2.replace(optimizer="adafactor"), Skip.IMPLIED, "cannot be faster")]
    out = follow_numerics(space, results, lambda c, why: fit(c, 90))
    assert {r.config.optimizer for r in out if r.measured} == {Optimizer.ADAMW, Optimizer.ADAFACTOR}


def test_the_decisions_closed_choices_are_enums_and_old_json_loads():
    import json

    from autofit.search.decision import Comparison, Confirmation, MarginKind, Method, Ratio

    ratio = Ratio(1.2, 1.1, 1.3, 1.0, 7)
    with pytest.raises(ValueError, match="kind='nois' is not known.*did you mean 'noise'"):
        Comparison(1, 0, ratio, 0.03, "nois", True)
    finalists_ = (Finalist(EXACT, 0, False, Source.PROBED, 100.0, (100.0,)),
                  Finalist(ADAFACTOR, 1, False, Source.PROBED, 120.0, (120.0,)))
    with pytest.raises(ValueError, match="method='live' is not known"):
        Confirmation(finalists_, 1, (), "live", 0.1)
    # as plan.json held them: plain strings
    written = {"finalists": [f.to_dict() for f in finalists_], "chosen": 1, "method": "live runs",
               "comparisons": [{"challenger": 1, "holder": 0, "ratio": dataclasses.asdict(ratio), "margin": 0.1,
                                "kind": "exactness", "won": True}], "exact_margin": 0.1}
    loaded = Confirmation.from_dict(json.loads(json.dumps(written)))
    assert loaded.method is Method.LIVE_RUNS and loaded.comparisons[0].kind is MarginKind.EXACTNESS
    assert Confirmation.from_dict(json.loads(json.dumps(loaded.to_dict()))) == loaded


# -- busy machines, the order of numerics changes, and what the reason and summary say (issue 57) -------------
PURE = Config(micro_batch_size=8, precision="pure_bf16")


@pytest.fixture(scope="module")
def pure_space():
    from autofit.strategies import PureBf16

    spec = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss)
    return build_space(spec, [PrecisionStrategy(), PureBf16(), OptimizerStates(), MicroBatch()])


def test_numerics_changes_are_ordered_by_how_much_they_change(pure_space):
    # exact < autocast < pure bf16 / Adafactor (the update itself changes) < autocast and Adafactor together
    degrees = {c.describe(): pure_space.degree(c) for c in (EXACT, BF16, PURE, ADAFACTOR, BF16.replace(optimizer="adafactor"))}
    assert list(degrees.values()) == [0, 1, 2, 2, 3]
    picked = finalists(pure_space, [fit(PURE, 140), fit(BF16, 130), fit(EXACT, 100)], LIVE_WINDOW)
    assert [r.config for r in picked] == [EXACT, BF16, PURE]


def test_pure_bf16_must_clear_the_exactness_margin_over_bf16_autocast(pure_space):
    """As the quickstart chose: bf16 autocast cleared the margin over fp32, and pure bf16 (bf16 weights and
    AdamW states: updates under bf16's resolution are lost) was kept over it on the 3% noise margin."""
    results = [fit(EXACT, 100), fit(BF16, 130), fit(PURE, 140)]
    measure = GivenRounds({EXACT: [100] * 7, BF16: [130] * 7, PURE: [140] * 7})
    confirmation = run_confirm(pure_space, results, measure, 7, 0.10, "live runs")
    assert confirmation.winner.config == BF16
    last = confirmation.comparisons[-1]
    assert last.kind == "exactness" and last.decided_by == "margin" and last.ratio.median == pytest.approx(140 / 130)
    plan = make_plan(pure_space, results, None, confirmation)
    assert f"{PURE.describe()} was 1.08x as fast as {BF16.describe()} (numerics: precision=bf16;" in plan.reason


def test_too_noisy_to_rank_keeps_the_exact_fit_and_says_so_with_the_figures(space):
    # paired ratios 0.6-2.6: a median of 1.5, faster in 4 of 5 rounds, on a machine that cannot rank at 10%
    noisy = [60, 260, 130, 200, 150] * 5
    measure = GivenRounds({EXACT: [100] * 21, ADAFACTOR: noisy})
    results = [fit(EXACT, 100), fit(ADAFACTOR, 140)]
    confirmation = run_confirm(space, results, measure, confirm.Rounds(7, 21, 60.0), 0.10, "live runs")
    (comparison,) = confirmation.comparisons
    assert confirmation.winner.config == EXACT and comparison.decided_by == "noise" and not comparison.won
    assert measure.rounds == 21  # rounds went on while noise alone left it undecided, up to the cap
    plan = make_plan(space, results, None, confirmation)
    assert ("too noisy to show a 10% gain: paired ratios 1.30-2.00 (the median's 85% interval) over 21 rounds"
            in plan.reason)
    assert "kept over" in plan.summary() and "too noisy" in plan.summary()


def test_more_rounds_settle_a_gain_the_first_rounds_left_to_noise(space):
    steady = [100, 150, 120, 130, 125, 160, 122] + [125] * 14
    measure = GivenRounds({EXACT: [100] * 21, ADAFACTOR: steady})
    results = [fit(EXACT, 100), fit(ADAFACTOR, 125)]
    confirmation = run_confirm(space, results, measure, confirm.Rounds(7, 21, 60.0), 0.10, "live runs")
    assert confirmation.winner.config == ADAFACTOR and confirmation.comparisons[0].decided_by == "cleared"
    assert 7 < measure.rounds < 21  # no more than it took


def test_interleaved_rounds_stop_at_the_time_cap():
    calls = []
    measure = confirm.interleaved(lambda c: calls.append(c) or 1.0)
    out = measure([EXACT, ADAFACTOR], confirm.Rounds(2, 50, 0.0), lambda figures: True)
    assert len(out[EXACT]) == 2 and len(calls) == 4  # at least `least`; none past a spent time cap


def test_a_faster_runner_up_is_never_left_unexplained(space):
    # 1.19x as fast by the median but faster in 4 of 7 rounds: the reason says the share decided it
    results = [fit(EXACT, 100), fit(ADAFACTOR, 119)]
    measure = GivenRounds({EXACT: [100] * 7, ADAFACTOR: [119, 125, 130, 135, 95, 96, 97]})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    assert plan.config == EXACT and plan.confirmation.comparisons[0].decided_by == "share of rounds"
    assert (f"{ADAFACTOR.describe()} was 1.19x as fast as {EXACT.describe()} (exact; interval 0.96-1.30 over 7 "
            "rounds), faster in too few rounds (57% of 7; a change must win 70%)") in plan.reason
    assert "within the 3% margin" not in plan.reason


def test_the_reason_names_the_class_of_what_a_numerics_change_beat(space):
    # the exact finalist could not be re-measured: Adafactor under bf16 beat bf16 autocast, not "an exact one"
    both = BF16.replace(optimizer="adafactor")
    results = [fit(EXACT, 100), fit(BF16, 110), fit(both, 130)]
    measure = GivenRounds({EXACT: "oom when re-measured: out of memory", BF16: [110] * 7, both: [130] * 7})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    assert plan.config == both
    assert f"it cleared the 10% margin over {BF16.describe()} (numerics: precision=bf16)" in plan.reason
    assert "over an exact configuration" not in plan.reason


def test_the_summary_is_three_short_lines_at_most(space):
    results = [fit(EXACT, 100), fit(ADAFACTOR, 125)]
    measure = GivenRounds({EXACT: [100] * 7, ADAFACTOR: [125, 124, 126, 125, 123, 127, 125]})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    lines = plan.summary().splitlines()
    assert len(lines) == 3 and all(len(line) <= 120 for line in lines), lines
    assert lines[0].startswith(ADAFACTOR.describe()) and "125.00 samples/s" in lines[0]
    assert lines[1] == f"1.25x {EXACT.describe()} (exact) over 7 rounds, above the 10% exactness margin"
    assert lines[2] == "numerics: optimizer=adafactor (tier 1)"
    assert len(plan.reason) > 300  # the whole comparison stays in the reason (and the confirmation)


def test_a_choice_near_the_limit_names_the_next_fit_with_headroom(space):
    four = EXACT.replace(micro_batch_size=4, grad_accum_steps=2)
    results = [fit(EXACT, 100, retries=3), fit(four, 80, retries=0)]
    measure = GivenRounds({EXACT: [100] * 7, four: [80] * 7})
    plan = make_plan(space, results, None, run_confirm(space, results, measure, 7, 0.10, "live runs"))
    assert plan.config == EXACT  # 1.25x: above the near-limit margin
    lines = plan.summary().splitlines()
    assert len(lines) == 3 and lines[2] == (f"near the limit (3 allocator retries while timed); with headroom: "
                                            f"{four.describe()}, 80.00 samples/s, peak 1.00 MiB")


def test_a_busy_machines_slower_rounds_get_their_share_of_extra_rounds(monkeypatch):
    """The first 7 rounds took 40 s on a busy machine, past a 30 s cap: extra rounds may still take up to
    three times that, so noise alone does not end the measurement at its first rounds."""
    clock = iter(range(0, 10_000, 1))
    monkeypatch.setattr(confirm.time, "perf_counter", lambda: float(next(clock)) * 5.0)  # 5 s a call
    measure = confirm.interleaved(lambda c: 1.0)
    out = measure([EXACT], confirm.Rounds(7, 21, 30.0, 3.0), lambda figures: True)
    assert 7 < len(out[EXACT]) <= 21
    assert confirm.Rounds(7, 21, 30.0, 3.0).cap(40.0) == 120.0 and confirm.Rounds(7, 21, 30.0).cap(40.0) == 30.0


def test_rounds_go_on_while_the_interval_holds_the_margins_edge(space):
    """A median just under the 10% margin after 7 noisy rounds (interval 0.97-1.25) is not a verdict: as on the
    nanoGPT bench, where 7 rounds kept AdamW at 1.10x and 15 showed Adafactor at 1.25x (1.19-1.28)."""
    first = [97, 125, 108, 130, 95, 109, 118]
    measure = GivenRounds({EXACT: [100] * 21, ADAFACTOR: first + [116] * 14})
    results = [fit(EXACT, 100), fit(ADAFACTOR, 120)]
    confirmation = run_confirm(space, results, measure, confirm.Rounds(7, 21, 60.0), 0.10, "live runs")
    assert measure.rounds > 7
    assert confirmation.winner.config == ADAFACTOR and confirmation.comparisons[0].decided_by == "cleared"


def test_an_interval_above_the_margin_by_more_than_its_width_shows_the_gain():
    from autofit.search.decision import Ratio, judge

    assert judge(Ratio(1.09, 1.07, 1.12, 0.9, 21), 0.03) == "cleared"  # wider than 3%, but 7% clear of 1
    assert judge(Ratio(1.09, 1.02, 1.12, 0.9, 21), 0.03) == "noise"  # its low end under the margin
    assert judge(Ratio(1.50, 1.30, 2.00, 0.8, 21), 0.10) == "noise"  # the rounds disagree more than the gain


def test_a_larger_micro_batch_where_batch_norm_couples_the_samples_changes_less():
    """The CNN bench: checkpointing at micro-batch 4 (batch norm over 4 of 16 samples) against no checkpointing
    at 2 (over 2) is not a further numerics change; the reverse is, and so is another knob's change."""
    from autofit.search.decision import Standing, margin_between

    two, four = (Standing(1, (f"micro_batch_size={m}",), micro_batch=m) for m in (2, 4))
    assert margin_between(two, four, 0.10) == (0.03, "noise")
    assert margin_between(four, two, 0.10) == (0.10, "exactness")
    adafactor = Standing(1, ("micro_batch_size=4", "optimizer=adafactor"), micro_batch=4)
    assert margin_between(two, adafactor, 0.10) == (0.10, "exactness")
    assert margin_between(Standing(0), four, 0.10) == (0.10, "exactness")


def test_a_riskier_class_s_close_fit_is_re_measured_though_five_fits_outran_it(pure_space):
    """The nanoGPT bench: the oracle's fastest (Adafactor) probed behind five fits and was left out of the
    re-measurement. Each class's fits within the window of the best are finalists, at most 3 of each."""
    exact = [fit(pure_space.at(EXACT, m), 100 - i) for i, m in enumerate((8, 4, 2, 1))]
    pure, adafactor = fit(PURE, 95), fit(ADAFACTOR, 60)  # one class (degree 2); 60 is outside 50% of 100
    picked = [r.config for r in finalists(pure_space, [*exact, fit(BF16, 96), pure, adafactor], LIVE_WINDOW)]
    assert PURE in picked and ADAFACTOR not in picked


# -- the stopping rule: rounds for what is still open, within a cap sized from the steps ----------------
def test_interleaved_retires_what_more_leaves_out_for_good():
    a, b, c = (Config(micro_batch_size=m) for m in (8, 4, 2))
    calls, asks = [], iter([frozenset({a, b, c}), frozenset({a, b}), frozenset({a, b, c}), frozenset()])
    measure = confirm.interleaved(lambda config: calls.append(config) or 1.0)
    out = measure([a, b, c], confirm.Rounds(2, 50, 60.0), lambda figures: next(asks))
    # 2 rounds of all, one more of all, then c is retired; wanted again, it stays out (pairs are positional)
    assert [len(out[x]) for x in (a, b, c)] == [5, 5, 3]
    assert calls.count(c) == 3


def test_interleaved_stops_when_fewer_than_two_are_still_needed():
    a, b = Config(micro_batch_size=8), Config(micro_batch_size=4)
    measure = confirm.interleaved(lambda config: 1.0)
    out = measure([a, b], confirm.Rounds(3, 50, 60.0), lambda figures: frozenset({a}))
    assert len(out[a]) == len(out[b]) == 3


class Sequenced:
    """A per-call measurement double: each config's samples/s come from its own list, in order."""

    def __init__(self, figures):
        self.figures = {c: iter(v) for c, v in figures.items()}

    def __call__(self, config):
        return next(self.figures[config])


def test_a_settled_loser_is_retired_and_the_open_pair_gets_the_rounds(space):
    """Three finalists: a slower exact micro-batch is settled after 7 rounds and measured no more; Adafactor's
    first rounds hold the 10% margin's edge (0.97-1.25), so it and the exact fit go on until the interval
    clears it."""
    four = EXACT.replace(micro_batch_size=4, grad_accum_steps=2)
    results = [fit(EXACT, 100), fit(four, 70), fit(ADAFACTOR, 120)]
    first = [97, 125, 108, 130, 95, 109, 118]
    measure = confirm.interleaved(Sequenced({EXACT: [100] * 99, four: [70] * 99, ADAFACTOR: first + [120] * 92}))
    confirmation = run_confirm(space, results, measure, confirm.Rounds(7, 99, 60.0), 0.10, "live runs",
                               LIVE_WINDOW)
    rounds = {f.config: len(f.rounds) for f in confirmation.finalists}
    assert rounds[four] == 7 and rounds[EXACT] == rounds[ADAFACTOR] > 7
    assert confirmation.winner.config == ADAFACTOR and confirmation.comparisons[-1].decided_by == "cleared"


def test_live_rounds_retire_settled_finalists_from_the_fewest_rounds_whose_range_holds_the_median(space):
    """Live rounds start judging after 4: the range of 4 ratios holds their median with 87.5% (all four on one
    side of it: 2 / 16), as 7 rounds' 2nd lowest to 2nd highest do, where 3 hold it with 75% only. A clearly
    slower micro-batch is retired there; the open pair (0.97-1.25 on a 10% margin) goes on."""
    from autofit.search.decision import CONFIDENCE, fewest_rounds, median_interval

    assert confirm.LIVE_ROUNDS.least == fewest_rounds() == 4
    assert 1 - 2 / 2 ** 4 >= CONFIDENCE > 1 - 2 / 2 ** 3
    assert median_interval([3.0, 1.0, 4.0, 2.0]) == (1.0, 4.0)
    assert median_interval([5.0, 1.0, 7.0, 2.0, 6.0, 3.0, 4.0]) == (2.0, 6.0)  # 87.5% too
    four = EXACT.replace(micro_batch_size=4, grad_accum_steps=2)
    results = [fit(EXACT, 100), fit(four, 70), fit(ADAFACTOR, 120)]
    first = [97, 125, 108, 130, 95, 109, 118]
    measure = confirm.interleaved(Sequenced({EXACT: [100] * 99, four: [70] * 99, ADAFACTOR: first + [120] * 92}))
    confirmation = run_confirm(space, results, measure, confirm.LIVE_ROUNDS, 0.10, "live runs", LIVE_WINDOW)
    rounds = {f.config: len(f.rounds) for f in confirmation.finalists}
    assert rounds[four] == 4 and rounds[EXACT] == rounds[ADAFACTOR] > 4
    assert confirmation.winner.config == ADAFACTOR


def test_on_a_quiet_machine_every_finalist_ends_at_the_first_rounds(space):
    four = EXACT.replace(micro_batch_size=4, grad_accum_steps=2)
    results = [fit(EXACT, 100), fit(four, 90), fit(ADAFACTOR, 125)]
    measure = confirm.interleaved(Sequenced({EXACT: [100] * 99, four: [90] * 99, ADAFACTOR: [125] * 99}))
    confirmation = run_confirm(space, results, measure, confirm.LIVE_ROUNDS, 0.10, "live runs", LIVE_WINDOW)
    assert {len(f.rounds) for f in confirmation.finalists} == {confirm.LIVE_ROUNDS.least}
    assert confirmation.winner.config == ADAFACTOR


def test_a_machine_that_cannot_rank_stops_at_the_cap_and_keeps_the_exact_fit(space):
    noisy = [60, 260, 130, 200, 150] * 20
    measure = confirm.interleaved(Sequenced({EXACT: [100] * 99, ADAFACTOR: noisy}))
    confirmation = run_confirm(space, [fit(EXACT, 100), fit(ADAFACTOR, 140)], measure, confirm.Rounds(7, 40, 60.0),
                               0.10, "live runs")
    assert confirmation.winner.config == EXACT and confirmation.comparisons[0].decided_by == "noise"
    assert len(confirmation.winner.rounds) == 40  # went on to the cap, then "too noisy"


def test_at_one_thread_a_step_counts_its_own_cpu_time_not_the_wait_for_a_core():
    import time

    def waited():  # a step that spends its wall time waiting, as one does while other jobs hold the cores
        time.sleep(0.05)
        return 0.05

    assert confirm.step_seconds(waited, threads=1) < 0.02
    assert confirm.step_seconds(waited, threads=2) == 0.05


def test_rounds_stop_once_what_is_still_open_cannot_change_the_choice(space):
    """Two exact micro-batches whose rounds cannot rank them at 3% (ratios 0.8-1.25), and Adafactor twice as
    fast as either, steadily: whichever of the two holds, Adafactor replaces it, so the first 7 rounds decide."""
    four = EXACT.replace(micro_batch_size=4, grad_accum_steps=2)
    results = [fit(EXACT, 100), fit(four, 100), fit(ADAFACTOR, 200)]
    measure = confirm.interleaved(Sequenced({EXACT: [100] * 99, four: [80, 125, 95, 110, 85, 120, 100] * 14,
                                             ADAFACTOR: [200] * 99}))
    confirmation = run_confirm(space, results, measure, confirm.Rounds(7, 99, 60.0), 0.10, "live runs",
                               LIVE_WINDOW)
    pool = confirmation.finalists
    assert [f.config for f in pool] == [EXACT, four, ADAFACTOR]
    assert {len(f.rounds) for f in pool} == {7}
    assert confirmation.winner.config == ADAFACTOR
    open_pair = confirmation.comparisons[0]
    assert unsettled(open_pair) and (open_pair.challenger, open_pair.holder) == (1, 0)


def test_possible_winners_takes_both_turns_of_an_open_comparison():
    four = EXACT.replace(micro_batch_size=4, grad_accum_steps=2)
    noisy = (80, 125, 95, 110, 85, 120, 100)
    pool = (finalist(EXACT, (100,) * 7), finalist(four, noisy), finalist(ADAFACTOR, (200,) * 7, tier=1))
    assert possible_winners(pool, 0.10) == {2}
    # Adafactor only 10% ahead of the exact fit's steady rounds but behind the noisy one in some: either may hold
    close = (finalist(EXACT, (100,) * 7), finalist(four, (80, 140, 95, 130, 85, 135, 100)),
             finalist(ADAFACTOR, (112,) * 7, tier=1))
    assert len(possible_winners(close, 0.10)) > 1


# -- what it spends ---------------------------------------------------------------------------------------
def test_live_runs_count_each_finalists_warm_up_step_and_its_rounds(space):
    spent = confirm.Spent()
    measure = confirm.live_measure(space.spec, space.strategies, threads=1, spent=spent)
    figures = measure([EXACT, ADAFACTOR], confirm.Rounds(3, 3, 0.0))
    assert all(len(figures[c]) == 3 for c in (EXACT, ADAFACTOR))
    assert spent.steps == 2 * (1 + 3)  # one warm-up step each, then one step per round


def test_whole_probes_count_the_steps_each_probe_took():
    spent = confirm.Spent()
    measure = confirm.probe_measure(lambda config, limit: dataclasses.replace(fit(config, 100), steps=5), spent)
    measure([EXACT, ADAFACTOR], confirm.Rounds(2, 2, 0.0))
    assert spent.steps == 2 * 2 * 5


def test_a_plan_says_the_training_steps_its_search_spent(tmp_path):
    plan = autofit.autofit(make_mlp, make_mlp_batch, loss_fn=mlp_loss, global_batch_size=8, device="cpu",
                           memory_budget="1GiB", strategies=[PrecisionStrategy(), OptimizerStates(), MicroBatch()],
                           warmup_steps=1, timed_steps=1, max_probes=4)
    probed = [p for p in plan.probes if p.source is Source.PROBED]
    assert probed and all(p.steps >= 2 for p in probed)  # warm-up and timed, the first probe settling too
    measured = plan.confirmation.method.value != "none"  # a lone finalist probed here is not re-measured
    assert (plan.confirmation.steps > 0) == measured
    assert plan.steps_spent == sum(p.steps for p in probed) + plan.confirmation.steps
    plan.save(tmp_path / "plan.json")
    assert autofit.Plan.load(tmp_path / "plan.json").steps_spent == plan.steps_spent
