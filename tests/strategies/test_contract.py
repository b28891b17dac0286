"""StrategyContract: every strategy, the ones added later included, passes the same tests."""

import pytest
from freeze_embeddings import FreezeEmbeddings
from models import make_gpt2, make_mlp, make_mlp_batch, mlp_loss

from autofit.config import Config
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
        assert 1 <= strategy.rung <= 8

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
