import dataclasses

import torch

from models import make_gpt2, make_mlp, make_mlp_batch, mlp_loss

from autofit.config import Config
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.strategies import FusedAttention, default_strategies


def test_hf_model_gets_sdpa_and_says_why_not_the_others():
    spec = make_spec(make_gpt2, global_batch_size=2, device="cpu", memory_budget="1GiB", seq_len=16)
    options = {o.value: o for o in FusedAttention().options(spec)}
    assert options["sdpa"].available and options["sdpa"].tier == 0
    assert not options["flash_attention_2"].available and "CUDA" in options["flash_attention_2"].reason
    assert not options["eager"].available and "SDPA is supported" in options["eager"].reason
    run = build_run(spec, Config(attention="eager", micro_batch_size=2), default_strategies())
    assert run.model.config._attn_implementation == "eager"


def test_plain_model_keeps_its_attention():
    spec = make_spec(make_mlp, make_mlp_batch, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss)
    [option] = FusedAttention().options(spec)
    assert option.value == "default" and "not a Hugging Face model" in option.reason


def test_a_model_without_attention_layers_has_nothing_to_switch():
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4)
    spec = make_spec(lambda: MambaForCausalLM(config), global_batch_size=2, device="cpu", memory_budget="1GiB",
                     seq_len=8)
    [option] = FusedAttention().options(spec)
    assert option.value == "default" and "has no attention layers" in option.reason


def test_switching_leaves_a_shared_config_alone():
    from transformers import GPT2Config, GPT2LMHeadModel

    shared = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(shared)  # transformers itself records its default implementation on the config
    before = shared._attn_implementation
    spec = make_spec(lambda: GPT2LMHeadModel(shared), global_batch_size=2, device="cpu", memory_budget="1GiB")
    run = build_run(spec, Config(attention="eager", micro_batch_size=2), default_strategies())
    assert run.model.config._attn_implementation == "eager"
    assert all(m.config is run.model.config for m in run.model.modules() if hasattr(m, "config"))
    assert shared._attn_implementation == before
    run.step([spec.batch_factory(2)])


def test_flash_attention_is_not_offered_before_ampere():
    from autofit.devices.gpus import get_gpu
    from autofit.job.target import Target

    spec = make_spec(make_gpt2, device="cpu", seq_len=16)
    for gpu, offered in (("t4", False), ("v100-16gb", False), ("a10g", True)):
        on = dataclasses.replace(spec, target=Target.from_profile(get_gpu(gpu), 1))
        flash = next(o for o in FusedAttention().options(on) if o.value == "flash_attention_2")
        assert flash.available is offered, flash.reason
        assert offered or "Ampere or later" in flash.reason


def test_a_sub_model_without_the_implementation_keeps_its_own():
    """DETR's ResNet backbone has no attention, so no SDPA: switching the model to SDPA raised
    (transformers' `_sdpa_can_dispatch`) in every probe and simulation. It keeps its own, the rest run SDPA,
    and the user's config (a backbone sub-config shared by each build) is left as it was."""
    from transformers import DetrConfig, DetrModel, ResNetConfig

    backbone = ResNetConfig(depths=[1, 1], hidden_sizes=[8, 16], embedding_size=8, out_features=["stage2"])
    shared = DetrConfig(use_timm_backbone=False, backbone_config=backbone, d_model=16, encoder_layers=1,
                        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, num_queries=4,
                        encoder_ffn_dim=32, decoder_ffn_dim=32)
    DetrModel(shared)  # transformers records its default implementations on the configs
    before = (shared._attn_implementation, shared.backbone_config._attn_implementation)
    spec = make_spec(lambda: DetrModel(shared), lambda n: {"pixel_values": torch.zeros(n, 3, 32, 32)},
                     device="cpu", memory_budget="1GiB", loss_fn=lambda output, _batch: output.last_hidden_state.sum())
    run = build_run(spec, Config(attention="sdpa", micro_batch_size=2), default_strategies())
    sub_models = {type(m).__name__: m.config._attn_implementation for m in run.model.modules()
                  if hasattr(m, "_supports_sdpa") and hasattr(m, "config")}
    assert sub_models["DetrModel"] == "sdpa" and sub_models["ResNetBackbone"] == "eager"
    backbone_model = next(m for m in run.model.modules() if type(m).__name__ == "ResNetBackbone")
    assert backbone_model.config is run.model.config.backbone_config  # paired in the private copy too
    assert (shared._attn_implementation, shared.backbone_config._attn_implementation) == before


def test_a_transformers_that_cannot_switch_a_built_model_keeps_what_it_runs_and_says_so_for_another():
    """transformers 4.46 has no set_attn_implementation: a model built with SDPA probes SDPA as it is, and a
    plan asking for eager says, in one line, that this release cannot switch it and how to get it."""
    import pytest
    from transformers import GPT2LMHeadModel

    from autofit.errors import UsageError

    spec = make_spec(make_gpt2, global_batch_size=2, device="cpu", memory_budget="1GiB", seq_len=16)
    run = build_run(spec, Config(attention="sdpa", micro_batch_size=2), default_strategies())
    assert run.model.config._attn_implementation == "sdpa"
    if hasattr(GPT2LMHeadModel, "set_attn_implementation"):
        return  # the switch itself: test_hf_model_gets_sdpa_and_says_why_not_the_others
    with pytest.raises(UsageError, match=r"^The plan runs attn_implementation='eager' but GPT2LMHeadModel was built "
                                         r"with 'sdpa', and transformers \S+ cannot switch a built model "
                                         r"\(set_attn_implementation: 4.57 has it\)"):
        build_run(spec, Config(attention="eager", micro_batch_size=2), default_strategies())
