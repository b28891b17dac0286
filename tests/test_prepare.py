"""autofit.prepare applies a plan with the probe's own code: a prepared step peaks where the probe did."""

from __future__ import annotations

import pytest
import torch

import autofit
from autofit import Config, UsageError
from autofit.devices.memory import CpuBudget
from autofit.probe.run import run_probe
from autofit.job.train_spec import make_spec
from autofit.strategies import default_strategies
from models import make_gpt2, make_mlp, make_mlp_batch, mlp_loss


def gpt2_batch(n: int) -> dict:
    ids = torch.randint(0, 256, (n, 48), generator=torch.Generator().manual_seed(n))
    return {"input_ids": ids, "labels": ids}


CASES = [
    (make_mlp, make_mlp_batch, mlp_loss, Config(micro_batch_size=4, grad_accum_steps=2)),
    (make_mlp, make_mlp_batch, mlp_loss, Config(micro_batch_size=2, grad_accum_steps=4, checkpointing="full",
                                                optimizer="adafactor")),
    (make_mlp, make_mlp_batch, mlp_loss, Config(micro_batch_size=8, checkpointing="every_k", checkpoint_every=2)),
    (make_gpt2, gpt2_batch, None, Config(micro_batch_size=4, grad_accum_steps=2, attention="sdpa",
                                         checkpointing="full")),
    (make_gpt2, gpt2_batch, None, Config(micro_batch_size=8, attention="eager", lora=16)),
]


@pytest.mark.parametrize("make_model, make_batch, loss_fn, config", CASES,
                         ids=lambda v: v.describe() if isinstance(v, Config) else None)
def test_prepared_step_peaks_where_the_probe_did(make_model, make_batch, loss_fn, config):
    spec = make_spec(make_model, make_batch, global_batch_size=config.global_batch_size, device="cpu",
                     memory_budget="1GiB", loss_fn=loss_fn)
    probe = run_probe(spec, config, default_strategies())
    assert probe.fits, probe.reason
    with CpuBudget(None) as budget:  # the probe counts the model build and its micro-batch too
        prepared = autofit.prepare(config, make_model(), loss_fn=loss_fn)
        micro_batch = make_batch(config.micro_batch_size)
        for _ in range(spec.warmup_steps):
            prepared.step(_tiled(micro_batch, config.grad_accum_steps))
    assert budget.peak == probe.peak_bytes


