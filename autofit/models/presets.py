"""Model presets: published Hugging Face configurations shipped as data (no weights), by short name.

`get_preset("llama-2-7b")` returns a `transformers.PretrainedConfig`; building a model from it on the
meta device or under fake tensors costs no memory, which is how `autofit dry-run` plans a 70B model on a
laptop. The data lives in `autofit/data/models.json`: adding a preset is adding an entry there.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
from importlib import resources
from typing import Any

from autofit.errors import UsageError

_RESERVED = {"model_type", "architecture", "aliases", "alias_differs"}


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, dict[str, Any]]:
    text = resources.files("autofit").joinpath("data/models.json").read_text(encoding="utf-8")
    return {name: entry for name, entry in json.loads(text).items() if not name.startswith("_")}


@functools.lru_cache(maxsize=1)
def _names() -> dict[str, str]:
    """Every accepted spelling (lower case) -> preset name."""
    names: dict[str, str] = {}
    for name, entry in _table().items():
        names[name.lower()] = name
        for alias in entry.get("aliases", ()):
            names[alias.lower()] = name
    return names


def list_presets() -> list[str]:
    """The preset names in models.json's order: by family, smallest first."""
    return list(_table())


def preset_aliases(name: str) -> list[str]:
    """The other names preset `name` is accepted by (hub ids, older spellings)."""
    return list(_table()[name].get("aliases", ()))


def alias_differences(spelling: str) -> dict[str, tuple[Any, Any]]:
    """Config fields where the model `spelling` (an alias) names differs from the preset it resolves to,
    as {field: (the preset's value, the named model's)}: "llama-3.1-8b" is the llama-3-8b preset, whose
    8,192 positions are Llama 3's, where Llama 3.1 has 131,072. Empty for a preset's own name or an
    alias of the same model."""
    name = resolve_name(spelling)
    if name is None:
        return {}
    entry = _table()[name]
    theirs = entry.get("alias_differs", {}).get(str(spelling).strip().lower(), {})
    return {field: (entry.get(field), value) for field, value in theirs.items()}


def resolve_name(name: str) -> str | None:
    """The preset `name` refers to (a name or an alias, any case), or None."""
    return _names().get(str(name).strip().lower())


def get_preset(name: str) -> Any:
    """The `transformers.PretrainedConfig` of preset `name` (a name or alias such as "meta-llama/Llama-2-7b-hf").

    `config.architectures[0]` names the transformers class to build. Unknown names raise `UsageError`
    listing the closest preset names.
    """
    resolved = resolve_name(name)
    if resolved is None:
        raise UsageError(_unknown_message(name))
    entry = _table()[resolved]
    from transformers import AutoConfig

    fields = {k: v for k, v in entry.items() if k not in _RESERVED}
    config = AutoConfig.for_model(entry["model_type"], **fields)
    config.architectures = [entry["architecture"]]
    config.name_or_path = resolved
    return config


def _unknown_message(name: str) -> str:
    close = difflib.get_close_matches(str(name).strip().lower(), list(_names()), n=5, cutoff=0.5)
    suggestions = list(dict.fromkeys(_names()[c] for c in close))  # most similar first
    hint = f"did you mean {', '.join(suggestions)}?" if suggestions else \
        f"known presets: {', '.join(list_presets())}."
    return (f"Unknown model preset {name!r}: {hint} Or pass a Hugging Face hub id as ORG/NAME (e.g. "
            "openai/whisper-small), a config.json, a model folder, or FILE.py:factory (`autofit models` lists the "
            "presets).")


# The Auto classes tried, in order, for a config that names no architecture: the first whose mapping knows
# the config's type builds it (the bare AutoModel last: it trains nothing without a head). An encoder-decoder
# config tries the encoder-decoder classes first (Whisper's and BART's are in the causal-LM mapping too, as
# their decoders alone), an encoder's the masked LM its pretraining trains (BERT's causal head needs
# is_decoder=True; DistilBERT has none), and an image-text model whose base class computes its contrastive
# loss (CLIP, SigLIP: `return_loss`) that class, not its vision tower's classifier. Waveform encoders
# (wav2vec2, HuBERT) fine-tune with CTC; a model whose only head is its self-supervised pretraining (ViTMAE,
# VideoMAE) trains that.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq",
                "AutoModelForImageTextToText", "AutoModelForImageClassification", "AutoModelForMaskedLM",
                "AutoModelForCTC", "AutoModelForPreTraining", "AutoModel")
