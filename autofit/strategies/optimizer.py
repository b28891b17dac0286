"""Rung 5, smaller optimizer states: bitsandbytes 8-bit AdamW (plain or paged) and Adafactor.

AdamW keeps 8 bytes of state per parameter; 8-bit AdamW 2 bytes (75% less); paged 8-bit AdamW also lets
the states page out to host memory under pressure; Adafactor keeps factored second moments only.
Costs numerics (tier 1). bitsandbytes is an optional extra (`autofit[bnb]`) and needs CUDA.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import Config
from autofit.config import Optimizer as O
from autofit.errors import MissingExtraError, UsageError
from autofit.strategies.base import Option, Placement, Strategy
from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.strategies.run import TrainRun
    from autofit.job.train_spec import TrainSpec
    from autofit.job.train_spec import OptimizerSpec

BNB = {O.ADAMW8BIT: "AdamW8bit", O.PAGED_ADAMW8BIT: "PagedAdamW8bit"}
TORCH_CLASSES = {O.ADAMW: torch.optim.AdamW, O.ADAFACTOR: torch.optim.Adafactor}


class OptimizerStates(Strategy):
    """adamw, adamw8bit, paged_adamw8bit, adafactor (or the user's own optimizer, kept)."""

    field = "optimizer"
    rung = 5

    def __init__(self, explore: bool = True):
        # False: the user's optimizer alone, where this rung joins a space whose strategies left it out
        # (`autofit.search.space.build_space`): not searched, but still the optimizer the job trains with
        self.explore = explore

    def options(self, spec: "TrainSpec") -> list[Option]:
        chosen = O(spec.optimizer.name)
        if not (spec.optimizer.explore and self.explore):
            available, why = _available(chosen, spec)
            return [Option(chosen, 0, why or f"the optimizer you gave ({chosen.value}) is kept", available)]
        options = [Option(O.ADAMW, 0, "torch AdamW, 8 bytes of state per parameter")]
        for name, why_offered in ((O.ADAMW8BIT, "bitsandbytes 8-bit AdamW: 75% less state"),
                                  (O.PAGED_ADAMW8BIT, "bitsandbytes paged 8-bit AdamW: states page to host; they live "
                                   "in unified memory, which the budget neither caps nor counts: bounded by the card"),
                                  (O.ADAFACTOR, "Adafactor: factored second moment, no first moment")):
            available, why_not = _available(name, spec)
            options.append(Option(name, 1, why_offered if available else why_not, available, degree=2))
        return options

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return a.optimizer is b.optimizer or b.optimizer is O.ADAMW

    def placement(self, config: Config) -> Placement:
        """Paged optimizers allocate unified memory outside the allocator: probe them in a child process."""
        return Placement.CHILD if config.optimizer is O.PAGED_ADAMW8BIT else Placement.IN_PROCESS

    def settings(self, config: Config, spec: "TrainSpec") -> dict[str, Any]:
        """The optimizer the probe built: its class (a user's own where it was given as an instance), the
        hyperparameters it was built with, defaults filled in (an instance's as its groups hold them, the
        largest group's where they differ), and which differ between the instance's groups; a factory's as
        it built over stand-in parameters (`autofit.job.train_spec.parse_optimizer`), nothing where that could
        not be seen."""
        chosen = spec.optimizer
        if config.optimizer is O.USER and chosen.cls is None:
            return {}
        cls = CLASSES.get(config.optimizer) or f"{chosen.cls.__module__}.{chosen.cls.__qualname__}"
        grouped = {"differ_by_group": list(chosen.grouped)} if chosen.grouped else {}
        return {"class": cls, "kwargs": hyperparameters(config.optimizer, chosen), **grouped}

    def apply(self, run: "TrainRun") -> None:
        run.optimizer_factory = make_factory(run.config.optimizer, run.spec.optimizer)


def make_factory(name: O, chosen: "OptimizerSpec") -> Any:
    """params -> optimizer for the optimizer `name`, with the user's hyperparameters where they apply."""
    if name is O.USER:
        return chosen.factory
    kwargs = _kwargs_for(name, chosen)
    cls = getattr(_import_bnb().optim, BNB[name]) if name in BNB else TORCH_CLASSES[name]
    return lambda params: cls(params, **kwargs)


def _kwargs_for(name: O, chosen: "OptimizerSpec") -> dict[str, Any]:
    """The user's hyperparameters that optimizer `name` takes: all of an AdamW's for the Adam types, lr and
    weight decay for Adafactor (its update has no betas)."""
    if name is O.ADAFACTOR:
        return {k: v for k, v in chosen.kwargs.items() if k in ("lr", "weight_decay")}
    return dict(chosen.kwargs)


# What each optimizer is built with when the user gives no hyperparameter: torch.optim.AdamW's defaults,
# which bitsandbytes' AdamW8bit and PagedAdamW8bit share (bitsandbytes/optim/adamw.py: lr 1e-3, betas
# (0.9, 0.999), eps 1e-8, weight_decay 1e-2), and torch.optim.Adafactor's (lr 1e-2, weight_decay 0).
DEFAULTS = {O.ADAMW: {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 1e-2},
            O.ADAFACTOR: {"lr": 1e-2, "weight_decay": 0.0}}
CLASSES = {**{name: f"torch.optim.{cls.__name__}" for name, cls in TORCH_CLASSES.items()},
           **{name: f"bitsandbytes.optim.{cls}" for name, cls in BNB.items()}}


def hyperparameters(name: O, chosen: "OptimizerSpec") -> dict[str, Any]:
    """The hyperparameters optimizer `name` is built with (`make_factory`), its defaults filled in, as JSON
    values: what the exports write (DeepSpeed's optimizer params, the Trainer's learning_rate and betas)."""
    defaults = DEFAULTS[O.ADAFACTOR if name is O.ADAFACTOR else O.ADAMW] if name is not O.USER else {}
    return _json_values({**defaults, **_kwargs_for(name, chosen)})


def recorded(config: Config, settings: dict[str, Any]) -> "OptimizerSpec | None":
    """The optimizer a plan's probes trained with, from what `OptimizerStates.settings` recorded (`Plan.settings`):
    the plan's kind with its hyperparameters, or the user's own class (torch.optim's, or another importable one)
    rebuilt with its hyperparameters. None where nothing was recorded or the class cannot be imported here; a
    `UsageError` where the groups of the optimizer it was tuned with differed (only that optimizer says how)."""
    from autofit.job.train_spec import OptimizerSpec

    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.get("kwargs", {}).items()}
    if settings.get("differ_by_group"):
        raise UsageError(f"The plan was tuned with an optimizer whose parameter groups differ in "
                         f"{', '.join(settings['differ_by_group'])}, which one set of hyperparameters cannot rebuild; "
                         "pass your optimizer (or a factory params -> optimizer) again: prepare(plan, model, optimizer) "
                         "(the exported train_with_prepare.py takes --optimizer FILE.py:fn).")
    if config.optimizer is not O.USER:
        return OptimizerSpec(config.optimizer.value, kwargs, explore=False)
    cls = _import_class(settings.get("class"))
    if cls is None:
        return None
    return OptimizerSpec("user", kwargs, factory=functools.partial(cls, **kwargs), cls=cls, explore=False)


def torch_name(settings: dict[str, Any]) -> str | None:
    """The `torch.optim` name of the class `OptimizerStates.settings` recorded ("SGD" for torch.optim.sgd.SGD),
    for launchers that build torch's optimizers by name; None for another class or nothing recorded."""
    cls = _import_class(settings.get("class"))
    return cls.__name__ if cls is not None and getattr(torch.optim, cls.__name__, None) is cls else None


def _import_class(path: str | None) -> type | None:
    module, _, name = (path or "").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def _json_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries JSON can hold (tuples as lists; `parse_optimizer` already made a tensor learning rate a float)."""
    out = {}
    for key, value in kwargs.items():
        value = list(value) if isinstance(value, tuple) else value
        items = value if isinstance(value, list) else [value]
        if all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
            out[key] = value
    return out


def _available(name: O, spec) -> tuple[bool, str]:
    if name is O.ADAFACTOR and spec.model.complex_weights:
        return False, ("Adafactor does not step complex weights, which this model trains (torch/optim/_adafactor.py "
                       "raises \"Adafactor does not support complex parameters\")")
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
    from autofit.devices.device import device_memory

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