def _tiled(micro_batch, times):
    """`times` copies of a micro-batch as one batch, made outside the count (a loader's batch is the
    loop's, not the step's); the probe keeps one micro-batch live, so the step splits this into views."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return torch.utils._pytree.tree_map(lambda t: torch.cat([t] * times), micro_batch)


def test_a_tuned_plan_runs_at_its_measured_peak(tmp_path):
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss)
    path = plan.save(tmp_path / "plan.json")
    with CpuBudget(None) as budget:
        prepared = autofit.prepare(str(path), make_mlp(), loss_fn=mlp_loss)
        batch = make_mlp_batch(plan.config.micro_batch_size)
        for _ in range(2):
            prepared.run.step([batch] * prepared.grad_accum_steps)  # the probe's worst case, every micro-step
    assert budget.peak == plan.peak_memory
    assert prepared.batch_size * plan.config.num_gpus == 8


def test_the_pieces_for_a_loop_of_your_own():
    config = Config(micro_batch_size=3, grad_accum_steps=2, checkpointing="full", optimizer="adafactor")
    prepared = autofit.prepare(config, make_mlp(), loss_fn=mlp_loss)
    assert isinstance(prepared.optimizer, torch.optim.Adafactor)
    assert "forward" in vars(prepared.model.blocks[0])  # checkpointed the way the probe does it
    chunks = prepared.micro_batches(make_mlp_batch(7))
    assert [c[0].shape[0] for c in chunks] == [3, 3, 1]
    before = [p.detach().clone() for p in prepared.model.parameters()]
    loss = prepared.step(make_mlp_batch(6))
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, prepared.model.parameters()))


@pytest.mark.parametrize("sharding,synced", [("fsdp_full", True), ("none", False)])
def test_accelerates_accumulation_reduces_as_the_plan_was_measured(sharding, synced):
    config = Config(micro_batch_size=2, grad_accum_steps=3, num_gpus=2, sharding=sharding)
    plugin = autofit.prepare(config, make_mlp(), loss_fn=mlp_loss, engine=False).gradient_accumulation_plugin()
    assert (plugin.num_steps, plugin.sync_each_batch) == (3, synced)  # FSDP2 reduce-scatters every micro-batch


def test_an_optimizer_of_the_plans_kind_is_kept_and_another_kind_rebuilt_with_its_lr():
    model = make_mlp()
    mine = torch.optim.AdamW(model.parameters(), lr=0.05)
    assert autofit.prepare(Config(), model, mine, loss_fn=mlp_loss).optimizer is mine
    rebuilt = autofit.prepare(Config(optimizer="adafactor"), make_mlp(), mine, loss_fn=mlp_loss).optimizer
    assert isinstance(rebuilt, torch.optim.Adafactor) and rebuilt.defaults["lr"] == 0.05


def test_an_optimizer_of_the_plans_kind_keeps_its_hyperparameters_when_rebuilt():
    model = make_gpt2()
    mine = torch.optim.Adafactor(model.parameters(), lr=0.05)
    prepared = autofit.prepare(Config(optimizer="adafactor", lora=4), model, mine)  # adapters: new parameters
    assert prepared.optimizer is not mine and isinstance(prepared.optimizer, torch.optim.Adafactor)
    assert prepared.optimizer.defaults["lr"] == 0.05


def test_an_optimizer_factory_is_used_and_checked():
    prepared = autofit.prepare(Config(), make_mlp(), lambda ps: torch.optim.AdamW(ps, lr=0.2), loss_fn=mlp_loss)
    assert prepared.optimizer.defaults["lr"] == 0.2
    with pytest.raises(UsageError, match="factory built SGD.*measured with AdamW"):
        autofit.prepare(Config(), make_mlp(), lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_lora_trains_the_adapters_only():
    model = make_gpt2()
    given = torch.optim.AdamW(model.parameters(), lr=0.01)
    prepared = autofit.prepare(Config(lora=8), model, given)
    trainable = {id(p) for p in prepared.model.parameters() if p.requires_grad}
    in_optimizer = {id(p) for g in prepared.optimizer.param_groups for p in g["params"]}
    assert prepared.optimizer is not given and in_optimizer == trainable
    assert prepared.optimizer.defaults["lr"] == 0.01
    assert len(trainable) < len(list(prepared.model.parameters()))


def test_bad_inputs_name_the_fix(tmp_path):
    with pytest.raises(UsageError, match="your own optimizer; pass it again"):
        autofit.prepare(Config(optimizer="user"), make_mlp())
    with pytest.raises(UsageError, match="measured with Adafactor.*SGD"):
        model = make_mlp()
        autofit.prepare(Config(optimizer="adafactor"), model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UsageError, match="4 ranks.*torchrun"):
        autofit.prepare(Config(num_gpus=4, micro_batch_size=2), make_mlp())
    with pytest.raises(UsageError, match="Cannot read a plan"):
        autofit.prepare(tmp_path / "missing.json", make_mlp())
    with pytest.raises(UsageError, match="attn_implementation='sdpa'.*BlockMLP is not a Hugging Face model"):
        autofit.prepare(Config(attention="sdpa"), make_mlp())
    with pytest.raises(UsageError, match="takes a Plan"):
        autofit.prepare({"precision": "bf16"}, make_mlp())


def test_the_probes_hyperparameters_are_recorded_and_reused_without_an_optimizer(tmp_path):
    model = make_mlp()
    mine = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.95), weight_decay=0.1)
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer=mine, allow=0)
    assert plan.settings["optimizer"] == {"class": "torch.optim.AdamW",
                                          "kwargs": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-8,
                                                     "weight_decay": 0.1}}
    prepared = autofit.prepare(plan.save(tmp_path / "plan.json"), make_mlp(), loss_fn=mlp_loss)
    used = prepared.optimizer.param_groups[0]  # an AdamW, or one per parameter stepped in backward
    assert (used["lr"], tuple(used["betas"]), used["weight_decay"]) == (3e-4, (0.8, 0.95), 0.1)


def test_a_plan_tuned_with_your_own_optimizer_instance_rebuilds_its_class(tmp_path):
    model = make_mlp()
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert plan.settings["optimizer"]["class"] == "torch.optim.sgd.SGD"
    prepared = autofit.prepare(plan.save(tmp_path / "plan.json"), make_mlp(), loss_fn=mlp_loss)
    assert isinstance(prepared.optimizer, torch.optim.SGD)
    assert (prepared.optimizer.defaults["lr"], prepared.optimizer.defaults["momentum"]) == (0.1, 0.9)


def test_a_plan_tuned_with_your_own_optimizer_factory_rebuilds_what_it_built(tmp_path):
    """A factory's class and hyperparameters are read from what it builds over stand-in parameters, as an
    instance's are: `prepare` rebuilds it without the factory; one whose groups differ asks for it again."""
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                           allow=0, max_probes=2)
    assert plan.settings["optimizer"]["class"] == "torch.optim.sgd.SGD"
    assert plan.spec["optimizer"] == "user (torch.optim.sgd.SGD)"
    prepared = autofit.prepare(plan.save(tmp_path / "plan.json"), make_mlp(), loss_fn=mlp_loss)
    assert isinstance(prepared.optimizer, torch.optim.SGD)
    assert (prepared.optimizer.defaults["lr"], prepared.optimizer.defaults["momentum"]) == (0.1, 0.9)

    def split(params):  # decay on matrices only: the stand-ins' matrix and vector show the groups differ
        params = list(params)
        return torch.optim.SGD([{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
                                {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}], lr=0.1)

    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer=split, allow=0, max_probes=2)
    assert plan.settings["optimizer"]["differ_by_group"] == ["weight_decay"]
    with pytest.raises(UsageError, match="groups differ in weight_decay.*train_with_prepare.py takes --optimizer"):
        autofit.prepare(plan, make_mlp(), loss_fn=mlp_loss)
    assert autofit.prepare(plan, make_mlp(), split, loss_fn=mlp_loss).optimizer.param_groups[1]["weight_decay"] == 0.0


