"""Hugging Face `Trainer`: `TrainingArguments` keyword arguments as JSON, and a short script using them.

trainer_args.json holds `TrainingArguments` keyword arguments and nothing else, so
`TrainingArguments(**json.load(open("launch/trainer_args.json")))` works as it reads; the measurement is
in train_with_trainer.py's docstring (and plan.json beside them). What `TrainingArguments` cannot say
(selective checkpointing, the attention implementation, LoRA / quantized base weights, pure bf16, the
chunked loss, activation offloading) is done to the model in train_with_trainer.py, which trains when
run (`--model`, `--dataset`) or says what to pass. The optimizer step in backward refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.config import Attention, Checkpointing, Engine, Loss, Offload, Optimizer, Precision, Quantization
from autofit.export.deepspeed import FILENAME as DEEPSPEED_FILENAME
from autofit.strategies.deepspeed_config import DEFAULT_GRADIENT_CLIPPING
from autofit.export.deepspeed import file_config as deepspeed_file_config
from autofit.export.measured import comment_lines, require_fit, with_plugin_keys
from autofit.export.model_setup import setup_lines
from autofit.strategies.lora import Lora
from autofit.strategies.optimizer import torch_name

if TYPE_CHECKING:
    from autofit.plan import Plan

FILENAME = "trainer_args.json"
SCRIPT_FILENAME = "train_with_trainer.py"

# autofit optimizer -> TrainingArguments.optim. A user's own optimizer goes to Trainer(optimizers=...).
OPTIM = {
    Optimizer.ADAMW.value: "adamw_torch",
    Optimizer.ADAMW8BIT.value: "adamw_bnb_8bit",
    Optimizer.PAGED_ADAMW8BIT.value: "paged_adamw_8bit",
    Optimizer.ADAFACTOR.value: "adafactor",
}


def _checkpointing_name() -> str:
    """TrainingArguments' name for activation checkpointing: `activation_checkpointing` from transformers 5.2x
    (`gradient_checkpointing` is its deprecated alias there, warned of), `gradient_checkpointing` before."""
    import dataclasses

    from transformers import TrainingArguments

    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"

# torch optimizers TrainingArguments names (transformers/trainer_optimizer.py: `optim` builds the class with
# `learning_rate`, the groups' `weight_decay`, and these from `optim_args`, "key=value,...").
TORCH_OPTIM = {"SGD": ("sgd", ("momentum", "dampening", "nesterov")), "Adagrad": ("adagrad", ("lr_decay", "eps")),
               "RMSprop": ("rmsprop", ("momentum", "alpha", "eps", "centered"))}


def applies(plan: "Plan") -> str | None:
    """Why the Trainer cannot run `plan` (the optimizer step in backward, or your own optimizer of a class
    TrainingArguments cannot name), or None."""
    if plan.config.steps_in_backward:
        return ("the Trainer steps the optimizer after backward and clips the global gradient norm "
                "(max_grad_norm); the step in backward needs neither: export torchrun and step in your loop")
    recorded = plan.settings.get("optimizer", {})
    if plan.config.optimizer is Optimizer.USER and torch_name(recorded) not in TORCH_OPTIM:
        own = recorded.get("class", "a factory")
        return (f"the plan was tuned with your own optimizer ({own}), which TrainingArguments.optim cannot name "
                f"(it names {', '.join(TORCH_OPTIM)} and the Adam types): export torchrun (autofit.prepare builds "
                "it), or pass Trainer(optimizers=(optimizer, None)) yourself")
    return None


def training_arguments(plan: "Plan", deepspeed_path: str | None = None) -> dict[str, Any]:
    """`TrainingArguments` kwargs reproducing `plan` (per device batch, accumulation, precision,
    checkpointing, optimizer, DeepSpeed config path)."""
    require_fit(plan)
    config, checkpointing = plan.config, _checkpointing_name()
    kwargs: dict[str, Any] = {
        "output_dir": "trainer_output",
        "per_device_train_batch_size": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "bf16": config.precision == Precision.BF16.value,
        "fp16": config.precision == Precision.FP16.value,
        # Trainer checkpoints all blocks or none; every k-th block is switched on in the script instead.
        checkpointing: config.checkpointing is Checkpointing.FULL,
        f"{checkpointing}_kwargs": {"use_reentrant": False},
        "max_grad_norm": DEFAULT_GRADIENT_CLIPPING,
        "use_cpu": str(plan.spec.get("device", "")).startswith("cpu"),
        "report_to": "none",
    }
    recorded = plan.settings.get("optimizer", {})
    if config.optimizer in OPTIM:
        kwargs["optim"] = OPTIM[config.optimizer]
        kwargs.update(_hyperparameters(recorded.get("kwargs", {})))
    elif torch_name(recorded) in TORCH_OPTIM:  # your own torch optimizer, by name
        kwargs.update(_torch_optim(torch_name(recorded), recorded["kwargs"]))
    if config.zero_stage:
        kwargs["deepspeed"] = deepspeed_path or DEEPSPEED_FILENAME
    if config.engine is Engine.FSDP:
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = {"version": 2, "reshard_after_forward": config.shards_parameters,
                                 "cpu_offload": config.offload is Offload.CPU,
                                 "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    if config.needs_sync_each_micro_batch:  # as measured; the Trainer defers the reduce-scatter otherwise
        kwargs["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    return with_plugin_keys(kwargs, config, "trainer")


# optimizer hyperparameter -> TrainingArguments field(s). The Trainer's own defaults differ from torch's
# (learning_rate 5e-5, weight_decay 0), so the probe's are written out.
HYPERPARAMETERS = {"lr": ("learning_rate",), "weight_decay": ("weight_decay",), "eps": ("adam_epsilon",),
                   "betas": ("adam_beta1", "adam_beta2")}


def _hyperparameters(recorded: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments' fields for the hyperparameters the probe's optimizer was built with."""
    out: dict[str, Any] = {}
    for key, value in recorded.items():
        fields = HYPERPARAMETERS.get(key, ())
        out.update(zip(fields, value if len(fields) > 1 else [value]))
    return out


