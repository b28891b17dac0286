"""LoRA adapters through peft, on a fp32 base on the CPU: options, apply, bad targets, and a search."""

import pytest
import torch
from torch import nn

import autofit
from autofit.config import Config
from autofit.errors import UsageError
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.strategies import Lora, MicroBatch, default_strategies
from autofit.strategies.lora import linear_layer_names

WIDTH = 256


class Mlp(nn.Module):
    """Four square linear layers (~263k parameters, ~1 MiB in fp32) returning a scalar loss."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.pow(2).mean()


class NoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return (x * self.scale).pow(2).mean()


def make_batch(n):
    return torch.randn(n, WIDTH)


def small_batch(n):
    return torch.randn(n, 8)


def _spec(model=Mlp, batch=make_batch, **kwargs):
    return make_spec(model, batch, device="cpu", **kwargs)


def test_options_offer_rank_as_tier_2():
    options = Lora(ranks=(8, 4)).options(_spec())
    assert [o.value for o in options] == [0, 8, 4]
    assert [o.tier for o in options] == [0, 2, 2]
    assert all(o.available for o in options)
    assert "4 linear layers" in options[1].reason


def test_no_linear_layers_is_unavailable_with_reason():
    options = Lora().options(_spec(NoLinear, small_batch))
    assert not options[1].available
    assert "no linear layers" in options[1].reason


def test_apply_trains_only_adapters():
    spec = _spec()
    run = build_run(spec, Config(lora=4, micro_batch_size=2), [MicroBatch(), Lora(ranks=(4,))])
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    optimized = sum(p.numel() for group in run.optimizer.param_groups for p in group["params"])
    assert optimized == 4 * 2 * 4 * WIDTH  # four layers, A (4 x 256) and B (256 x 4)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    run.step([make_batch(2)])
    changed = {n for n, p in run.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable


def test_target_modules_subset():
    spec = _spec()
    run = build_run(spec, Config(lora=2), [MicroBatch(), Lora(ranks=(2,), target_modules=["blocks.0", "blocks.3"])])
    adapted = {n.split(".lora_")[0] for n, p in run.model.named_parameters() if p.requires_grad}
    assert adapted == {"base_model.model.blocks.0", "base_model.model.blocks.3"}


def test_target_modules_matching_nothing_names_them_and_the_layers():
    with pytest.raises(UsageError) as info:
        Lora(target_modules=["q_proj", "blocks.1"]).options(_spec())
    message = str(info.value)
    assert "['q_proj']" in message and "'0'" in message  # the bad name, and the model's layer names


def test_a_target_typed_in_a_hurry_is_answered_with_the_layer_it_is_close_to():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=128)
    with pytest.raises(UsageError, match=r"\['q_prj'\] match no linear layer of the model \(did you mean 'q_proj'.*no --lora-targets"):
        Lora(target_modules=["q_prj", "v_proj"]).targets(LlamaForCausalLM(config))


def test_bad_rank_is_a_usage_error():
    with pytest.raises(UsageError, match="-1"):
        Lora(ranks=(-1,))


def test_output_head_is_left_out_of_hugging_face_models():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    targets = Lora().targets(model)
    assert "lm_head" in linear_layer_names(model)
    assert "transformer.h.0.attn.c_attn" in targets  # GPT-2's Conv1D linears are adapted
    assert "lm_head" not in targets


def test_saves_at_least():
    lora = Lora()
    r4, r8, full = Config(lora=4), Config(lora=8), Config()
    assert lora.saves_at_least(r4, full) and lora.saves_at_least(r4, r8) and not lora.saves_at_least(full, r4)


def test_default_strategies_put_quantization_before_lora():
    names = [type(s).__name__ for s in default_strategies()]
    assert names.index("QuantizedBase") < names.index("Lora")


# Full fine-tuning of Mlp needs weights + grads + AdamW states = 16 bytes x 263k params = 4 MiB;
# LoRA needs the frozen weights (1 MiB) and tiny adapters. 3 MiB only LoRA can meet.
BUDGET = 3 * 2**20


def test_search_picks_lora_when_allowed(tmp_path):
    lora = Lora(ranks=(4,), target_modules=["blocks.0", "blocks.1"], alpha=8, dropout=0.05)
    plan = autofit.autofit(Mlp, make_batch, device="cpu", memory_budget=BUDGET, global_batch_size=4,
                           allow={"lora"}, strategies=[MicroBatch(), lora], warmup_steps=1, timed_steps=1)
    assert plan.fits, plan.reason
    assert plan.config.lora == 4
    full = [p for p in plan.probes if p.config.lora == 0]
    assert full and not any(p.fits for p in full)  # full fine-tuning ran out (or was predicted to)
    recorded = {"target_modules": ["blocks.0", "blocks.1"], "alpha": 8, "dropout": 0.05}
    assert plan.settings["lora"] == recorded  # the adapters the probes trained, for exports and prepare
    assert autofit.Plan.load(plan.save(tmp_path / "plan.json")).settings == plan.settings
    prepared = autofit.prepare(plan, Mlp())  # no strategies given: the recorded adapters
    adapted = {name.split(".lora_")[0] for name, p in prepared.model.named_parameters() if p.requires_grad}
    assert adapted == {"base_model.model.blocks.0", "base_model.model.blocks.1"}


def test_search_without_allow_hints_at_lora():
    plan = autofit.autofit(Mlp, make_batch, device="cpu", memory_budget=BUDGET, global_batch_size=4,
                           strategies=[MicroBatch(), Lora(ranks=(4,))], warmup_steps=1, timed_steps=1)
    assert not plan.fits
    assert "allow={'lora'}" in plan.reason


def peft_llama():
    """A transformers Llama with the user's own peft adapters (r=8 on q and v): only they train."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=256)
    return peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))


