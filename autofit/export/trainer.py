"""Hugging Face `Trainer`: `TrainingArguments` keyword arguments as JSON, and a short script using them.

trainer_args.json holds `TrainingArguments` keyword arguments and nothing else, so
`TrainingArguments(**json.load(open("launch/trainer_args.json")))` works as it reads; the measurement is
in train_with_trainer.py's docstring (and plan.json beside them). The keys come from the strategies
(`Strategy.launcher_keys(config, "trainer")`); what `TrainingArguments` cannot say (selective
checkpointing, the attention implementation, LoRA / quantized base weights, pure bf16, the chunked loss,
activation offloading: `Strategy.setup_lines`) is done to the model in train_with_trainer.py, which trains
when run (`--model`, `--dataset`) or says what to pass. The optimizer step in backward refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.export import nodes
from autofit.export.deepspeed import file_config as deepspeed_file_config
from autofit.export.measured import measured, python_literal, require_fit, with_launcher_keys
from autofit.export.model_setup import setup_lines, strategies_of
from autofit.export.output import Output
from autofit.strategies.run import DEFAULT_GRADIENT_CLIPPING

if TYPE_CHECKING:
    from autofit.plan import Plan

FILENAME = "trainer_args.json"
SCRIPT_FILENAME = "train_with_trainer.py"
DEEPSPEED_ARGUMENT = "deepspeed"  # TrainingArguments' path to a DeepSpeed config: written beside when a key names it


def training_arguments(plan: "Plan", deepspeed_path: str | None = None) -> dict[str, Any]:
    """`TrainingArguments` kwargs reproducing `plan`: the per device batch, accumulation, clipping and device,
    then what the strategies say (`Strategy.launcher_keys(config, "trainer")`: precision, checkpointing, the
    optimizer, the engine), the DeepSpeed config at `deepspeed_path` where one is named."""
    require_fit(plan)
    config = plan.config
    kwargs: dict[str, Any] = {
        "output_dir": "trainer_output",
        "per_device_train_batch_size": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "max_grad_norm": DEFAULT_GRADIENT_CLIPPING,
        "use_cpu": str(plan.spec.get("device", "")).startswith("cpu"),
        "report_to": "none",
    }
    kwargs = with_launcher_keys(kwargs, plan, "trainer")
    if deepspeed_path and DEEPSPEED_ARGUMENT in kwargs:
        kwargs[DEEPSPEED_ARGUMENT] = deepspeed_path
    return kwargs


def model_setup(plan: "Plan") -> list[str]:
    """Python lines applied to `model` before the Trainer is built, for knobs TrainingArguments lacks."""
    return setup_lines(plan, "trainer")


def beyond_arguments(plan: "Plan") -> list[str]:
    """The plan's knobs `trainer_args.json` cannot say, which train_with_trainer.py applies to the model (the
    JSON alone trains without them, at a micro-batch measured with them): those whose strategy has lines for
    the script, as knob=value."""
    return [f"{strategy.field}={strategy.value(plan.config)}" for strategy in strategies_of(plan)
            if strategy.setup_lines(plan.config, "trainer")]


def script(plan: "Plan") -> str:
    """train_with_trainer.py: `train(model, dataset, **overrides)`, and a command line that calls it."""
    setup = "\n".join(model_setup(plan)) or "# Nothing to change on the model for this plan."
    return f'''"""Train with the configuration autofit measured, through the Hugging Face Trainer. What was measured
is MEASURED below (and plan.json beside this file, where autofit tune wrote both).

    {launch_words(plan)} --model MODEL --dataset FILE.py:fn [--collate-fn FILE.py:fn] [--max-steps N]
{_nodes_usage(plan)}
MODEL is what `autofit tune --model` took; the dataset's samples are dicts the model takes, with labels
(a Hugging Face model returns its loss). In Python: `from train_with_trainer import train`, then
`train(model, dataset, num_train_epochs=3)` (keyword overrides win).
"""
import json
from collections.abc import Mapping
from pathlib import Path

MEASURED = {python_literal(measured(plan))}


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
    from transformers import Trainer, TrainingArguments  # here, not above: a usage error answers at once

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


def _nodes_usage(plan: "Plan") -> str:
    """Over several nodes, how the script is launched on each (torchrun's rendezvous); nothing on one."""
    config = plan.config
    if config.nodes == 1:
        return ""
    words = " ".join(w if "$" not in w else f'"{w}"' for w in nodes.torchrun_arguments(config))
    return (f"\nOver {config.nodes} nodes x {config.gpus_per_node} GPUs, on every node (MASTER_ADDR: the first node's "
            f"address,\nMASTER_PORT: {nodes.DEFAULT_PORT} unless set; these files on a path every node reads):\n\n"
            f"    torchrun {words} train_with_trainer.py --model MODEL --dataset FILE.py:fn\n")


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _usage(plan: "Plan") -> str:
    """How to launch the script: python, or torchrun on as many processes as the plan has ranks on a node (over
    several nodes, `_nodes_usage` says how each node joins)."""
    ranks = plan.config.gpus_per_node
    return f"torchrun --nproc_per_node {ranks}" if plan.config.num_gpus > 1 else "python"


def launch_words(plan: "Plan") -> str:
    """The command that launches train_with_trainer.py as the plan was measured."""
    return f"{_usage(plan)} {SCRIPT_FILENAME}"


def files(plan: "Plan", folder: Path) -> list[Output]:
    """trainer_args.json (the kwargs alone) and train_with_trainer.py (and deepspeed.json where the arguments
    name one, by its absolute path in `folder`, the export folder)."""
    deepspeed_name = training_arguments(plan).get(DEEPSPEED_ARGUMENT)  # the engine's file, as its strategy names it
    deepspeed_path = str((folder / deepspeed_name).resolve()) if deepspeed_name else None
    out = [Output(FILENAME, json.dumps(training_arguments(plan, deepspeed_path), indent=2) + "\n"),
           Output(SCRIPT_FILENAME, script(plan))]
    if deepspeed_name:
        out.append(Output(deepspeed_name, json.dumps(deepspeed_file_config(plan), indent=2) + "\n"))
    return out


def launched(plan: "Plan") -> dict[str, Any]:
    """What runs without your code: the TrainingArguments and the lines train_with_trainer.py runs on the model
    (`autofit.export.notes` names the knobs neither says)."""
    return {"arguments": training_arguments(plan), "script": model_setup(plan)}
