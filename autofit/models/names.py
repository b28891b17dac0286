"""What `--model` names, turned into factories: a preset, a Hugging Face hub id (ORG/NAME), a local
Hugging Face config, or FILE.py:factory.

    model_factory, batch_factory, description = resolve_model("gpt2")
    model_factory, _, description = resolve_model("Qwen/Qwen2.5-7B-Instruct")

Configs give random weights: no weights are ever downloaded. A hub id is read from the local Hugging Face
cache first (`HF_HOME`, `HF_HUB_CACHE`; `HF_HUB_OFFLINE=1` honoured), then from a preset of that name,
and only then is its config.json alone downloaded. The batch is then synthesized by the spec from the
config. Factories are small picklable objects so that probes in child processes can rebuild them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from autofit.models import presets
from autofit.errors import UsageError


def resolve_model(arg: str) -> tuple[Callable[[], nn.Module], Callable[[int], Any] | None, str]:
    """(model factory, batch factory or None, one-line description) for a `--model` argument.

    `arg` is a preset name ("gpt2"), a Hugging Face hub id ("Qwen/Qwen2.5-7B-Instruct": `hub_config`), a
    config.json or a folder holding one, or "path/to/file.py:factory" where factory() returns a model,
    (model, make_batch) or (model, make_batch, loss_fn) (`factory_loss_fn` gives the loss).
    A None batch factory means: synthesize one from the model's config.
    """
    text = str(arg).strip()
    if not text:
        raise UsageError("--model is empty; give a preset name (e.g. gpt2), a hub id (ORG/NAME), a config.json, "
                         "a model folder or FILE.py:factory.")
    if ".py:" in text or text.endswith(".py"):
        return _from_file(text)
    path = Path(text).expanduser()
    if path.exists():
        config = load_config(path)
        return functools.partial(presets.build_model, config), None, f"{_architecture(config)} from {path} (random weights)"
    if presets.resolve_name(text) is None and (text.endswith(".json") or text.startswith((".", "/", "~"))):
        raise UsageError(f"--model {text!r}: no such file or folder. Give an existing config.json or model "
                         "folder, a preset name, or FILE.py:factory.")
    if HUB_ID.fullmatch(text):
        config, where = hub_config(text)
        if config is not None:
            return functools.partial(presets.build_model, config), None, \
                f"{_architecture(config)} {text} from {where} (random weights)"
    if presets.resolve_name(text) is None:
        cached = cached_repos(text)
        if cached:
            raise UsageError(f"--model {text!r} is not a preset; the local Hugging Face cache holds "
                             f"{' and '.join(map(repr, cached))}: pass {'it' if len(cached) == 1 else 'one'} as "
                             f"--model {cached[0]} (its config.json is read from the cache).")
    config = presets.get_preset(text)  # unknown names raise UsageError listing the close ones
    return functools.partial(presets.build_model, config), None, \
        f"preset {config.name_or_path} ({config.architectures[0]}, random weights)"


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME, as the hub spells repository ids


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (`HF_HUB_CACHE`, else `HF_HOME`/hub,
    else ~/.cache/huggingface/hub), as huggingface_hub resolves it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_repos(name: str) -> list[str]:
    """Hub ids ORG/NAME in the local cache whose NAME is `name` (any case): what a bare name typed for a
    model probably meant ("whisper-small" for "openai/whisper-small")."""
    cache = hub_cache_dir()
    folders = cache.glob("models--*--*") if cache.is_dir() else ()
    ids = (folder.name.removeprefix("models--").replace("--", "/", 1) for folder in folders)
    return sorted(i for i in ids if i.partition("/")[2].lower() == name.lower())


VARIANTS = ("-hf", "-instruct", "-chat", "-base", "-it")  # hub names of one architecture's variants


def matching_preset(repo_id: str) -> tuple[str, str] | None:
    """(preset, the spelling that matched) for hub id ORG/NAME whose NAME, or NAME less a variant suffix
    (`VARIANTS`), is a preset's name or alias (any case): "meta-llama/Llama-3.1-8B" -> ("llama-3-8b",
    "llama-3.1-8b"); None when none matches."""
    name = repo_id.partition("/")[2].strip().lower()
    for spelling in (name, *(name.removesuffix(v) for v in VARIANTS if name.endswith(v))):
        preset = presets.resolve_name(spelling)
        if preset is not None:
            return preset, spelling
    return None


def preset_hint(repo_id: str) -> str:
    """A sentence naming the preset that matches hub id `repo_id` (`matching_preset`) and where it differs
    from the model the id names (`presets.alias_differences`: Llama 3.1's maximum length); "" for none."""
    found = matching_preset(repo_id)
    if found is None:
        return ""
    preset, spelling = found
    name = repo_id.partition("/")[2].strip()
    parts = ([f"as {spelling}"] if spelling != preset else []) + \
        ([f"less its {name[len(spelling):]} suffix"] if len(name) > len(spelling) else [])
    named = f" ({', '.join(parts)})" if parts else ""
    hint = f" The preset {preset} matches its name{named}: --model {preset} plans it without the hub"
    differs = presets.alias_differences(spelling)
    if not differs:
        return hint + "."
    gaps = [f"its maximum length: {ours:,} tokens ({field}) where {repo_id} has {theirs:,}, so plan a --seq-len "
            f"up to {ours:,} with it" if field in LENGTH_FIELDS else f"{field}: {ours!r} where {repo_id} has {theirs!r}"
            for field, (ours, theirs) in differs.items()]
    return f"{hint}, but it differs from {repo_id} in {'; and in '.join(gaps)}."


LENGTH_FIELDS = ("max_position_embeddings", "n_positions")  # a config's maximum length, as the families name it


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) forbids the network, read from the environment now."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_config(repo_id: str) -> tuple[Any, str]:
    """(config, where it came from) for hub id `repo_id`: the local cache, else a preset of that name
    (None, "preset": the caller builds it), else config.json alone downloaded when online.
    `UsageError` naming every place looked at when it is found nowhere."""
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir()
    cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    if isinstance(cached, str):
        return load_config(Path(cached), name=repo_id), "the local Hugging Face cache"
    if presets.resolve_name(repo_id) is not None:
        return None, "preset"
    looked = f"the local Hugging Face cache ({cache}) and autofit's presets"
    if hub_offline():
        raise UsageError(f"--model {repo_id!r} was not found in {looked}, and HF_HUB_OFFLINE is set, so nothing "
                         f"was downloaded. Unset HF_HUB_OFFLINE to download its config.json alone, run "
                         f"`hf download {repo_id} config.json` where the network is reachable, or pass a local "
                         "config.json." + preset_hint(repo_id))
    return _downloaded(repo_id, cache, looked), "the Hugging Face hub (config.json only)"


