"""Train with a plan under `accelerate launch`: autofit.prepare applies what accelerate's config cannot
say (micro-batch, checkpointing, optimizer), accelerate does the rest (processes, mixed precision,
accumulation from the launch script's environment).

    autofit export examples/classifier-plan.json --format accelerate --out launch/
    bash launch/accelerate_launch.sh examples/train_accelerate.py --max-steps 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from accelerate import Accelerator
from torch.utils.data import DataLoader

import autofit

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from anywhere: classifier.py sits beside this file
from classifier import loss_fn, make_dataset, make_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=10, help="optimizer steps")
    args = parser.parse_args()
    prepared = autofit.prepare(os.environ["AUTOFIT_PLAN"], make_model(), engine=False)
    # The plan's accumulation, with gradients reduced on every micro-batch where it was measured so (FSDP2)
    accelerator = Accelerator(gradient_accumulation_plugin=prepared.gradient_accumulation_plugin())
    loader = DataLoader(make_dataset(), batch_size=prepared.micro_batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(prepared.model, prepared.optimizer, loader)
    steps = 0
    while steps < args.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(batch[0]), batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps += 1
                accelerator.print(f"step {steps}: loss {loss.item():.4f} ({prepared.config.describe()}, "
                                  f"accumulation {accelerator.gradient_accumulation_steps})")
                if steps == args.max_steps:
                    break


if __name__ == "__main__":
    main()
