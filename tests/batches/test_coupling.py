"""A loss that couples samples (a contrastive loss's negatives) makes a smaller micro-batch a numerics change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.search.space import build_space
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch, MixedPrecision

WIDTH = 32


class Siamese(nn.Module):
    """Two views of each sample through one encoder (SimCLR-style), in training mode with dropout."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(WIDTH, 64), nn.Dropout(0.2), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, a, b):
        return F.normalize(self.encoder(a), dim=-1), F.normalize(self.encoder(b), dim=-1)


def views(n):
    x = torch.randn(n, WIDTH)
    return {"a": x + 0.1 * torch.randn(n, WIDTH), "b": x + 0.1 * torch.randn(n, WIDTH)}


def info_nce(output, batch):  # each sample's negatives are the batch's other samples
    a, b = output
    return F.cross_entropy(a @ b.t(), torch.arange(len(a)))


def pulled_together(output, batch):  # one term per sample, their mean
    return (output[0] - output[1]).pow(2).sum(-1).mean()


def summed(output, batch):  # one term per sample, their sum
    return (output[0] - output[1]).pow(2).sum()


class Sampling(Siamese):
    """A VAE-like forward: random in eval mode too."""

    def forward(self, a, b):
        z = self.encoder(a)
        return z + 10 * torch.randn_like(z), self.encoder(b)


def _coupling(model, loss_fn, batch=views):
    return make_spec(model, batch, loss_fn=loss_fn, global_batch_size=8, device="cpu",
                     memory_budget="1GiB").sample_coupling


@pytest.mark.parametrize("given", [Siamese, Siamese()], ids=["factory", "module"])
def test_a_contrastive_loss_is_found_to_couple_samples(given):
    assert "the loss couples samples, as a contrastive loss's negatives" in _coupling(given, info_nce)


@pytest.mark.parametrize("loss_fn", [pulled_together, summed], ids=["mean", "sum"])
def test_a_loss_of_one_term_per_sample_does_not(loss_fn):
    assert _coupling(Siamese, loss_fn) is None


def test_a_loss_of_yours_averaging_over_the_batchs_targets_is_a_coupling_too():
    """Rows of 20 and of 5 targets: split and weighed by samples (a loss of yours is), the step's loss differs."""
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Embedding(50, 16), nn.Linear(16, 50)
            with torch.no_grad():
                self.out.bias[0] = 8.0  # class 0 is predicted: rows of 0s cost little, the others much

        def forward(self, ids):
            return self.out(self.embed(ids))

    def padded(n):  # even rows: 5 targets, all class 0; odd rows: 20 random ones
        targets = torch.randint(1, 50, (n, 20))
        targets[::2] = -100
        targets[::2, :5] = 0
        return torch.randint(0, 50, (n, 20)), targets

    def token_mean(output, batch):
        return F.cross_entropy(output.flatten(0, 1), batch[1].flatten(), ignore_index=-100)

    assert "a mean over the batch's targets" in _coupling(Tagger, token_mean, padded)


def test_a_random_forward_decides_nothing():
    assert _coupling(Sampling, lambda output, batch: (output[0] @ output[1].t()).logsumexp(-1).mean()) is None


def test_the_users_model_keeps_its_mode_and_weights():
    model = Siamese()
    model.encoder[1].eval()  # a mode of its own on one module
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _coupling(model, info_nce)
    assert model.training and not model.encoder[1].training and model.encoder[0].training
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


