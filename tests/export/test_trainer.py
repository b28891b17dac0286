"""trainer_args.json goes into `transformers.TrainingArguments(**kwargs)`, and the exported script trains
a tiny GPT-2 for two steps on the CPU with it."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from autofit import Config, UsageError

TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)


def load_kwargs(path):
    return json.load(open(path))  # as the README does it: the file holds the kwargs and nothing else


@pytest.mark.parametrize("precision,checkpointing,optimizer,optim", [
    ("fp32", "none", "adamw", "adamw_torch"),
    ("bf16", "full", "adafactor", "adafactor"),
    ("fp16", 2, "paged_adamw8bit", "paged_adamw_8bit"),
    ("bf16", "none", "adamw8bit", "adamw_bnb_8bit"),
])
def test_training_arguments_accept_kwargs(tmp_path, plan_for, precision, checkpointing, optimizer, optim):
    mode = "every_k" if checkpointing == 2 else checkpointing
    config = Config(micro_batch_size=4, grad_accum_steps=2, precision=precision, checkpointing=mode,
                    checkpoint_every=2 if checkpointing == 2 else 1, optimizer=optimizer)
    args_path, script_path = plan_for(config).export("trainer", tmp_path)
    kwargs = load_kwargs(args_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated name (gradient_checkpointing in 5.2x)
        args = TrainingArguments(**kwargs)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2)
    assert (args.bf16, args.fp16) == (precision == "bf16", precision == "fp16")
    assert args.gradient_checkpointing is (checkpointing == "full")  # the old name mirrors the new one
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.optim.value == optim
    assert ("checkpoint(model, 2)" in script_path.read_text()) is (checkpointing == 2)


def test_exported_script_trains_two_steps(tmp_path, plan_for):
    torch.manual_seed(0)
    config = Config(micro_batch_size=2, grad_accum_steps=2, checkpointing="every_k", checkpoint_every=2)
    args_path, script_path = plan_for(config).export("trainer", tmp_path)
    spec = importlib.util.spec_from_file_location("train_with_trainer", script_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    ids = torch.randint(0, 64, (8, 16))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    collated = []  # a collate function of one's own (`--collate-fn`) makes the Trainer's batches

    def collate(samples):
        collated.append(len(samples))
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    trainer = module.train(model, dataset, max_steps=2, output_dir=str(tmp_path / "out"), save_strategy="no",
                           data_collator=collate)
    assert trainer.state.global_step == 2 and collated and set(collated) == {2}
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.args.per_device_train_batch_size == 2
    # every 2nd block, switched on by the script: transformers' switch, or (before 4.52, one switch for the whole
    # stack) the block's own forward
    assert model.is_gradient_checkpointing or "forward" in vars(model.transformer.h[0])
    assert load_kwargs(args_path)["use_cpu"] is True


def test_zero_plan_names_its_deepspeed_file(tmp_path, plan_for):
    config = Config(micro_batch_size=2, grad_accum_steps=2, sharding="zero2", precision="bf16")
    paths = plan_for(config, device="cuda:0").export("trainer", tmp_path)
    kwargs = load_kwargs(paths[0])
    ds_path = tmp_path / "deepspeed.json"
    assert ds_path in paths and kwargs["deepspeed"] == str(ds_path.resolve())
    assert json.loads(ds_path.read_text())["zero_optimization"]["stage"] == 2


def test_fsdp_plan_sets_fsdp2_arguments(tmp_path, plan_for):
    config = Config(micro_batch_size=2, grad_accum_steps=2, num_gpus=2, sharding="fsdp_full", offload="cpu")
    args_path, _ = plan_for(config).export("trainer", tmp_path)
    args = TrainingArguments(**load_kwargs(args_path))
    assert args.fsdp_config["version"] == 2
    assert args.fsdp_config["reshard_after_forward"] is True and args.fsdp_config["cpu_offload"] is True
    # measured reducing gradients on every micro-batch; the Trainer defers the reduce-scatter otherwise
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}


@pytest.mark.parametrize("config", [Config(micro_batch_size=2, num_gpus=2, sharding="fsdp_full"),
                                    Config(micro_batch_size=2, grad_accum_steps=2, num_gpus=2)])
def test_the_trainers_own_accumulation_stays_where_it_costs_no_memory(tmp_path, plan_for, config):
    args_path, _ = plan_for(config).export("trainer", tmp_path)  # FSDP2 without accumulation; DDP
    assert "accelerator_config" not in load_kwargs(args_path)


def test_new_rungs_run_in_the_exported_script(tmp_path, plan_for):
    torch.manual_seed(0)
    config = Config(micro_batch_size=2, grad_accum_steps=2, precision="pure_bf16", checkpointing="ops",
                    loss="chunked", activation_offload="cpu")
    args_path, script_path = plan_for(config).export("trainer", tmp_path)
    text = script_path.read_text()
    assert "pure_bf16(model)" in text and "chunk_loss(model)" in text and "ops=True" in text
    assert "offload_activations(model)" in text
    spec = importlib.util.spec_from_file_location("train_with_trainer_rungs", script_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    ids = torch.randint(0, 64, (8, 16))
    trainer = module.train(model, [{"input_ids": row, "labels": row} for row in ids], max_steps=2,
                           output_dir=str(tmp_path / "out"), save_strategy="no")
    assert trainer.state.global_step == 2 and trainer.state.log_history
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert load_kwargs(args_path)["bf16"] is False  # no autocast: the weights are bf16 themselves


def test_the_step_in_backward_refuses_the_trainer_with_the_reason(tmp_path, plan_for):
    plan = plan_for(Config(micro_batch_size=4, optimizer_step="in_backward"))
    with pytest.raises(UsageError, match="steps the optimizer after backward"):
        plan.export("trainer", tmp_path)


DATA = textwrap.dedent("""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    def make_model():
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))

    def make_dataset():
        ids = torch.randint(0, 64, (8, 16))
        return [{"input_ids": row, "labels": row} for row in ids]

    def with_loss_fn():  # a model whose loss is the user's: (model, make_batch, loss_fn)
        head = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Flatten(), torch.nn.Linear(128, 64))
        return (head, lambda n: {"input": torch.randint(0, 64, (n, 16)), "labels": torch.randint(0, 64, (n,))},
                lambda output, batch: torch.nn.functional.cross_entropy(output, batch["labels"]))
