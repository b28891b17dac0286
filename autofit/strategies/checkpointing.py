"""Rung 3, activation checkpointing: recompute blocks in backward instead of keeping their activations.

"ops" checkpoints every block op by op (selective activation checkpointing, torch's
`create_selective_checkpoint_contexts`): the outputs of matmuls and attention are kept, pointwise ops
(activation functions, norms, dropout, residual adds) are recomputed -- their share of the activations
for almost no extra FLOPs. "every_k" checkpoints every k-th block wholly (k = 2 and 4 where the depth
allows), "full" all blocks: 50-70% of activation memory for ~20-35% more compute. All tier 0 (same
math). Hugging Face models use their own switch; plain models (blocks in an nn.ModuleList /
nn.Sequential) get `torch.utils.checkpoint` with `use_reentrant=False` on the chosen blocks' forward,
whose recomputation updates scratch copies of their batch norms' running statistics, so the statistics
stay as the first run left them (same evaluation statistics too), op by op as well.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autofit.config import Checkpointing as C
from autofit.config import Config
from autofit.models.info import checkpoint_blocks
from autofit.strategies.base import Option, Rule, Strategy

if TYPE_CHECKING:
    from autofit.job.target import Target
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.run import TrainRun

# autofit checkpoints without re-entry (`use_reentrant=False`, torch's recommended mode): the forward keeps
# its autograd graph, so what a custom autograd Function holds as a plain attribute (bitsandbytes before
# 0.43.2, `autofit.strategies.quantization.SimulatedLinear4bit`) is kept through the forward. The
# calibration sets True to simulate runs measured with the re-entrant mode.
REENTRANT = False

EVERY = (4, 2)  # whole-block frequencies offered where the depth exceeds k: every k-th block, cheapest first

aten = torch.ops.aten
# What op-level checkpointing keeps: the outputs of matmuls and attention kernels (the FLOPs); everything
# else in a block is recomputed in backward. torchtitan's selective policy keeps the same kind of ops.
KEPT_OPS = frozenset(op for op in (
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.convolution,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    getattr(aten, "_scaled_dot_product_cudnn_attention", None),
    getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)) if op is not None)


class ActivationCheckpointing(Strategy):
    """none, op by op, every k-th block, all blocks."""

    field = "checkpointing"
    rung = 3
    order = 0
    activation_knobs = ("checkpointing", "checkpoint_every")

    def recomputes(self, config: Config) -> float:
        return config.recomputed_share

    def recomputed_blocks(self, config: Config) -> float:
        return config.checkpointed_share

    def relieves(self, config: Config) -> Config | None:
        # recomputation only adds FLOPs and kernels at the same micro-batch
        return config.replace(checkpointing=C.NONE, checkpoint_every=1) if config.checkpointing is not C.NONE else None

    def rules(self) -> tuple[Rule, ...]:
        return (Rule("activation offload with none or full checkpointing", ("activation_offload", "checkpointing"),
                     _activation_offload_pairing),)

    def options(self, spec: "TrainSpec") -> list[Option]:
        blocks = spec.model.num_blocks
        why_not = f"{spec.model.name} has no repeated blocks (nn.ModuleList / nn.Sequential) to checkpoint"
        too_few = lambda k: why_not if blocks < 2 else f"{blocks} blocks are too few to checkpoint every {_ordinal(k)}"  # noqa: E731
        selective = [Option(C.EVERY_K, 0, f"recompute every {_ordinal(k)} of {blocks} blocks" if blocks > k
                            else too_few(k), available=blocks > k, also=(("checkpoint_every", k),)) for k in EVERY]
        return [Option(C.NONE, 0, "keep all activations"),
                Option(C.OPS, 0, "every block op by op: keep matmul and attention outputs, recompute the "
                       "pointwise ops" if blocks >= 2 else why_not, available=blocks >= 2),
                *selective,
                Option(C.FULL, 0, f"recompute all {blocks} blocks" if blocks >= 2 else why_not,
                       available=blocks >= 2)]

    def saves_at_least(self, a: Config, b: Config) -> bool:
        # A partial order: full saves at least any mode, any mode at least none, every_k at least every_j
        # for k <= j; op-level and every_k keep different things, so neither is known to save more.
        if a.checkpointing is b.checkpointing:
            return a.checkpoint_every <= b.checkpoint_every
        return a.checkpointing is C.FULL or b.checkpointing is C.NONE

    def apply(self, run: "TrainRun") -> None:
        config = run.config
        if config.checkpointing is not C.NONE:
            enable(run.model, config.checkpoint_every, ops=config.checkpointing is C.OPS)

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        # whether checkpointing re-enters is the calibration's to set (`REENTRANT`); the step repeats alike every
        # k blocks where every k-th is checkpointed ("_unit": the blocks a deep model is simulated in units of)
        mode, every = config.checkpointing, config.checkpoint_every
        return {"checkpointing": (mode.value, every, mode is not C.NONE and REENTRANT), "_unit": every}

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        mode = config.checkpointing
        if mode not in (C.EVERY_K, C.OPS):  # none, or full: the launchers' own switch (`launcher_keys`)
            return []
        ops = mode is C.OPS
        what = "every block op by op" if ops else f"every {config.checkpoint_every}-th block"
        return ["from autofit.strategies.checkpointing import enable as checkpoint",
                f"checkpoint(model, {config.checkpoint_every}{', ops=True' if ops else ''})  # recompute {what}, "
                "as probed"]

    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        if fmt != "trainer":
            return {}
        # Trainer checkpoints all blocks or none; every k-th block is switched on in the script instead.
        name = trainer_switch()
        return {name: config.checkpointing is C.FULL, f"{name}_kwargs": {"use_reentrant": False}}


RENAMED_IN = (5, 23)  # the transformers release whose TrainingArguments took `activation_checkpointing`


def trainer_switch() -> str:
    """TrainingArguments' name for activation checkpointing: `activation_checkpointing` from transformers 5.23
    (`gradient_checkpointing` is its deprecated alias there, warned of), `gradient_checkpointing` before. A
    release is known by its version (importing TrainingArguments takes seconds, and a plain PyTorch model's
    search imports nothing else of transformers); a build between releases by its fields."""
    import dataclasses
    import importlib.metadata
    import re

    release = re.fullmatch(r"(\d+)\.(\d+)\.\d+", importlib.metadata.version("transformers"))
    if release:
        renamed = (int(release[1]), int(release[2])) >= RENAMED_IN
    else:
        from transformers import TrainingArguments

        renamed = "activation_checkpointing" in {field.name for field in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if renamed else "gradient_checkpointing"


def enable(model: nn.Module, k: int, ops: bool = False) -> None:
    """Checkpoint every k-th block of `model` (k=1: all), wholly or (`ops`) op by op, through Hugging
    Face's switch where it has one."""
    kwargs: dict[str, Any] = {"use_reentrant": REENTRANT}
    if ops:
        kwargs["context_fn"] = keep_matmuls
    hf_switch = getattr(model, "activation_checkpointing_enable", None)
    if getattr(model, "supports_gradient_checkpointing", False) and hf_switch is not None \
            and "every_n_layers" in inspect.signature(hf_switch).parameters:
        hf_switch(activation_checkpointing_kwargs=kwargs, every_n_layers=k)
        return
    if getattr(model, "supports_gradient_checkpointing", False) and (k == 1 or _flagged_layers(model)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for index, layer in enumerate(_flagged_layers(model)):  # every k-th, as `every_n_layers` switches them
            layer.gradient_checkpointing = index % k == 0
        return
    for index, block in enumerate(checkpoint_blocks(model)):
        if index % k == 0 and "forward" not in vars(block):
            block.forward = _checkpointed(block, block.forward, kwargs)


def _flagged_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated layers transformers switches one by one (its `GradientCheckpointingLayer`s, in module
    order), for transformers releases before `activation_checkpointing_enable(every_n_layers=)` (5.0 up to
    5.2x): switched on all by `gradient_checkpointing_enable`, then off but every k-th, as `every_n_layers`
    does. Empty where transformers has no such layers (4.x before 4.52: one switch on the whole stack, so
    every k-th block is checkpointed by its own forward, as a plain model's is)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def keep_matmuls() -> Any:
    """`context_fn` for `torch.utils.checkpoint.checkpoint`: keep the outputs of `KEPT_OPS`, recompute the rest."""
    return create_selective_checkpoint_contexts(_policy)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def disable(model: nn.Module) -> None:
    """Undo `enable`."""
    if hasattr(model, "gradient_checkpointing_disable") and getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    for block in checkpoint_blocks(model):
        vars(block).pop("forward", None)


def _checkpointed(block: nn.Module, forward: Any, options: dict[str, Any]) -> Any:
    """`forward` of `block` under `torch.utils.checkpoint`, its recomputation in backward leaving the
    block's batch norms' running statistics as the first run left them (`_statistics_aside`)."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        runs = iter(range(2))
        aside = _scratch_statistics(norms)  # made here, outside the region the checkpoint records

        def once(*inner: Any, **named: Any) -> Any:
            if next(runs, 1) == 0 or not aside:
                return forward(*inner, **named)
            with _statistics_aside(aside):
                return forward(*inner, **named)

        return torch.utils.checkpoint.checkpoint(once, *args, **options, **kwargs)

    return run


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _scratch_statistics(norms: list[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """A copy of each running statistic a training batch norm of `norms` updates, for the recomputation to
    update instead (`_statistics_aside`); none where no batch norm trains with running statistics."""
    with torch.no_grad():
        return [(m, name, m._buffers[name].clone()) for m in norms if m.training and m.track_running_stats
                for name in _STATISTICS if m._buffers.get(name) is not None]


@contextlib.contextmanager
def _statistics_aside(aside: list[tuple[nn.Module, str, torch.Tensor]]) -> Any:
    """The batch norms' running statistics (and `num_batches_tracked`) swapped for the scratch copies in
    `aside` while a recomputation runs, then swapped back untouched. A checkpointed block's forward runs
    twice per step, and each run in training updates them (torch/nn/modules/batchnorm.py
    `_BatchNorm.forward`), so a checkpointed ResNet's evaluation statistics had drifted from an unchecked
    one's (twice the momentum, num_batches_tracked 2 a step). Swapped, not skipped: the recomputation must
    run the ops the first run ran (torch.utils.checkpoint counts the tensors saved, and op-level
    checkpointing replays the first run's ops one for one: a clone or copy it did not record fails with
    "aten.clone.default encountered during backward but not found in storage"). Batch norm in training
    normalises by the batch's own statistics, so the copies' values change no output or gradient."""
    kept = [(module, name, module._buffers[name]) for module, name, _ in aside]
    try:
        for module, name, scratch in aside:
            module._buffers[name] = scratch
        yield
    finally:
        for module, name, buffer in kept:
            module._buffers[name] = buffer


def _ordinal(k: int) -> str:
    """2 -> "2nd", 4 -> "4th" (the every-k options' wording)."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def _activation_offload_pairing(c: Config, t: "Target") -> str | None:
    """The rule: activation offloading with none or full checkpointing only."""
    if c.offloads_activations and c.checkpointing in (C.EVERY_K, C.OPS):
        return (f"activation offloading is searched alone (every saved tensor moves) and on top of full "
                f"checkpointing (the block inputs move), not with checkpointing={c.checkpointing.value}, which "
                "keeps on the device some of what offloading moves")
    return None
