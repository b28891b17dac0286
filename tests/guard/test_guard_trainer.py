"""The OOM guard in the Hugging Face Trainer: `Trainer(...)` -> `GuardedTrainer(...)` is the whole change.

An OOM forced mid-run (the CPU budget, lowered from a callback, with a forward that needs memory per
sample) is recovered inside the accumulation window: the weights match a plain Trainer's run. An OOM in
evaluation shrinks evaluation only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (BertConfig, BertForTokenClassification, GPT2Config, GPT2LMHeadModel, Trainer,
                          TrainerCallback, TrainingArguments)

from autofit.guard.trainer import GuardedTrainer
from autofit.devices.memory import CpuBudget
from guard_helpers import TokenLM

torch.set_num_threads(1)
SCRATCH = 1_000_000  # floats per sample the forward needs while `state["on"]`: dwarfs a step of the tiny model
SEQ, BATCH = 16, 8


class Records(torch.utils.data.Dataset):
    """Token rows; `padded`: each row's labels end early (-100), so pieces hold unlike numbers of targets."""

    def __init__(self, n: int, seed: int, padded: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=gen)
        self.labels = self.ids.clone()
        if padded:
            for row, length in enumerate(torch.randint(2, SEQ + 1, (n,), generator=gen).tolist()):
                self.labels[row, length:] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


MeanLossLM = TokenLM  # its loss is a mean (no `num_items_in_batch`): pieces must be weighted


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(config)
    if kind == "bert-token":  # takes **kwargs, so the Trainer passes num_items_in_batch, yet its loss is a mean
        config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=SEQ, num_labels=64,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return BertForTokenClassification(config)
    return MeanLossLM()


def _args(tmp_path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                             per_device_eval_batch_size=32, gradient_accumulation_steps=2, max_steps=4,
                             learning_rate=0.1, optim="sgd", max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", seed=0, dataloader_num_workers=0)


class _SqueezeAtStep(TrainerCallback):
    """From optimizer step `step` on, the forward needs SCRATCH floats per sample and the budget is tight."""

    def __init__(self, budget: CpuBudget, state: dict, step: int):
        self.budget, self.state, self.step, self.base = budget, state, step, 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:  # measure what one clean step needs above what lives between steps
            self.base = self.budget.current
            self.budget.reset_peak()
        if state.global_step == self.step and not self.state["on"]:
            self.state["on"] = True
            step_needs = self.budget.peak - self.base
            self.budget.limit = self.budget.current + step_needs + 6 * SCRATCH * 4  # 8 samples' scratch is over


def _needs_scratch(state: dict):
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if state["on"]:
            scratch = torch.ones(SCRATCH * ids.shape[0])
            del scratch

    return hook


@pytest.mark.parametrize("kind", ["gpt2", "mean-loss", "bert-token"])
def test_trainer_recovers_mid_run_and_matches_the_plain_trainer(tmp_path, kind):
    reference, padded = _model(kind), kind == "bert-token"  # its loss: a mean over the targets its labels hold
    Trainer(model=reference, args=_args(tmp_path / "ref"), train_dataset=Records(64, 1, padded)).train()

    model, state = _model(kind), {"on": False}
    model.register_forward_pre_hook(_needs_scratch(state), with_kwargs=True)
    with CpuBudget(None) as budget:
        trainer = GuardedTrainer(model=model, args=_args(tmp_path / "guarded"), train_dataset=Records(64, 1, padded),
                                 callbacks=[_SqueezeAtStep(budget, state, step=2)])
        trainer.train()
    guard = trainer.oom_guard
    assert state["on"] and [r.action for r in guard.recoveries] == ["micro-batch"]
    assert guard.recoveries[0].step == 2 and guard.config.micro_batch_size == 4
    assert guard.config.grad_accum_steps == 4 and trainer.state.global_step == 4
    assert guard.samples_seen == 4 * 2 * BATCH
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_evaluation_oom_in_trainer_leaves_the_training_batch_alone(tmp_path):
    model, state = _model("gpt2"), {"on": False}
    model.register_forward_pre_hook(_needs_scratch(state), with_kwargs=True)
    plain = Trainer(model=model, args=_args(tmp_path / "plain"), eval_dataset=Records(32, 2)).evaluate()
    with CpuBudget(None) as budget:
        trainer = GuardedTrainer(model=model, args=_args(tmp_path / "guarded"), eval_dataset=Records(32, 2))
        trainer.evaluate()
        state["on"] = True
        budget.limit = budget.peak + 10 * SCRATCH * 4  # 32 samples' scratch is over, 8 under
        metrics = trainer.evaluate()
    guard = trainer.oom_guard
    assert guard.eval_micro_batch_size <= 8 and guard.recoveries == []
    assert guard.config is None  # training never ran: its size was never set by evaluation
    assert metrics["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)


class _Wide(nn.Module):
    """One wide layer: 4 MB of weights, a few KB of activations per sample."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1000, 1000)

    def forward(self, x, labels):
        return {"loss": nn.functional.mse_loss(self.layer(x), labels)}


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict:
        return {"x": torch.randn(1000), "labels": torch.randn(1000)}


def test_an_oom_in_the_trainers_optimizer_step_names_what_needs_a_restart(tmp_path):
    """The guard splits the forward and backward; AdamW's states, made at the Trainer's first optimizer step,
    do not fit: the run ends in `GuardGaveUp` naming the rungs that need a new job, as `OomGuard.step` does
    (it had ended in the allocator's bare error from inside `torch.optim.adam`)."""
    from autofit.guard.core import GuardGaveUp

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=2,
                             optim="adamw_torch", report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", dataloader_num_workers=0)
    trainer = GuardedTrainer(model=_Wide(), args=args, train_dataset=_Rows())
    with CpuBudget(6_000_000):  # the gradients (4 MB) and the step fit; two AdamW states (8 MB) do not
        with pytest.raises(GuardGaveUp, match=r"Out of memory in the optimizer step at step 0 .*8-bit optimizer"):
            trainer.train()
    assert trainer.oom_guard.recoveries == []  # the forward and backward never ran out


@pytest.mark.parametrize("flag, running", [("bf16", "bf16"), ("fp16", "fp16")])
def test_a_trainer_in_another_precision_than_the_plans_is_refused(tmp_path, flag, running):
    from autofit import Config, Plan, UsageError

    plan = Plan(fits=True, config=Config(micro_batch_size=4), throughput=1.0, tokens_per_second=None, peak_memory=1,
                reason="tuned", probes=(), spec={}).save(tmp_path / "plan.json")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=32, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", dataloader_num_workers=0, **{flag: True})
    trainer = GuardedTrainer(model=_model("mean"), args=args, eval_dataset=Records(32, 2), guard_plan=plan)
    with pytest.raises(UsageError, match=f"The plan was measured in fp32 but this job runs {running};"):
        trainer.evaluate()
