"""StrategyContract: every strategy, the ones added later included, passes the same tests."""

import json

import pytest
import torch
from freeze_embeddings import FreezeEmbeddings
from models import make_gpt2, make_mlp, make_mlp_batch, mlp_loss

from autofit.config import Config
from autofit.errors import UsageError
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.strategies import Option, Placement, default_strategies

STRATEGIES = [*default_strategies(), FreezeEmbeddings()]  # a plug-in technique passes the same contract
IDS = [s.field for s in STRATEGIES]


@pytest.fixture(scope="module", params=["mlp", "gpt2"])
def spec(request):
    if request.param == "mlp":
        return make_spec(make_mlp, make_mlp_batch, global_batch_size=4, device="cpu", memory_budget="1GiB",
                         loss_fn=mlp_loss)
    return make_spec(make_gpt2, global_batch_size=4, device="cpu", memory_budget="1GiB", seq_len=16)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=IDS)
class TestStrategyContract:
    def test_declares_a_config_field_and_a_rung(self, strategy):
        assert strategy.field in Config.__dataclass_fields__ or strategy.knob_type is not None
        assert 0 <= strategy.rung <= 8  # 0: the allocator, before the decision tree's first rung

    def test_options_carry_tier_and_reason(self, strategy, spec):
        options = strategy.options(spec)
        assert options and all(isinstance(o, Option) for o in options)
        for option in options:
            assert option.tier in (0, 1, 2)
            assert isinstance(option.reason, str) and option.reason.strip()
        assert any(o.available for o in options), "the no-op value must always be available"

    def test_cheapest_option_first(self, strategy, spec):
        options = strategy.options(spec)
        assert options[0].tier == min(o.tier for o in options)

    def test_option_values_are_the_knobs_type(self, strategy, spec):
        for option in strategy.options(spec):
            config = Config().replace(**option.knobs(strategy.field))  # validated: a bad value raises
            assert config.knob(strategy.field) == option.value

    def test_saves_at_least_is_reflexive_and_placement_is_declared(self, strategy, spec):
        for option in strategy.options(spec):
            config = Config().replace(**option.knobs(strategy.field))
            assert strategy.saves_at_least(config, config)
            assert isinstance(strategy.placement(config), Placement)

    def test_every_available_option_trains_a_step(self, strategy, spec):
        for option in strategy.options(spec):
            config = Config(micro_batch_size=4).replace(**option.knobs(strategy.field))
            if not option.available or strategy.placement(config) is not Placement.IN_PROCESS:
                continue
            if strategy.field == "micro_batch_size":
                config = config.replace(grad_accum_steps=4 // option.value)
            run = build_run(spec, config, STRATEGIES)
            loss = run.step([spec.batch_factory(config.micro_batch_size)] * config.grad_accum_steps)
            assert loss.isfinite(), (strategy.field, option.value)


# -- the hooks every consumer loops over (probe, simulation, prepare, guard, exports) -------------------------
@pytest.fixture(scope="module", params=["mlp", "gpt2"])
def planned(request):
    """A dry-run's spec: two GPUs of a profile, where every option (bf16, ZeRO, FSDP2, 4-bit ...) is planned."""
    from autofit.devices.gpus import get_gpu
    from autofit.job.target import Target

    target = Target.from_profile(get_gpu("a100-80gb"), 2)
    if request.param == "mlp":
        return make_spec(make_mlp, make_mlp_batch, global_batch_size=4, device="cpu", memory_budget="1GiB",
                         loss_fn=mlp_loss, num_gpus=2, target=target)
    return make_spec(make_gpt2, global_batch_size=4, device="cpu", memory_budget="1GiB", seq_len=16, num_gpus=2,
                     target=target)


def planned_configs(strategy, spec):
    """A config per available option of `strategy` for `spec`."""
    return [(o.value, Config(micro_batch_size=2, num_gpus=spec.num_gpus).replace(**o.knobs(strategy.field)))
            for o in strategy.options(spec) if o.available]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=IDS)
class TestHookContract:
    def test_its_apply_shapes_a_simulated_step(self, strategy, planned):
        """`apply` on a `SimulatedRun` (a meta model, made of fake tensors afterwards) leaves a step the
        estimator can run, and `simulated_as` names what it depends on in hashable values (a step is simulated
        once per distinct set of them, as the estimator does)."""
        from autofit.estimate.simulation.adapters import block_linears, within_block
        from autofit.estimate.simulation.step import simulate_step
        from autofit.models.info import meta_model
        from autofit.strategies.run import SimulatedRun

        simulated = set()
        for value, config in planned_configs(strategy, planned):
            facts = strategy.simulated_as(config, {})
            key = tuple(sorted(facts.items()))
            assert isinstance(facts, dict) and hash(key) is not None, (value, facts)
            meta = meta_model(planned.model_factory)
            adapted = frozenset(within_block(name) for name in block_linears(meta))
            strategy.apply(SimulatedRun(config=config, model=meta_model(planned.model_factory), adapted=adapted))
            if key in simulated:
                continue
            simulated.add(key)
            peak = simulate_step(meta, planned.batch_factory(2), planned.loss_fn, config, device="cpu",
                                 adapted=adapted, strategies=[strategy])
            assert peak.forward > 0 and peak.kernels > 0, value

    def test_a_live_model_takes_its_value_or_the_reason_names_the_fix(self, strategy, spec):
        """The OOM guard's live run (`TrainRun.live`), for the values this machine runs: applied in place, or a
        `UsageError` saying what to do."""
        from autofit.prepare import apply_in_place

        for value, config in planned_configs(strategy, spec):
            model = spec.model_factory()
            try:
                run = apply_in_place(config, model, torch.optim.AdamW(model.parameters()))
            except UsageError as exc:
                assert len(str(exc)) > 40 and ("autofit" in str(exc) or "tune" in str(exc)), (value, str(exc))
            else:
                assert run.live and run.model is model, value

    def test_its_launcher_keys_lines_and_refusals_are_data(self, strategy, planned):
        """Keys JSON can hold, lines that compile as Python, and refusals that name a format that can."""
        from autofit.export import FORMATS

        for value, config in planned_configs(strategy, planned):
            recorded = strategy.recorded(strategy.settings(config, planned), planned.summary())
            assert type(recorded) is type(strategy) and recorded.field == strategy.field
            for fmt in FORMATS:
                keys = recorded.launcher_keys(config, fmt)
                assert all(isinstance(k, str) for k in keys) and json.loads(json.dumps(keys)) == keys, (value, fmt)
                lines = recorded.setup_lines(config, fmt)
                assert all(isinstance(line, str) for line in lines), (value, fmt)
                compile("\n".join(lines), f"<{strategy.field}={value} in {fmt}>", "exec")
                why = recorded.refuses(config, fmt)
                assert why is None or any(other in why for other in FORMATS if other != fmt), (value, fmt, why)

    def test_its_default_value_writes_nothing_a_format_refuses(self, strategy, planned):
        config = Config(micro_batch_size=2, num_gpus=2)
        from autofit.export import FORMATS

        assert all(strategy.refuses(config, fmt) is None for fmt in FORMATS)
        assert all(not strategy.setup_lines(config, fmt) for fmt in FORMATS)
