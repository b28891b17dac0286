"""Rung 5, the optimizer step inside backward: each parameter steps as soon as its gradient is made.

A post-accumulate-grad hook per parameter runs that parameter's own optimizer and frees the gradient,
so the gradients never exist for the whole model at once: the step's peak loses all gradients but the
one being applied (4 bytes per parameter in fp32, 2 in pure bf16). It is the same math as a step after
backward only where every update reads its own parameter alone: accumulation 1 (otherwise the step would
run once per micro-batch), no clipping of the global gradient norm, no fp16 loss scaler (which checks
every gradient first), one torch rank (an engine or DDP reduces gradients after the hook) -- the rules
(`autofit.search.rules`) keep it there, so it is tier 0. Costs the optimizer's multi-tensor (foreach)
kernels: one small step per parameter.

In your own loop: `optimizer = InBackward(model.parameters(), torch.optim.AdamW)`, then `loss.backward()`
steps the weights; `optimizer.step()` and `zero_grad()` are no-ops (torchtune's `optimizer_in_bwd` works
the same way).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn

from autofit.config import Config
from autofit.config import OptimizerStep as S
from autofit.errors import UsageError
from autofit.strategies.base import Option, Rule, Strategy

if TYPE_CHECKING:
    from autofit.job.target import Target
    from autofit.strategies.run import TrainRun
    from autofit.job.train_spec import TrainSpec


def _in_backward_accumulation(c: Config, t: "Target") -> str | None:
    if c.steps_in_backward and c.grad_accum_steps > 1:
        return (f"the optimizer step in backward is exact only at accumulation 1: at {c.grad_accum_steps} it "
                "would step once per micro-batch")
    return None


class OptimizerInBackward(Strategy):
    """after_backward (the baseline), in_backward."""

    field = "optimizer_step"
    rung = 5  # after the optimizer strategy, whose optimizer it runs per parameter
    order = 1

    def options(self, spec: "TrainSpec") -> list[Option]:
        return [Option(S.AFTER_BACKWARD, 0, "one optimizer step after backward"),
                Option(S.IN_BACKWARD, 0, "optimizer step per parameter inside backward: no whole-model gradients "
                       "(accumulation 1, no global clipping)")]

    def rules(self) -> tuple[Rule, ...]:
        """The step in backward is exact at accumulation 1 only (its other limits are joint ones,
        `autofit.estimate.states.JOINT_RULES`)."""
        return (Rule("step in backward at accumulation 1", ("optimizer_step", "grad_accum_steps"), _in_backward_accumulation),)

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return a.steps_in_backward or not b.steps_in_backward

    def apply(self, run: "TrainRun") -> None:
        if not run.config.steps_in_backward or run.simulated or run.live:
            return  # simulated: its memory is `autofit.estimate.states.step_in_backward`'s
        if run.max_grad_norm:
            raise UsageError(f"max_grad_norm={run.max_grad_norm}: this plan steps the optimizer inside the backward "
                             f"({run.config.describe()}), one parameter at a time, so there is no global gradient "
                             "norm to clip. Leave max_grad_norm out, or train a plan whose optimizer steps after "
                             "the backward.")
        inner = run.optimizer_factory or torch.optim.AdamW
        run.optimizer_factory = lambda params: InBackward(params, inner)

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        return {}

    def replays_training(self, config: Config) -> bool:
        """No whole-model step to replay: each parameter steps in the backward."""
        return not config.steps_in_backward

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if not config.steps_in_backward:
            return []
        return ["from autofit.strategies.optimizer_in_backward import InBackward",
                "optimizer = InBackward(model.parameters(), torch.optim.AdamW)  # loss.backward() steps each "
                "parameter; optimizer.step() is a no-op"]

    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        # train_with_prepare.py clips nothing: no global gradient exists to clip
        return {"max_grad_norm": None} if fmt == "torchrun" and config.steps_in_backward else {}

    def refuses(self, config: Config, fmt: str) -> str | None:
        if not config.steps_in_backward or fmt not in REFUSED:
            return None
        return REFUSED[fmt]


REFUSED = {  # the formats whose launcher steps after backward, and why
    "deepspeed": "DeepSpeed's engine steps the optimizer after backward; the plan steps each parameter inside "
                 "backward (optimizer_step='in_backward'): export torchrun instead",
    "accelerate": "accelerate's optimizer wrapper and clip_grad_norm_ expect whole-model gradients after backward; "
                  "the plan steps each parameter inside backward (optimizer_step='in_backward'): export torchrun "
                  "instead",
    "trainer": "the Trainer steps the optimizer after backward and clips the global gradient norm (max_grad_norm); "
               "the step in backward (optimizer_step='in_backward') needs neither: export torchrun and step in your "
               "loop",
}


class InBackward:
    """One optimizer per parameter, stepped by that parameter's post-accumulate-grad hook; `step` and
    `zero_grad` are no-ops (the work happened in backward), so a plain training loop runs unchanged."""

    def __init__(self, params: Iterable[nn.Parameter], factory: Callable[[list[nn.Parameter]], Any]):
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = [factory([p]) for p in self.params]
        # Each hook reaches this object through a weak reference: a parameter keeps its hooks in autograd's C++
        # metadata, where the garbage collector cannot see a cycle (parameter -> hook -> optimizer -> parameter),
        # so a strong one would keep the model, its gradients and states alive after every probe.
        owner = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hooked, owner, i))
                       for i, p in enumerate(self.params)]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every per-parameter optimizer's groups (a learning-rate scheduler may edit them)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def defaults(self) -> dict[str, Any]:
        """The hyperparameters every per-parameter optimizer was built with."""
        return self.optimizers[0].defaults if self.optimizers else {}

    @property
    def state(self) -> dict[Any, Any]:
        """The states of all per-parameter optimizers, by parameter."""
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self, closure: Any = None) -> None:
        """Nothing: each parameter stepped when its gradient was made."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each gradient was freed once applied."""

    def state_dict(self) -> dict[str, Any]:
        """The per-parameter optimizers' state dicts, in parameter order."""
        return {"per_parameter": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""
        for optimizer, saved in zip(self.optimizers, state["per_parameter"], strict=True):
            optimizer.load_state_dict(saved)

    def remove(self) -> None:
        """Remove the hooks (the parameters then keep their gradients again)."""
        for hook in self._hooks:
            hook.remove()


def _hooked(owner: "weakref.ref[InBackward]", index: int, param: nn.Parameter) -> None:
    """The hook of parameter `index`: step its optimizer, while the `InBackward` that made it lives."""
    stepper = owner()
    if stepper is not None:
        _step(stepper.optimizers[index], param)


def _step(optimizer: Any, param: nn.Parameter) -> None:
    optimizer.step()
    param.grad = None
