"""The estimator's central files name no technique: each technique's step-time term, engine memory and
error class is its strategy's hook (`autofit.strategies.base`), which the cost model, `engines.py`,
`facts.py`, `tolerance.py` and the allocator replay combine over the strategies. A plug-in technique that
implements those hooks changes the dry-run's figures with no other edit; the built-ins' hooks give the terms
the estimator used to compute by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autofit import config as config_module
from autofit.config import Config, Knob
from autofit.devices.gpus import get_gpu
from autofit.estimate import cost_model
from autofit.estimate.cuda.training_replay import replays_training
from autofit.estimate.engines import engine_memory
from autofit.estimate.facts import ModelFacts, formula_activations
from autofit.estimate.tolerance import ENGINE_TOLERANCE, PREDICTION_TOLERANCE, bound_for, tolerance_for, Family
from autofit.job.train_spec import make_spec
from autofit.models.presets import get_preset
from autofit.strategies import completed
from autofit.strategies import base
from autofit.strategies.base import Option, Strategy
from autofit.strategies.chunked_loss import ChunkedLoss
from autofit.strategies.costs import Links, StepFacts
from autofit.strategies.lora import Lora
from autofit.strategies.memory import EngineFacts, EngineMemory
from autofit.strategies.quantization import QuantizedBase
from autofit.strategies.zero import Zero, zero_memory


class Warp(Knob):
    """A plug-in's knob: off (the no-op) or on."""

    OFF = "off"
    ON = "on"


EXTRA_FLOPS, SLOWDOWN, OFFLOAD_S, MICRO_OPS, STEP_OPS, HELD = 1e9, 3.0, 0.125, 7, 11, 12345


@pytest.fixture(scope="module", autouse=True)
def warping():
    """A plug-in technique registered for this module's tests only (defining it registers its knob and the
    strategy; both are taken back afterwards, so no other test's search sees it)."""

    class Warping(Strategy):
        """A technique of one's own that costs step time every way the cost model counts, and memory."""

        field = "warp"
        rung = 8
        knob_type = Warp

        def options(self, spec):
            return [Option(Warp.OFF, 0, "off"), Option(Warp.ON, 0, "on")]

        def apply(self, run) -> None:
            pass

        def on(self, config: Config) -> bool:
            return self.value(config) is Warp.ON

        def extra_flops(self, config, step):
            return EXTRA_FLOPS if self.on(config) else 0.0

        def compute_slowdown(self, config):
            return SLOWDOWN if self.on(config) else 1.0

        def offload_seconds(self, config, step):
            return OFFLOAD_S if self.on(config) else 0.0

        def host_ops(self, config, step):
            return MICRO_OPS if self.on(config) else 0

        def step_ops(self, config, step):
            return STEP_OPS if self.on(config) else 0

        def runs_engine(self, config):
            return self.on(config)

        def replays_training(self, config):
            return not self.on(config)

        def engine_memory(self, config, engine):
            return EngineMemory(held=HELD, terms=(("warp_buffer", HELD),)) if self.on(config) else None

    yield Warping
    base._PLUGINS.remove(Warping)
    config_module._EXTENSIONS.pop("warp")


FACTS = ModelFacts(num_params=10_000_000, trainable_params=10_000_000, trainable_tensors=20, num_blocks=4,
                   linear_params=8_000_000, lora_params_per_rank=40_000, adapted_layers=16)


@pytest.fixture(scope="module")
def spec():
    return make_spec(get_preset("gpt2"), global_batch_size=8, device="cpu", memory_budget="24GiB", seq_len=128)


def test_a_plug_ins_step_time_hooks_enter_every_part_of_the_cost(spec):
    gpu = get_gpu("a100-40gb")
    off, on = Config(micro_batch_size=4, grad_accum_steps=2), Config(micro_batch_size=4, grad_accum_steps=2).replace(warp="on")
    plain, warped = (cost_model.step_cost(spec, c, gpu, FACTS, kernels=100) for c in (off, on))
    assert warped.offload == pytest.approx(plain.offload + OFFLOAD_S)
    assert warped.compute > SLOWDOWN * 0.99 * plain.compute  # slower arithmetic, and more of it
    extra_host = (2 * MICRO_OPS + STEP_OPS) * cost_model.SECONDS_PER_KERNEL  # every micro-step's, then the step's
    assert warped.host == pytest.approx(plain.host + extra_host)
    assert cost_model.engine_host_ops(on, FACTS) == cost_model.engine_host_ops(off, FACTS) + MICRO_OPS
    assert cost_model.optimizer_host_ops(on, FACTS) == cost_model.optimizer_host_ops(off, FACTS) + STEP_OPS


