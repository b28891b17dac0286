"""Rung 5, smaller optimizer states: bitsandbytes 8-bit AdamW (plain or paged) and Adafactor.

AdamW keeps 8 bytes of state per parameter; 8-bit AdamW 2 bytes (75% less); paged 8-bit AdamW also lets
the states page out to host memory under pressure; Adafactor keeps factored second moments only.
Costs numerics (tier 1). bitsandbytes is an optional extra (`autofit[bnb]`) and needs CUDA.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from autofit.config import Optimizer as O
from autofit.errors import MissingExtraError
from autofit.strategies.base import Option, Strategy

BNB = {O.ADAMW8BIT.value: "AdamW8bit", O.PAGED_ADAMW8BIT.value: "PagedAdamW8bit"}


class OptimizerStates(Strategy):
    """adamw, adamw8bit, paged_adamw8bit, adafactor (or the user's own optimizer, kept)."""

    field = "optimizer"
    rung = 5

    def options(self, spec) -> list[Option]:
        chosen = spec.optimizer
        if not chosen.explore:
            available, why = _available(chosen.name, spec)
            return [Option(chosen.name, 0, why or f"the optimizer you gave ({chosen.name}) is kept", available)]
        options = [Option(O.ADAMW.value, 0, "torch AdamW, 8 bytes of state per parameter")]
        for name, why_offered in ((O.ADAMW8BIT.value, "bitsandbytes 8-bit AdamW: 75% less state"),
                                  (O.PAGED_ADAMW8BIT.value, "bitsandbytes paged 8-bit AdamW: states page to host"),
                                  (O.ADAFACTOR.value, "Adafactor: factored second moment, no first moment")):
            available, why_not = _available(name, spec)
            options.append(Option(name, 1, why_offered if available else why_not, available))
        return options

    def saves_at_least(self, a: Any, b: Any) -> bool:
        return a == b or b == O.ADAMW.value

    def isolates(self, value: Any) -> bool:
        """Paged optimizers allocate unified memory outside the allocator: probe them in a child process."""
        return value == O.PAGED_ADAMW8BIT.value

    def apply(self, run, value: Any) -> None:
        run.optimizer_factory = make_factory(value, run.spec.optimizer)


def make_factory(name: str, chosen) -> Any:
    """params -> optimizer for the optimizer `name`, with the user's hyperparameters where they apply."""
    kwargs = dict(chosen.kwargs)
    if name == O.USER.value:
        return chosen.factory
    if name == O.ADAMW.value:
        return lambda params: torch.optim.AdamW(params, **kwargs)
    if name == O.ADAFACTOR.value:
        keep = {k: v for k, v in kwargs.items() if k in ("lr", "weight_decay")}
        return lambda params: torch.optim.Adafactor(params, **keep)
    if name in BNB:
        bnb = _import_bnb()
        cls = getattr(bnb.optim, BNB[name])
        return lambda params: cls(params, **kwargs)
    raise ValueError(f"unknown optimizer {name!r}")


def _available(name: str, spec) -> tuple[bool, str]:
    if name not in BNB:
        return True, ""
    if importlib.util.find_spec("bitsandbytes") is None:
        return False, "bitsandbytes is not installed: pip install 'autofit[bnb]'"
    if spec.device.type != "cuda":
        return False, "bitsandbytes 8-bit optimizers need CUDA"
    return True, ""


def _import_bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError as exc:
        raise MissingExtraError("bitsandbytes", "bnb", "8-bit optimizers") from exc
    return bitsandbytes