ENCODER_DECODER_CLASSES = ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq")


def model_class(config: Any) -> Any:
    """The transformers class a config's `architectures[0]` names (`trained_name`), else the first of
    `auto_classes(config)` whose mapping knows the config's type; a `UsageError` when none does."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, trained_name(name), None)
        if cls is not None:
            return cls
    for auto in auto_classes(config):
        built = _built_by(auto, config)
        if built is not None and not _deprecated(built):
            return built
    model_type = getattr(config, "model_type", "?")
    raise UsageError(f"No transformers Auto class builds a model to train from a {type(config).__name__} "
                     f"(model_type {model_type!r}) alone; add \"architectures\": [\"ClassName\"] to its config.json, "
                     "naming the transformers class you train, or pass FILE.py:factory.")


def check_head(model: Any) -> None:
    """A transformers bare model (`LayoutLMv3Model`, `Dinov2Model`: no head, its forward takes no labels)
    returns no loss to train: the `UsageError` naming the heads transformers has for it, before any probe."""
    from autofit.models.info import forward_parameters, is_pretrained, takes_labels

    if not is_pretrained(model):
        return
    import transformers

    name = type(model).__name__
    if _refuses_training(type(model)):
        raise UsageError(f"{name}'s forward raises \"Training is not implemented yet\" when given labels: "
                         "transformers has no training loss for it. Pass loss_fn=lambda output, batch: ... "
                         "computing yours from its output (autofit tune: --loss-fn FILE.py:fn, or a factory "
                         "returning (model, make_batch, loss_fn)).")
    if "For" in name or not name.endswith("Model"):
        return
    params = forward_parameters(name)
    if not params or "return_loss" in params or takes_labels(params):
        return
    stem = name.removesuffix("Model")
    heads = sorted(head for head in dir(transformers)
                   if head.startswith(stem + "For") or head == stem + "LMHeadModel")
    train = (f"Train one of its heads ({', '.join(heads)}): name it in the config's architectures "
             f"(\"architectures\": [\"{heads[0]}\"] in config.json) or build it yourself, or pass "
             if heads else "transformers has no head for it: pass ")
    raise UsageError(f"{name} is transformers' bare model: it has no head and returns no loss. {train}"
                     "loss_fn=lambda output, batch: ... computing your loss from the bare model's output "
                     "(autofit tune: --loss-fn FILE.py:fn, or a factory returning (model, make_batch, loss_fn)).")


NO_PADDING = "Cannot handle batch sizes > 1 if no padding token is defined"  # transformers' classifiers' error


def check_padding(model: Any) -> None:
    """A transformers classifier that finds each sequence's last token by its config's `pad_token_id` (GPT-2's,
    Llama's, Qwen2's, Mistral's `ForSequenceClassification`, reward models) raises on every batch of more than
    one sample while it is unset, as base checkpoints leave it: the `UsageError` naming the id to set, before
    any probe (every probe failed alike; a dry-run's simulation of 2 samples failed and rested on the formula)."""
    from autofit.models.info import is_pretrained

    config = getattr(model, "config", None)
    if not is_pretrained(model) or getattr(config, "pad_token_id", 0) is not None \
            or not _forward_says(type(model), NO_PADDING):
        return
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    id_text = f" ({eos})" if isinstance(eos, int) else ""
    json_text = f'; in config.json, "pad_token_id": {eos}' if isinstance(eos, int) else ""
    raise UsageError(f"{type(model).__name__} finds each sequence's last token by its config's pad_token_id, which "
                     f"is unset (base checkpoints leave it so): transformers refuses any batch of more than one "
                     f"sample (\"{NO_PADDING}.\"). Set it to the id your tokenizer pads with: "
                     f"model.config.pad_token_id = tokenizer.pad_token_id, or its eos_token_id{id_text} where it "
                     f"has no pad token{json_text}.")


def _refuses_training(cls: type) -> bool:
    """Whether a transformers head's forward raises on labels rather than compute a loss (DPT, Depth Anything,
    ZoeDepth and Depth Pro's depth heads, OmDet-Turbo: `raise NotImplementedError("Training is not
    implemented yet")`), read from its source, which says so where a name would not (GLPN's depth head
    trains)."""
    return _forward_says(cls, "Training is not implemented yet")


def _deprecated(cls: type) -> bool:
    """Whether transformers builds `cls` only to warn it is deprecated (4.x's `Wav2Vec2ForMaskedLM`, mapped as
    wav2vec2's masked LM, computes no loss: "Please use `Wav2Vec2ForCTC` instead"), read from its __init__."""
    try:
        return f"`{cls.__name__}` is deprecated" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False


def _forward_says(cls: type, text: str) -> bool:
    """Whether `text` is in the source of transformers class `cls`'s forward (False where it has none to read)."""
    try:
        return text in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def trained_name(architecture: str) -> str:
    """The class that trains for a config's architecture: a distilled classifier `...WithTeacher` (DeiT's,
    LeViT's) runs inference only in transformers (its forward takes no labels) and trains as the classifier
    without the teacher's head (`DeiTForImageClassification`), as transformers' DeiT docs advise."""
    return architecture.removesuffix("WithTeacher")


def auto_classes(config: Any) -> tuple[str, ...]:
    """`AUTO_CLASSES` in the order tried for `config`: the base class first where it computes its own
    contrastive loss, encoder-decoder classes first for an encoder-decoder, the masked LM before the causal
    LM for a config that is not a decoder."""
    if _trains_whole(config):
        first: tuple[str, ...] = ("AutoModel",)
    elif getattr(config, "is_encoder_decoder", False):
        first = ENCODER_DECODER_CLASSES
    elif not getattr(config, "is_decoder", False):
        first = ("AutoModelForMaskedLM",)
    else:
        first = ()
    return first + tuple(auto for auto in AUTO_CLASSES if auto not in first)


def _trains_whole(config: Any) -> bool:
    """Whether transformers' base class for `config` takes `return_loss` (CLIP, SigLIP: the contrastive loss)."""
    from autofit.models.info import forward_parameters

    base = _built_by("AutoModel", config)
    return base is not None and "return_loss" in forward_parameters(base.__name__)


def _built_by(auto: str, config: Any) -> Any:
    """The class transformers' Auto class `auto` builds from `config` (BertForMaskedLM), or None where its
    mapping does not know the config's type (or this transformers has no such Auto class). Where it maps
    several (DeiT's classifier and its inference-only ...WithTeacher, Perceiver's three, Funnel's two
    bare models), the first, as transformers' auto factory takes for a config naming none of them."""
    import transformers

    cls = getattr(transformers, auto, None)  # names differ between transformers versions
    if cls is None or type(config) not in cls._model_mapping:
        return None
    built = cls._model_mapping[type(config)]
    return built[0] if isinstance(built, (tuple, list)) else built


def build_model(config: Any) -> Any:
    """A freshly initialised fp32 model for `config` (call under `torch.device("meta")` to allocate nothing).

    transformers 5 builds in `config.dtype` when none is given (modeling_utils.py `_from_config`): a hub
    config.json saying bfloat16 would make every probe, fp32 ones included, train bf16 weights."""
    import torch

    cls = model_class(config)
    build = functools.partial(cls.from_config if hasattr(cls, "from_config") else cls._from_config,
                              **{_dtype_keyword(): torch.float32})
    try:
        try:
            model = build(config)
        except AttributeError as exc:
            if "'pad_token_id'" not in str(exc) or hasattr(config, "pad_token_id"):
                raise
            # transformers 5.0's PhiConfig (and kin) define no pad_token_id where their model reads one; later
            # releases define it None, as here
            config.pad_token_id = None
            model = build(config)
    except (AssertionError, AttributeError, ValueError, TypeError, KeyError, IndexError) as exc:  # a field wrong or missing
        raise UsageError(f"transformers cannot build {getattr(cls, '__name__', cls)} from this "
                         f"{type(config).__name__}: {type(exc).__name__}: {exc}. Check the config's fields (e.g. "
                         "pad_token_id below vocab_size).") from exc
    if hasattr(model, "tie_weights"):  # transformers 5.0 leaves tied embeddings untied when built on the meta device
        model.tie_weights()
    return model


def _dtype_keyword() -> str:
    """The keyword transformers' `_from_config` takes for the dtype to build in: `dtype` from 4.56, where it
    renamed `torch_dtype` (4.46-4.55 pass an unknown `dtype` on to the model's __init__, a TypeError)."""
    import transformers

    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if release >= (4, 56) else "torch_dtype"
