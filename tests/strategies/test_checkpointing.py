import copy

import pytest
import torch
from forcing import budget_between, long_batch, peak, tune
from models import make_gpt2, make_mlp, mlp_loss
from torch import nn

from autofit.config import Config
from autofit.estimate.estimator import Estimator
from autofit.estimate.tolerance import PREDICTION_TOLERANCE
from autofit.probe.run import run_probe
from autofit.job.train_spec import make_spec
from autofit.strategies.run import build_run
from autofit.strategies import ActivationCheckpointing, MicroBatch, default_strategies
from autofit.strategies.checkpointing import disable, enable, trainer_switch


def test_plain_model_blocks_are_checkpointed_every_k():
    model = make_mlp()
    enable(model, 2)
    assert ["forward" in vars(b) for b in model.blocks] == [True, False, True, False]
    disable(model)
    assert not any("forward" in vars(b) for b in model.blocks)


def test_the_trainers_switch_is_the_name_the_installed_training_arguments_take():
    # read from the release's version, so an export never imports TrainingArguments (seconds) to learn it
    import dataclasses

    from transformers import TrainingArguments

    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    assert trainer_switch() in names
    assert trainer_switch() == "activation_checkpointing" or "activation_checkpointing" not in names


def test_hf_model_uses_its_own_switch():
    spec = make_spec(make_gpt2, global_batch_size=2, device="cpu", memory_budget="1GiB", seq_len=16)
    run = build_run(spec, Config(checkpointing="every_k", checkpoint_every=2, micro_batch_size=2), default_strategies())
    blocks = run.model.transformer.h
    if hasattr(blocks[0], "gradient_checkpointing"):  # transformers 4.52 and later switch layer by layer
        assert [layer.gradient_checkpointing for layer in blocks] == [True, False, True, False]
    else:  # one switch for the whole stack: every other block checkpointed by its own forward
        assert ["forward" in vars(layer) for layer in blocks] == [True, False, True, False]


def test_unavailable_without_repeated_blocks():
    import torch

    spec = make_spec(lambda: torch.nn.Linear(4, 1), lambda n: torch.randn(n, 4), device="cpu",
                     memory_budget="1GiB", loss_fn=lambda out, batch: out.sum())
    options = ActivationCheckpointing().options(spec)
    assert [o.value for o in options if o.available] == ["none"]
    assert all("Linear has no repeated blocks" in o.reason for o in options if not o.available)  # not "0 blocks"


class Vocoder(nn.Module):
    """Weight-normed convolutions, as HiFi-GAN's: torch makes each a class of its own (`ParametrizedConv1d`)."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm

        self.convs = nn.ModuleList([weight_norm(nn.Conv1d(8, 8, 7, padding=3)) for _ in range(4)])

    def forward(self, x):
        for conv in self.convs:
            x = x + torch.nn.functional.leaky_relu(conv(x), 0.1)
        return x


def test_parametrized_layers_are_repeated_blocks_and_checkpoint_exactly():
    spec = make_spec(Vocoder, lambda n: torch.randn(n, 8, 64), device="cpu", memory_budget="1GiB",
                     loss_fn=lambda out, batch: out.pow(2).mean())
    assert {o.value for o in ActivationCheckpointing().options(spec) if o.available} >= {"none", "full", "every_k"}
    grads = []
    for config in (Config(micro_batch_size=2), Config(checkpointing="full", micro_batch_size=2)):
        torch.manual_seed(0)
        run = build_run(spec, config, default_strategies())
        run.forward_backward(torch.randn(2, 8, 64), 1.0)
        grads.append([p.grad.clone() for p in run.model.parameters()])
    assert all(torch.allclose(a, b) for a, b in zip(*grads))
    assert sum("forward" in vars(conv) for conv in run.model.convs) == 4  # each conv recomputes in backward


def stem_blocks_head():
    """The blocks between a stem and a head in one `nn.Sequential`, as plain models are often written."""
    block = lambda: nn.Sequential(nn.Linear(64, 64), nn.GELU())  # noqa: E731
    return nn.Sequential(nn.Linear(16, 64), *[block() for _ in range(4)], nn.LayerNorm(64), nn.Linear(64, 3))


def test_blocks_between_a_stem_and_a_head_are_found_and_checkpointed():
    from autofit.models.info import find_blocks

    model = stem_blocks_head()
    assert find_blocks(model) == ("", list(model)[1:5])  # the stem, the norm and the head are layers
    assert find_blocks(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))) == (None, [])
    none, full = checkpointed_peaks(stem_blocks_head, lambda n: (torch.randn(n, 16), torch.randint(0, 3, (n,))),
                                    512, blocks=4)
    assert full < 0.8 * none


def checkpointed_peaks(factory, make_batch, size, blocks):
    """The measured peaks without and with every block checkpointed (each predicted within 2%), for a
    classifier `factory` whose spec counts `blocks` blocks."""
    spec = make_spec(factory, make_batch, device="cpu", memory_budget="1GiB", global_batch_size=size,
                     loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]))
    assert spec.model.num_blocks == blocks
    peaks = []
    for config in (Config(micro_batch_size=size), Config(checkpointing="full", micro_batch_size=size)):
        measured = run_probe(spec, config, default_strategies()).peak_bytes
        assert Estimator(spec).predict(config).peak_bytes == pytest.approx(measured, rel=0.02)
        peaks.append(measured)
    return peaks


class Basic(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(x + self.norm(self.conv(x)))


class Stages(nn.Module):
    """A ResNet's layout: stages `layer1` .. `layer3`, each an `nn.Sequential` of its blocks, widening and
    shrinking: the widest stage holds the most weights and the fewest activations."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layer1 = nn.Sequential(Basic(8), Basic(8))
        self.layer2 = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2), Basic(16), Basic(16))
        self.layer3 = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2), Basic(32), Basic(32))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.layer3(self.layer2(self.layer1(self.stem(x)))).mean((2, 3)))


