"""TrainSpec: what the user asked for, validated once, in the form every later step reads.

This is the first step of the flow: model and batch become factories, the budget becomes bytes, the
device is checked, and the model is inspected on the meta device (nothing real is allocated).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Iterable

import torch
from torch import nn

from autofit.batches import batch as batches
from autofit.config import ALLOW_NAMES, NUMERICS_WORDS, tier_name
from autofit.models import presets
from autofit.batches.synthetic import synthesize_batch
from autofit.batches.coupling import sample_coupling
from autofit.devices.device import check_nvme_path, device_memory, memory_report, resolve_device
from autofit.errors import Param, UsageError, did_you_mean
from autofit.models.depth import shallow
from autofit.models.info import ModelInfo, build_on_meta, inspect_model, loaded_class
from autofit.models.info import meta_model as meta_copy
from autofit.job.optimizer_costs import OptimizerCosts, measure, stand_ins
from autofit.batches.sample_axis import check_sample_axis
from autofit.job.target import Target
from autofit.units import format_size, parse_length, parse_size

LossFn = Callable[[Any, Any], torch.Tensor]

DEFAULT_MAX_TIER = 1  # tier 1 (mixed precision, 8-bit optimizers) is standard practice; tier 2 changes what is trained
DEFAULT_SAFETY_MARGIN = 0.10  # see TrainSpec.safety_margin
ADAM_NAMES = {"adamw", "adam"}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer the user trains with, and whether the optimizer rung may swap it."""

    name: str  # "adamw", "adafactor", ... or "user" for a given instance/factory
    kwargs: dict = dataclasses.field(default_factory=dict)  # hyperparameters (lr, betas, weight_decay)
    factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None  # a user's own
    cls: type | None = None  # the class of a user's own optimizer (None: a factory whose build it could not see)
    grouped: tuple[str, ...] = ()  # hyperparameters whose values differ between the instance's parameter groups
    explore: bool = True  # Adam-type optimizers may become 8-bit / paged / Adafactor (tier 1)
    costs: OptimizerCosts | None = None  # a user's own: its states and step temporaries, measured (None: unknown)

    def describe(self) -> str:
        """The name, and for a user's own optimizer its class where known: "user (torch.optim.sgd.SGD)"."""
        return f"{self.name} ({self.cls.__module__}.{self.cls.__qualname__})" if self.cls else self.name


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Everything a probe needs to build and run a training step; immutable."""

    model_factory: Callable[[], nn.Module]  # builds a fresh model on the CPU
    batch_factory: Callable[[int], Any]  # make_batch(num_samples) -> batch
    model: ModelInfo
    device: torch.device  # where probes run
    target: Target  # what the plan is for: the probe device (tune) or a GPU profile (dry-run)
    memory_budget: int  # bytes a plan may use on `device`
    budget_reason: str  # where the budget came from ("given", "the card's memory", "free RAM")
    global_batch_size: int | None  # samples per optimizer step; None = find the best micro-batch
    num_gpus: int = 1
    max_tier: int = DEFAULT_MAX_TIER  # highest exactness tier allowed (allow=)
    optimizer: OptimizerSpec = OptimizerSpec("adamw")
    loss_fn: LossFn = batches.default_loss
    # A fit must peak under budget * (1 - safety_margin). 10% covers what a probe of a few steps does
    # not see: allocator fragmentation growing over a long run and variation between batches.
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    warmup_steps: int = 2  # untimed steps: optimizer states are created, kernels autotuned
    timed_steps: int = 3  # steps averaged for throughput
    max_micro_batch: int = 1024  # largest micro-batch tried when the global batch is not given
    tokens_per_sample: int | None = None  # length of the sequence axis, for tokens/s
    images_per_sample: int | None = None  # images (a video's frames) per sample, for images/s; None: no images
    batch_description: str = ""
    # Bytes of the user's own module and batch already on the probe device when the spec was made: they
    # stay there during in-process probes but are no part of the plan, so budgets do not charge them.
    resident_bytes: int = 0
    # CUDA: bytes other processes held on the card when the spec was made (None: NVML cannot tell), and
    # how this process's memory outside the allocator is measured (`autofit.devices.memory.accounting`).
    foreign_memory: int | None = None
    memory_accounting: str = ""
    nvme_path: str | None = None  # folder on a fast local disk for NVMe offload (checked writable); exports write it
    # What couples the samples of the loss (a contrastive loss's negatives), so that a micro-batch smaller than
    # the rank's batch changes it; None: one term per sample, or not found out (`autofit.batches.coupling`)
    sample_coupling: str | None = None
    # Each batch padded to its own longest sample, up to the length given: the dry-run predicts the caching
    # allocator's reserve after shorter batches (`autofit.estimate.cuda.varied_lengths`); probes are unaffected
    varied_lengths: bool = False

    @property
    def fit_limit(self) -> int:
        """Peak bytes under which a probe counts as a fit."""
        return int(self.memory_budget * (1 - self.safety_margin))

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable description of the spec, stored in plans and trial storage."""
        return {
            "model": self.model.name,
            "model_fingerprint": self.model.fingerprint,
            "num_params": self.model.num_params,
            "hidden_size": self.model.hidden_size,
            "device": str(self.device),
            "memory_budget": self.memory_budget,
            "budget_reason": self.budget_reason,
            "global_batch_size": self.global_batch_size,
            "num_gpus": self.num_gpus,
            "max_tier": self.max_tier,
            "optimizer": self.optimizer.describe(),
            "safety_margin": self.safety_margin,
            "tokens_per_sample": self.tokens_per_sample,
            "images_per_sample": self.images_per_sample,
            "batch": self.batch_description,
            "resident_bytes": self.resident_bytes,
            "foreign_memory": self.foreign_memory,
            "memory_accounting": self.memory_accounting,
            "nvme_path": self.nvme_path,
        }


