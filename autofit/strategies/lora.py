"""Rung 7, LoRA adapters (peft): the base weights are frozen and only low-rank adapters are trained.

Buys the base model's gradients and optimizer states (only the adapters have them); costs what is
trained: tier 2, opt-in with `allow={"lora"}`. Adapters go on every linear layer except the output head
by default (as QLoRA does), or on the `target_modules` given. On a quantized base (the quantization
strategy, applied just before this one) the model is first prepared with
`peft.prepare_model_for_kbit_training`. Plain LoRA on a fp32/bf16 base runs anywhere, the CPU included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from autofit.config import Config
from autofit.errors import MissingExtraError, UsageError, did_you_mean
from autofit.models.info import build_on_meta
from autofit.strategies.base import Option, Strategy

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.run import TrainRun

DEFAULT_RANK = 16  # the usual QLoRA rank: adapters are ~0.5-1% of a 1B model's parameters
# peft keeps LoRA's adapters in fp32 beside a 16-bit base (`get_peft_model(..., autocast_adapter_dtype=True)`,
# its default) and casts each input to their dtype; releases before that made them in the base's dtype (the
# calibration's fsdp_qlora runs, on PEFT 0.10, set this so: `bench/calibration/measured_code.py`)
PEFT_UPCASTS_ADAPTERS = True
ADAPTERS = ("lora_A", "lora_B")  # the parameters `add_simulated` makes, named as peft's modules
LORA_SCALING = 2.0  # peft's lora_alpha / r; any constant costs the same multiply


class Lora(Strategy):
    """0 (full fine-tuning) or LoRA adapters of each rank in `ranks`."""

    field = "lora"
    rung = 7
    order = 1

    def __init__(self, ranks: Sequence[int] = (DEFAULT_RANK,), target_modules: Sequence[str] | None = None,
                 alpha: int | None = None, dropout: float = 0.0):
        """`ranks`: adapter ranks to try (smallest saves most); `target_modules`: module names or name
        suffixes to adapt (default: every linear layer but the output head); `alpha`: LoRA scaling
        numerator (default 2 x rank); `dropout`: peft's `lora_dropout` on each adapter's input (keeps a
        copy of that input and its mask for backward, which the estimator simulates)."""
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 1]
        if bad or not ranks:
            raise UsageError(f"LoRA ranks must be integers >= 1, but got {list(ranks)!r}; e.g. ranks=(16,).")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise UsageError(f"LoRA dropout must be a probability in [0, 1), but got {dropout!r}; e.g. dropout=0.05.")
        self.ranks = tuple(sorted(set(ranks), reverse=True))
        self.target_modules = tuple(target_modules) if target_modules is not None else None
        self.alpha = alpha
        self.dropout = float(dropout)

    def options(self, spec: "TrainSpec") -> list[Option]:
        if spec.model.trains_part:  # its own adapters or frozen weights: adapters over them train something else
            why = (f"{spec.model.name} already trains {spec.model.trained()} (its own adapters or a frozen "
                   "part): LoRA over it would change what it trains")
            return [Option(0, 0, f"as the model trains: {spec.model.trained()}")] + \
                [Option(r, 2, why, available=False) for r in self.ranks]
        full = Option(0, 0, "full fine-tuning: every parameter trained")
        if not spec.target.has("peft"):
            why = "LoRA needs peft, which is not installed: pip install 'autofit[peft]'"
            return [full] + [Option(r, 2, why, available=False) for r in self.ranks]
        model = _inspectable(spec.model_factory)
        if not linear_layer_names(model):
            why = f"{spec.model.name} has no linear layers to adapt"
            return [full] + [Option(r, 2, why, available=False) for r in self.ranks]
        targets = self.targets(model)
        return [full] + [Option(r, 2, f"LoRA rank {r} on {len(targets)} linear layers, base frozen")
                         for r in self.ranks]

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return a.lora == b.lora or (a.lora > 0 and (b.lora == 0 or a.lora <= b.lora))

    def settings(self, config: Config, spec: "TrainSpec") -> dict[str, Any]:
        """The adapters the probe trained beside the rank: target modules as given (None: every linear
        layer but the output head), alpha, dropout."""
        if not config.lora:
            return {}
        targets = list(self.target_modules) if self.target_modules is not None else None
        return {"target_modules": targets, "alpha": self.scaling_alpha(config.lora), "dropout": self.dropout}

    @classmethod
    def from_settings(cls, rank: int, settings: dict[str, Any]) -> "Lora":
        """The strategy that trains the adapters `settings` (`Lora.settings`) recorded, at `rank`."""
        return cls((rank,), target_modules=settings.get("target_modules"), alpha=settings.get("alpha"),
                   dropout=settings.get("dropout", 0.0))

    def scaling_alpha(self, rank: int) -> float:
        """LoRA's alpha at `rank`: as given, else 2 x rank (a scaling alpha / r of 2)."""
        return self.alpha or 2 * rank

    def peft_kwargs(self, rank: int) -> dict[str, Any]:
        """`peft.LoraConfig` keyword arguments for these adapters on a Hugging Face model (peft's
        "all-linear" leaves the output layer out, as the default targets do)."""
        targets = list(self.target_modules) if self.target_modules is not None else "all-linear"
        return {"r": rank, "lora_alpha": self.scaling_alpha(rank), "lora_dropout": self.dropout, "target_modules": targets}

    def recorded(self, settings: dict[str, Any], summary: dict[str, Any]) -> "Lora":
        """LoRA with the adapters the plan's probes trained (`settings`)."""
        if not settings:
            return self
        return Lora(self.ranks, target_modules=settings.get("target_modules"), alpha=settings.get("alpha"),
                    dropout=settings.get("dropout", 0.0))

    def adapting(self, modules: Sequence[str]) -> "Lora":
        return Lora(self.ranks, target_modules=modules, alpha=self.alpha, dropout=self.dropout)

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        # the rank sizes the adapters; peft makes them fp32 beside a 16-bit base unless an engine casts it all
        if not config.adapters:
            return {}
        return {"adapters": (config.lora, PEFT_UPCASTS_ADAPTERS, facts.get("_cast_whole", False))}

    def trains(self, config: Config, facts: Any) -> tuple[int, int] | None:
        """The adapters (rank r adds r * `facts.lora_params_per_rank`; the usual rank where a quantized base
        trains them without one given), two tensors per adapted layer; the base frozen."""
        if not config.adapters:
            return None
        return (config.lora or DEFAULT_RANK) * facts.lora_params_per_rank, 2 * facts.adapted_layers

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if not config.lora or fmt != "trainer":  # autofit.prepare adds them for the other formats
            return []
        kwargs = self.peft_kwargs(config.lora)  # the adapters the probe trained (`recorded`)
        return ["from peft import LoraConfig, get_peft_model",
                f"model = get_peft_model(model, LoraConfig({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}))"]

    def apply(self, run: "TrainRun") -> None:
        if run.live:
            _check_live(run.config, run.model)
            return
        if run.simulated:
            if run.config.adapters and run.adapted is not None:
                # peft's adapters (fp32 as peft makes them, or the model's dtype where an engine casts it all)
                dtype = torch.float32 if PEFT_UPCASTS_ADAPTERS and not run.cast_whole else None
                add_simulated(run.model, run.adapted, run.config.lora or DEFAULT_RANK, run.adapter_dropout, dtype)
                freeze_all_but_adapters(run.model)
            return
        value = run.config.lora
        if not value:
            return
        peft = _import_peft()
        targets = self.targets(run.model)
        if is_quantized(run.model):
            run.model = peft.prepare_model_for_kbit_training(run.model, use_gradient_checkpointing=False)
        conv1d = all(type(run.model.get_submodule(name)).__name__ == "Conv1D" for name in targets)
        config = peft.LoraConfig(**{**self.peft_kwargs(value), "target_modules": list(targets)},
                                 fan_in_fan_out=conv1d)  # GPT-2 stores W transposed
        run.model = peft.get_peft_model(run.model, config)

    def adapted_layers(self, model: nn.Module) -> list[str] | None:
        return self.targets(model)

    def adapter_dropout(self) -> float | None:
        return self.dropout

    def targets(self, model: nn.Module) -> list[str]:
        """Full names of the linear layers of `model` to adapt; `UsageError` when a given target matches none."""
        linear = linear_layer_names(model)
        if self.target_modules is None:
            head = output_head(model)
            return [name for name in linear if name != head or len(linear) == 1]
        missing = [t for t in self.target_modules if not any(_matches(name, t) for name in linear)]
        if missing:
            shown = sorted({name.rsplit(".", 1)[-1] for name in linear})
            hints = "".join(did_you_mean(t, shown) for t in missing)
            raise UsageError(f"LoRA target_modules {missing} match no linear layer of the model{hints}; its linear "
                             f"layers are named {shown}. Pass some of those, or None (on the command line, no "
                             "--lora-targets) for all linear layers.")
        return [name for name in linear if any(_matches(name, t) for t in self.target_modules)]


