"""Benchmark scenarios: a model, a batch, a global batch and a memory budget.

Budgets are fractions of a measured baseline peak (fp32, no checkpointing, the whole global batch in
one micro-batch, AdamW), so each scenario keeps needing the rungs it was written for when the model
changes. CPU scenarios use tiny models with random weights; GPU scenarios use ~125M-3B models under
budgets that stand in for 16/24/40/80 GB cards.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from autofit.batches.synthetic_batches import TokenBatches
from autofit.config import Config
from autofit.probe.run import run_probe
from autofit.job.train_spec import TrainSpec, make_spec
from autofit.strategies import default_strategies

PROBE_STEPS = dict(warmup_steps=2, timed_steps=3)  # autofit's defaults, for autofit and the oracle alike


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One benchmark case. `budget_fraction` of the baseline peak, or `budget_bytes` when given."""

    name: str
    family: str  # "transformer" | "mlp" | "cnn"
    model_factory: Callable[[], nn.Module]
    batch_factory: Callable[[int], Any]
    global_batch_size: int
    budget_fraction: float | None = None  # budget = fraction x baseline peak
    budget_bytes: int | None = None  # a fixed budget (GPU cards) instead of a fraction
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None  # None: the model's own loss (Hugging Face)
    intent: str = ""  # which rungs the budget is meant to need, in words
    allow: Any = None  # autofit's allow= (None: tiers 0-1)
    strategies: Callable[[], list[Any]] | None = None  # the techniques searched (None: the suite's)
    robustness_steps: int | None = None  # at most this many robustness steps (None: the suite's)
    large: bool = False  # >= 50M parameters: arithmetic, not per-operation overhead, dominates a step

    def spec(self, device: str, memory_budget: int, **overrides: Any) -> TrainSpec:
        """The `TrainSpec` autofit and the oracle both search."""
        kwargs = dict(self.autofit_kwargs(device, memory_budget))
        kwargs.update(overrides)
        return make_spec(self.model_factory, self.batch_factory, **kwargs)

    def autofit_kwargs(self, device: str, memory_budget: int) -> dict[str, Any]:
        """Keyword arguments of `autofit.autofit` for this scenario."""
        return dict(global_batch_size=self.global_batch_size, device=device, memory_budget=memory_budget,
                    loss_fn=self.loss_fn, allow=self.allow, **PROBE_STEPS)


# -- models (module-level factories, so specs pickle into child processes) ------------------------------
def make_gpt2(n_layer: int, n_embd: int, n_head: int, vocab: int, positions: int) -> nn.Module:
    """A GPT-2 from a transformers config, random weights (seeded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                                      n_positions=positions, bos_token_id=0, eos_token_id=0))


def make_hf_causal_lm(name: str) -> nn.Module:
    """A Hugging Face causal LM from one of autofit's model presets, random weights (GPU scenarios)."""
    from autofit.models.presets import build_model, get_preset

    torch.manual_seed(0)
    return build_model(get_preset(name))


class Block(nn.Module):
    """Residual MLP block: activations grow with the batch, parameters with the width."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class BlockMLP(nn.Module):
    """Token-wise MLP with its blocks in an nn.ModuleList; forward(x) returns logits per token."""

    def __init__(self, width: int, depth: int, classes: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ConvBlock(nn.Module):
    """Residual 3x3 conv block at constant resolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(nn.functional.relu(self.norm(self.conv1(x))))