""")


def test_run_as_a_script_it_trains_or_says_what_to_pass(tmp_path, plan_for):
    _, script_path = plan_for(Config(micro_batch_size=2, grad_accum_steps=2)).export("trainer", tmp_path / "launch")
    (tmp_path / "data.py").write_text(DATA)
    bare = subprocess.run([sys.executable, "-X", "importtime", str(script_path)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert bare.returncode == 2 and "pass --model and --dataset" in bare.stderr
    # the usage answers without transformers' import (seconds): the script imports the Trainer when it trains
    imported = {line.rsplit("|", 1)[-1].strip() for line in bare.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported and not any(name.split(".")[0] == "transformers" for name in imported)
    done = subprocess.run([sys.executable, str(script_path), "--model", "data.py:make_model", "--dataset",
                           "data.py:make_dataset", "--max-steps", "2"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'train_loss'" in done.stdout + done.stderr or "train_runtime" in done.stdout + done.stderr
    assert (tmp_path / "trainer_output").is_dir()
    examples = Path(__file__).resolve().parents[2] / "examples" / "classifier.py"  # tuple samples, a loss_fn
    tuples = subprocess.run([sys.executable, str(script_path), "--model", f"{examples}:make", "--dataset",
                             f"{examples}:make_dataset", "--max-steps", "2"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)
    assert tuples.returncode == 1 and "dict samples" in tuples.stderr and "train_with_prepare.py" in tuples.stderr
    # dict samples for a model whose loss is a loss_fn: was the Trainer's "The model did not return a loss"
    owned = subprocess.run([sys.executable, str(script_path), "--model", "data.py:with_loss_fn", "--dataset",
                            "data.py:make_dataset", "--max-steps", "2"], capture_output=True, text=True, cwd=tmp_path,
                           timeout=300)
    assert owned.returncode == 1 and "this model's loss is your loss_fn" in owned.stderr, owned.stderr[-2000:]


def test_lora_is_exported_as_the_probes_trained_it(plan_for):
    import dataclasses

    from autofit.export.trainer import model_setup

    plan = dataclasses.replace(plan_for(Config(lora=8)), settings={
        "lora": {"target_modules": ["c_attn"], "alpha": 4, "dropout": 0.05}})
    assert "LoraConfig(r=8, lora_alpha=4, lora_dropout=0.05, target_modules=['c_attn'])" in "\n".join(model_setup(plan))
    older = plan_for(Config(lora=8))  # a plan saved before settings were recorded: autofit's defaults
    assert "LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules='all-linear')" in "\n".join(model_setup(older))


def test_the_probes_hyperparameters_become_training_arguments(plan_for):
    import dataclasses

    from autofit.export.trainer import training_arguments

    recorded = {"class": "torch.optim.AdamW", "kwargs": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-8,
                                                          "weight_decay": 0.1}}
    plan = dataclasses.replace(plan_for(Config()), settings={"optimizer": recorded})
    kwargs = training_arguments(plan)
    assert {k: kwargs[k] for k in ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay")} == \
        {"learning_rate": 3e-4, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-8, "weight_decay": 0.1}
    TrainingArguments(**kwargs)  # transformers takes them


def test_your_own_torch_optimizer_is_named_and_another_refused(tmp_path, plan_for):
    import dataclasses

    from autofit.export import applicable
    from autofit.export.trainer import training_arguments

    recorded = {"class": "torch.optim.sgd.SGD", "kwargs": {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                                            "weight_decay": 1e-4, "foreach": None}}
    plan = dataclasses.replace(plan_for(Config(optimizer="user")), settings={"optimizer": recorded})
    kwargs = training_arguments(plan)
    assert {k: kwargs[k] for k in ("optim", "learning_rate", "weight_decay", "optim_args")} == \
        {"optim": "sgd", "learning_rate": 0.05, "weight_decay": 1e-4, "optim_args": "momentum=0.9,nesterov=True"}
    TrainingArguments(**kwargs)
    mine = dataclasses.replace(plan, settings={"optimizer": {"class": "__main__.Lion", "kwargs": {"lr": 1e-4}}})
    assert "trainer" not in applicable(mine)
    with pytest.raises(UsageError, match=r"your own optimizer \(__main__.Lion\).*export torchrun"):
        mine.export("trainer", tmp_path)


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_a_loss_that_ignores_num_items_in_batch_is_divided_by_the_accumulation(tmp_path, plan_for, family):
    """The Trainer leaves a forward taking **kwargs to divide its loss by num_items_in_batch and does not divide it
    by the accumulation steps; T5's own cross-entropy ignores it (transformers 5.24), so a step of 2 micro-batches
    logged twice the loss of the same samples in one (measured: 10.5 against 5.3). GPT-2's loss honours it."""
    from transformers import T5Config, T5ForConditionalGeneration

    _, script_path = plan_for(Config(micro_batch_size=4, grad_accum_steps=2)).export("trainer", tmp_path)
    spec = importlib.util.spec_from_file_location(f"train_with_trainer_{family}", script_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(**overrides):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
                                                    vocab_size=64, decoder_start_token_id=0, pad_token_id=0,
                                                    dropout_rate=0.0)) \
            if family == "t5" else GPT2LMHeadModel(GPT2Config(**TINY, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
        rows = torch.randint(1, 64, (8, 16), generator=torch.Generator().manual_seed(1))
        data = [{"input_ids": row, "labels": row} for row in rows]
        trainer = module.train(model, data, max_steps=1, output_dir=str(tmp_path / "out"), save_strategy="no",
                               logging_steps=1, **overrides)
        return trainer, trainer.state.log_history[0]["loss"]

    accumulated, loss = run()
    whole = run(per_device_train_batch_size=8, gradient_accumulation_steps=1)[1]
    assert loss == pytest.approx(whole, rel=0.02)  # one step over the same 8 samples, however it is split
    # GPT-2's forward takes **kwargs (num_items_in_batch) where its release does (not 4.46's); T5's never counts
    takes = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(GPT2LMHeadModel.forward).parameters.values())
    assert accumulated.model_accepts_loss_kwargs is (family == "gpt2" and takes)
