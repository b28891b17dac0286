"""The lines a training script runs on its model to apply what no launcher file can say: pure bf16,
the chunked loss, checkpointing op by op or every k-th block, activation offloading and the optimizer
step in backward. Each line calls the strategy function the probe ran, in the order the probe applied
them (rung order), so the launched job runs what was measured.

The Trainer script runs them itself; the DeepSpeed file lists them in its "autofit" section, and the
accelerate and torchrun files as comments, for your train.py.
"""

from __future__ import annotations

from autofit.config import Checkpointing, Config, Loss


def setup_lines(config: Config) -> list[str]:
    """Python lines applying `config`'s model-side rungs to a variable `model` (none when it has none)."""
    lines = []
    if config.pure_bf16:
        lines += ["from autofit.strategies.pure_bf16 import enable as pure_bf16",
                  "pure_bf16(model)  # bf16 weights and inputs; build the optimizer afterwards (bf16 states)"]
    if config.loss is Loss.CHUNKED:
        lines += ["from autofit.strategies.chunked_loss import enable as chunk_loss",
                  "chunk_loss(model)  # head + cross-entropy in chunks when labels are given"]
    if config.checkpointing in (Checkpointing.EVERY_K, Checkpointing.OPS):
        ops = config.checkpointing is Checkpointing.OPS
        what = "every block op by op" if ops else f"every {config.checkpoint_every}-th block"
        lines += ["from autofit.strategies.checkpointing import enable as checkpoint",
                  f"checkpoint(model, {config.checkpoint_every}{', ops=True' if ops else ''})  # recompute {what}, "
                  "as probed"]
    if config.offloads_activations:
        lines += ["from autofit.strategies.activation_offload import enable as offload_activations",
                  "offload_activations(model)  # saved activations to pinned host memory"]
    if config.steps_in_backward:
        lines += ["from autofit.strategies.optimizer_in_backward import InBackward",
                  "optimizer = InBackward(model.parameters(), torch.optim.AdamW)  # loss.backward() steps each "
                  "parameter; optimizer.step() is a no-op"]
    return lines


def setup_comments(config: Config) -> list[str]:
    """`setup_lines` as shell/YAML comments for train.py (none when there are none)."""
    lines = setup_lines(config)
    return ["# In train.py, after building the model (as probed):", *(f"#   {line}" for line in lines)] if lines else []