class SmallCNN(nn.Module):
    """Stem, residual conv blocks in an nn.ModuleList, pooled linear head."""

    def __init__(self, channels: int, depth: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused projection to q, k, v, causal scaled-dot-product attention, output
    projection."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class GptBlock(nn.Module):
    """nanoGPT's block: pre-norm attention and a 4x GELU MLP, each residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-style model in plain torch (no Hugging Face): token and position embeddings, blocks in an
    nn.ModuleList, a head tied to the token embedding; `forward(idx, targets=None)` returns `(logits, loss)`,
    as nanoGPT's `GPT.forward` does, so a dict batch {"idx", "targets"} trains it with no loss_fn."""

    def __init__(self, vocab: int, block_size: int, depth: int, width: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(GptBlock(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():  # nanoGPT's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def make_nanogpt(vocab: int, block_size: int, depth: int, width: int, heads: int) -> nn.Module:
    """Seeded `NanoGPT`."""
    torch.manual_seed(0)
    return NanoGPT(vocab, block_size, depth, width, heads)


@dataclasses.dataclass(frozen=True)
class NanoTokens:
    """make_batch(n) for `NanoGPT`: {"idx": n x block_size token ids, "targets": the next token of each}."""

    vocab: int
    block_size: int

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (n, self.block_size + 1), generator=gen)
        return {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}


def make_mlp(width: int, depth: int) -> nn.Module:
    """Seeded `BlockMLP`."""
    torch.manual_seed(0)
    return BlockMLP(width, depth)


def make_cnn(channels: int, depth: int) -> nn.Module:
    """Seeded `SmallCNN`."""
    torch.manual_seed(0)
    return SmallCNN(channels, depth)


@dataclasses.dataclass(frozen=True)
class TokenFeatures:
    """make_batch(n) for `BlockMLP`: (features n x tokens x width, class per token)."""

    tokens: int
    width: int
    classes: int = 16

    def __call__(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(n, self.tokens, self.width, generator=gen),
                torch.randint(0, self.classes, (n, self.tokens), generator=gen))


@dataclasses.dataclass(frozen=True)
class Images:
    """make_batch(n) for `SmallCNN`: (images n x 3 x side x side, class)."""

    side: int
    classes: int = 10

    def __call__(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return torch.randn(n, 3, self.side, self.side, generator=gen), torch.randint(0, self.classes, (n,), generator=gen)


def token_loss(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy per token."""
    return nn.functional.cross_entropy(output.flatten(0, 1), batch[1].flatten())


def class_loss(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy per sample."""
    return nn.functional.cross_entropy(output, batch[1])


# -- the suites ---------------------------------------------------------------------------------------
def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (avx512_bf16 or AMX); without them torch emulates bf16 and
    every bf16 step runs several times slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux: assume it has (the rungs are searched)
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_rungs() -> list[Any]:
    """The rungs the CPU suite searches: every rung, less bf16 autocast and pure bf16 on a CPU without bf16
    instructions, where they cannot win and each costs the exhaustive search minutes (autofit prunes them
    after a few seconds, which would flatter its cost ratio)."""
    from autofit.strategies import MixedPrecision, PureBf16

    skipped = () if cpu_has_bf16() else (MixedPrecision, PureBf16)
    return [s for s in default_strategies() if not isinstance(s, skipped)]


def cpu_scenarios() -> list[Scenario]:
    """Tiny transformer and non-transformer models under budgets that need different rungs."""
    gpt2 = functools.partial(make_gpt2, 2, 64, 2, 256, 64)
    tokens = TokenBatches(256, 64)
    mlp = functools.partial(make_mlp, 64, 4)
    cnn = functools.partial(make_cnn, 16, 3)
    nanogpt = functools.partial(make_nanogpt, 512, 64, 4, 128, 4)  # 0.87M parameters, as issue 57's
    return [
        Scenario("nanogpt@50%", "transformer", nanogpt, NanoTokens(512, 64), 16, 0.50,
                 intent="a plain-torch GPT with a dict batch {idx, targets}, half its peak: micro-batch, "
                        "checkpointing or Adafactor"),
        Scenario("gpt2-tiny@60%", "transformer", gpt2, tokens, 8, 0.60,
                 intent="a little short: a smaller micro-batch (or bf16) is enough"),
        Scenario("gpt2-tiny@25%", "transformer", gpt2, tokens, 8, 0.25,
                 intent="tight: micro-batch 1 alone does not fit; needs bf16, checkpointing or Adafactor too"),
        Scenario("mlp@40%", "mlp", mlp, TokenFeatures(32, 64), 16, 0.40, loss_fn=token_loss,
                 intent="activations dominate: micro-batch or checkpointing"),
        Scenario("cnn@30%", "cnn", cnn, Images(16), 16, 0.30, loss_fn=class_loss,
                 intent="conv activations dominate: micro-batch or checkpointing"),
        *large_cpu_scenarios(),
    ]


def large_cpu_scenarios() -> list[Scenario]:
    """Two ~50M-parameter models under budgets over 500 MiB, where a step is arithmetic (1024- and
    640-wide matmuls), not per-operation overhead. They search checkpointing, micro-batch and optimizer
    states (and the attention kernel): bf16 autocast is left out because this CPU has no bf16 units
    (no avx512_bf16), so every bf16 probe is pruned by autofit after a few seconds but runs for minutes
    in the exhaustive search."""
    from autofit.strategies import FusedAttention, ActivationCheckpointing, MicroBatch, OptimizerStates

    def rungs() -> list[Any]:
        return [FusedAttention(), ActivationCheckpointing(), MicroBatch(), OptimizerStates()]

    mlp = functools.partial(make_mlp, 1024, 6)  # 50.4M parameters
    gpt2 = functools.partial(make_gpt2, 8, 640, 10, 20000, 64)  # 52.2M parameters
    return [
        Scenario("mlp-50m@65%", "mlp", mlp, TokenFeatures(16, 1024), 4, 0.65, loss_fn=token_loss, strategies=rungs,
                 robustness_steps=10, large=True,
                 intent="model states dominate: AdamW's 8 bytes/param cannot fit, Adafactor's factored states do"),
        Scenario("gpt2-50m@125%", "transformer", gpt2, TokenBatches(20000, 16), 4, 1.25, strategies=rungs,
                 robustness_steps=10, large=True,
                 intent="everything fits: an exact AdamW fit is there, a numerics change must earn its place"),
    ]


def gpu_scenarios() -> list[Scenario]:
    """~125M-3B models under budgets standing in for 16, 24, 40 and 80 GB cards (UNTESTED here: no GPU)."""
    out = []
    for model, seq, batch, cards in (("gpt2", 1024, 32, (16, 24)), ("qwen2.5-0.5b", 2048, 16, (16, 24, 40)),
                                     ("qwen2.5-1.5b", 2048, 16, (24, 40, 80)), ("qwen2.5-3b", 2048, 8, (40, 80))):
        for card in cards:
            out.append(Scenario(f"{model}@{card}GB", "transformer", functools.partial(make_hf_causal_lm, model),
                                GpuTokens(model, seq), batch, budget_bytes=card * 10**9,
                                intent=f"stands in for a {card} GB card"))
    # Multi-rung: full fine-tuning of 3B cannot fit 16 GB; LoRA (tier 2) is allowed so it can.
    out.append(Scenario("qwen2.5-3b@16GB+lora", "transformer", functools.partial(make_hf_causal_lm, "qwen2.5-3b"),
                        GpuTokens("qwen2.5-3b", 2048), 8, budget_bytes=16 * 10**9, allow={"lora"},
                        intent="needs LoRA: full fine-tuning states alone exceed 16 GB"))
    return out


@dataclasses.dataclass(frozen=True)
class GpuTokens:
    """make_batch(n) for a preset causal LM at `seq_len` tokens (vocabulary read from the preset)."""

    model: str
    seq_len: int

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        from autofit.models.presets import get_preset

        return TokenBatches(get_preset(self.model).vocab_size, self.seq_len)(n)


# -- budgets --------------------------------------------------------------------------------------------
def baseline_config(spec: TrainSpec) -> Config:
    """fp32, no checkpointing, the whole global batch in one micro-batch, AdamW."""
    attention = "sdpa" if "sdpa" in spec.model.attention else "default"
    return Config(attention=attention, micro_batch_size=spec.global_batch_size, grad_accum_steps=1)


def baseline_peak(scenario: Scenario, device: str = "cpu", roomy: int = 16 * 2**30) -> int:
    """Measured peak bytes of the baseline config under a budget big enough for it."""
    spec = scenario.spec(device, roomy, warmup_steps=1, timed_steps=1)
    result = run_probe(spec, baseline_config(spec), default_strategies())
    if not result.fits:
        raise RuntimeError(f"{scenario.name}: the baseline did not fit {roomy} bytes: {result.reason}")
    return result.peak_bytes


def budget_for(scenario: Scenario, device: str = "cpu") -> tuple[int, int | None]:
    """(budget bytes, baseline peak bytes or None for a fixed budget)."""
    if scenario.budget_bytes is not None:
        return scenario.budget_bytes, None
    peak = baseline_peak(scenario, device)
    return int(peak * scenario.budget_fraction), peak
