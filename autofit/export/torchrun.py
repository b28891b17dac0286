"""torchrun: the command line and the environment it needs, as a bash script, and a training script.

torchrun.sh names the plan (AUTOFIT_PLAN, plan.json written beside it) for `autofit.prepare`, which
applies every knob in the training script with the probe's own code; train_with_prepare.py is such a
script (`--model`, `--dataset`, as `autofit tune` reads them). The knobs also travel as AUTOFIT_*
variables for scripts of your own, with those strategies add (`Strategy.launcher_keys(config, "torchrun")`);
where one names a DeepSpeed config (AUTOFIT_DEEPSPEED_CONFIG, ZeRO's), it is written beside them.
Over several nodes torchrun.sh runs on every node and the nodes meet at a c10d rendezvous on the first
(MASTER_ADDR, MASTER_PORT: `autofit.export.nodes`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from autofit.export import nodes
from autofit.export.deepspeed import file_config as deepspeed_file_config
from autofit.export.measured import comment_lines, measured, python_literal, require_fit
from autofit.export.model_setup import launcher_keys, setup_comments
from autofit.export.output import PLAN_FILENAME, Output, plan_output
from autofit.strategies.run import DEFAULT_GRADIENT_CLIPPING

FILENAME = "torchrun.sh"
SCRIPT_FILENAME = "train_with_prepare.py"
DEEPSPEED_VARIABLE = "AUTOFIT_DEEPSPEED_CONFIG"  # names the DeepSpeed config written beside torchrun.sh

if TYPE_CHECKING:
    from autofit.plan import Plan



def environment(plan: "Plan") -> dict[str, str]:
    """The environment variables the launched job needs (names -> values): every knob of the plan,
    plug-in strategies' included, as AUTOFIT_<KNOB>, the global batch, the plan's path, and those strategies
    add (a file they name lies beside torchrun.sh: `$here/`)."""
    require_fit(plan)
    config = plan.config
    env = {f"AUTOFIT_{name.upper()}": str(value) for name, value in config.to_dict().items()}
    env["AUTOFIT_GLOBAL_BATCH_SIZE"] = str(config.global_batch_size)
    env["AUTOFIT_PLAN"] = "$here/" + PLAN_FILENAME
    for name, value in launcher_keys(plan, "torchrun").items():
        if name.isupper():  # an environment variable (AUTOFIT_*, or a library's own such as PYTORCH_CUDA_ALLOC_CONF)
            env[name] = "$here/" + str(value) if name == DEEPSPEED_VARIABLE else str(value)
    return env


def command(plan: "Plan") -> list[str]:
    """The torchrun command line (the training script and its arguments follow it); over several nodes its
    rendezvous names MASTER_ADDR and MASTER_PORT, which the script expands (`autofit.export.nodes`)."""
    require_fit(plan)
    return ["torchrun", *nodes.torchrun_arguments(plan.config)]


def script(plan: "Plan") -> str:
    """torchrun.sh: comments with the measurement, the exports, then torchrun on the given script."""
    exports = [f'export {name}="{value}"' if value.startswith("$here") else f"export {name}={shlex.quote(value)}"
               for name, value in environment(plan).items()]
    return "\n".join([
        "#!/usr/bin/env bash", *comment_lines(plan), *setup_comments(plan, "torchrun"),
        "# Usage: bash torchrun.sh train.py [script args]", "set -euo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', *nodes.setup_lines(plan.config), *exports,
        f'exec {nodes.shell_join(command(plan))} "$@"',
    ]) + "\n"


def training_script(plan: "Plan") -> str:
    """train_with_prepare.py: a plain PyTorch loop over a DataLoader, the plan applied by `autofit.prepare`."""
    return f'''"""Train with the configuration autofit measured, in a plain PyTorch loop: autofit.prepare applies the
