"""What the estimator knows of a model before simulating it: parameter counts by role (`ModelFacts`,
read from a meta build), and the activation formula used when a step cannot be simulated."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from torch import nn

from autofit.config import Config
from autofit.batches.synthetic import image_sides
from autofit.job.optimizer_costs import OptimizerCosts
from autofit.strategies import completed


# -- model facts ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """Parameter counts the state formulas need (elements, not bytes), read from a meta build."""

    num_params: int
    trainable_params: int
    linear_params: int = 0  # weights of the Linear layers inside the blocks: what NF4/int8 quantize, LoRA adapts
    linear_rows: int = 0  # output rows of those layers (int8 keeps one fp32 scale per row)
    lora_params_per_rank: int = 0  # sum of (in + out) over those layers: LoRA rank r adds r times this
    factored_params: int = 0  # Adafactor state elements: rows + cols per matrix, numel per vector
    largest_param: int = 0
    block_params: int = 0  # parameters of one repeated block
    block_trainable_params: int = 0  # those of them that train (a frozen block has no gradient to stage)
    num_blocks: int = 0
    weight_bytes: float = 4.0  # bytes per weight as the model stores them (4 fp32; 2 for a bf16 model)
    sparse_params: int = 0  # trainable weights whose gradient is sparse (`nn.Embedding`/`nn.EmbeddingBag` built with
    # sparse=True): the rows a batch looks up, not a dense copy (`Estimator.predict` adds them from the simulation)
    tied_params: int = 0  # the largest parameter used by two modules (GPT-2's embedding and head), else 0
    trainable_bytes: float = 4.0  # bytes per trainable weight as the model stores them
    trainable_tensors: int = 0  # trainable parameter tensors (an engine's per-parameter hooks run for each)
    trainable_sizes: tuple[int, ...] = ()  # their elements, in the model's order (how ZeRO-1/2 flattens them)
    adapted_layers: int = 0  # linear layers LoRA adapts (two adapter tensors each)
    buffer_bytes: int = 0  # the model's buffers as stored (normalization statistics, RoPE tables, masks)
    half_buffer_bytes: int = 0  # the same with its floating-point buffers cast to 16 bits
    # The user's own optimizer's states and step temporaries per byte of weight, measured on stand-ins
    # (`autofit.job.optimizer_costs`); None: unknown, counted as AdamW
    own_optimizer: OptimizerCosts | None = None

    def tensors_trained(self, adapters: bool) -> int:
        """Parameter tensors that train: the model's trainable ones, or two per adapted layer with LoRA."""
        return 2 * self.adapted_layers if adapters else self.trainable_tensors

    @property
    def trains_part(self) -> bool:
        """Whether the model trains only part of its weights (its own adapters, or a frozen part)."""
        return 0 < self.trainable_params < self.num_params