def test_strategies_that_leave_the_optimizer_out_still_build_the_plans():
    """The search trained Adafactor with `strategies` that leave the optimizer rung out; `prepare` given the
    same strategies builds Adafactor too, not the Config's default AdamW."""
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer="adafactor", strategies=["micro_batch", "checkpointing"],
                           max_probes=2)
    assert plan.config.optimizer.value == "adafactor"
    prepared = autofit.prepare(plan, make_mlp(), loss_fn=mlp_loss, strategies=["micro_batch", "checkpointing"])
    assert isinstance(prepared.optimizer, torch.optim.Adafactor)


def test_adam_by_name_is_adamw_without_weight_decay():
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer="adam", allow=0)
    assert plan.settings["optimizer"]["kwargs"]["weight_decay"] == 0.0


def test_hyperparameters_are_read_from_the_groups_as_they_are_now():
    model = make_mlp()
    edited = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.2)
    for group in edited.param_groups:  # a scheduler or an edit after construction
        group["lr"], group["weight_decay"] = 3e-5, 0.0
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer=edited, allow=0, max_probes=2)
    assert plan.settings["optimizer"]["kwargs"]["lr"] == 3e-5 and plan.settings["optimizer"]["kwargs"]["weight_decay"] == 0

    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    grouped = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}])
    plan = autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="3MiB",
                           loss_fn=mlp_loss, optimizer=grouped, allow=0, max_probes=2)
    recorded = plan.settings["optimizer"]
    assert recorded["kwargs"]["weight_decay"] == 0.1 and recorded["differ_by_group"] == ["weight_decay"]  # the largest
    with pytest.raises(UsageError, match="parameter groups differ in weight_decay.*pass your optimizer"):
        autofit.prepare(plan, make_mlp(), loss_fn=mlp_loss)