def test_a_plug_ins_engine_is_trusted_held_and_replayed_as_an_engine():
    on = Config().replace(warp="on")
    assert tolerance_for(torch.device("cuda"), on) == ENGINE_TOLERANCE["cuda"]
    assert tolerance_for(torch.device("cuda"), Config()) == PREDICTION_TOLERANCE["cuda"]
    assert bound_for(Family("decoder", "fused", True), on).key == "engine"
    assert not replays_training(on) and replays_training(Config())
    assert engine_memory(FACTS, on, {}).held == HELD
    assert engine_memory(FACTS, Config(), {}) == EngineMemory()


def test_the_built_ins_supply_the_terms_the_estimator_used_to_name(spec):
    step = cost_model.step_facts(spec, Config(), get_gpu("a100-40gb"), FACTS)
    hf = spec.model.hf_config
    assert ChunkedLoss().extra_flops(Config(loss="chunked"), step) == 2 * hf.vocab_size * hf.hidden_size * 128
    assert ChunkedLoss().extra_flops(Config(), step) == 0
    assert QuantizedBase().compute_slowdown(Config(quantization="nf4", lora=16)) == 1.25
    assert QuantizedBase().compute_slowdown(Config()) == 1.0
    # QLoRA without a rank trains the usual rank's adapters, two tensors a layer; the base is frozen
    assert Lora().trains(Config(quantization="nf4"), FACTS) == (16 * 40_000, 32)
    assert Lora().trains(Config(), FACTS) is None
    for config in (Config(optimizer="adamw8bit"), Config(sharding="zero2", num_gpus=2), Config(offload="cpu"),
                   Config(optimizer_step="in_backward")):
        assert not replays_training(config), config.describe()
    assert replays_training(Config(precision="bf16", checkpointing="full"))
    # the compute dtype is the strategies' (pure bf16 too), else the model's own
    for precision, dtype in (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("pure_bf16", "bf16")):
        assert cost_model.computes_in(spec, Config(precision=precision), completed()) == dtype


def test_zero_s_engine_memory_is_its_strategy_s():
    config = Config(sharding="zero2", num_gpus=2, grad_accum_steps=2, precision="bf16")
    found = engine_memory(FACTS, config, {})
    assert found.note.startswith("ZeRO-2") and dict(found.terms)["zero2_accumulated_grads"] > 0
    engine = EngineFacts(facts=FACTS, summary={}, state_grads=0)
    assert Zero().engine_memory(Config(), engine) is None  # plain torch: not ZeRO's to say
    assert zero_memory(Config(sharding="zero3", num_gpus=2), engine, {}).grads_held


def test_the_activation_formula_reads_the_strategies_hooks():
    hf = get_preset("gpt2")
    facts = dataclasses.replace(FACTS, num_blocks=12)
    base = formula_activations(hf, facts, 256, 1, Config())
    assert formula_activations(hf, facts, 256, 1, Config(attention="sdpa")) < base  # no attention matrix
    assert formula_activations(hf, facts, 256, 1, Config(checkpointing="full")) < base  # block inputs only
    half = formula_activations(hf, facts, 256, 1, Config(precision="bf16"))
    sharded = formula_activations(hf, facts, 256, 1, Config(precision="bf16", sharding="zero2", num_gpus=2))
    assert sharded == half - 2 * facts.linear_params  # an engine's 16-bit weights: no autocast copies


def test_collectives_of_no_engine_are_data_parallel_all_reduce():
    links = Links(100e9, None)
    assert cost_model.collective_seconds(Config(num_gpus=4), links, 1e9, 2e9) == (2 * 0.75 * 1e9 / 100e9, 0.0)
    assert cost_model.collective_seconds(Config(), links, 1e9, 2e9) == (0, 0)
    step = StepFacts(facts=FACTS, links=links, pcie=1.0, half=2, trained=1, tensors=1, grad_bytes=1e9,
                     weight_bytes=2e9)
    # ZeRO-3 gathers the weights twice in every micro-step beside the gradients' reduce
    within, _ = Zero().collective_seconds(Config(sharding="zero3", num_gpus=4, grad_accum_steps=2), step)
    assert within == pytest.approx(2 * 0.75 * 1e9 / 100e9 + 4 * 0.75 * 2e9 / 100e9)


def test_completed_makes_each_strategy_once_and_sees_a_plug_in_defined_later(warping):
    """`completed()` shares one instance of each strategy between calls (the dry-run asks it for every
    configuration), and a plug-in defined after a call is among the next call's, once."""
    first, again = completed(), completed()
    assert [id(s) for s in first] == [id(s) for s in again]
    assert [type(s) for s in first].count(warping) == 1

    class Later(Strategy):
        field, rung, knob_type = "later", 9, Knob("Later", {"OFF": "off", "ON": "on"})

        def options(self, spec):
            return [Option("off", 0, "off")]

        def apply(self, run, config):
            pass

    try:
        assert [type(s) for s in completed()].count(Later) == 1
    finally:
        base._PLUGINS.remove(Later)
        config_module._EXTENSIONS.pop("later")
    assert Later not in [type(s) for s in completed()]