def linear_layer_names(model: nn.Module) -> list[str]:
    """Full names of the model's linear layers: nn.Linear (bitsandbytes' 4/8-bit linears subclass it)
    and transformers' Conv1D (GPT-2's transposed linear, which peft adapts too)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"]


def is_quantized(model: nn.Module) -> bool:
    """Whether the quantization strategy replaced the model's linear layers with 4/8-bit ones."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def output_head(model: nn.Module) -> str | None:
    """Name of the output projection (Hugging Face's `get_output_embeddings`), kept out of LoRA and
    quantization as QLoRA does: it is tied to the embeddings or needs full precision for the logits."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return next((name for name, module in model.named_modules() if module is head), None) if head is not None else None


def _matches(name: str, target: str) -> bool:
    """peft's rule for a string target: the full name, or a suffix after a dot."""
    return name == target or name.endswith("." + target)


def _inspectable(factory: Any) -> nn.Module:
    """The model built on the meta device (no memory), or for real when the factory cannot do that."""
    return build_on_meta(factory) or factory()


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        if "HybridCache" in str(exc):  # peft 0.16 and 0.17 import it, and transformers 5.0 removed it
            from importlib.metadata import version

            raise UsageError(f"peft {version('peft')} cannot be imported beside transformers {version('transformers')} "
                             f"({exc}): peft 0.16 and 0.17 import transformers' HybridCache, which transformers 5 "
                             "removed. Install peft 0.18 or later (pip install -U peft), or 0.12-0.15.") from exc
        raise MissingExtraError("peft", "peft", "LoRA adapters") from exc
    return peft