def _downloaded(repo_id: str, cache: Path, looked: str) -> Any:
    """config.json of `repo_id`, downloaded alone into `cache`."""
    from huggingface_hub import hf_hub_download
    # huggingface_hub.utils holds them in every release transformers 4.46 takes (0.23.2 on); .errors from 0.25
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or None
    unreachable = _unreachable(repo_id, endpoint)
    if unreachable:
        raise UsageError(f"--model {repo_id!r} was not found in {looked}, and {unreachable}. Set HF_HUB_OFFLINE=1 "
                         f"to look in the cache alone, run `hf download {repo_id} config.json` where the network "
                         "is reachable, or pass a local config.json or a preset (`autofit models` lists them)."
                         + preset_hint(repo_id))
    try:
        path = hf_hub_download(repo_id, "config.json", cache_dir=cache, endpoint=endpoint, etag_timeout=10)
    except GatedRepoError as exc:
        why = f"the repository is gated ({type(exc).__name__}): accept its terms on the hub and log in (`hf auth login`)"
    except RepositoryNotFoundError as exc:
        why = f"the hub has no such repository, or it is private ({type(exc).__name__})"
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        why = f"the download failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    else:
        return load_config(Path(path), name=repo_id)
    raise UsageError(f"--model {repo_id!r} was not found in {looked}, and {why}. Pass a local config.json or a "
                     "preset (`autofit models` lists them)." + preset_hint(repo_id))


