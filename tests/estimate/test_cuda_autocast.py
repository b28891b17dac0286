"""Autocast simulated on CPU kernels as CUDA runs it (autofit/estimate/cuda/autocast.py): the ops CUDA's
autocast runs in fp32 keep fp32 tensors for backward where the CPU's autocast keeps bf16 ones."""

import torch
import torch.nn.functional as F
from torch import nn

from autofit.config import Config
from autofit.estimate.simulation.step import simulate_step

BATCH, TOKENS, WIDTH, HEADS = 2, 64, 128, 4


def forward_peak(build, cuda_ampere, precision="bf16", loss=lambda out, _batch: out.float().sum()):
    with torch.device("meta"):
        model = build()
    batch = torch.zeros(BATCH, TOKENS, WIDTH)
    return simulate_step(model, batch, loss, Config(precision=precision), device="cpu", cuda_ampere=cuda_ampere).forward


class HandWrittenAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x):
        q, k, v = self.qkv(x).view(BATCH, TOKENS, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        return F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def test_a_hand_written_softmax_keeps_fp32_probabilities_on_cuda():
    scores = BATCH * HEADS * TOKENS * TOKENS
    on_cpu, on_cuda = forward_peak(HandWrittenAttention, None), forward_peak(HandWrittenAttention, True)
    # at the softmax, CUDA holds the bf16 scores, autocast's fp32 copy of them and fp32 probabilities (10 bytes
    # a score), the CPU bf16 scores and bf16 probabilities (4); backward then keeps the fp32 probabilities
    # and the matmul's bf16 cast of them on CUDA (6), the bf16 probabilities on the CPU (2)
    assert on_cuda - on_cpu == scores * 6


class GeluNew(nn.Module):  # transformers' gelu_new, GPT-2's activation
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)

    def forward(self, x):
        h = self.up(x)
        return 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0))))


def test_gelu_new_computes_in_fp32_on_cuda_from_its_pow():
    elements = BATCH * TOKENS * 4 * WIDTH
    added = forward_peak(GeluNew, True) - forward_peak(GeluNew, None)
    assert added >= elements * 2 * 2  # at least pow's input and tanh's output kept in fp32, not bf16


def test_nothing_changes_without_autocast_or_where_inputs_are_fp32():
    assert forward_peak(HandWrittenAttention, True, "fp32") == forward_peak(HandWrittenAttention, None, "fp32")

    class Normed(nn.Module):  # the residual stream stays fp32 under autocast: its LayerNorm is as on the CPU
        def __init__(self):
            super().__init__()
            self.norm, self.up = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.up(self.norm(x))

    assert forward_peak(Normed, True) == forward_peak(Normed, None)


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(WIDTH, 512)

    def forward(self, x):
        return self.head(x)


def test_cross_entropy_of_bf16_logits_keeps_what_cuda_keeps():
    target = torch.zeros(BATCH * TOKENS, dtype=torch.long)

    def loss(logits, _batch):
        return F.cross_entropy(logits.flatten(0, 1), target)

    elements = BATCH * TOKENS * 512
    # backward keeps, beside the bf16 logits, bf16 log-probabilities and nll_loss's fp32 copy of them on CUDA
    # (6 bytes each), fp32 log-probabilities on the CPU (4); the forward's peak is at the casts: the logits'
    # fp32 copy and fp32 log-probabilities on the CPU (8), bf16 log-probabilities and their fp32 copy on CUDA (6)
    assert forward_peak(Logits, None, loss=loss) - forward_peak(Logits, True, loss=loss) == elements * 2


def test_cross_entropy_on_cuda_computes_what_cross_entropy_computes():
    from autofit.estimate.cuda.autocast import _cross_entropy

    logits = torch.randn(6, 5).to(torch.bfloat16)
    target = torch.tensor([0, 1, 2, 3, 4, -100])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(logits.float(), target)
        got = _cross_entropy((logits, target), {"reduction": "mean"})
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert _cross_entropy((logits, target), {"label_smoothing": 0.1}) is None  # run as given


def test_checkpointed_blocks_recompute_in_backward_as_their_forward_ran():
    from transformers import GPT2Config, GPT2LMHeadModel

    originals = (torch.pow, torch.Tensor.softmax, torch.Tensor.__pow__, F.layer_norm, F.cross_entropy)
    config = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    ids = torch.zeros(2, 32, dtype=torch.long)
    for checkpointing in ("full", "ops"):  # gelu_new's fp32 pow recomputed in fp32, or the check raises
        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        simulate_step(model, {"input_ids": ids, "labels": ids}, lambda out, _batch: out.loss,
                      Config(precision="bf16", attention="sdpa", checkpointing=checkpointing), device="cpu",
                      cuda_ampere=True)
    assert (torch.pow, torch.Tensor.softmax, torch.Tensor.__pow__, F.layer_norm, F.cross_entropy) == originals
