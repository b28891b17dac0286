"""A deep model's allocation events synthesized from a simulation of two of its blocks
(autofit/estimate/simulation/deepen.py): the same events, in the same order, as a simulation of every block makes,
and so the same peaks, kernels and reserve replayed through the caching allocator."""

import itertools

import pytest
import torch
import transformers
from torch import nn

from autofit.config import Config
from autofit.estimate.simulation import deepen
from autofit.estimate.simulation import step as simulate
from autofit.estimate.cuda.allocator import allocations
from autofit.estimate.estimator import Estimator
from autofit.models.depth import rebuild
from autofit.job.train_spec import make_spec


def gpt2(layers):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=128, n_head=4,
                                                                vocab_size=1000, n_positions=256))


def llama(layers):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000))


def token_batch(n):
    ids = torch.zeros(n, 64, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def structure(events):
    """(op, allocation, bytes) with each allocation named as made (`allocations`: storage ids are reused)."""
    out = [event[:3] for _, event in allocations(events)]
    # frees in a row leave the same cache in any order (some come in the order of a dict of storages)
    runs = itertools.groupby(out, key=lambda event: event[0] == "free")
    return [event for freeing, run in runs for event in (sorted(run) if freeing else run)]


def step(model, config, replay_depth=None):
    ids = torch.zeros(config.micro_batch_size, 64, dtype=torch.long)
    with simulate.recorded_events() as recorded:
        peak = simulate.simulate_step(model, {"input_ids": ids, "labels": ids}, lambda out, batch: out.loss,
                                      config, device="cpu", cuda_ampere=True, replay_depth=replay_depth)
    return peak, recorded[0]


@pytest.fixture
def deepened(monkeypatch):
    """What `deepen.deepen` returns, as the simulation calls it."""
    made = []
    real = deepen.deepen

    def keep(*args):
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(deepen, "deepen", keep)
    return made


@pytest.mark.parametrize("build, key", [(gpt2, "n_layer"), (llama, "num_hidden_layers")])
@pytest.mark.parametrize("config", [Config(micro_batch_size=2), Config(micro_batch_size=1, grad_accum_steps=3),
                                    Config(checkpointing="full", micro_batch_size=2),
                                    Config(checkpointing="every_k", checkpoint_every=2, micro_batch_size=2),
                                    Config(precision="bf16", checkpointing="ops", micro_batch_size=2),
                                    Config(optimizer="adamw8bit", micro_batch_size=2)])  # one step replayed
def test_two_units_deepened_are_the_whole_depths_events_peaks_and_reserve(build, key, config, deepened):
    with torch.device("meta"):
        whole = build(8)
    unit = config.checkpoint_every
    full_peak, full_events = step(whole, config)
    peak, _ = step(rebuild(whole, key, 2 * unit), config, replay_depth=(unit, 8 // unit))
    assert deepened[-1] is not None and peak.whole_depth and not full_peak.whole_depth
    assert structure(deepened[-1].events) == structure(full_events)
    # every field: the forward's and the backward's peaks, the gradients beside them, the kernels, the reserve
    assert peak == full_peak


def test_a_step_is_read_from_its_events():
    # forward: 1 KiB then 2 KiB live; backward from index 3: a 4 KiB temporary, then a 1 KiB gradient dropped
    events = [("malloc", "a", 1024), ("malloc", "b", 1024), ("free", "b"), ("malloc", "t", 4096),
              ("free", "t"), ("malloc", "g", 1000), ("grad", "g", 1000, "w"), ("free", "g")]
    assert simulate.curve(events, 3, 512) == {"forward": 2048, "peak": 5120, "grads_at_peak": 0, "tail": 1024,
                                              "joint": 5120, "grads_at_joint": 0, "at_grad": 2048}
    assert simulate.curve(events, len(events), 1)["forward"] == 5120  # no backward: all of it the forward


def test_the_estimate_replays_the_allocator_at_the_whole_depth():
    # GPT-2 small with full checkpointing, replayed at 2, 8, 10 and 12 blocks, reserved 638, 304, 1,009 and
    # 882 MiB above its allocated bytes (854 measured on an H100): the two simulated blocks' figure misled
    spec = make_spec(lambda: gpt2(6), token_batch, device="cpu", memory_budget="1TiB")
    config = Config(checkpointing="full", micro_batch_size=2)
    deep = Estimator(spec, target="cuda").activations(config)[0]
    whole = Estimator(spec, target="cuda", full_depth=True).activations(config)[0]
    assert deep.fragmentation == whole.fragmentation
    assert "at 2 of 6 blocks, the second unit repeated" in Estimator(spec, target="cuda").activations(config)[1]


class Alternating(nn.Module):
    """Blocks that allocate differently by position: the second unit is no template for the rest."""

    def __init__(self, layers=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(layers))

    def forward(self, x):
        for index, block in enumerate(self.blocks):
            x = block(x) if index % 2 == 0 else block(torch.cat([x, x])[: len(x)])
        return x


def test_units_that_allocate_differently_are_replayed_as_simulated(deepened):
    with torch.device("meta"):
        model = Alternating(2)
    peak = simulate.simulate_step(model, torch.randn(8, 64), lambda out, batch: out.square().mean(), Config(),
                                  device="cpu", cuda_ampere=True, replay_depth=(1, 4))
    assert deepened == [None] and not peak.whole_depth
    alone = simulate.simulate_step(Alternating(2).to("meta"), torch.randn(8, 64),
                                   lambda out, batch: out.square().mean(), Config(), device="cpu", cuda_ampere=True)
    assert peak.fragmentation == alone.fragmentation


def test_missing_marks_deepen_nothing():
    events = [("malloc", 1, 512), ("free", 1)]
    assert deepen.deepen(events, deepen.Marks(first=0, second=1), 4) is None
    assert deepen.deepen(events, deepen.Marks(0, 1, 1, 2, 2), 1) is None


class OnceEmpty(nn.Module):
    """Blocks the first of which makes a tensor of no bytes, once (on CUDA, a checkpointed model's first block
    did so: an empty CUDA storage, which the caching allocator gives no block)."""

    def __init__(self, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(layers))
        self.made = []

    def forward(self, x):
        for block in self.blocks:
            if not self.made:
                self.made.append(x.new_empty(0))
            x = block(x)
        return x


def test_storages_of_no_bytes_are_no_allocations_and_leave_the_units_alike(deepened):
    with torch.device("meta"):
        model = OnceEmpty()
    with simulate.recorded_events() as recorded:
        simulate.simulate_step(model, torch.randn(8, 64), lambda out, batch: out.square().mean(), Config(),
                               device="cpu", cuda_ampere=True, replay_depth=(1, 4))
    assert all(event[2] for event in recorded[0] if event[0] == "malloc")
    assert deepened[-1] is not None


def test_activation_offload_is_read_on_the_line_through_one_and_two_blocks():
    # an offloaded tensor's device storage is freed units later (a residual): two units cannot show which
    spec = make_spec(lambda: gpt2(8), token_batch, device="cpu", memory_budget="1TiB")
    config = Config(activation_offload="cpu", micro_batch_size=2)
    line, how = Estimator(spec, target="cuda").activations(config)
    assert "at 1 and 2 of 8 blocks, extrapolated" in how and not line.whole_depth
    whole, _ = Estimator(spec, target="cuda", full_depth=True).activations(config)
    assert (line.forward, line.peak, line.offloaded) == (whole.forward, whole.peak, whole.offloaded)