def _unreachable(repo_id: str, endpoint: str | None) -> str | None:
    """Why the hub cannot be reached, from one request for config.json's metadata (None when it answers).
    `hf_hub_download` retries an unreachable hub five times with backoff: offline, a mistyped id took
    half a minute of "Retrying in 8s" before its error."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import HfHubHTTPError

    # the URL names the endpoint; later releases also take it apart (for Xet storage), 0.23-0.26 do not
    takes_endpoint = "endpoint" in inspect.signature(get_hf_file_metadata).parameters
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json", endpoint=endpoint), timeout=10,
                             **({"endpoint": endpoint} if takes_endpoint else {}))
    except HfHubHTTPError:
        return None  # it answered: the download says what is wrong (gated, missing, ...)
    except Exception as exc:  # noqa: BLE001 - the HTTP client's transport errors (httpx's, under any name)
        host = endpoint or "https://huggingface.co"
        return f"the hub ({host}) did not answer ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
    return None


def _architecture(config: Any) -> str:
    """The transformers class the model is built as (`presets.model_class`), and the config's own where it
    names another (an inference-only one, or none transformers has); else the config's model type
    (building it then says why none fits)."""
    try:
        built = presets.model_class(config).__name__
    except UsageError:
        return config.model_type
    named = next(iter(getattr(config, "architectures", None) or ()), built)
    if named == built:
        return built
    why = "runs inference only" if presets.trained_name(named) == built else "is not a transformers class"
    return f"{built} (the config's {named} {why})"


def load_config(path: Path, name: str | None = None) -> Any:
    """A `transformers.PretrainedConfig` from a config.json or a folder holding one (local only)."""
    from transformers import CONFIG_MAPPING

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"{path} holds no config.json; point --model at a Hugging Face model folder or its "
                         "config.json.")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"Cannot read {file} as JSON ({exc}); pass a Hugging Face config.json.") from exc
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"{file} has model_type={model_type!r}, which transformers does not know; a Hugging "
                         "Face config.json names its model_type (e.g. \"gpt2\", \"llama\").")
    cls = CONFIG_MAPPING[model_type]
    # transformers writes floats JSON lacks as {"__float__": "Infinity"} (Mamba2's time_step_limit) and
    # decodes them when it reads a config file (`_dict_from_json_file`): the same here
    config = cls.from_dict(getattr(cls, "_decode_special_floats", lambda data: data)(data))
    config.name_or_path = name or str(path)
    return config


def _from_file(text: str) -> tuple[Callable[[], nn.Module], Callable[[int], Any] | None, str]:
    factory = file_factory(text)
    built = factory.probe_call()
    description = f"{factory.name}() from {factory.path}"
    if isinstance(built, tuple):
        extra = " and loss_fn" if len(built) == 3 else ""
        return factory, FileBatch(factory.path, factory.name), description + f" (with its make_batch{extra})"
    return factory, None, description


def file_factory(text: str, option: str = "--model") -> "FileFactory":
    """`FILE.py:name` as a `FileFactory` (the file resolved); `UsageError` naming the fix when a part is missing."""
    file, _, name = text.rpartition(":") if ".py:" in text else (text, "", "")
    if not name:
        what, example = {"--loss-fn": ("function", "loss_fn"), "--dataset": ("function", "make_dataset"),
                         "--batch": ("function", "make_batch"),
                         "--optimizer": ("function", "make_optimizer")}.get(option, ("factory", "make_model"))
        raise UsageError(f"{option} {text!r} names a file but no {what}; write FILE.py:{what}, e.g. {text}:{example}.")
    return FileFactory(str(Path(file).expanduser().resolve()), name, option)


def resolve_loss_fn(text: str) -> "FileFunction":
    """`--loss-fn FILE.py:fn`: the function `fn(output, batch) -> scalar loss` from a Python file (picklable,
    so probes in child processes load it too); `UsageError` naming the file, the function and the fix."""
    return _file_function(text, "--loss-fn")


def resolve_batch(text: str, model_arg: str) -> "FileFunction":
    """`--batch FILE.py:make_batch`: `make_batch(n)` returning n samples, for a model given without one (a
    `--model FILE.py:make_model` returning the model alone, or a preset trained on your own batches).
    `UsageError` when `--model` names a factory that returns its own make_batch too: one of the two must go."""
    function = _file_function(text, "--batch")
    try:
        inspect.signature(function.load()).bind(1)
    except TypeError:
        raise UsageError(f"--batch {text}: {function.source.name}{inspect.signature(function.load())} must take the "
                         "number of samples to make, as make_batch(n) -> a batch of n samples.") from None
    except ValueError:  # no signature to read (a builtin): calling it says
        pass
    if ".py:" in model_arg and isinstance(file_factory(model_arg).probe_call(), tuple):
        raise UsageError(f"--batch {text} and --model {model_arg}: the model's factory returns its own make_batch "
                         "too; drop --batch, or have the factory return the model alone.")
    return function


def resolve_optimizer(text: str) -> "str | FileFunction":
    """`--optimizer`: a name (adamw, adafactor, ...: `autofit.job.train_spec.parse_optimizer` checks it), or
    FILE.py:fn, a function `fn(params) -> optimizer` from a Python file (your own optimizer, such as
    `torch.optim.SGD(params, lr=0.1, momentum=0.9)`), loaded as `--loss-fn` is."""
    return _file_function(text, "--optimizer") if ".py" in text else text


def _file_function(text: str, option: str) -> "FileFunction":
    function = FileFunction(file_factory(text, option))
    function.load()  # a missing file or function is reported now, not in the first probe
    return function


def factory_loss_fn(text: str) -> "FileLoss | None":
    """The loss_fn a `--model FILE.py:factory` returns as the third item of (model, make_batch, loss_fn)."""
    if ".py:" not in text:
        return None
    factory = file_factory(text)
    built = factory.probe_call()
    return FileLoss(factory.path, factory.name) if isinstance(built, tuple) and len(built) == 3 else None


@dataclasses.dataclass(frozen=True)
class FileFactory:
    """`factory()` from a Python file, returning the model (the first item when it returns a tuple
    (model, make_batch) or (model, make_batch, loss_fn))."""

    path: str
    name: str
    option: str = dataclasses.field(default="--model", compare=False)  # the CLI option that named it

    def load(self) -> Callable[..., Any]:
        """The function itself."""
        module = import_file(self.path, self.option)
        factory = getattr(module, self.name, None)
        if not callable(factory):
            found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise UsageError(f"{self.option}: {self.path} has no function {self.name!r}; functions there: {found}.")
        return factory

    def probe_call(self) -> Any:
        """Call the factory once, on the meta device where it allows (nothing allocated); check the result."""
        return _probed(self.path, self.name)

    def __call__(self) -> nn.Module:
        built = self.load()()
        return built[0] if isinstance(built, tuple) else built


@functools.lru_cache(maxsize=None)
def _probed(path: str, name: str) -> Any:
    """What the factory returns, built on the meta device where it allows; checked once per factory."""
    factory = FileFactory(path, name).load()
    try:
        with torch.device("meta"):
            built = factory()
    except Exception:  # factories that load weights or touch devices cannot build on meta
        try:
            built = factory()
        except Exception as exc:
            raise UsageError(f"--model {path}:{name}: {name}() raised {type(exc).__name__}: {exc}. Fix the factory "
                             f"(calling {name}() alone shows the traceback) and retry.") from exc
    model = built[0] if isinstance(built, tuple) else built
    shape_ok = not isinstance(built, tuple) or (len(built) in (2, 3) and all(callable(f) for f in built[1:]))
    if not isinstance(model, nn.Module) or not shape_ok:
        what = type(built).__name__ if not isinstance(built, tuple) else \
            f"a tuple of {len(built)} ({', '.join(type(x).__name__ for x in built)})"
        raise UsageError(f"--model {path}:{name}: {name}() returned {what}; it must return an nn.Module, a pair "
                         "(model, make_batch) where make_batch(n) returns n samples, or a triple "
                         "(model, make_batch, loss_fn) where loss_fn(output, batch) returns the scalar loss.")
    return built


@dataclasses.dataclass(frozen=True)
class FileBatch:
    """make_batch(n) taken from the tuple a file's factory returns."""

    path: str
    name: str

    def __call__(self, n: int) -> Any:
        return _make_batch(self.path, self.name)(n)


