"""A prediction for a CUDA target says where transformers ran a fused kernel's reference PyTorch path
(mamba-ssm, causal-conv1d, flash-linear-attention not installed here), which a GPU machine with the
package replaces: the reference path keeps more activations and issues more kernels."""

import importlib.util

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MambaConfig, MambaForCausalLM

from autofit.pipelines.dry_run import dry_run
from autofit.estimate.simulation.reference_paths import clause, describe, reference_paths, unread
from autofit.strategies import MicroBatch, MixedPrecision

try:
    from transformers.integrations import hub_kernels
except ImportError:  # transformers 4.x has no hub_kernels module
    hub_kernels = None

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is not None,
                                reason="mamba-ssm is installed: transformers runs its fused kernels")
# the fallback wrapper reference_paths reads: 5.17 and later; 4.x and 5.0 load Mamba's kernels without it
WRAPPER = hasattr(hub_kernels, "use_kernel_func_from_hub_with_fallback")

SMALL_MAMBA = MambaConfig(vocab_size=100, hidden_size=32, state_size=4, num_hidden_layers=1, expand=2,
                          architectures=["MambaForCausalLM"])


@pytest.mark.skipif(not WRAPPER, reason="this transformers has no fallback wrapper to read (5.17 and later have)")
def test_the_fallen_back_functions_are_read_from_the_models_code():
    with torch.device("meta"):
        mamba, gpt2 = MambaForCausalLM(SMALL_MAMBA), GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2))
    paths = reference_paths(mamba)
    assert "mamba_inner_fn" in paths["mamba-ssm"] and "causal_conv1d_fn" in paths["causal-conv1d"]
    assert reference_paths(gpt2) == {} and describe({}) == ""


def test_a_cuda_plan_on_the_reference_path_says_so():
    report = dry_run(SMALL_MAMBA, seq_len=16, global_batch_size=2, gpu="a100-40gb",
                     strategies=[MixedPrecision(), MicroBatch()])
    method = report.chosen.estimate.method
    assert "causal-conv1d and mamba-ssm not installed here" in method
    if WRAPPER:
        assert "there the peak is lower and the step faster than predicted" in method
    else:  # an older transformers says it cannot tell which functions fell back, and which release can
        assert "cannot say which functions ran on its reference PyTorch path instead (5.17 and later can)" in method


def test_a_transformers_without_the_wrapper_says_it_cannot_tell_and_only_for_a_model_naming_the_packages():
    with torch.device("meta"):
        mamba, gpt2 = MambaForCausalLM(SMALL_MAMBA), GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2))
    assert unread(gpt2) == ""
    if WRAPPER:
        assert unread(mamba) == "" and clause(mamba) == describe(reference_paths(mamba))
    else:
        assert unread(mamba).startswith("; causal-conv1d and mamba-ssm not installed here and transformers ")
        assert clause(mamba) == unread(mamba)