def _check_live(config: Config, model: nn.Module) -> None:
    """`UsageError` where a live model's adapters are not the plan's (the OOM guard cannot add or remove them)."""
    has = hasattr(model, "peft_config")
    if config.adapters and not has:
        raise UsageError(f"The plan trains LoRA adapters ({config.describe()}) but the model has none; build them "
                         "with autofit.prepare(plan, model, optimizer) and guard prepared.model and "
                         "prepared.optimizer.")
    if has and not config.adapters:
        raise UsageError("The model carries LoRA adapters but the plan trains every weight; give the guard the plan "
                         "it was tuned with.")


# -- what the estimator simulates in place of peft ----------------------------------------------------------
def freeze_all_but_adapters(model: nn.Module) -> None:
    """Freeze every parameter but the adapters `add_simulated` made."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.rpartition(".")[2] in ADAPTERS)


def add_simulated(model: nn.Module, adapted: frozenset[str], rank: int, p: float, dtype: torch.dtype | None) -> None:
    """Give each adapted layer (`is_adapted` names) peft's LoRA adapters (peft/tuners/lora/layer.py
    `Linear.forward`: `result + lora_B(lora_A(dropout(x))) * scaling`, cast back to the result's dtype):
    rank-`rank` factors in `dtype` (None: the layer's weight's), the input cast to it
    (`LoraLayer._cast_input_dtype`; bitsandbytes' 4-bit layer under autocast leaves it,
    peft/tuners/lora/bnb.py), with dropout `p` a dropped-out copy and its mask (`nn.functional.dropout`, as
    peft's `nn.Dropout` calls it). So the step keeps what peft's keeps: the adapters' inputs (an fp32 copy of
    a 16-bit input beside fp32 adapters), their matmuls' outputs under op-level checkpointing, and the
    adapters' own gradients and optimizer states. On the meta device, before the model is made of fake
    tensors."""
    from autofit.strategies.quantization import SimulatedLinear4bit

    def add(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if not (isinstance(module, SimulatedLinear4bit) and torch.is_autocast_enabled(x.device.type)):
            x = x.to(module.lora_A.dtype)
        x = nn.functional.dropout(x, p, True) if p else x
        # one expression, as peft's: the adapters' output is freed once scaled, not held through the sum
        return (out + nn.functional.linear(nn.functional.linear(x, module.lora_A), module.lora_B)
                * LORA_SCALING).to(out.dtype)

    for module in _adapted_layers(model, adapted):
        n_in, n_out = _features(module)
        made = dtype or module.weight.dtype
        module.lora_A = nn.Parameter(torch.empty(rank, n_in, dtype=made, device="meta"))
        module.lora_B = nn.Parameter(torch.empty(n_out, rank, dtype=made, device="meta"))
        module.register_forward_hook(add)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer: nn.Linear's and `SimulatedLinear4bit`'s attributes, a
    transformers Conv1D's (in, out) weight."""
    if hasattr(module, "in_features"):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)


def _adapted_layers(model: nn.Module, adapted: frozenset[str]) -> list[nn.Module]:
    """The linear layers (nn.Linear, transformers' Conv1D, a quantized layer simulated) `is_adapted` names."""
    from autofit.strategies.quantization import SimulatedLinear4bit  # SimulatedLinear8bit is one too

    return [module for name, module in model.named_modules() if is_adapted(name, adapted)
            and (isinstance(module, (nn.Linear, SimulatedLinear4bit)) or type(module).__name__ == "Conv1D")]


def is_adapted(name: str, adapted: frozenset[str]) -> bool:
    """Whether the module `name` is one of `adapted` (names inside a block, `within_block` of
    `autofit.estimate.simulation.adapters`), matched as peft matches a target module: the whole name or a
    suffix after a dot. A wrapper's generic name ('attn.linear' beside 'mlp.fc.linear') stays distinct."""
    return any(name == target or name.endswith("." + target) for target in adapted)