class Queue(nn.Module):
    """A MoCo-style queue of negatives its forward updates, even in eval mode and without gradients."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 4)
        self.register_buffer("queue", torch.randn(16, 4))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.long))

    def forward(self, x, y):
        z = self.encoder(x)
        loss = torch.cat([(z * self.encoder(y)).sum(1, keepdim=True), z @ self.queue.t()], 1).logsumexp(1).mean()
        with torch.no_grad():
            at = int(self.pointer)
            self.queue[at:at + len(z)] = z.detach()
            self.pointer = (self.pointer + len(z)) % 16  # another tensor in its place
        return loss


def test_the_users_buffers_keep_their_values_and_tensors():
    """The check runs the user's own module: a forward that updates its buffers had left a MoCo queue and
    its pointer changed by the search."""
    model = Queue()
    tensors = {name: buffer for name, buffer in model.named_buffers()}
    values = {name: buffer.clone() for name, buffer in tensors.items()}
    make_spec(model, {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}, device="cpu", memory_budget="1GiB",
              global_batch_size=4)
    for name, buffer in model.named_buffers():
        assert buffer is tensors[name] and torch.equal(buffer, values[name]), name


def test_clip_asking_for_its_contrastive_loss_is_known_to_without_running():
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 2, "vocab_size": 99},
                        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                       "num_attention_heads": 2, "image_size": 32, "patch_size": 16},
                        projection_dim=16)
    coupling = make_spec(config, global_batch_size=8, device="cpu", memory_budget="1GiB").sample_coupling
    assert coupling == "CLIPModel's contrastive loss takes each sample's negatives from its batch"
    assert make_spec(lambda: CLIPModel(config), global_batch_size=8, device="cpu",
                     memory_budget="1GiB").sample_coupling == coupling


def test_a_smaller_micro_batch_is_then_a_numerics_change_counted_in_the_configs_tier():
    spec = make_spec(Siamese, views, loss_fn=info_nce, global_batch_size=8, device="cpu", memory_budget="1GiB")
    space = build_space(spec, [MicroBatch(), MixedPrecision()])
    whole, split = space.at(space.levels()[0], 8), space.at(space.levels()[0], 2)
    assert space.tier(whole) == 0 and space.tier(split) == 1
    [(knob, reason)] = space.changes(split)
    assert knob == "micro_batch_size" and reason.startswith("2 x 4 accumulation steps = 8 per rank; the loss over "
                                                            "2 samples, not 8: the loss couples samples")
    exact = build_space(spec.__class__(**{**spec.__dict__, "max_tier": 0}), [MicroBatch()])
    excluded = {e.config.micro_batch_size: e.reason for e in exact.excluded}
    assert exact.sizes == (8,) and set(excluded) == {1, 2, 4}  # each shown at its own size, with what it changes
    assert "the loss over 4 samples, not 8" in excluded[4] and "tier 1, not allowed: allow={'numerics'}" in excluded[4]


def test_the_plan_says_what_a_chosen_micro_batch_changes():
    """A micro-batch of 8 does not fit: the plan takes a smaller one, and its reason says what that changes."""
    class Tokens(nn.Module):  # sets of 256 tokens per view, pooled: activations outweigh the weights
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(WIDTH, 512), nn.ReLU(), nn.Linear(512, 16))

        def forward(self, a, b):
            return F.normalize(self.encoder(a).mean(1), dim=-1), F.normalize(self.encoder(b).mean(1), dim=-1)

    def token_views(n):
        x = torch.randn(n, 256, WIDTH)
        return {"a": x + 0.1 * torch.randn_like(x), "b": x + 0.1 * torch.randn_like(x)}

    plan = autofit.autofit(Tokens, token_views, global_batch_size=8, loss_fn=info_nce, device="cpu",
                           memory_budget="16MiB", strategies=[MicroBatch()], max_probes=6)
    assert plan.fits and plan.config.micro_batch_size < 8, plan.reason
    assert "a numerics change is taken (tier 1" in plan.reason and "the loss couples samples" in plan.reason
    assert "because no exact configuration fits" in plan.reason


def test_nothing_exact_fits_names_the_micro_batches_the_next_tier_opens():
    plan = autofit.autofit(Siamese, views, global_batch_size=64, loss_fn=info_nce, device="cpu",
                           memory_budget="120KiB", allow=0, strategies=["micro_batch"], max_probes=3)
    assert not plan.fits
    assert "Pass allow={'numerics'} (mixed precision, 8-bit optimizers, micro-batches smaller than the rank's " \
           "batch) to go further" in plan.reason, plan.reason


def test_the_check_computes_without_tf32_and_leaves_the_callers_flags():
    from autofit.devices.flags import backend_flags, without_tf32

    before, seen = backend_flags(), []

    def spying(output, batch):
        seen.append(backend_flags())
        return pulled_together(output, batch)

    _coupling(Siamese, spying)
    assert without_tf32(before) != before  # the loss is computed 4 times for the check (and once on meta before)
    assert len(seen) == 5 and seen[1:] == [without_tf32(before)] * 4
    assert backend_flags() == before