@dataclasses.dataclass(frozen=True)
class FileLoss:
    """loss_fn(output, batch) taken from the triple (model, make_batch, loss_fn) a file's factory returns."""

    path: str
    name: str

    def __call__(self, output: Any, batch: Any) -> Any:
        return _probed(self.path, self.name)[2](output, batch)


@dataclasses.dataclass(frozen=True)
class FileFunction:
    """A module-level function of a Python file (`--loss-fn FILE.py:fn`, `--optimizer FILE.py:fn`), loaded
    where it is called."""

    source: FileFactory

    def load(self) -> Callable[..., Any]:
        """The function itself."""
        return self.source.load()

    def __call__(self, *args: Any) -> Any:
        return self.load()(*args)


@functools.lru_cache(maxsize=None)
def _make_batch(path: str, name: str) -> Callable[[int], Any]:
    """make_batch from a meta-device call, unless its batches come out on meta too (then a real call)."""
    make_batch = _probed(path, name)[1]
    leaves = torch.utils._pytree.tree_leaves(make_batch(1))
    if any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in leaves):
        make_batch = FileFactory(path, name).load()()[1]
    return make_batch


def import_file(path: str, option: str = "--model") -> Any:
    """Import a Python file as a module (once per path), with its folder importable (so it may import the
    modules beside it, as `python FILE.py` would); clear errors for missing or broken files."""
    module_name = "autofit_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not Path(path).is_file():
        raise UsageError(f"{option} file {path} does not exist; give FILE.py:function with an existing file.")
    folder = str(Path(path).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise UsageError(f"{option}: Importing {path} failed: {type(exc).__name__}: {exc}. Fix the file and "
                         "retry.") from exc
    return module
