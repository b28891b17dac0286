"""Why nothing fits, kept as fields: the limit, the candidate closest to fitting, what it needs and how that is
known, and the next step (a tier to allow, or more memory). A plan (`autofit.plan.Plan.shortfall`) and a
dry-run report keep it; `Shortfall.words` says it, in Python's words (`allow={'numerics'}`, `num_gpus`) for a
plan's reason or the command line's (`--allow numerics`, `--num-gpus`) where `autofit tune` and
`autofit dry-run` print it: each edge composes its own sentence from the same fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autofit.config import Config, Knob, tier_name
from autofit.errors import Param
from autofit.units import format_size

# What allowing each exactness tier opens: the name `allow` takes for it, and what it brings
TIERS = {1: (tier_name(1), "mixed precision, 8-bit optimizers"),
         2: (tier_name(2), "LoRA adapters, quantized base weights")}
MICRO_BATCHES = "micro-batches smaller than the rank's batch"  # what a tier opens where a coupled loss held them


def tier_words(tier: int, cli: bool = False, micro_batches: bool = False) -> str:
    """"allow={'numerics'} (mixed precision, 8-bit optimizers)", or "--allow numerics (...)" with `cli`."""
    name, what = TIERS[tier]
    return f"{Param('allow', {name}).words(cli)} ({what}{', ' + MICRO_BATCHES if micro_batches else ''})"


class Basis(Knob):
    """How the bytes the closest candidate needs are known."""

    PREDICTED = "predicted"  # the estimator's prediction
    HELD = "held"  # what it held when it ran out: a lower bound
    OVER_BUDGET = "over-budget"  # it ran out with no figure: more than the budget, no more is known


class Remedy(Knob):
    """The next step when nothing fits."""

    ALLOW = "allow"  # allow the next exactness tier (`Shortfall.tier`): what it opens may fit
    MORE_MEMORY = "more-memory"  # more memory per rank: a larger budget or GPU, more GPUs, offload, a smaller job
    LARGER_GPU = "larger-gpu"  # the fixed overhead alone (CUDA context, workspaces) exceeds the limit


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """Why no candidate fits: bytes for memory, a fraction for the margin. `gpu` names the GPU profile a
    dry-run planned for ("" for a budget probed by `autofit tune`): its figures are all predictions."""

    limit: int  # bytes a fit may peak at per device: `capacity` less the safety margin
    capacity: int  # bytes: the memory budget (tune) or the GPU's memory (dry-run)
    margin: float  # the safety margin, a fraction of `capacity`
    gpu: str = ""
    smallest: Config | None = None  # the candidate closest to fitting (None: no probe ran out of memory)
    need: int | None = None  # bytes `smallest` needs (None with `Basis.OVER_BUDGET`)
    basis: Basis | None = None  # how `need` is known
    remedy: Remedy | None = None  # the next step (None: none to say, as when every probe failed with an error)
    tier: int | None = None  # the exactness tier to allow (`Remedy.ALLOW`)
    micro_batches: bool = False  # allowing `tier` opens micro-batches smaller than the rank's batch too
    opened: Config | None = None  # dry-run: the configuration `tier` opens that is predicted to fit ...
    opened_peak: int | None = None  # ... at this peak (bytes)
    overhead_terms: tuple[str, ...] = ()  # `Remedy.LARGER_GPU`: the overhead's terms (CUDA context, ...)
    overhead: int = 0  # ... and their bytes
    more_gpus: bool = True  # dry-run, `Remedy.MORE_MEMORY`: whether more GPUs with ZeRO-3 are worth naming
    first_error: str | None = None  # every probe failed with an error: the first one's reason

    def __post_init__(self) -> None:
        if self.basis is not None:
            object.__setattr__(self, "basis", Basis.parse(self.basis, "basis"))
        if self.remedy is not None:
            object.__setattr__(self, "remedy", Remedy.parse(self.remedy, "remedy"))
        if self.remedy is Remedy.ALLOW and self.tier not in TIERS:
            raise ValueError(f"a shortfall whose next step is to allow a tier names one of {sorted(TIERS)}, "
                             f"not {self.tier!r}")
        object.__setattr__(self, "overhead_terms", tuple(self.overhead_terms))

    def words(self, cli: bool = False) -> str:
        """The sentence for people: Python's words for a parameter, or the command line's with `cli`."""
        if self.gpu:
            head = (f"No candidate fits {format_size(self.limit)} per GPU ({self.gpu}, {format_size(self.capacity)} "
                    f"less the {self.margin:.0%} margin)")
        else:
            head = (f"No candidate fits {format_size(self.limit)} ({format_size(self.capacity)} budget less the "
                    f"{self.margin:.0%} margin)")
        if self.smallest is None and self.remedy is None:  # no probe ran out of memory
            return f"{head}: every probe failed with an error, the first: {self.first_error}" \
                if self.first_error else head
        if self.smallest is not None:
            head += f"; the smallest needs {self._need()} ({self.smallest.describe()})"
        return f"{head}. {self._next(cli)}" if self.remedy is not None else f"{head}."

    def _need(self) -> str:
        if self.basis is Basis.OVER_BUDGET or self.need is None:
            return "more than the budget"
        if self.basis is Basis.HELD:
            return f"more than {format_size(self.need)}"
        # a dry-run's figures are all predictions: said bare there
        return format_size(self.need) + ("" if self.gpu else " by the estimator's prediction")

    def _next(self, cli: bool) -> str:
        if self.remedy is Remedy.ALLOW:
            allow = f"Pass {tier_words(self.tier, cli, self.micro_batches)} to go further"
            if self.opened is None:
                return allow + "."
            return f"{allow}: {self.opened.describe()} is predicted to fit at {format_size(self.opened_peak)}."
        if self.remedy is Remedy.LARGER_GPU:
            return (f"Its overhead alone ({format_size(self.overhead)}: {', '.join(self.overhead_terms)}) exceeds "
                    "the limit: use a GPU with more memory.")
        gpus = Param("num_gpus").words(cli)
        if not self.gpu:
            return f"Raise the budget, use more GPUs ({gpus}) or offload to go further."
        more = f"more GPUs ({gpus}) with ZeRO-3, " if self.more_gpus else ""
        return f"Use {more}a larger GPU, a shorter sequence or a smaller model to go further."

    def to_dict(self) -> dict[str, Any]:
        """JSON form (kept in plan.json and a dry-run's document)."""
        data = dataclasses.asdict(self)
        data.update(smallest=self.smallest.to_dict() if self.smallest else None,
                    opened=self.opened.to_dict() if self.opened else None, overhead_terms=list(self.overhead_terms),
                    basis=self.basis.value if self.basis else None, remedy=self.remedy.value if self.remedy else None)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Shortfall":
        """Inverse of `to_dict`."""
        configs = {key: Config.from_dict(data[key]) if data.get(key) else None for key in ("smallest", "opened")}
        return cls(**{**data, **configs})