plan (precision, checkpointing, optimizer, LoRA, engine) with the code its probe ran. What was measured is
MEASURED below (and plan.json beside this file).

    bash {FILENAME} {SCRIPT_FILENAME} --model MODEL --dataset FILE.py:fn [--collate-fn FILE.py:fn]
        [--loss-fn FILE.py:fn] [--optimizer FILE.py:fn] [--max-steps N]

MODEL is what `autofit tune --model` took. Copy `train` into your own script as a starting point.
"""
import gc
import os
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import autofit

MEASURED = {python_literal(measured(plan))}


def train(model, dataset, loss_fn=None, optimizer=None, max_steps=None, max_grad_norm={_clipping(plan)!r},
          collate_fn=None):
    """Train on `dataset` (one epoch, or `max_steps` optimizer steps; batches made by `collate_fn`, default
    torch's), the gradients' global norm clipped to `max_grad_norm` (None: not clipped), as the Trainer,
    accelerate and DeepSpeed exports clip them; returns the prepared run."""
    plan = os.environ.get("AUTOFIT_PLAN", Path(__file__).with_name("{PLAN_FILENAME}"))
    prepared = autofit.prepare(plan, model, optimizer, loss_fn=loss_fn, max_grad_norm=max_grad_norm)
    ranks = dist.is_initialized() and dist.get_world_size() > 1
    sampler = DistributedSampler(dataset) if ranks else None
    loader = DataLoader(dataset, batch_size=prepared.batch_size, shuffle=sampler is None, sampler=sampler,
                        drop_last=True, collate_fn=collate_fn)  # micro-batch x accumulation samples per step and rank
    if not len(loader):
        raise SystemExit(f"The dataset has {{len(dataset)}} samples, fewer than one optimizer step's "
                         f"{{prepared.batch_size}} per rank; give it more samples.")
    step, epoch = 0, 0
    while step < (max_steps or len(loader)):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            loss = prepared.step(batch)
            step += 1
            if not ranks or dist.get_rank() == 0:
                print(f"step {{step}}: loss {{loss.item():.4f}} ({{prepared.config.describe()}})", flush=True)
            if step == (max_steps or len(loader)):
                break
        epoch += 1
    return prepared


if __name__ == "__main__":
    from autofit.export.scripts import (command_line, load_collate, load_dataset, load_loss, load_model,
                                        load_optimizer)

    options = command_line(__doc__, optimizer=True)
    train(load_model(options.model), load_dataset(options.dataset), load_loss(options.model, options.loss_fn),
          optimizer=load_optimizer(options.optimizer), max_steps=options.max_steps,
          collate_fn=load_collate(options.collate_fn))
    # Before exit, while the interpreter lives: what the run left in reference cycles, then the group.
    # Without the collect, 5 of 30 two-rank gloo runs aborted a rank at exit even after
    # destroy_process_group ("terminate called without an active exception"); with it, none of 60.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
'''


def _clipping(plan: "Plan") -> float | None:
    """The global gradient norm the script clips to: the other exports' (DEFAULT_GRADIENT_CLIPPING), or what a
    strategy says instead (None where the optimizer steps inside the backward: no global gradient to clip)."""
    return launcher_keys(plan, "torchrun").get("max_grad_norm", DEFAULT_GRADIENT_CLIPPING)


def files(plan: "Plan", folder: Path) -> list[Output]:
    """torchrun.sh, plan.json and train_with_prepare.py (and deepspeed.json where the environment names it)."""
    out = [Output(FILENAME, script(plan), executable=True), plan_output(plan),
           Output(SCRIPT_FILENAME, training_script(plan))]
    deepspeed_name = launcher_keys(plan, "torchrun").get(DEEPSPEED_VARIABLE)  # the engine's file, as its strategy names it
    if deepspeed_name:
        out.append(Output(deepspeed_name, json.dumps(deepspeed_file_config(plan), indent=2) + "\n"))
    return out


# What runs without your code, for `autofit.export.notes`: everything (train_with_prepare.py applies every knob
# with autofit.prepare; torchrun.sh launches the ranks), so no knob is left to your script.
launched = None
