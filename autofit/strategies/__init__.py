"""Step 2 of the flow (docs/design.md): the decision tree's techniques, one module each, in rung order.

Each offers its options for a spec's `Target`; `autofit.search.space` lays them out as candidates. The
built-in strategies are found, not listed: every `Strategy` class of a module of this package that declares
its `order` (its place among its rung's) is one (`BUILT_IN`), and each is importable from here by its class
name (`from autofit.strategies import MicroBatch`).
"""

import functools
import importlib
import pkgutil
from typing import Any, Iterable

from autofit.config import Knob
from autofit.errors import UsageError, did_you_mean
from autofit.strategies.base import Option, Placement, Strategy, plugin_classes, plugins


def _built_in() -> tuple[type[Strategy], ...]:
    """Every strategy class a module of this package defines with its own `order`, by rung and `order`."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [cls for cls in vars(module).values() if isinstance(cls, type) and issubclass(cls, Strategy)
                  and cls.__module__ == module.__name__ and "order" in cls.__dict__]
    return tuple(sorted(found, key=lambda cls: (cls.rung, cls.order)))


# The built-ins in the order they apply: by rung, and within a rung by `order` (the quantized base before
# LoRA: the adapters go on the quantized layers; the optimizer before its step in backward, which runs the
# optimizer the former chose, one per parameter). A plug-in comes after these at its rung.
BUILT_IN = _built_in()
globals().update({cls.__name__: cls for cls in BUILT_IN})

class EngineChoice(Knob):
    """Which sharding engines a search over several ranks tries (`autofit.autofit(engine=...)`)."""

    AUTO = "auto"  # both: ZeRO where DeepSpeed is installed, and FSDP2; the faster measured one wins
    DEEPSPEED = "deepspeed"  # DeepSpeed's ZeRO alone
    FSDP = "fsdp"  # torch's own FSDP2 alone


ENGINES = tuple(EngineChoice)  # str-enums: each equals its name ("auto" in ENGINES)


def default_strategies(engine: EngineChoice | str = EngineChoice.AUTO) -> list[Strategy]:
    """One instance of every built-in strategy, in rung order. `engine` pins the sharding rung: "deepspeed"
    (ZeRO), "fsdp" (FSDP2), or "auto" = both searched (ZeRO offered where DeepSpeed is installed); an engine's
    strategy is one whose class names its `engine`."""
    engine = EngineChoice.parse(engine, "engine")
    return [cls() for cls in BUILT_IN
            if engine is EngineChoice.AUTO or getattr(cls, "engine", None) in (None, engine.value)]


def with_required(strategies: Iterable[Strategy]) -> list[Strategy]:
    """`strategies` in order (`in_order`), with those every run needs where none given sets their knob
    (`Strategy.required`): the micro-batch's, the rank count's, and the optimizer's offering the user's
    optimizer alone (strategies that leave that rung out do not search it, yet the job trains with the
    optimizer given, not the Config's default AdamW)."""
    strategies = list(strategies)
    given = {s.field for s in strategies}
    required = [r for r in (cls.required() for cls in BUILT_IN) if r is not None and r.field not in given]
    return in_order([*strategies, *required])


def completed(strategies: Iterable[Strategy] = ()) -> list[Strategy]:
    """`strategies` in order (`in_order`), with one of every built-in and plug-in strategy whose class is not
    among them: what shapes a step, a simulation or an export whichever knobs were searched (the others, at
    their defaults, apply nothing). The ones added are made once per set of plug-ins (`_every`) and shared: a
    strategy holds nothing but what it was made with."""
    every = _every(plugin_classes())
    strategies = list(strategies)
    if not strategies:
        return list(every)
    given = {type(s) for s in strategies}
    return in_order([*strategies, *(s for s in every if type(s) not in given)])


@functools.lru_cache(maxsize=8)
def _every(plugin_classes: tuple[type[Strategy], ...]) -> tuple[Strategy, ...]:
    """One instance of every built-in strategy and of each of `plugin_classes`, in order (`in_order`)."""
    return tuple(in_order([*default_strategies(), *(cls() for cls in plugin_classes)]))


def compute_dtype(config: Any) -> Any:
    """The 16-bit `torch.dtype` `config`'s step computes in: the first a strategy names
    (`Strategy.compute_dtype`: an autocast's, 16-bit weights'); None where none casts (the model's own)."""
    return next((dtype for s in completed() if (dtype := s.compute_dtype(config)) is not None), None)


def for_plan(settings: dict[str, Any], summary: dict[str, Any], strategies: Iterable[Strategy] = ()) -> list[Strategy]:
    """The strategies a saved plan runs with (`completed`), each as the plan recorded it (`Strategy.recorded`:
    `settings` are `Plan.settings`, by knob; `summary` is `Plan.spec`)."""
    return [s.recorded(dict(settings.get(s.field) or {}), dict(summary)) for s in completed(strategies)]


def in_order(strategies: Iterable[Strategy]) -> list[Strategy]:
    """`strategies` in the order they apply (`BUILT_IN`'s, a plug-in after the built-ins of its rung),
    whatever order they were given in."""
    return sorted(strategies, key=lambda s: (s.rung, 0, type(s).order) if type(s) in BUILT_IN else (s.rung, 1, 0))


def resolve_strategies(given: Any) -> list[Strategy]:
    """`strategies=` as a user writes it: Strategy instances, their classes, or names in any case -- a file's
    (`micro_batch`, `pure_bf16`), a class's (`MicroBatch`) or a knob's, which names every strategy setting it
    (`precision`: fp32/bf16/fp16 and pure bf16; `sharding`: ZeRO and FSDP2)."""
    if isinstance(given, (str, Strategy, type)):
        given = [given]
    known = [*default_strategies(), *plugins()]
    chosen: list[Strategy] = []
    for value in given:
        if isinstance(value, type) and issubclass(value, Strategy):
            value = value()
        found = [value] if isinstance(value, Strategy) else \
            [s for s in known if isinstance(value, str) and _normal(value) in _names(s)]
        if not found:
            names = sorted({name for s in known for name in (type(s).__module__.rpartition(".")[2], s.field)})
            raise UsageError(f"strategies: {value!r} is not a strategy{did_you_mean(value, names)}; give names such "
                             f"as {', '.join(map(repr, names[:4]))}, ... (a strategy's file in autofit/strategies, or "
                             "the knob it sets), Strategy instances, or leave it out to search every rung.")
        chosen += [s for s in found if all(type(c) is not type(s) for c in chosen)]
    return chosen


def _names(strategy: Strategy) -> set[str]:
    """What a strategy may be called by (`_normal` forms): its file, its class, the knob it sets."""
    return {_normal(type(strategy).__module__.rpartition(".")[2]), _normal(type(strategy).__name__),
            _normal(strategy.field)}


def _normal(name: str) -> str:
    return name.strip().lower().replace("_", "").replace("-", "").replace(" ", "")


__all__ = sorted([*(cls.__name__ for cls in BUILT_IN), "BUILT_IN", "Option", "Placement", "Strategy", "completed", "compute_dtype",
                  "default_strategies", "for_plan", "in_order", "plugins", "resolve_strategies", "with_required"])
