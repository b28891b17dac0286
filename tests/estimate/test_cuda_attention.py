"""Attention simulated on CPU kernels as CUDA runs it (autofit/estimate/cuda/attention.py): the backend
CUDA's rules pick, and the scores the math backend keeps, which the CPU's fused kernel does not."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autofit.config import Config
from autofit.estimate.cuda.attention import backend
from autofit.estimate.simulation.step import simulate_step

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def qkv(heads=8, kv_heads=8, dim=64, seq=16):
    return torch.empty(1, heads, seq, dim), torch.empty(1, kv_heads, seq, dim), torch.empty(1, kv_heads, seq, dim)


@pytest.mark.parametrize("dtype, shapes, mask, gqa, ampere, expected", [
    (BF16, {}, None, False, True, "flash"),
    (BF16, {"kv_heads": 2}, None, True, True, "flash"),  # grouped heads: flash takes them with enable_gqa
    (F32, {"kv_heads": 2}, None, True, True, "math"),  # fp32: no flash; grouped: no memory-efficient
    (F32, {}, None, False, True, "efficient"),
    (BF16, {}, torch.empty(16, 16), False, True, "efficient"),  # a mask: no flash
    (BF16, {"kv_heads": 2}, torch.empty(16, 16), True, True, "math"),
    (BF16, {"dim": 320}, None, False, True, "efficient"),  # heads over 256: no flash
    (F16, {"kv_heads": 2}, None, True, False, "math"),  # a T4 or V100: no flash at all
    (F16, {}, None, False, False, "efficient"),
    (BF16, {}, None, False, False, "math"),  # bf16 before Ampere: neither fused kernel
    (F32, {"dim": 66}, None, False, True, "math"),  # fp32 head size not a multiple of 4
])
def test_the_backend_cuda_picks(dtype, shapes, mask, gqa, ampere, expected):
    assert backend(dtype, *qkv(**shapes), mask, gqa, ampere) == expected


def test_inputs_that_are_not_4d_run_on_the_math_backend():
    q = k = v = torch.empty(8, 16, 64)
    assert backend(BF16, q, k, v, None, False, True) == "math"


def grouped_llama():
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def peak(config, seq=256, **kwargs):
    ids = torch.zeros(2, seq, dtype=torch.long)
    return simulate_step(grouped_llama(), {"input_ids": ids, "labels": ids}, lambda out, batch: out.loss, config,
                         device="cpu", **kwargs).peak


def test_fp32_grouped_attention_keeps_the_scores_cuda_keeps_and_bf16_does_not():
    torch.set_num_threads(1)
    fp32, bf16 = Config(attention="sdpa"), Config(attention="sdpa", precision="bf16")
    scores = 2 * 8 * 256 * 256 * 4  # the softmax of one layer: batch x heads x seq x seq, fp32
    assert peak(fp32, cuda_ampere=True) - peak(fp32) >= 2 * scores  # both layers keep theirs
    assert peak(bf16, cuda_ampere=True) == peak(bf16)  # flash on CUDA: what the CPU kernel keeps
    assert peak(Config(attention="sdpa", precision="fp16"), cuda_ampere=False) - peak(bf16) >= scores  # a T4


def test_flash_attention_is_simulated_for_a_model_that_refuses_sdpa(tmp_path):
    # Gemma-2 soft-caps its attention scores, which flash-attention's kernels do and SDPA does not
    # (`_supports_sdpa = False`): its flash rows failed to simulate as SDPA and rested on the formula.
    from transformers import Gemma2Config

    from autofit.pipelines.dry_run import dry_run
    from autofit.strategies import FusedAttention, MicroBatch, MixedPrecision

    config = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          architectures=["Gemma2ForCausalLM"], pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)
    path = tmp_path / "gemma2" / "config.json"
    path.parent.mkdir()
    config.to_json_file(path)
    report = dry_run(str(path), seq_len=64, global_batch_size=2, gpu="rtx-4090",
                     strategies=[MixedPrecision(), FusedAttention(), MicroBatch()])
    by_attention = {c.config.attention.value: c for c in report.candidates
                    if c.config.micro_batch_size == 2 and c.config.precision.value == "bf16"}
    assert set(by_attention) == {"eager", "flash_attention_2"}
    assert all(c.estimate.simulated for c in report.candidates), [c.reason for c in report.candidates]
    flash, eager = by_attention["flash_attention_2"], by_attention["eager"]
    assert flash.estimate.breakdown.activations < eager.estimate.breakdown.activations  # no scores kept
