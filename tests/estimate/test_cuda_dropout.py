"""Dropout simulated on CPU kernels as CUDA runs it (autofit/estimate/cuda/dropout.py, and attention
dropout in autofit/estimate/cuda/attention.py): a bool mask where the CPU keeps its noise in the
input's dtype, and no mask at all inside CUDA's fused attention."""

import torch
import torch.nn.functional as F
from torch import nn

from autofit.config import Config
from autofit.estimate.cuda import dropout as cuda_dropout
from autofit.estimate.simulation.step import simulate_step

TOKENS, WIDTH = 64, 256


class Dropped(nn.Module):
    """A linear layer whose input is dropped out: what the layer keeps for backward is the dropout's output."""

    def __init__(self, p: float = 0.1, inplace: bool = False):
        super().__init__()
        self.p, self.inplace = p, inplace
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.linear(F.dropout(self.linear(x), self.p, self.training, self.inplace))


def forward_peak(model: nn.Module, cuda_ampere: bool | None, precision: str = "fp32") -> int:
    with torch.device("meta"):
        model = model()
    batch = torch.zeros(2, TOKENS, WIDTH)
    return simulate_step(model, batch, lambda out, _batch: out.sum(), Config(precision=precision), device="cpu",
                         cuda_ampere=cuda_ampere).forward


def test_a_cuda_dropout_keeps_a_bool_mask_where_the_cpu_keeps_its_noise_in_the_input_dtype():
    elements = 2 * TOKENS * WIDTH
    on_cpu, on_cuda = forward_peak(Dropped, None), forward_peak(Dropped, True)
    assert on_cpu - on_cuda == elements * (4 - 1)  # fp32 noise -> bool mask
    no_dropout = forward_peak(lambda: Dropped(p=0.0), True)
    # the mask: the next layer keeps the dropped-out copy where it would keep the first layer's output
    assert on_cuda - no_dropout == elements


def test_in_place_dropout_keeps_its_noise_on_cuda_too():
    assert forward_peak(lambda: Dropped(inplace=True), True) == forward_peak(lambda: Dropped(inplace=True), None)


def test_the_simulated_cuda_dropout_computes_what_dropout_computes():
    x = torch.randn(64, 32, requires_grad=True)
    torch.manual_seed(0)
    y = cuda_dropout.dropout(x, 0.25)
    y.backward(torch.ones_like(y))
    kept = y != 0
    assert 0.6 < kept.float().mean() < 0.9
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    torch.testing.assert_close(x.grad, kept.float() / 0.75)  # each element's gradient: its mask times the scale
    assert cuda_dropout.dropout(x, 0.25, training=False) is x


def test_f_dropout_is_itself_again_after_the_simulation():
    original = F.dropout
    forward_peak(Dropped, True)
    assert F.dropout is original


class Attention(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.size(0), x.size(1), 3, 4, WIDTH // 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)


def test_attention_dropout_in_a_fused_cuda_kernel_keeps_no_scores():
    # bf16 on an Ampere GPU: flash, which keeps the output and the log-sum-exp whatever the dropout; the
    # CPU's fused kernel refuses dropout and would keep [batch, heads, seq, seq] scores and noise
    with_dropout = forward_peak(lambda: Attention(0.1), True, "bf16")
    assert with_dropout == forward_peak(lambda: Attention(0.0), True, "bf16")
    scores = 2 * 4 * TOKENS * TOKENS * 2
    assert forward_peak(lambda: Attention(0.1), None, "bf16") - with_dropout >= scores