def make_spec(model: Any, batch: Any = None, *, global_batch_size: int | None = None,
              device: str | torch.device | None = None, memory_budget: int | str | None = None,
              num_gpus: int = 1, allow: Any = None, optimizer: Any = "adamw",
              loss_fn: LossFn | None = None, seq_len: int | None = None,
              safety_margin: float = DEFAULT_SAFETY_MARGIN, warmup_steps: int = 2, timed_steps: int = 3,
              max_micro_batch: int = 1024, target: Target | None = None, nvme_path: Any = None,
              nodes: int = 1, varied_lengths: bool = False) -> TrainSpec:
    """Validate the user's arguments and build a `TrainSpec` (see `autofit.autofit` for their meaning).

    `target`: the hardware planned for, when it is not the probe device (the dry-run's GPU profile)."""
    resolved = resolve_device(device)
    resident = _resident_bytes((model, batch), resolved)
    # A module or sample batch already on a GPU is copied to the CPU once: probes and children build from it.
    model, batch = _on_cpu(model), batches.to_device(batch, torch.device("cpu")) if _is_sample(batch) else batch
    if target is None:
        _check_weights(model)
    model_factory = _model_factory(model)
    # A given module is inspected as it is; a factory is built on the meta device (no memory used).
    meta_model = None if isinstance(model, nn.Module) else build_on_meta(model_factory)
    info = inspect_model(model if isinstance(model, nn.Module) else meta_model or model_factory())
    if loss_fn is None:
        presets.check_head(model if isinstance(model, nn.Module) else meta_model)
    if global_batch_size is None or global_batch_size > num_gpus:  # a rank's batch may hold more than one sample
        presets.check_padding(model if isinstance(model, nn.Module) else meta_model)
    if seq_len is not None:
        seq_len = parse_length(seq_len)  # "4k" as the CLI takes it
        _check_positive("seq_len", seq_len)
    batch_factory, description = _batch_factory(batch, info, seq_len)
    sample = _checked_sample(batch_factory)
    if batch is not None and seq_len is not None:
        _check_given_length(seq_len, sample, description)
    _check_positive("num_gpus", num_gpus)
    budget, budget_reason = _budget(memory_budget, resolved, num_gpus)
    if global_batch_size is not None:
        _check_global_batch(global_batch_size, num_gpus)
    _check_fraction("safety_margin", safety_margin)
    _check_positive("nodes", nodes)
    target = target or Target.from_device(resolved, num_gpus, budget, nodes)  # over `nodes`: a multiple of them
    spec = TrainSpec(
        model_factory=model_factory, batch_factory=batch_factory, model=info, device=resolved, target=target,
        memory_budget=budget, budget_reason=budget_reason, global_batch_size=global_batch_size,
        num_gpus=num_gpus, max_tier=parse_allow(allow), optimizer=parse_optimizer(optimizer),
        loss_fn=loss_fn or batches.default_loss, safety_margin=safety_margin,
        warmup_steps=_check_positive("warmup_steps", warmup_steps, minimum=0),
        timed_steps=_check_positive("timed_steps", timed_steps),
        max_micro_batch=_check_positive("max_micro_batch", max_micro_batch),
        tokens_per_sample=batches.tokens_per_sample(sample), images_per_sample=batches.images_per_sample(sample),
        batch_description=description,
        resident_bytes=resident, **memory_report(resolved),
        nvme_path=_checked_nvme_path(nvme_path), varied_lengths=bool(varied_lengths),
    )
    called = model if isinstance(model, nn.Module) else meta_model
    if called is not None:
        _check_sparse_gradients(called, spec.optimizer)
        batches.check_call(called, sample, loss_fn)
        check_sample_axis(called, batch_factory)
    if meta_model is not None or isinstance(model, nn.Module):  # a given module: on its copy on the meta device
        _check_loss_on_meta(meta_model if meta_model is not None else model_factory, sample, spec.loss_fn)
    if global_batch_size is not None and global_batch_size > num_gpus:  # else no rank's batch is ever split
        spec = dataclasses.replace(spec, sample_coupling=sample_coupling(called, model_factory, batch_factory,
                                                                          spec.loss_fn))
    return spec


