"""The space: one code for the tuner and the dry-run, the rules between knobs applied once, every
exclusion recorded once with its reason and never probed."""

import itertools

import pytest
from models import make_mlp, make_mlp_batch, mlp_loss

import autofit
from autofit.config import Config
from autofit.devices.gpus import get_gpu
from autofit.probe.outcome import Skip
from autofit.pipelines.levels import _reliefs
from autofit.search.rules import rules, violation
from autofit.search.space import build_space
from autofit.job.target import Target
from autofit.job.train_spec import make_spec
from autofit.strategies import default_strategies


def two_block_gpt2():
    """make_gpt2 with two blocks: the levels do not depend on depth, and a dry-run of a model this shallow
    simulates each step as it is, its allocator replayed at two blocks (the dry-run test took 70 s with four
    blocks while a deep model was simulated at one block and at two)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def level_of(config):
    return config.replace(micro_batch_size=1, grad_accum_steps=1)


@pytest.fixture(scope="module")
def gpu_space():
    target = Target.from_profile(get_gpu("a100-80gb"), 2)
    spec = make_spec(two_block_gpt2, global_batch_size=4, device="cpu", memory_budget=target.memory_bytes,
                     num_gpus=2, seq_len=16, allow={"lora"}, target=target)
    return build_space(spec, default_strategies())


def test_the_dry_run_plans_the_levels_the_tuner_walks(gpu_space):
    # one sample per rank: every level at one micro-batch (at global batch 4, each at two: twice the simulated
    # steps); the levels are the same at any batch (only `Space.sizes` differs), so the fixture's are walked
    report = autofit.dry_run(two_block_gpt2, seq_len=16, global_batch_size=2, gpu="a100-80gb", num_gpus=2,
                             allow={"lora"})
    planned = {level_of(c.config): c for c in report.candidates}
    walked = {level_of(c) for c in gpu_space.levels()}
    assert set(planned) <= walked
    # left out only: a level whose knobs just relieve memory (checkpointing, offloading, a chunked loss,
    # expandable segments) where the level they relieve fits at its largest micro-batch (`Strategy.relieves`:
    # that one is as fast or faster there), as most do at this size
    left_out = walked - set(planned)
    assert len(left_out) > len(walked) // 2
    for level in left_out:
        relieved = [planned[r] for r, _ in _reliefs(level, default_strategies(), walked) if r in planned]
        # the largest micro-batch is one per rank
        assert any(r.fits and r.config.micro_batch_size == 1 for r in relieved), level.describe()


def test_no_level_breaks_a_rule(gpu_space):
    assert gpu_space.levels()
    assert all(violation(level, gpu_space.spec.target) is None for level in gpu_space.levels())


def test_each_rule_excludes_its_combinations_once_with_its_reason(gpu_space):
    ruled = [e for e in gpu_space.excluded if e.rule is not None]
    for rule in rules():
        mine = [e for e in ruled if e.rule == rule.name]
        keys = [tuple(e.config.knob(k) for k in rule.knobs) for e in mine]
        assert len(keys) == len(set(keys)), rule.name  # once per distinct value of the knobs it reads
        assert all(rule.check(e.config, gpu_space.spec.target) in e.reason for e in mine)
    # on 2 GPUs with everything installed, these rules have something to exclude
    for name in ("offload needs an engine", "quantization needs LoRA", "ZeRO-Offload steps with CPU Adam",
                 "flash-attention needs half precision", "quantized weights are not sharded"):
        assert any(e.rule == name for e in ruled), name


def test_every_combination_a_rule_forbids_is_left_out(gpu_space):
    kept = set(gpu_space.levels())
    fields = list(gpu_space.choices)
    for idx in itertools.islice(itertools.product(*(gpu_space.choices[f] for f in fields)), 5000):
        knobs = {}
        for field, option in zip(fields, idx):
            knobs.update(option.knobs(field))
        level = Config(num_gpus=2).replace(**knobs)
        assert (level in kept) is (violation(level, gpu_space.spec.target) is None)


def test_exclusions_are_in_the_plan_and_never_probed():
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="64MiB",
                           loss_fn=mlp_loss, warmup_steps=1, timed_steps=1, max_probes=4)
    excluded = [p for p in plan.probes if p.skip is Skip.EXCLUDED]
    assert excluded and all(p.reason for p in excluded)
    assert any("bitsandbytes" in p.reason for p in excluded)
    measured = {level_of(p.config) for p in plan.probes if p.measured}
    assert not measured & {level_of(p.config) for p in excluded}
    assert len({(p.config, p.reason) for p in excluded}) == len(excluded)  # each recorded once


def test_a_knob_with_nothing_usable_is_a_usage_error():
    spec = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss, optimizer="adamw")

    class Nothing(autofit.strategies.OptimizerStates):
        def options(self, spec):
            return [autofit.strategies.Option(o.value, o.tier, "not here", available=False)
                    for o in super().options(spec)]

    with pytest.raises(autofit.UsageError, match="No usable optimizer: not here"):
        build_space(spec, [Nothing()])


@pytest.mark.parametrize("optimizer, knob", [("adafactor", "adafactor"), ("adamw", "adamw"),
                                             (lambda ps: __import__("torch").optim.SGD(ps, lr=0.1), "user")])
def test_strategies_that_leave_the_optimizer_rung_out_still_train_the_optimizer_given(optimizer, knob):
    """`strategies=["micro_batch", "checkpointing"]` searches neither 8-bit states nor Adafactor, but the
    job is the user's: every candidate keeps the optimizer given (it had been the Config's default AdamW,
    Adafactor and SGD alike, and the plan recorded no optimizer)."""
    spec = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss, optimizer=optimizer)
    space = build_space(spec, autofit.strategies.resolve_strategies(["micro_batch", "checkpointing"]))
    assert {level.optimizer.value for level in space.levels()} == {knob}
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                           loss_fn=mlp_loss, optimizer=optimizer, strategies=["micro_batch"], max_probes=1)
    assert plan.config.optimizer.value == knob and plan.settings["optimizer"]["class"]