def model_facts(model: nn.Module, lora_targets: Sequence[str] | None = None) -> ModelFacts:
    """`ModelFacts` of a built model (meta or real). `lora_targets`: the full names of the linear layers
    LoRA adapts (`Lora.targets`); None: every linear layer inside the blocks."""
    from autofit.models.info import find_blocks, partly_trainable

    params = list(model.parameters())
    _, blocks = find_blocks(model)
    part = partly_trainable(model)  # its own adapters: the frozen layers are the base
    linears = [m for block in blocks for m in block.modules() if _is_linear(m) and not (part and m.weight.requires_grad)]
    shapes = [_in_out(m) for m in linears]
    adapted = shapes if lora_targets is None else [_in_out(model.get_submodule(name)) for name in lora_targets]
    factored = sum(sum(p.shape[-2:]) if p.dim() >= 2 else p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return ModelFacts(
        num_params=total, trainable_params=sum(p.numel() for p in params if p.requires_grad),
        linear_params=sum(i * o for i, o in shapes), linear_rows=sum(o for _, o in shapes),
        lora_params_per_rank=sum(i + o for i, o in adapted), factored_params=factored,
        largest_param=max((p.numel() for p in params), default=0),
        block_params=sum(p.numel() for p in blocks[0].parameters()) if blocks else 0, num_blocks=len(blocks),
        block_trainable_params=sum(p.numel() for p in blocks[0].parameters() if p.requires_grad) if blocks else 0,
        weight_bytes=sum(p.numel() * p.element_size() for p in params) / total if total else 4.0,
        tied_params=_largest_tied(model), sparse_params=_sparse_params(model),
        trainable_bytes=_bytes_each([p for p in params if p.requires_grad]),
        trainable_tensors=sum(1 for p in params if p.requires_grad), adapted_layers=len(adapted),
        trainable_sizes=tuple(p.numel() for p in params if p.requires_grad),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        half_buffer_bytes=sum(b.numel() * (2 if b.is_floating_point() else b.element_size())
                              for b in model.buffers()))


def _bytes_each(params: list) -> float:
    """Bytes per element over `params` as stored (4.0 for none)."""
    total = sum(p.numel() for p in params)
    return sum(p.numel() * p.element_size() for p in params) / total if total else 4.0


def _sparse_params(model: nn.Module) -> int:
    """Elements of the trainable weights whose gradient is sparse (`nn.Embedding`/`nn.EmbeddingBag(sparse=True)`)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
               and m.sparse and m.weight.requires_grad)


def _largest_tied(model: nn.Module) -> int:
    """Elements of the largest parameter registered in two places (tied weights), or 0."""
    seen: set[int] = set()
    tied = 0
    for _, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied = max(tied, param.numel())
        seen.add(id(param))
    return tied


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's transposed Linear


def _in_out(module: nn.Module) -> tuple[int, int]:
    rows, cols = module.weight.shape
    return (cols, rows) if isinstance(module, nn.Linear) else (rows, cols)



def formula_activations(hf: Any, facts: ModelFacts, tokens: int | None, mb: int, config: Config) -> int:
    """Activation bytes by formula, for a step that cannot be simulated (an op without a fake kernel).

    Per block, Korthikanti et al. 2022, eq. 1: s*b*h*(34 + 5*a*s/h) bytes in 16 bits (the 5as/h term is
    the attention matrix, absent with fused attention), with the MLP's share (19 s*b*h for GPT's 4h MLP)
    rescaled to the model's intermediate width (gated MLPs keep three intermediate tensors, not two);
    checkpointed blocks keep their 16-bit input (2*s*b*h) and one block is recomputed at a time. Beside
    the blocks: the output logits (16-bit, their fp32 upcast and its gradient: 10 bytes per logit) and,
    under autocast of fp32 weights, the 16-bit copy of every block weight autocast keeps (2 bytes each).
    fp32 compute doubles the activation bytes. Its measured bound is `autofit.estimate.tolerance.FORMULA_UNDER_PREDICTION`."""
    hidden = config_int(hf, "hidden_size", "hidden_sizes")
    heads = config_int(hf, "num_attention_heads", default=1)
    s, b, blocks = formula_positions(hf, tokens) or 1, mb, max(facts.num_blocks, 1)
    inter = config_int(hf, "intermediate_size", "n_inner", "d_ff", default=4 * hidden)
    gated = getattr(hf, "hidden_act", "") in ("silu", "swiglu") or bool(getattr(hf, "is_gated_act", False))
    mlp = 2 * hidden + (6 if gated else 4) * inter + inter // 4  # input + intermediates (+ a dropout mask)
    strategies = completed()
    attention = 0 if any(strategy.fuses_attention(config) for strategy in strategies) else 5 * heads * s
    layer = s * b * (15 * hidden + mlp + attention)  # 34 s*b*h when the MLP is GPT's
    share = sum(strategy.recomputed_blocks(config) for strategy in strategies)
    kept = (1 - share) * blocks * layer + share * blocks * 2 * s * b * hidden + (layer if share else 0)
    logits = 10 * s * b * int(getattr(hf, "vocab_size", 0) or 0)
    half = any(strategy.compute_dtype(config) is not None for strategy in strategies)  # 16-bit compute
    scale = 1 if half else 2
    half_weights = any(strategy.runs_engine(config) for strategy in strategies)  # 16-bit weights, no autocast copies
    copies = 2 * facts.linear_params if half and not half_weights and facts.weight_bytes > 2 else 0
    return int(scale * kept + logits + copies)


def config_int(hf: Any, *names: str, default: int = 0) -> int:
    """The first of `names` a Hugging Face config sets to a positive int, else `default`; a per-stage list
    (Swin's, SegFormer's widths and heads) gives its largest, which bounds every stage."""
    for name in names:
        value = getattr(hf, name, None)
        if isinstance(value, (list, tuple)):
            value = max((v for v in value if isinstance(v, int) and not isinstance(v, bool)), default=None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def formula_positions(hf: Any, tokens: int | None) -> int | None:
    """Positions per sample: the batch's sequence length, or a plain vision transformer's patches (+ class
    token, + YOLOS' detection tokens); None when neither says (a CNN, a detector's feature maps, a
    model in stages)."""
    if tokens:
        return tokens
    sides, patch = image_sides(hf), getattr(hf, "patch_size", None)
    patch = patch[0] if isinstance(patch, (list, tuple)) and patch else patch
    if sides is None or not isinstance(patch, int) or patch <= 0 or in_stages(hf):
        return None
    detection = getattr(hf, "num_detection_tokens", 0)
    return (sides[0] // patch) * (sides[1] // patch) + 1 + (detection if isinstance(detection, int) else 0)


def in_stages(hf: Any) -> bool:
    """A hierarchical vision model (Swin, ConvNeXt, Hiera): stages of their own depth and width, merging
    patches between them, so that no one count of positions runs through the model."""
    return any(isinstance(getattr(hf, name, None), (list, tuple)) and len(getattr(hf, name)) > 1
               for name in ("depths", "hidden_sizes", "embed_dims"))


def formula_covers(hf: Any, tokens: int | None) -> bool:
    """Whether `formula_activations` counts this model's step: a transformer's config (its width) with its
    positions per sample known. Its bound (`FORMULA_UNDER_PREDICTION`) was measured on such models only;
    elsewhere (a model of your own, a CNN, DETR's backbone and feature maps) it has none."""
    return config_int(hf, "hidden_size", "hidden_sizes") > 0 and formula_positions(hf, tokens) is not None