# torch optimizers that step sparse gradients (torch/optim: the others raise "does not support sparse
# gradients"); SparseAdam steps nothing else
SPARSE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def _check_sparse_gradients(model: nn.Module, optimizer: OptimizerSpec) -> None:
    """`UsageError` where a trainable `nn.Embedding`/`nn.EmbeddingBag(sparse=True)` (a recommendation
    model's tables) meets an optimizer that cannot step its sparse gradient: every probe would fail alike
    in the step. A class not of torch.optim is left to its probes."""
    sparse = next((name for name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                   and m.sparse and m.weight.requires_grad), None)
    own = optimizer.cls
    if sparse is None or (own is not None and (issubclass(own, SPARSE_OPTIMIZERS) or
                                               not own.__module__.startswith("torch.optim"))):
        return
    if optimizer.name == "user" and own is None:
        return  # a factory that could not be built over stand-ins: its probes will say
    which = own.__name__ if own is not None else optimizer.name
    rung = " (nor the 8-bit AdamW or Adafactor the optimizer rung would try)" if optimizer.explore else ""
    raise UsageError(f"{type(model).__name__}.{sparse} is built with sparse=True: its gradient is a sparse tensor, "
                     f"which {which} cannot step{rung}. Pass an optimizer that steps sparse gradients, such as "
                     "optimizer=torch.optim.SGD(model.parameters(), lr=0.1) or Adagrad (an instance or a factory "
                     "params -> optimizer; on the command line, --optimizer FILE.py:fn), or build it with sparse=False.")


def _model_factory(model: Any) -> Callable[[], nn.Module]:
    # partials, not lambdas: a spec must pickle to be probed in a child process.
    if isinstance(model, nn.Module):
        # Each probe trains a deep copy: the user's module is never touched.
        return functools.partial(copy.deepcopy, model)
    if _is_hf_config(model):
        return functools.partial(_model_from_config, model)
    if callable(model):
        _check_no_arguments(model)
        return functools.partial(_called_factory, model)
    raise UsageError(f"model must be an nn.Module, a zero-argument factory returning one, or a Hugging Face "
                     f"config, but got {type(model).__name__}.")


def _check_no_arguments(factory: Callable[..., Any]) -> None:
    """`UsageError` when the model factory (a class, a function) cannot be called with no arguments."""
    if not batches.binds(factory, (), {}):
        name = getattr(factory, "__name__", type(factory).__name__)
        # a lambda taking inputs is most often a forward written out, not a factory: it has no name to repeat
        example = "lambda: MyModel()" if name == "<lambda>" else f"lambda: {name}(...)"
        raise UsageError(f"model={name}{batches.signature_text(factory)} is called with no arguments to build each "
                         f"probe's model; pass a built model (the nn.Module, which autofit calls on the batch), or "
                         f"a zero-argument factory such as {example}.")


def _called_factory(factory: Callable[[], Any]) -> nn.Module:
    built = factory()
    if not isinstance(built, nn.Module):
        raise UsageError(f"The model factory returned {type(built).__name__}, not an nn.Module; "
                         "make it return the model.")
    return built