def test_a_model_with_its_own_adapters_gets_no_lora_or_quantization_over_them():
    import dataclasses

    from autofit.devices.gpus import get_gpu
    from autofit.job.target import Target
    from autofit.strategies import QuantizedBase

    spec = make_spec(peft_llama, device="cpu", seq_len=32)  # a peft model is a Hugging Face one: batch synthesized
    assert spec.model.is_hf and spec.model.trains_part
    options = Lora(ranks=(16,)).options(spec)
    assert [o.value for o in options] == [0, 16] and options[0].available and not options[1].available
    assert f"already trains {spec.model.trained()}" in options[1].reason and "(its own adapters" in options[1].reason
    on_a_gpu = dataclasses.replace(spec, target=Target.from_profile(get_gpu("a100-80gb"), 1))
    nf4 = QuantizedBase().options(on_a_gpu)[-1]
    assert not nf4.available and "load the base quantized yourself" in nf4.reason


def test_a_dry_run_of_a_peft_model_plans_its_own_adapters():
    from autofit.strategies import MixedPrecision, QuantizedBase

    report = autofit.dry_run(peft_llama, seq_len=64, global_batch_size=4, gpu="a100-80gb", allow={"lora"},
                             strategies=[MicroBatch(), MixedPrecision(), QuantizedBase(), Lora(ranks=(16,))])
    assert report.fits and report.candidates
    assert all(not c.config.lora and c.config.quantization.value == "none" for c in report.candidates)
    trainable = sum(p.numel() for p in peft_llama().parameters() if p.requires_grad)
    fp32 = next(c for c in report.candidates if c.config.precision.value == "fp32")
    assert fp32.estimate.breakdown.grads == 4 * trainable  # the adapters' gradients only


def test_adapting_other_modules_keeps_ranks_alpha_and_dropout():
    lora = Lora(ranks=(8, 4), alpha=16, dropout=0.1).adapting(("blocks.0",))
    assert (lora.ranks, lora.target_modules, lora.alpha, lora.dropout) == ((8, 4), ("blocks.0",), 16, 0.1)
    micro = MicroBatch()
    assert micro.adapting(("blocks.0",)) is micro  # a strategy that adapts no modules is itself


def test_dry_run_adapts_the_lora_targets_it_is_given():
    kwargs = dict(global_batch_size=4, gpu="a100-40gb", allow={"lora"}, strategies=[MicroBatch(), Lora(ranks=(4,))])
    every = autofit.dry_run(Mlp, make_batch, **kwargs)
    two = autofit.dry_run(Mlp, make_batch, lora_targets=("blocks.0", "blocks.1"), **kwargs)
    every_states, two_states = ([c.estimate.breakdown.optimizer for c in report.candidates if c.config.lora == 4]
                                for report in (every, two))
    assert every_states and two_states and max(two_states) < min(every_states)  # adapters on 2 of 4 layers
