"""Rung 5, smaller optimizer states: bitsandbytes 8-bit AdamW (plain or paged) and Adafactor.

AdamW keeps 8 bytes of state per parameter; 8-bit AdamW 2 bytes (75% less); paged 8-bit AdamW also lets
the states page out to host memory under pressure; Adafactor keeps factored second moments only.
Costs numerics (tier 1). bitsandbytes is an optional extra (`autofit[bnb]`) and needs CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from autofit.config import Config
from autofit.config import Optimizer as O
from autofit.errors import MissingExtraError
from autofit.strategies.base import Option, Placement, Strategy
from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.probe.step import TrainRun
    from autofit.spec.train import TrainSpec
    from autofit.spec.train import OptimizerSpec

BNB = {O.ADAMW8BIT: "AdamW8bit", O.PAGED_ADAMW8BIT: "PagedAdamW8bit"}


class OptimizerStates(Strategy):
    """adamw, adamw8bit, paged_adamw8bit, adafactor (or the user's own optimizer, kept)."""

    field = "optimizer"
    rung = 5

    def options(self, spec: "TrainSpec") -> list[Option]:
        chosen = O(spec.optimizer.name)
        if not spec.optimizer.explore:
            available, why = _available(chosen, spec)
            return [Option(chosen, 0, why or f"the optimizer you gave ({chosen.value}) is kept", available)]
        options = [Option(O.ADAMW, 0, "torch AdamW, 8 bytes of state per parameter")]
        for name, why_offered in ((O.ADAMW8BIT, "bitsandbytes 8-bit AdamW: 75% less state"),
                                  (O.PAGED_ADAMW8BIT, "bitsandbytes paged 8-bit AdamW: states page to host; they live "
                                   "in unified memory, which the budget neither caps nor counts: bounded by the card"),
                                  (O.ADAFACTOR, "Adafactor: factored second moment, no first moment")):
            available, why_not = _available(name, spec)
            options.append(Option(name, 1, why_offered if available else why_not, available))
        return options

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return a.optimizer is b.optimizer or b.optimizer is O.ADAMW

    def placement(self, config: Config) -> Placement:
        """Paged optimizers allocate unified memory outside the allocator: probe them in a child process."""
        return Placement.CHILD if config.optimizer is O.PAGED_ADAMW8BIT else Placement.IN_PROCESS

    def apply(self, run: "TrainRun") -> None:
        run.optimizer_factory = make_factory(run.config.optimizer, run.spec.optimizer)


def make_factory(name: O, chosen: "OptimizerSpec") -> Any:
    """params -> optimizer for the optimizer `name`, with the user's hyperparameters where they apply."""
    kwargs = dict(chosen.kwargs)
    if name is O.USER:
        return chosen.factory
    if name is O.ADAMW:
        return lambda params: torch.optim.AdamW(params, **kwargs)
    if name is O.ADAFACTOR:
        keep = {k: v for k, v in kwargs.items() if k in ("lr", "weight_decay")}
        return lambda params: torch.optim.Adafactor(params, **keep)
    if name in BNB:
        bnb = _import_bnb()
        cls = getattr(bnb.optim, BNB[name])
        return lambda params: cls(params, **kwargs)
    raise ValueError(f"unknown optimizer {name!r}")


def _available(name: O, spec) -> tuple[bool, str]:
    if name not in BNB:
        return True, ""
    if not spec.target.has("bitsandbytes"):
        return False, "bitsandbytes is not installed: pip install 'autofit[bnb]'"
    if not spec.target.cuda:
        return False, "bitsandbytes 8-bit optimizers need CUDA"
    if name is O.PAGED_ADAMW8BIT:
        return _paged_bounded(spec)
    return True, ""


def _paged_bounded(spec: "TrainSpec") -> tuple[bool, str]:
    """Paged states come from cudaMallocManaged (bitsandbytes functional.py `get_paged`, a CPU-typed tensor
    tagged is_paged): the caching allocator neither caps nor counts them, so a probe cannot show they fit
    a budget below the card it runs on. Offered only where the budget is the whole card."""
    if not (spec.target.live and spec.target.cuda):
        return True, ""
    from autofit.spec.devices import device_memory

    card = device_memory(spec.device)
    if spec.memory_budget < card:
        return False, (f"paged 8-bit states live in unified memory that the {format_size(spec.memory_budget)} budget "
                       f"cannot cap or count: a probe on this {format_size(card)} card cannot show they fit a smaller "
                       "one (tune with the whole card as the budget to consider them)")
    return True, ""


def _import_bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError as exc:
        raise MissingExtraError("bitsandbytes", "bnb", "8-bit optimizers") from exc
    return bitsandbytes
