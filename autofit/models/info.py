"""What autofit needs to know about a model, read from a build on the meta device (no memory used)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import inspect
import sys
from typing import Any, Callable

import torch
from torch import nn

from autofit.errors import UsageError


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Facts about the model read once before the search; sizes in parameters, not bytes."""

    name: str  # class name, e.g. "GPT2LMHeadModel"
    num_params: int  # all parameters
    trainable_params: int  # parameters with requires_grad
    hf_config: Any = None  # transformers.PretrainedConfig for Hugging Face models, else None
    fingerprint: str = ""  # hash of parameter names, shapes and dtypes: identifies the model in trial storage
    attention: tuple[str, ...] = ()  # fused attention implementations a Hugging Face model supports
    blocks: str | None = None  # dotted path of the repeated blocks (checkpointing unit), "" for the model itself
    num_blocks: int = 0  # blocks checkpointing recomputes (`checkpoint_blocks`)
    hidden_size: int = 0  # the model's width: the Hugging Face config's, else the widest matrix's smaller side
    has_attention: bool = True  # a module named *Attention* (transformers' convention); False: Mamba, RWKV, CNNs
    weights_dtype: str = "float32"  # the floating dtype holding most parameters ("bfloat16": a model cast to bf16)
    batch_norm: bool = False  # a module normalises over the micro-batch in training (`batch_normalises`)
    complex_weights: bool = False  # a trainable weight is complex (a Fourier layer's spectral weights)

    @property
    def smallest_micro_batch(self) -> int:
        """The least micro-batch a training step takes (`least_micro_batch`)."""
        return least_micro_batch(self.batch_norm)

    @property
    def is_hf(self) -> bool:
        """Whether the model is a Hugging Face `PreTrainedModel` (or a peft model wrapping one)."""
        return self.hf_config is not None

    @property
    def trains_part(self) -> bool:
        """Whether the model trains only part of its parameters: its own adapters (a peft model), or
        weights its author froze. What it trains is then the author's choice, which LoRA would change."""
        return 0 < self.trainable_params < self.num_params

    @property
    def half_weights(self) -> bool:
        """Whether the model was given in a 16-bit dtype (bf16 or fp16 weights)."""
        return self.weights_dtype in ("bfloat16", "float16")

    def noting_weights(self, reason: str, casts: bool) -> str:
        """`reason`, saying what fp32 means for a model whose weights are 16-bit already: no autocast, the step
        in the weights' own dtype (probes train the model as given). `casts`: whether the chosen config's step
        computes in a dtype a strategy names (`autofit.strategies.compute_dtype`), which leaves nothing to say."""
        if casts or not self.half_weights:
            return reason
        return (f"{reason.rstrip('.')}. The model's weights are {self.weights_dtype}: fp32 here means no "
                f"autocast, so the step runs in {self.weights_dtype}, as the model was given (model.float() "
                "first for fp32 weights).")

    def trained(self) -> str:
        """What the model trains, e.g. "294,912 of 1,060,992 parameters"."""
        return f"{self.trainable_params:,} of {self.num_params:,} parameters"


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module | None:
    """Build the model with meta parameters (shapes only), or None when the factory cannot do that. A
    `UsageError` the factory raises (autofit's own builder refusing a config transformers cannot build) is
    raised: building for real would meet it too, after allocating every layer before it (a 40-layer
    CohereCompass classifier's config took 24 GB of RAM and the process with it)."""
    try:
        with torch.device("meta"):
            model = factory()
    except UsageError:
        raise
    except Exception:  # factories that load weights or touch real devices cannot build on meta
        return None
    return model if isinstance(model, nn.Module) else None