def _is_hf_config(value: Any) -> bool:
    config_class = loaded_class("transformers.configuration_utils", "PretrainedConfig")
    return config_class is not None and isinstance(value, config_class)


def _model_from_config(config: Any) -> nn.Module:
    from autofit.models.presets import build_model

    return build_model(config)  # the class its architectures name, else the Auto class that knows it; fp32


def _is_sample(batch: Any) -> bool:
    return batch is not None and not (callable(batch) and not isinstance(batch, torch.Tensor))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, nn.Module):
        return [*value.parameters(), *value.buffers()]
    from torch.utils._pytree import tree_flatten

    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _resident_bytes(values: Any, device: torch.device) -> int:
    """Bytes of the tensors in `values` (a module, a sample batch) that sit on `device`, each storage once."""
    if device.type == "cpu":
        return 0
    storages = {}
    for value in values:
        for tensor in _tensors(value):
            if tensor.device == device:
                storages[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def _check_weights(model: Any) -> None:
    """`UsageError` for a module whose weights are on the meta device (built under `torch.device("meta")`
    or accelerate's `init_empty_weights`): probes train, and there is nothing to train."""
    if isinstance(model, nn.Module) and any(tensor.is_meta for tensor in _tensors(model)):
        raise UsageError(f"{type(model).__name__}'s weights are on the meta device (built under "
                         "torch.device('meta') or init_empty_weights()): probes train real steps and these "
                         "have no data. Pass the model with its weights, or a factory that builds it; "
                         "autofit.dry_run takes it as it is.")


def _on_cpu(model: Any) -> Any:
    """`model` itself when it is no module or all its tensors are on the CPU (or the meta device: no data
    to copy); else a CPU copy, made tensor by tensor (never a second copy on the GPU; tied weights stay
    tied). The user's module is not touched."""
    if not isinstance(model, nn.Module):
        return model
    memo: dict[int, Any] = {}
    for tensor in _tensors(model):
        if tensor.device.type not in ("cpu", "meta") and id(tensor) not in memo:
            moved = tensor.detach().to("cpu")
            memo[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
    return copy.deepcopy(model, memo) if memo else model


def _batch_factory(batch: Any, info: ModelInfo, seq_len: int | None) -> tuple[Callable[[int], Any], str]:
    if batch is None:
        if not info.is_hf:
            raise UsageError(f"No batch given and {info.name} is not a Hugging Face model, so none can be "
                             "synthesized; pass a sample batch or a make_batch(batch_size) factory (from the "
                             "command line, --batch FILE.py:make_batch beside --model FILE.py:make_model, or a --model "
                             "FILE.py:factory returning (model, make_batch) or (model, make_batch, loss_fn)).")
        return synthesize_batch(info.hf_config, seq_len, info.name)
    if callable(batch) and not isinstance(batch, torch.Tensor):
        batches.check_factory(batch)
        return batch, "from make_batch(batch_size)"
    return batches.factory_from_sample(batch), f"sample batch of {batches.leading_dim(batch)} rows, cycled"


def _check_given_length(seq_len: int, sample: Any, description: str) -> None:
    """`UsageError` when `seq_len` asks for a length the given batch does not have: it sets the length of
    a synthesized batch only, and a given one is probed as it is."""
    tokens = batches.tokens_per_sample(sample)
    if tokens == seq_len:
        return
    has = f"{tokens} tokens per sample" if tokens is not None else "no sequence axis autofit can read"
    raise UsageError("{given} sets the length of the batch autofit synthesizes for a Hugging Face model, but a batch "
                     "is given ({description}: {has}) and is probed as it is. Make the batch at the longest length "
                     "the job will see, or leave {name} out.", given=Param("seq_len", seq_len), name=Param("seq_len"),
                     description=description, has=has)


def _checked_sample(batch_factory: Callable[[int], Any]) -> Any:
    """A sample of two, after checking the factory makes the number of samples asked for at another size too."""
    batches.made(batch_factory, 3)
    return batches.made(batch_factory, 2)


def _budget(memory_budget: int | str | None, device: torch.device, num_gpus: int = 1) -> tuple[int, str]:
    available = device_memory(device)
    if memory_budget is None and device.type == "cuda":
        return available, "the card's memory"
    if memory_budget is None:  # CPU ranks rehearsing several GPUs share the host's RAM
        return available // num_gpus, "free host RAM" + (f" shared by {num_gpus} ranks" if num_gpus > 1 else "")
    budget = parse_size(memory_budget)
    if device.type == "cuda" and budget > available:
        raise UsageError(f"memory_budget {format_size(budget)} exceeds the card's {format_size(available)}; "
                         "use dry_run() to plan for a larger GPU.")
    return budget, "given"


def parse_allow(allow: Any) -> int:
    """The highest exactness tier `allow` opens: None -> 1, an int tier, or names such as {"lora"}; a string
    as `--allow` takes it too: names separated by commas ("lora,numerics"), or a tier ("2")."""
    if allow is None:
        return DEFAULT_MAX_TIER
    if isinstance(allow, str) and allow.strip().isdigit():
        allow = int(allow)
    if isinstance(allow, int) and not isinstance(allow, bool):
        if 0 <= allow <= 2:
            return allow
        raise UsageError("{given}: the tiers are 0 (exact), 1 (numerics changes) and 2 (LoRA, quantization); give "
                         "one of them, or names such as {example}.", given=Param("allow", allow),
                         example=Param("allow", {tier_name(2)}))
    names = [part for part in allow.split(",") if part.strip()] if isinstance(allow, str) else allow
    try:
        names = [name.strip().lower() if isinstance(name, str) else name for name in names]  # "LoRA" too
        unknown = [name for name in names if name not in ALLOW_NAMES]
    except TypeError:
        unknown = [allow]
    if unknown:
        which = ": {name} is not a name it takes" + _allow_hint(unknown[0]) if isinstance(unknown[0], str) else \
            " is not understood"
        raise UsageError("{given}" + which + "; give a tier 0-2 or names from {names} (e.g. {example} to train LoRA "
                         "adapters).", given=Param("allow", allow), name=repr(unknown[0]),
                         names=str(sorted(ALLOW_NAMES)), example=Param("allow", {tier_name(2)}),
                         every=Param("allow", 2))
    return max([ALLOW_NAMES[name] for name in names], default=0)


def _allow_hint(name: str) -> str:
    """What an `allow` name that is not one meant: a precision or optimizer is a numerics change (tier 1, open by
    default), "all" is tier 2 (`{every}`, a `UsageError` placeholder); else the name it is close to."""
    if name in NUMERICS_WORDS:
        return (f" ({name} is a numerics change, which 'numerics', tier 1, opens: the default already; the "
                "search picks the precision and optimizer)")
    if name in ("all", "everything", "any"):
        return " ({every} opens every tier)"
    return did_you_mean(name, ALLOW_NAMES)


def parse_optimizer(optimizer: Any) -> OptimizerSpec:
    """An `OptimizerSpec` from a name, an optimizer instance (its class and hyperparameters) or a factory."""
    from autofit.config import Optimizer

    if isinstance(optimizer, str):
        name = optimizer.lower()
        known = {o.value for o in Optimizer} - {"user"}
        if name not in known | ADAM_NAMES:
            raise UsageError("{given} is not known{close}; use one of {names}, an optimizer instance (e.g. "
                             "torch.optim.SGD(model.parameters(), lr=0.1)), or a factory params -> optimizer (on the "
                             "command line, --optimizer FILE.py:fn).", given=Param("optimizer", optimizer),
                             close=did_you_mean(name, known | ADAM_NAMES), names=str(sorted(known | ADAM_NAMES)))
        # Adam is AdamW without weight decay (the decay is the only difference between the two updates)
        kwargs = {"weight_decay": 0.0} if name == "adam" else {}
        return OptimizerSpec("adamw" if name in ADAM_NAMES else name, kwargs, explore=name in ADAM_NAMES)
    if isinstance(optimizer, torch.optim.Optimizer):
        kwargs, grouped = _hyperparameters(optimizer)
        if type(optimizer) is torch.optim.AdamW:
            keep = {"lr", "betas", "eps", "weight_decay"}
            return OptimizerSpec("adamw", {k: v for k, v in kwargs.items() if k in keep}, explore=True,
                                 grouped=tuple(k for k in grouped if k in keep))
        cls = type(optimizer)
        params = stand_ins()
        built = _built(cls, kwargs, params)
        return OptimizerSpec("user", kwargs, factory=functools.partial(cls, **kwargs), cls=cls, explore=False,
                             grouped=grouped, costs=measure(built, params) if built is not None else None)
    if callable(optimizer):
        return _factory_spec(optimizer)
    raise UsageError(f"optimizer must be a name, an optimizer instance or a factory, got {type(optimizer).__name__}.")


def _factory_spec(factory: Callable[..., Any]) -> OptimizerSpec:
    """A factory `params -> optimizer`, kept as given, with the class and hyperparameters of what it builds
    over stand-in parameters (a matrix and a vector, so a decay / no-decay split shows as values that
    differ by group), for the plan's record: `autofit.prepare` and the exports rebuild it from them as
    they do an instance; and its memory costs, measured on them. Where the stand-in build fails, nothing is
    recorded or measured; where it returns no optimizer (an (optimizer, scheduler) pair), `UsageError`."""
    params = stand_ins()
    try:
        built = factory(params)
    except Exception:  # noqa: BLE001 - the factory may need real parameters; its probes will say if it fails
        return OptimizerSpec("user", factory=factory, explore=False)
    if not isinstance(built, torch.optim.Optimizer):
        raise UsageError(f"The optimizer factory returned a {type(built).__name__}, not an optimizer: return the "
                         "torch.optim.Optimizer alone, e.g. lambda params: torch.optim.SGD(params, lr=0.1) (a "
                         "learning-rate scheduler is your loop's to step; a probe's few steps need none).")
    kwargs, grouped = _hyperparameters(built)  # before `measure` steps it (and sets its groups' foreach)
    return OptimizerSpec("user", kwargs, factory=factory, cls=type(built), explore=False, grouped=grouped,
                         costs=measure(built, params))


def _built(cls: type, kwargs: dict[str, Any], params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    """A `cls(params, **kwargs)`, or None where building one over stand-ins fails."""
    try:
        return cls(params, **kwargs)
    except Exception:  # noqa: BLE001 - a class that needs more than parameters: left unmeasured
        return None


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The optimizer's hyperparameters as its parameter groups hold them now (a scheduler or an edit changes
    them after construction): a value every group shares, else the largest group's; and the names whose
    values differ between groups (a decay / no-decay split), which one set of keyword arguments cannot say."""
    groups = optimizer.param_groups
    largest = max(groups, key=lambda group: sum(p.numel() for p in group["params"]))
    kwargs = {key: _scalar(largest.get(key, default)) for key, default in optimizer.defaults.items()}
    kwargs = {key: value for key, value in kwargs.items() if not isinstance(value, torch.Tensor)}
    grouped = tuple(key for key in kwargs if len({repr(_scalar(group.get(key))) for group in groups}) > 1)
    return kwargs, grouped


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _checked_nvme_path(path: Any) -> str | None:
    return None if path is None else str(check_nvme_path(path))


def _check_positive(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, but got {value!r}.")
    return value


def _check_global_batch(global_batch_size: Any, num_gpus: int) -> None:
    _check_positive("global_batch_size", global_batch_size)
    if global_batch_size % num_gpus:
        raise UsageError("global_batch_size {size} cannot be split over {ranks} ranks; use a multiple of {count}.",
                         size=str(global_batch_size), ranks=Param("num_gpus", num_gpus), count=str(num_gpus))


def _check_fraction(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise UsageError(f"{name} must be a fraction in [0, 1), but got {value!r}.")


def _check_loss_on_meta(model: nn.Module | Callable[[], nn.Module], sample: Any, loss_fn: LossFn) -> None:
    """Raise the loss error now, before any probe, when a meta forward shows the model and loss_fn give no
    scalar loss to backward through. `model`: a build on the meta device, or a given module's deep-copy
    factory, copied onto the meta device here (`autofit.models.info.meta_model`: no memory, the module left
    as it was). A deep Hugging Face model runs at one block (`shallow`): its output is shaped as the whole
    model's, for a fraction of the ops."""
    on_meta = batches.to_device(sample, torch.device("meta"))
    try:
        built = model if isinstance(model, nn.Module) else meta_copy(model)
        with batches.quiet_transformers():
            loss = loss_fn(batches.call_model(shallow(built), on_meta), on_meta)
    except UsageError:
        raise
    except Exception:  # some ops have no meta kernel, or the loss reads a value: the first probe will tell
        return
    batches.checked_loss(loss)