def _torch_optim(name: str, recorded: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments' fields for your own torch optimizer `name` with its recorded hyperparameters."""
    optim, extra = TORCH_OPTIM[name]
    args = ",".join(f"{key}={recorded[key]}" for key in extra if recorded.get(key) is not None)
    return {"optim": optim, "learning_rate": recorded["lr"], "weight_decay": recorded.get("weight_decay", 0.0),
            **({"optim_args": args} if args else {})}


def model_setup(plan: "Plan") -> list[str]:
    """Python lines applied to `model` before the Trainer is built, for knobs TrainingArguments lacks."""
    config = plan.config
    lines = []
    if config.attention != "default":
        lines.append(f'# Build the model with attn_implementation="{config.attention}" '
                     f'(e.g. AutoModelForCausalLM.from_config(config, attn_implementation="{config.attention}")).')
    lines += setup_lines(config)  # pure bf16, chunked loss, every-k / op-level checkpointing, activation offload
    if config.quantization is not Quantization.NONE:
        lines.append(f"# Load the base weights quantized ({config.quantization}) with transformers."
                     "BitsAndBytesConfig, then peft.prepare_model_for_kbit_training(model).")
    if config.lora:  # the adapters the probe trained (`Plan.settings`)
        kwargs = Lora.from_settings(config.lora, plan.settings.get("lora", {})).peft_kwargs(config.lora)
        lines += ["from peft import LoraConfig, get_peft_model",
                  f"model = get_peft_model(model, LoraConfig({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}))"]
    return lines


def beyond_arguments(plan: "Plan") -> list[str]:
    """The plan's knobs `trainer_args.json` cannot say, which train_with_trainer.py applies to the model (the
    JSON alone trains without them, at a micro-batch measured with them)."""
    config = plan.config
    knobs = {
        "pure bf16 weights": config.pure_bf16,
        f"attn_implementation={config.attention.value}": config.attention is not Attention.DEFAULT,
        f"checkpointing={config.checkpointing.value}": config.checkpointing in (Checkpointing.EVERY_K,
                                                                                Checkpointing.OPS),
        "the chunked loss": config.loss is Loss.CHUNKED,
        "activation offloading": config.offloads_activations,
        f"LoRA rank {config.lora}": bool(config.lora),
        f"{config.quantization.value} base weights": config.quantization is not Quantization.NONE,
    }
    return [name for name, applies in knobs.items() if applies]


def script(plan: "Plan") -> str:
    """train_with_trainer.py: `train(model, dataset, **overrides)`, and a command line that calls it."""
    setup = "\n".join(model_setup(plan)) or "# Nothing to change on the model for this plan."
    return f'''"""Train with the configuration autofit measured, through the Hugging Face Trainer.

{chr(10).join(comment_lines(plan, prefix=""))}

    python train_with_trainer.py --model MODEL --dataset FILE.py:fn [--collate-fn FILE.py:fn] [--max-steps N]

MODEL is what `autofit tune --model` took; the dataset's samples are dicts the model takes, with labels
(a Hugging Face model returns its loss). In Python: `from train_with_trainer import train`, then
`train(model, dataset, num_train_epochs=3)` (keyword overrides win).
"""
import json
from collections.abc import Mapping
from pathlib import Path

from transformers import Trainer, TrainingArguments


def train(model, train_dataset, loss_fn=None, data_collator=None, **overrides):
    """Train `model` on `train_dataset` with the exported arguments (`overrides` win, e.g. max_steps), its
    batches made by `data_collator` (default the Trainer's)."""
    sample = train_dataset[0]
    if not isinstance(sample, Mapping):  # the Trainer's collator and model(**batch) take dict samples
        raise SystemExit(f"The Trainer trains on dict samples (model(**batch), the model returning its loss); "
                         f"this dataset's are {{type(sample).__name__}}. Train with launch/train_with_prepare.py "
                         "(autofit export --format torchrun), which takes tuples and your loss_fn.")
    if loss_fn is not None:  # the Trainer's loss is the one the model returns
        raise SystemExit("The Trainer trains on the loss the model returns (output.loss); this model's loss is "
                         "your loss_fn. Train with launch/train_with_prepare.py (autofit export --format "
                         "torchrun), which takes your loss_fn.")
    kwargs = json.loads(Path(__file__).with_name("{FILENAME}").read_text())
    args = TrainingArguments(**{{**kwargs, **overrides}})
{_indent(setup)}
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, data_collator=data_collator)
    if args.gradient_accumulation_steps > 1 and trainer.model_accepts_loss_kwargs and \
            not _divides_by_count(trainer, train_dataset):
        # A forward taking **kwargs is left to divide its loss by num_items_in_batch, and the Trainer then does
        # not divide it by the accumulation steps; this model's loss ignores it (T5's own cross-entropy), so each
        # step would add its micro-batches' means. The Trainer divides instead, as autofit's probes weighed them.
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    return trainer


def _divides_by_count(trainer, train_dataset):
    """Whether the model's loss on a micro-batch divides by the num_items_in_batch it is given (evaluation mode,
    no gradient: autofit.batches.shares.divides_by_count, as the guard asks it); True, the Trainer's own reading,
    where the forward cannot tell (it refuses the keyword, or runs under an engine)."""
    import torch
    from autofit.batches.shares import divides_by_count

    model, device = trainer.model, trainer.args.device
    samples = [train_dataset[i] for i in range(min(len(train_dataset), trainer.args.per_device_train_batch_size))]
    batch = {{key: value.to(device) if hasattr(value, "to") else value
             for key, value in trainer.data_collator(samples).items()}}
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return divides_by_count(
                lambda n: float(model(**batch, num_items_in_batch=torch.tensor(n, device=device)).loss), 1)
    except Exception:  # noqa: BLE001 - the Trainer's own reading stands
        return True
    finally:
        model.train(training)


if __name__ == "__main__":
    from autofit.export.scripts import command_line, load_collate, load_dataset, load_loss, load_model

    options = command_line(__doc__, loss=False)
    overrides = {{"max_steps": options.max_steps}} if options.max_steps else {{}}
    train(load_model(options.model), load_dataset(options.dataset), load_loss(options.model, None),
          data_collator=load_collate(options.collate_fn), **overrides)
'''


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def export(plan: "Plan", out_dir: Path) -> list[Path]:
    """Write trainer_args.json (the kwargs alone) and train_with_trainer.py (and deepspeed.json when ZeRO
    is used)."""
    paths = []
    deepspeed_path = None
    if plan.config is not None and plan.config.zero_stage:
        ds = out_dir / DEEPSPEED_FILENAME
        ds.write_text(json.dumps(deepspeed_file_config(plan), indent=2) + "\n")
        paths.append(ds)
        deepspeed_path = str(ds.resolve())
    args_path = out_dir / FILENAME
    args_path.write_text(json.dumps(training_arguments(plan, deepspeed_path), indent=2) + "\n")
    script_path = out_dir / SCRIPT_FILENAME
    script_path.write_text(script(plan))
    return [args_path, script_path, *paths]