def inspect_model(model: nn.Module) -> ModelInfo:
    """Read `ModelInfo` from a built model (meta or real)."""
    digest = hashlib.sha256()
    total = trainable = 0
    by_dtype: dict[torch.dtype, int] = {}
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{param.requires_grad};".encode())
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
        if param.is_floating_point():
            by_dtype[param.dtype] = by_dtype.get(param.dtype, 0) + param.numel()
    weights = max(by_dtype, key=by_dtype.__getitem__, default=torch.float32)
    hf = hf_model(model)
    hf_config = hf.config if hf is not None else None
    path, blocks = find_blocks(model)[0], checkpoint_blocks(model)
    attention = tuple(name for name, flag in (("sdpa", "_supports_sdpa"), ("flash_attention_2", "_supports_flash_attn"))
                      if hf is not None and getattr(hf, flag, False))
    attends = any("Attention" in type(module).__name__ for module in model.modules())
    return ModelInfo(type(model).__name__, total, trainable, hf_config, digest.hexdigest()[:16],
                     attention, path, len(blocks), hidden_size(model, hf_config), attends,
                     str(weights).removeprefix("torch."), batch_normalises(model),
                     any(p.is_complex() and p.requires_grad for p in model.parameters()))


BATCH_NORM_MICRO_BATCH = 2  # the least micro-batch batch norm trains on: one sample gives no statistics


def least_micro_batch(batch_norm: bool) -> int:
    """The least micro-batch a training step takes, for the search and the OOM guard alike: 2 where batch
    norm needs the statistics of more than one sample (`BatchNorm1d` refuses one: "Expected more than 1
    value per channel when training"; others normalise a sample by itself), else 1."""
    return BATCH_NORM_MICRO_BATCH if batch_norm else 1


def batch_normalises(model: nn.Module) -> bool:
    """Whether `model` holds batch norm (BatchNorm1d/2d/3d, SyncBatchNorm): in training it normalises over
    the micro-batch, whose size then changes the numerics and must exceed one sample."""
    return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())


def partly_trainable(model: nn.Module) -> bool:
    """Whether `model` trains some of its weights and not others: its own adapters (a peft model), or a
    part its author froze (`ModelInfo.trains_part`)."""
    return {p.requires_grad for p in model.parameters()} == {True, False}


def hidden_size(model: nn.Module, hf_config: Any = None) -> int:
    """The model's width (elements): `hidden_size` (or the largest of `hidden_sizes`) of a Hugging Face
    config or its text config, as the DeepSpeed integrations read it; else the largest smaller side of
    a weight matrix (a Linear's input width, an embedding's dimension); 0 for a model without matrices."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        if config is None:
            continue
        if isinstance(getattr(config, "hidden_size", None), int):
            return config.hidden_size
        if getattr(config, "hidden_sizes", None):
            return max(config.hidden_sizes)
    return max((min(p.shape[:2]) for p in model.parameters() if p.dim() >= 2), default=0)


def find_blocks(model: nn.Module) -> tuple[str | None, list[nn.Module]]:
    """The model's repeated blocks: in the `nn.ModuleList`/`nn.Sequential` where they hold the most
    parameters, its children when at least two and all of one class (`module_class`), or else its
    largest group of at least two children of one class that are modules of modules (a stack of blocks
    between a stem and a head: `nn.Sequential(*blocks, norm, head)`; a lone `nn.Linear` or `nn.Conv2d`
    there is a layer, not a block); as (dotted path of the container, blocks), (None, []) when there is none."""
    best: tuple[int, str | None, list[nn.Module]] = (-1, None, [])
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            blocks = _repeated(list(module.children()))
            size = _size(blocks)
            if blocks and size > best[0]:
                best = (size, path, blocks)
    return best[1], best[2]


def checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks checkpointing recomputes, in the model's order: `find_blocks`', and in a model of your own
    the repeated blocks of its other containers too (`_repeated`, modules of modules) — a ResNet's stages
    `layer1` .. `layer4`, each an `nn.Sequential` of its blocks, of which the largest holds the fewest
    activations; a U-Net's down and up blocks; an encoder's and a decoder's stacks. (A Hugging Face model
    checkpoints through its own switch.) A block inside another is left to the outer one."""
    blocks = find_blocks(model)[1]
    if not blocks or hf_model(model) is not None:
        return blocks
    chosen = {id(block) for block in blocks}
    found: list[nn.Module] = []
    inside: set[int] = set()
    for _, container in model.named_modules():  # outer containers first: their blocks come before what they hold
        if isinstance(container, (nn.ModuleList, nn.Sequential)) and id(container) not in inside:
            for block in _repeated(list(container.children())):
                if id(block) not in inside and (id(block) in chosen or next(block.children(), None) is not None):
                    found.append(block)
                    inside.update(id(m) for m in block.modules())
    return found