def test_every_stage_of_a_resnet_is_checkpointed_not_its_widest_alone():
    from autofit.models.info import checkpoint_blocks

    model = Stages()
    assert checkpoint_blocks(model) == [*model.layer1, model.layer2[1], model.layer2[2], model.layer3[1], model.layer3[2]]
    none, full = checkpointed_peaks(Stages, lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))), 16,
                                    blocks=6)
    assert full < 0.8 * none  # the widest stage's two blocks alone had saved 2.5%


class Down(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.block = Basic(width)
        self.pool = nn.Conv2d(width, width, 3, stride=2, padding=1)

    def forward(self, x):
        return self.pool(self.block(x))


class Up(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.block = Basic(2 * width)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)

    def forward(self, x, skip):
        return self.up(self.block(torch.cat([x, skip], 1)))


class UNet(nn.Module):
    """Down blocks and up blocks, each in a `nn.ModuleList` of its own class."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.downs = nn.ModuleList([Down(8), Down(8)])
        self.ups = nn.ModuleList([Up(8), Up(8)])

    def forward(self, x):
        skips = []
        x = self.stem(x)
        for down in self.downs:
            x = down(x)
            skips.append(x)
        for up, skip in zip(self.ups, reversed(skips)):
            x = up(x, torch.nn.functional.interpolate(skip, size=x.shape[-2:]))
        return x


def test_a_unets_down_and_up_blocks_are_all_checkpointed():
    from autofit.models.info import checkpoint_blocks

    model = UNet()
    assert checkpoint_blocks(model) == [*model.downs, *model.ups]  # the ups hold the most weights, not all blocks


@pytest.mark.parametrize("ops", [False, True], ids=["whole blocks", "op by op"])
@pytest.mark.parametrize("frozen", [False, True], ids=["training", "frozen statistics"])
def test_batch_norm_statistics_are_updated_once_per_step_as_without_checkpointing(frozen, ops):
    """A checkpointed block runs its forward twice per step, and batch norm in training updates its running
    statistics at each run: twice the momentum, num_batches_tracked 2 after one step. The recomputation
    leaves them alone; a batch norm in eval mode (frozen, as a detector's backbone) keeps normalising by them.
    Op by op too: its recomputation replays the first run's ops one for one, where putting the statistics
    back with a clone and a copy failed every step ("aten.clone.default encountered during backward but
    not found in storage")."""
    from autofit.strategies.checkpointing import enable

    torch.manual_seed(0)
    plain = Stages()
    if frozen:
        plain.layer1[0].norm.eval()
    checkpointed = copy.deepcopy(plain)
    enable(checkpointed, 1, ops=ops)
    x = torch.randn(4, 3, 16, 16)
    for _ in range(2):  # the second step normalises a frozen norm by statistics the first left
        for model in (plain, checkpointed):
            model(x).pow(2).mean().backward()
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffer, dict(checkpointed.named_buffers())[name]), name
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_full_saves_at_least_every_2():
    strategy = ActivationCheckpointing()
    full, every_2, none = Config(checkpointing="full"), Config(checkpointing="every_k", checkpoint_every=2), Config()
    assert strategy.saves_at_least(full, every_2) and strategy.saves_at_least(every_2, none)
    assert not strategy.saves_at_least(none, full)


def test_op_level_sits_between_none_and_full_and_beside_every_k():
    strategy = ActivationCheckpointing()
    ops, full, none = Config(checkpointing="ops"), Config(checkpointing="full"), Config()
    every_2, every_4 = (Config(checkpointing="every_k", checkpoint_every=k) for k in (2, 4))
    assert strategy.saves_at_least(ops, none) and strategy.saves_at_least(full, ops)
    assert not strategy.saves_at_least(ops, every_4) and not strategy.saves_at_least(every_4, ops)
    assert strategy.saves_at_least(every_2, every_4) and not strategy.saves_at_least(every_4, every_2)
    assert ops.recomputed_share == 0 and full.recomputed_share == 1 and every_4.recomputed_share == 0.25


class GatedBlock(nn.Module):
    """Few matmuls, many pointwise ops: what op-level checkpointing recomputes."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.up(x)
        g = nn.functional.gelu(h) * torch.sigmoid(h)
        return x + self.down(nn.functional.silu(g * torch.tanh(g)))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(6))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def gated_batch(n):
    return torch.randn(n, 512, 64, generator=torch.Generator().manual_seed(n))


def test_every_4_is_offered_where_the_depth_allows():
    six = {o.knobs("checkpointing").get("checkpoint_every"): o for o in ActivationCheckpointing().options(
        make_spec(Gated, gated_batch, device="cpu", memory_budget="1GiB")) if o.value == "every_k"}
    four = [o for o in ActivationCheckpointing().options(make_spec(make_mlp, long_batch, device="cpu", memory_budget="1GiB",
                                                         loss_fn=mlp_loss)) if o.value == "every_k"]
    assert six[4].available and six[2].available
    assert [o.available for o in four] == [False, True] and "too few" in four[0].reason


def test_op_level_gives_the_same_gradients():
    spec = make_spec(Gated, gated_batch, global_batch_size=2, device="cpu", memory_budget="1GiB")
    grads = []
    for mode in ("none", "ops"):
        run = build_run(spec, Config(checkpointing=mode, micro_batch_size=2), default_strategies())
        run.forward_backward(gated_batch(2), 1.0)
        grads.append([p.grad for p in run.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_forced_by_a_budget_only_op_level_meets_without_recomputing_matmuls():
    # One sample per step: a smaller micro-batch cannot rescue every_k.
    ops = peak(Gated, gated_batch, Config(checkpointing="ops"))
    every_2 = peak(Gated, gated_batch, Config(checkpointing="every_k", checkpoint_every=2))
    plan = tune(Gated, gated_batch, [ActivationCheckpointing(), MicroBatch()], budget_between(ops, every_2), 1)
    assert plan.fits and plan.config.checkpointing == "ops", plan.reason
    full = [p for p in plan.probes if p.config.checkpointing == "full"]
    assert full and not full[0].measured and "only adds work" in full[0].reason


def test_estimator_predicts_op_level_within_its_tolerance():
    spec = make_spec(Gated, gated_batch, global_batch_size=4, device="cpu", memory_budget="1GiB")
    config = Config(checkpointing="ops", micro_batch_size=4)
    measured = run_probe(spec, config, default_strategies()).peak_bytes
    predicted = Estimator(spec).predict(config).peak_bytes
    assert abs(predicted / measured - 1) <= PREDICTION_TOLERANCE["cpu"], (predicted, measured)


def test_forced_by_a_budget_only_checkpointing_meets():
    none = peak(make_mlp, long_batch, Config(micro_batch_size=1), loss_fn=mlp_loss)
    full = peak(make_mlp, long_batch, Config(checkpointing="full", micro_batch_size=1), loss_fn=mlp_loss)
    plan = tune(make_mlp, long_batch, [ActivationCheckpointing(), MicroBatch()], budget_between(full, none), 1,
                loss_fn=mlp_loss)
    assert plan.fits and plan.config.checkpointing != "none"
    assert plan.peak_memory < none
