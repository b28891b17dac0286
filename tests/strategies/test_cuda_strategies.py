"""Strategies on a CUDA target, in the CUDA test double (tests/cuda_double.py) where a card is
needed: where engines build the model, what DeepSpeed is told, which options a card allows. Nothing
here ran on a GPU; DeepSpeed, torch's FSDP2 and transformers are the real ones."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cuda_double import GiB, FakeCuda, FakeGpu  # noqa: E402

from autofit.config import Attention as A  # noqa: E402
from autofit.config import Config  # noqa: E402
from autofit.config import Optimizer as O  # noqa: E402
from autofit.strategies.deepspeed_config import deepspeed_config  # noqa: E402
from autofit.strategies.run import TrainRun  # noqa: E402
from autofit.search.rules import violation  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import FusedAttention, Fsdp, OptimizerStates, QuantizedBase, Zero  # noqa: E402
from autofit.strategies import fsdp as fsdp_module  # noqa: E402
from autofit.strategies.quantization import as_linear, quantizable_layers  # noqa: E402
from models import LinearBlocks, make_gpt2  # noqa: E402


class Blocks(LinearBlocks):
    def __init__(self):
        super().__init__(16, 2)


def _batch(n):
    return torch.randn(n, 16)


def _cuda_spec(model=Blocks, batch=_batch, extras=(), **kwargs):
    spec = make_spec(model, batch, device="cuda", **kwargs)
    return dataclasses.replace(spec, target=dataclasses.replace(spec.target, extras=frozenset(extras)))


@pytest.mark.parametrize("config", [Config(sharding="zero3", offload="cpu"), Config(sharding="zero2", offload="cpu"),
                                    Config(sharding="zero3", num_gpus=2)])
def test_zero_engines_get_the_model_on_the_cpu(config):
    # Defect 3: the whole fp32 model went to the GPU before DeepSpeed partitioned (or offloaded) it.
    seen = []
    with FakeCuda():
        run = TrainRun(spec=_cuda_spec(), config=config, model=Blocks())
        Zero().apply(run)
        run.engine_factory = lambda r: seen.append({p.device.type for p in r.model.parameters()})
        run.ready()
    assert seen == [{"cpu"}]


def test_fsdp_shards_a_model_still_on_the_cpu(monkeypatch):
    # Defect 3: FSDP2 moved the whole model to the GPU before `fully_shard`; now each block moves as it
    # is sharded. A CPU mesh stands in for the card's (this is a CPU build).
    from torch.distributed.device_mesh import init_device_mesh

    monkeypatch.setattr(fsdp_module, "mesh_for", lambda config, device: init_device_mesh("cpu", (1,)))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        with FakeCuda():
            run = TrainRun(spec=_cuda_spec(), config=Config(sharding="fsdp_full", offload="none"), model=Blocks())
            Fsdp().apply(run)
            fsdp_module.shard(run, reshard_after_forward=True)
        assert all(type(p).__name__ == "DTensor" for p in run.model.parameters())
    finally:
        dist.destroy_process_group()


def test_zero_without_offload_steps_with_torch_adamw_as_deepspeed_reads_it():
    # Defect 4 (fixed on main in 383c441, autofit/export/deepspeed.py): DeepSpeed's own selection
    # (engine.py get_optimizer_configuration) returns torch's AdamW, never the nvcc-built FusedAdam;
    # with offload the key is absent, so DeepSpeed's CPU Adam steps on the host.
    from deepspeed.runtime.engine import DeepSpeedEngine

    params = deepspeed_config(Config(sharding="zero2", num_gpus=2))["optimizer"]["params"]
    chosen, _ = DeepSpeedEngine.get_optimizer_configuration(None, dict(params), True)  # returns before using self
    assert chosen is torch.optim.AdamW
    assert "torch_adam" not in deepspeed_config(Config(sharding="zero2", offload="cpu"))["optimizer"]["params"]


def test_nvme_is_offered_with_zero3_only():
    # Defect 17 (fixed on main, autofit/search/rules.py "NVMe needs ZeRO-3"): at stage 1/2 DeepSpeed
    # silently offloads to the CPU (runtime/zero/stage_1_and_2.py: any offload device sets cpu_offload).
    with FakeCuda():
        target = _cuda_spec().target
    rule, reason = violation(Config(sharding="zero2", offload="nvme"), target)
    assert rule.name == "NVMe needs ZeRO-3" and "offloads to the CPU instead" in reason
    assert violation(Config(sharding="zero3", offload="nvme"), target) is None


def test_paged_states_are_not_offered_for_a_budget_below_the_card():
    # Defect 7: paged 8-bit states live in unified memory the fraction does not cap: a probe on an 80 GiB
    # card cannot show they fit 24 GiB.
    with FakeCuda([FakeGpu(total=80 * GiB)]):
        smaller = {o.value: o for o in OptimizerStates().options(_cuda_spec(extras={"bitsandbytes"},
                                                                            memory_budget="24GiB"))}
        whole = {o.value: o for o in OptimizerStates().options(_cuda_spec(extras={"bitsandbytes"}))}
    assert smaller[O.ADAMW8BIT].available and not smaller[O.PAGED_ADAMW8BIT].available
    assert "cannot show they fit a smaller one" in smaller[O.PAGED_ADAMW8BIT].reason
    assert whole[O.PAGED_ADAMW8BIT].available and "bounded by the card" in whole[O.PAGED_ADAMW8BIT].reason


def test_a_flash_attn_module_transformers_cannot_use_is_not_offered(tmp_path, monkeypatch):
    # Defect 14: availability was `find_spec("flash_attn")`; a broken install (a bare module, no flash-attn
    # distribution) passed it.
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with FakeCuda():
        spec = _cuda_spec(make_gpt2, None, extras={"flash_attn"}, seq_len=16)
        flash = {o.value: o for o in FusedAttention().options(spec)}[A.FLASH_ATTENTION_2]
    assert "flash_attention_2" in spec.model.attention
    assert not flash.available and "is_flash_attn_2_available() is False" in flash.reason
    target = spec.target  # and flash-attention never runs in fp32: a rule says so
    assert "fp16/bf16 only" in violation(Config(attention="flash_attention_2", precision="fp32"), target)[1]


def test_gpt2_conv1d_layers_are_quantizable_and_become_equal_linears():
    # Defect 15: only nn.Linear was replaced, so GPT-2 (Conv1D projections) was labelled quantized with
    # nothing quantized.
    model = make_gpt2()
    layers = quantizable_layers(model)
    assert len(layers) == 4 * model.config.n_layer and "lm_head" not in layers
    conv = model.get_submodule("transformer.h.0.mlp.c_fc")
    x = torch.randn(3, model.config.n_embd)
    torch.testing.assert_close(as_linear(conv)(x), conv(x))


class NoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(16, 16, 1)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.conv(x.unsqueeze(-1)).squeeze(-1)).pow(2).mean()

    def get_output_embeddings(self):
        return self.head


def test_a_model_with_nothing_to_quantize_has_quantization_unavailable_with_the_reason():
    with FakeCuda():
        spec = _cuda_spec(NoLinear, extras={"bitsandbytes", "peft"})
        options = {o.value: o for o in QuantizedBase().options(spec)}
    assert not options["nf4"].available and "no linear layer to quantize" in options["nf4"].reason