def _repeated(children: list[nn.Module]) -> list[nn.Module]:
    """`find_blocks`' blocks among a container's `children`, or []."""
    if len(children) >= 2 and len({module_class(child) for child in children}) == 1:
        return children
    groups: dict[type, list[nn.Module]] = {}
    for child in children:
        if next(child.children(), None) is not None:
            groups.setdefault(module_class(child), []).append(child)
    return max((group for group in groups.values() if len(group) >= 2), key=_size, default=[])


def _size(modules: list[nn.Module]) -> int:
    return sum(p.numel() for module in modules for p in module.parameters())


def module_class(module: nn.Module) -> type:
    """The class a module was built as: a parametrized one's (`weight_norm`, `spectral_norm`, your own
    `register_parametrization`) is a class torch makes for that module alone (`ParametrizedConv1d`, a new
    one each time: torch/nn/utils/parametrize.py `_inject_new_class`), so a vocoder's weight-normed convs
    share no class but the one each was made from, its first base."""
    from torch.nn.utils import parametrize

    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def loaded_class(module: str, name: str) -> type | None:
    """Class `name` of `module` where that module is imported already, else None. An object can be an instance
    of a class only once the module defining the class is imported, so a model of plain PyTorch is found not to
    be a transformers one without importing transformers (seconds in every process: the search, each probe
    process and rank, an exported script)."""
    found = sys.modules.get(module)
    return getattr(found, name, None) if found is not None else None


def hf_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face `PreTrainedModel` that `model` is, or wraps as a peft `PeftModel` (adapters on a
    transformers model: `get_base_model()`), else None."""
    if is_pretrained(model):
        return model
    base = model.get_base_model() if callable(getattr(type(model), "get_base_model", None)) else None
    return base if is_pretrained(base) else None


def is_pretrained(model: Any) -> bool:
    """Whether `model` is a transformers `PreTrainedModel` (without importing transformers: `loaded_class`)."""
    pretrained = loaded_class("transformers.modeling_utils", "PreTrainedModel")
    return pretrained is not None and isinstance(model, pretrained)


def takes_labels(params: frozenset[str]) -> bool:
    """Whether a forward with these arguments takes targets for its loss (`labels`, `next_sentence_label`,
    DETR's list of `labels`, `mc_labels`): a model whose forward takes none computes its loss alone (ViTMAE)
    or has no head at all (`presets.check_head`)."""
    return any("label" in param for param in params)


def forward_parameters(model_class: str | None) -> frozenset[str]:
    """Names of the arguments of transformers class `model_class`'s forward (empty when unknown)."""
    import transformers

    cls = getattr(transformers, model_class, None) if model_class else None
    if cls is None or not hasattr(cls, "forward"):
        return frozenset()
    return frozenset(inspect.signature(cls.forward).parameters) - {"self", "kwargs"}


def meta_model(factory: Callable[[], nn.Module]) -> nn.Module:
    """A build of `factory`'s model on the meta device. A given module (the spec's deep-copy factory) is
    copied with its tensors replaced by meta ones, so no real copy is made; factories that cannot build
    on meta are built for real once and moved."""
    if isinstance(factory, functools.partial) and factory.func is copy.deepcopy \
            and isinstance(factory.args[0], nn.Module):
        module = factory.args[0]
        memo: dict[int, Any] = {}
        for tensor in (*module.parameters(), *module.buffers()):
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        return copy.deepcopy(module, memo)
    built = build_on_meta(factory)
    if built is None or any(t.device.type != "meta" for t in (*built.parameters(), *built.buffers())):
        built = (built or factory()).to("meta")
    return built
