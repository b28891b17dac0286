"""What a user's own optimizer holds and allocates, measured on stand-in parameters.

autofit's named optimizers have formulas (`autofit.estimate.states`): AdamW keeps two moments the size of
the weights, 8-bit AdamW one byte each, Adafactor its factored moments. An optimizer of your own (an
instance or a factory: SGD, RMSprop, Lion, ...) has none, and counting it as AdamW over-predicts plain
SGD by twice the weights, enough for the tuner to skip configurations that fit. So its first steps are
run here over two stand-in parameters (a matrix and a vector, gradients of ones) and what they allocate
is read as a CPU probe reads memory (`autofit.devices.memory.CpuBudget`):

- `states`: bytes of per-parameter state tensors after the first step, per byte of weight (SGD 0, SGD
  with momentum 1, Adam 2; scalar step counters left out);
- `foreach_temporaries`: the most bytes the step holds beyond its states on torch's foreach path (the
  CUDA default: lists the size of every weight), per byte of weight;
- `single_temporaries`: the same on its single-tensor path (the CPU default: one parameter at a time),
  per byte of the largest parameter. An optimizer whose groups name no `foreach` is measured as built.

The estimator scales them by the trainable weights (`autofit.estimate.states`). Where the stand-in steps
fail (a closure-taking optimizer such as LBFGS, a factory that needs the real parameters), nothing is
measured and the estimator counts AdamW, saying so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

STAND_IN_SIDE = 256  # the matrix's rows and columns: a step counter's 4 bytes are 0.006% of its weight


@dataclasses.dataclass(frozen=True)
class OptimizerCosts:
    """Bytes per byte of weight (see the module's docstring)."""

    states: float
    foreach_temporaries: float
    single_temporaries: float

    def describe(self) -> str:
        return f"{self.states:.3g}x the trained weights, measured on stand-ins"


def stand_ins() -> list[nn.Parameter]:
    """A matrix and a vector: a factory that splits decay from no-decay parameters shows its groups."""
    return [nn.Parameter(torch.zeros(STAND_IN_SIDE, STAND_IN_SIDE)), nn.Parameter(torch.zeros(STAND_IN_SIDE))]


def measure(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> OptimizerCosts | None:
    """The costs of `optimizer`, built over `params` (`stand_ins`, no state yet): three steps with gradients
    of ones, the first making its states, the next two on each path. None where a step fails."""
    weight = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    for param in params:
        param.grad = torch.ones_like(param)
    try:
        with torch.no_grad():
            optimizer.step()
            states = sum(_state_bytes(optimizer.state.get(p, {})) for p in params)
            foreach, single = (_temporaries(optimizer, path) for path in (True, False))
    except Exception:  # noqa: BLE001 - the stand-ins cannot show this optimizer's costs: counted as AdamW
        return None
    return OptimizerCosts(states / weight, foreach / weight, single / largest)


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(t.untyped_storage().nbytes() for t in state.values() if isinstance(t, torch.Tensor) and t.numel() > 1)


def _temporaries(optimizer: torch.optim.Optimizer, foreach: bool) -> int:
    """The most bytes one step holds beyond what it started with, on the foreach or single-tensor path
    where its groups name one (torch's optimizers read `group["foreach"]` at every step)."""
    from autofit.devices.memory import CpuBudget  # counts what ops make, as a CPU probe does

    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = foreach
    with CpuBudget(None) as allocations:
        optimizer.step()
    return allocations.peak
