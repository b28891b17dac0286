"""Quantized base weights (QLoRA). On the CPU the strategy is unavailable with its reason; the real
4-bit / 8-bit runs need CUDA and bitsandbytes and are `gpu`-marked."""

import importlib.util

import pytest
import torch
from torch import nn

import autofit
from autofit.config import Config
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.devices.gpus import get_gpu
from autofit.search.rules import violation
from autofit.job.target import Target
from autofit.strategies import Lora, MicroBatch, QuantizedBase

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_cuda_bnb = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_BNB), reason="needs CUDA and bitsandbytes")


class Mlp(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x).pow(2).mean()


def make_batch(n):
    return torch.randn(n, 256)


def test_unavailable_on_cpu_with_reason():
    options = QuantizedBase().options(make_spec(Mlp, make_batch, device="cpu"))
    assert [o.value for o in options] == ["none", "int8", "nf4"]
    assert options[0].available
    for option in options[1:]:
        assert not option.available and option.tier == 2
        expected = "pip install 'autofit[bnb]'" if not HAS_BNB else "need CUDA"
        assert expected in option.reason


def test_cpu_search_goes_on_without_it():
    plan = autofit.autofit(Mlp, make_batch, device="cpu", global_batch_size=2, allow={"lora"},
                           strategies=[MicroBatch(), QuantizedBase()], warmup_steps=1, timed_steps=1)
    assert plan.fits and plan.config.quantization == "none"


def test_quantized_base_without_lora_is_a_rule():
    target = Target.from_profile(get_gpu("a100-80gb"), 1)
    assert "without LoRA adapters nothing is trained" in violation(Config(quantization="nf4"), target)[1]
    assert violation(Config(quantization="nf4", lora=16), target) is None


def test_savings_order():
    q = QuantizedBase()
    nf4, int8, none = Config(quantization="nf4"), Config(quantization="int8"), Config()
    assert q.saves_at_least(nf4, int8) and q.saves_at_least(int8, none)
    assert not q.saves_at_least(none, nf4)


@pytest.mark.gpu
@needs_cuda_bnb
@pytest.mark.parametrize("value", ["nf4", "int8"])
def test_qlora_trains_adapters_on_cuda(value):
    import bitsandbytes as bnb

    spec = make_spec(Mlp, make_batch, device="cuda")
    run = build_run(spec, Config(quantization=value, lora=8, precision="bf16"),
                    [MicroBatch(), QuantizedBase(), Lora(ranks=(8,))])
    layer_types = {type(m) for m in run.model.modules()}
    assert (bnb.nn.Linear4bit if value == "nf4" else bnb.nn.Linear8bitLt) in layer_types
    trainable = [n for n, p in run.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    loss = run.step([make_batch(2).cuda()])
    assert torch.isfinite(loss)


@pytest.mark.gpu
@needs_cuda_bnb
def test_qlora_search_on_cuda_picks_quantization_under_a_small_budget():
    # 4 x 8192^2 = 268M parameters: full fine-tuning needs ~4.3 GB, fp32 weights + LoRA ~1.1 GB plus the
    # CUDA context; NF4 weights ~0.13 GB. Under 1.5 GiB only a quantized base fits.
    plan = autofit.autofit(_wide, _wide_batch, device="cuda", global_batch_size=2, allow={"lora"},
                           memory_budget="1.5GiB", strategies=[MicroBatch(), QuantizedBase(), Lora(ranks=(8,))],
                           warmup_steps=1, timed_steps=1)
    assert plan.fits, plan.reason
    assert plan.config.quantization in ("nf4", "int8") and plan.config.lora == 8


def _wide():
    return Mlp(width=8192)


def _wide_batch(n):
    return torch.randn(n, 8192)


@pytest.mark.parametrize("version", ["0.41.1", "0.43.1", "0.43.0rc1", "0.43.2rc1"])
def test_a_bitsandbytes_that_keeps_every_input_is_refused_with_the_fix(monkeypatch, version):
    import sys
    import types

    from autofit.errors import UsageError
    from autofit.strategies.quantization import _import_bnb

    # a test double of the bitsandbytes module: only its version is read
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.SimpleNamespace(__version__=version))
    with pytest.raises(UsageError, match=rf"bitsandbytes {version} keeps .*pip install -U 'autofit\[bnb\]'"):
        _import_bnb()


@pytest.mark.parametrize("version", ["0.43.2", "0.45.0", "0.48.0.dev0", "1.0.0+cu121"])
def test_a_bitsandbytes_with_the_fix_is_used(monkeypatch, version):
    import sys
    import types

    from autofit.strategies.quantization import _import_bnb

    double = types.SimpleNamespace(__version__=version)  # a test double of the bitsandbytes module
    monkeypatch.setitem(sys.modules, "bitsandbytes", double)
    assert _import_bnb() is double
