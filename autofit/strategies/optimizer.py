"""Rung 5, smaller optimizer states: bitsandbytes 8-bit AdamW (plain or paged) and Adafactor.

AdamW keeps 8 bytes of state per parameter; 8-bit AdamW 2 bytes (75% less); paged 8-bit AdamW also lets
the states page out to host memory under pressure; Adafactor keeps factored second moments only.
Costs numerics (tier 1). bitsandbytes is an optional extra (`autofit[bnb]`) and needs CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import Config, Engine
from autofit.config import Optimizer as O
from autofit.errors import MissingExtraError, UsageError
from autofit.strategies.base import EngineInputs, Option, Placement, Rule, Strategy
from autofit.units import format_size

if TYPE_CHECKING:
    from autofit.job.target import Target
    from autofit.strategies.costs import StepFacts
    from autofit.strategies.run import TrainRun
    from autofit.job.train_spec import TrainSpec
    from autofit.job.train_spec import OptimizerSpec

logger = logging.getLogger("autofit.prepare")

BNB = {O.ADAMW8BIT: "AdamW8bit", O.PAGED_ADAMW8BIT: "PagedAdamW8bit"}
TORCH_CLASSES = {O.ADAMW: torch.optim.AdamW, O.ADAFACTOR: torch.optim.Adafactor}
# Ops of one optimizer step on the weights' device as CUDA's default runs it (foreach): (fixed, per
# trainable tensor, a one-tensor step), counted on the CPU with foreach=True (bench/measurements/host_ops.py, torch
# 2.13). bitsandbytes' 8-bit step loops over the parameters in Python: one fused update and a
# `torch.cuda.synchronize()` each (bitsandbytes/optim/optimizer.py `Optimizer8bit.step`, @ 51294d90).
OPTIMIZER_OPS = {O.ADAMW: (8, 0, 8), O.USER: (8, 0, 8), O.ADAFACTOR: (23, 4, 20),
                 O.ADAMW8BIT: (0, 2, 2), O.PAGED_ADAMW8BIT: (0, 2, 2)}


class OptimizerStates(Strategy):
    """adamw, adamw8bit, paged_adamw8bit, adafactor (or the user's own optimizer, kept)."""

    field = "optimizer"
    rung = 5
    order = 0

    def __init__(self, explore: bool = True):
        # False: the user's optimizer alone, where this rung joins a space whose strategies left it out
        # (`autofit.search.space.build_space`): not searched, but still the optimizer the job trains with
        self.explore = explore
        self.trained: dict[str, Any] = {}  # what `settings` recorded, where this instance is a plan's (`recorded`)

    @classmethod
    def required(cls) -> "OptimizerStates":
        """Every run trains with an optimizer: the user's alone where this rung is not searched."""
        return cls(explore=False)

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

    def rules(self) -> tuple[Rule, ...]:
        """8-bit states step on the GPU only; torch's Adafactor cannot step FSDP2's sharded parameters."""
        return (Rule("8-bit states cannot step on the host", ("offload", "optimizer"), _offload_eight_bit),
                Rule("Adafactor cannot step FSDP2 shards", ("sharding", "optimizer"), _fsdp_adafactor))

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
        if run.simulated:
            return  # the simulated step ends before the optimizer's (its states are formulas)
        if run.live:
            check_class(run.config, run.optimizer, "the guard was given")
            return
        run.optimizer_factory = make_factory(run.config.optimizer, run.spec.optimizer)
        run.hyperparameters = hyperparameters(run.config.optimizer, run.spec.optimizer)  # an engine's own optimizer

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        return {}

    def step_ops(self, config: Config, step: "StepFacts") -> int:
        """Ops of one optimizer step (`OPTIMIZER_OPS`): the whole model's foreach step, or with the step in
        backward one single-tensor step per trainable tensor."""
        fixed, per_tensor, single = OPTIMIZER_OPS[config.optimizer]
        return step.tensors * single if config.steps_in_backward else fixed + per_tensor * step.tensors

    def replays_training(self, config: Config) -> bool:
        """The replay holds torch AdamW's states and step."""
        return config.optimizer is O.ADAMW

    def recorded(self, settings: dict[str, Any], summary: dict[str, Any]) -> "OptimizerStates":
        """This rung with the optimizer the plan's probes trained (`settings`), for the exports."""
        rebuilt = OptimizerStates(self.explore)
        rebuilt.trained = dict(settings)
        return rebuilt

    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        if fmt != "trainer":
            return {}
        if config.optimizer in TRAINER_OPTIM:
            return {"optim": TRAINER_OPTIM[config.optimizer], **_trainer_hyperparameters(self.trained.get("kwargs", {}))}
        name = torch_name(self.trained)
        return _trainer_torch_optim(name, self.trained["kwargs"]) if name in TRAINER_TORCH_OPTIM else {}

    def refuses(self, config: Config, fmt: str) -> str | None:
        if fmt == "deepspeed" and config.optimizer.eight_bit:
            return (f"the plan's optimizer is bitsandbytes' {config.optimizer.value}, which a DeepSpeed config "
                    "cannot name (its types are DeepSpeed's own and torch.optim's); export torchrun (its script "
                    "builds the optimizer with autofit.prepare and hands it to deepspeed.initialize) or trainer "
                    "(TrainingArguments.optim) instead")
        if fmt == "trainer" and config.optimizer is O.USER and torch_name(self.trained) not in TRAINER_TORCH_OPTIM:
            own = self.trained.get("class", "a factory")
            return (f"the plan was tuned with your own optimizer ({own}), which TrainingArguments.optim cannot name "
                    f"(it names {', '.join(TRAINER_TORCH_OPTIM)} and the Adam types): export torchrun "
                    "(autofit.prepare builds it), or pass Trainer(optimizers=(optimizer, None)) yourself")
        return None

    def deepspeed_keys(self, config: Config, inputs: EngineInputs) -> dict[str, Any]:
        """The optimizer DeepSpeed builds from its config (`DEEPSPEED_OPTIMIZERS`) with the probe's
        hyperparameters (`inputs`: the probe's, else the plan's, else the defaults), or your own torch optimizer
        by name (`TORCH_BY_NAME`); none for another, which the script hands to `deepspeed.initialize`."""
        out: dict[str, Any] = {}
        recorded_settings = self.trained  # a plan's (`recorded`); nothing for a probe's
        name = DEEPSPEED_OPTIMIZERS.get(config.optimizer)
        if name is not None:
            given = inputs.hyperparameters if inputs.hyperparameters is not None else recorded_settings.get("kwargs")
            params = {**DEFAULTS[config.optimizer], **(given or {})}
            out["optimizer"] = {"type": name, "params": json.loads(json.dumps(params))}  # a copy: callers may edit theirs
            if config.optimizer is O.ADAMW and not config.offloads:
                # torch's fused AdamW: one kernel over the flat fp32 partition, no temporaries (the
                # single-tensor path makes two of the partition's size, the foreach path one); the
                # keys DeepSpeed does not read go to the constructor (engine.py, _configure_basic_optimizer)
                out["optimizer"]["params"].update(torch_adam=True, fused=True)
        if config.zero_stage and config.optimizer is not O.ADAMW:
            out["zero_allow_untested_optimizer"] = True  # ZeRO tests its own Adam types; others run as they are
        own = torch_name(recorded_settings)
        if own in TORCH_BY_NAME:  # your own torch optimizer, which DeepSpeed builds by name
            out["optimizer"] = {"type": own, "params": dict(recorded_settings["kwargs"])}
        return out

    def observed(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        return {"optimizer": knob_of(optimizer)}  # a class autofit does not search is the user's own

    def replaces(self, config: Config, spec: "TrainSpec") -> str:
        asked = spec.optimizer
        if asked.explore and config.optimizer is not O(asked.name):
            return (f"your optimizer {asked.name} is replaced by {config.optimizer.value} "
                    "(different numerics, same hyperparameters where they apply)")
        return ""


# The optimizer knob -> the class name its factory builds (a USER optimizer is whatever was given).
CLASS_NAMES = {O.ADAMW: "AdamW", O.ADAFACTOR: "Adafactor"}  # bitsandbytes' are added below (`BNB`)


def check_class(config: Config, optimizer: Any, given: str) -> None:
    """`UsageError` where `optimizer` (an instance; None passes) is not of the class `config`'s optimizer
    builds, the memory having been measured with that one; `given` says where it came from."""
    if optimizer is None or config.optimizer is O.USER:
        return
    expected, name = CLASS_NAMES[config.optimizer], type(optimizer).__name__
    if name != expected:
        raise UsageError(f"The plan's memory was measured with {expected} (optimizer={config.optimizer.value!r}) "
                         f"but {given} {name}; pass a {expected}, build them with autofit.prepare(plan, model, "
                         f"optimizer) and guard prepared.model and prepared.optimizer, or tune again with "
                         f"optimizer={name!r}.")


@dataclasses.dataclass
class GivenOptimizer:
    """The optimizer `autofit.prepare` was given (`optimizer`: an instance, a factory or None) for a plan of
    `config`, and the spec this rung builds from (`spec`): the plan's kind, with the given optimizer's
    hyperparameters, or, with none given, those the probes trained with (`Plan.settings["optimizer"]`)."""

    optimizer: Any
    config: Config
    spec: "OptimizerSpec"

    @property
    def factory(self) -> bool:
        """Whether a factory `params -> optimizer` was given."""
        return callable(self.optimizer) and not isinstance(self.optimizer, torch.optim.Optimizer)

    def adopt(self, run: "TrainRun") -> None:
        """Once every strategy has applied: a factory builds the plan's kind; an instance of it over exactly the
        trainable parameters is kept (unless an engine builds its own), else the run builds one."""
        if self.factory and self.config.optimizer is not O.USER:
            run.optimizer_factory = self.optimizer
        if isinstance(self.optimizer, torch.optim.Optimizer) and run.engine_factory is None:
            run.optimizer = _reused(self.optimizer, self.config, run.model)

    def check(self, run: "TrainRun") -> None:
        """Once the run is ready: `UsageError` where the factory built another class than the plan measured."""
        if self.factory and run.engine is None and self.config.optimizer is not O.USER \
                and _class_name(run.optimizer) != CLASS_NAMES[self.config.optimizer]:
            raise UsageError(f"The optimizer factory built {_class_name(run.optimizer)}, but the plan's memory was "
                             f"measured with {CLASS_NAMES[self.config.optimizer]}; return one from the factory, or "
                             "tune again with this optimizer.")


def given_optimizer(optimizer: Any, config: Config, recorded_settings: dict[str, Any]) -> GivenOptimizer:
    """What `autofit.prepare` builds the plan's optimizer from (`GivenOptimizer`); `UsageError` where the plan
    was tuned with your own optimizer and none is given, or the instance given is of another kind."""
    from autofit.job.train_spec import OptimizerSpec, parse_optimizer

    if optimizer is None:
        spec = recorded(config, recorded_settings)
        if spec is None and config.optimizer is O.USER:
            named = recorded_settings.get("class")
            outside = (f" (autofit imports a plan's optimizer class only from {', '.join(OPTIMIZER_MODULES)}, not "
                       f"{named!r})" if isinstance(named, str) and not allowed_class(named) else "")
            raise UsageError(f"The plan was tuned with your own optimizer{outside}; pass it again: "
                             "prepare(plan, model, optimizer=...) (an instance or a factory params -> optimizer; "
                             "the exported train_with_prepare.py takes --optimizer FILE.py:fn).")
        return GivenOptimizer(optimizer, config, spec or OptimizerSpec(config.optimizer.value))
    if config.optimizer is O.USER:
        return GivenOptimizer(optimizer, config, parse_optimizer(optimizer))
    if not isinstance(optimizer, torch.optim.Optimizer):  # a factory is checked once it has built (`check`)
        return GivenOptimizer(optimizer, config, OptimizerSpec(config.optimizer.value))
    given, expected = parse_optimizer(optimizer), CLASS_NAMES[config.optimizer]
    if _class_name(optimizer) not in (expected, "AdamW"):
        kinds = "an AdamW" if expected == "AdamW" else f"an AdamW or a {expected}"
        raise UsageError(f"The plan's memory was measured with {expected} (optimizer={config.optimizer.value!r}), "
                         f"but the optimizer given is {_class_name(optimizer)}; pass {kinds} (its "
                         "hyperparameters are kept), or tune again with this optimizer.")
    if _class_name(optimizer) != expected:
        logger.warning("autofit.prepare: the plan chose %s; a %s is built over the model with your AdamW's lr and "
                       "weight decay", expected, expected)
    return GivenOptimizer(optimizer, config, OptimizerSpec(config.optimizer.value, given.kwargs))


def _class_name(optimizer: Any) -> str:
    return type(optimizer).__name__ if isinstance(optimizer, torch.optim.Optimizer) else getattr(optimizer, "__name__", "?")


def _reused(optimizer: torch.optim.Optimizer, config: Config, model: Any) -> torch.optim.Optimizer | None:
    """The given optimizer when it is the plan's kind over exactly the trainable parameters, else None
    (the run builds one of the plan's kind over them, with its hyperparameters)."""
    if config.optimizer is not O.USER and _class_name(optimizer) != CLASS_NAMES[config.optimizer]:
        return None
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return optimizer if given == trainable else None


def knob_of(optimizer: Any) -> O:
    """The optimizer knob naming `optimizer`'s class (a class autofit does not search is the user's own)."""
    name = type(optimizer).__name__
    return next((kind for kind, cls in CLASS_NAMES.items() if cls == name), O.USER)


# autofit optimizer -> TrainingArguments.optim. A user's own optimizer goes to Trainer(optimizers=...).
TRAINER_OPTIM = {O.ADAMW: "adamw_torch", O.ADAMW8BIT: "adamw_bnb_8bit", O.PAGED_ADAMW8BIT: "paged_adamw_8bit",
                 O.ADAFACTOR: "adafactor"}
# torch optimizers TrainingArguments names (transformers/trainer_optimizer.py: `optim` builds the class with
# `learning_rate`, the groups' `weight_decay`, and these from `optim_args`, "key=value,...").
TRAINER_TORCH_OPTIM = {"SGD": ("sgd", ("momentum", "dampening", "nesterov")),
                       "Adagrad": ("adagrad", ("lr_decay", "eps")),
                       "RMSprop": ("rmsprop", ("momentum", "alpha", "eps", "centered"))}
# optimizer hyperparameter -> TrainingArguments field(s). The Trainer's own defaults differ from torch's
# (learning_rate 5e-5, weight_decay 0), so the probe's are written out.
TRAINER_HYPERPARAMETERS = {"lr": ("learning_rate",), "weight_decay": ("weight_decay",), "eps": ("adam_epsilon",),
                           "betas": ("adam_beta1", "adam_beta2")}


def _trainer_hyperparameters(recorded: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments' fields for the hyperparameters the probe's optimizer was built with."""
    out: dict[str, Any] = {}
    for key, value in recorded.items():
        fields = TRAINER_HYPERPARAMETERS.get(key, ())
        out.update(zip(fields, value if len(fields) > 1 else [value]))
    return out


def _trainer_torch_optim(name: str, recorded: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments' fields for your own torch optimizer `name` with its recorded hyperparameters."""
    optim, extra = TRAINER_TORCH_OPTIM[name]
    args = ",".join(f"{key}={recorded[key]}" for key in extra if recorded.get(key) is not None)
    return {"optim": optim, "learning_rate": recorded["lr"], "weight_decay": recorded.get("weight_decay", 0.0),
            **({"optim_args": args} if args else {})}


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
CLASS_NAMES.update(BNB)

# The optimizers DeepSpeed builds itself from its config (with ZeRO-Offload it swaps in its CPU Adam). A type
# DeepSpeed does not know by name is looked up in torch.optim (deepspeed/runtime/engine.py,
# _configure_basic_optimizer: `getattr(torch.optim, self.optimizer_name())`), which is how Adafactor is named.
# bitsandbytes' 8-bit optimizers have no name there: the `deepspeed` format refuses them (`refuses`); a
# user's own optimizer is passed to deepspeed.initialize(optimizer=...) by the script.
DEEPSPEED_OPTIMIZERS = {
    # torch_adam: torch's AdamW, not DeepSpeed's FusedAdam, which is compiled with nvcc on first use
    # (deepspeed/runtime/engine.py, get_optimizer_configuration: `torch_adam` is read before the offload
    # check, so it is only set without offload, where DeepSpeed's CPU Adam steps on the host).
    O.ADAMW: "AdamW",
    O.ADAFACTOR: "Adafactor",  # torch.optim.Adafactor
}
# torch optimizers a plan tuned with your own may name: DeepSpeed looks a type it does not know up in
# torch.optim (see above); Adagrad is left out, as DeepSpeed reads "adagrad" as its own CPU Adagrad.
TORCH_BY_NAME = ("SGD", "RMSprop")
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


# The only modules an optimizer class named in a plan is imported from: a plan is data, and importing a module
# runs it (a plan naming any other class is rebuilt only from the optimizer you pass to autofit.prepare).
OPTIMIZER_MODULES = ("torch.optim", "bitsandbytes.optim", "transformers.optimization")


def allowed_class(path: str | None) -> bool:
    """Whether the class path `path` ("torch.optim.sgd.SGD") lies in one of `OPTIMIZER_MODULES`."""
    module = (path or "").rpartition(".")[0]
    return any(module == allowed or module.startswith(allowed + ".") for allowed in OPTIMIZER_MODULES)


def _import_class(path: str | None) -> type | None:
    """The optimizer class at `path`, imported only from `OPTIMIZER_MODULES`; None for any other path."""
    if not isinstance(path, str) or not allowed_class(path):
        return None
    module, _, name = path.rpartition(".")
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


def _offload_eight_bit(c: Config, t: "Target") -> str | None:
    if c.offloads and c.optimizer.eight_bit:
        return f"{c.optimizer.value} steps on the GPU; offloaded states step on the host"
    return None


def _fsdp_adafactor(c: Config, t: "Target") -> str | None:
    if c.engine is Engine.FSDP and c.optimizer is O.ADAFACTOR:
        # measured on 2 CPU ranks (torch 2.13): "aten.pow_.Scalar: in-place operations that require
        # placement changes are not supported" in torch.optim.Adafactor's factored row/column norms
        return "torch's Adafactor cannot step FSDP2's sharded (DTensor) parameters: its in-place norms fail"
    return None
