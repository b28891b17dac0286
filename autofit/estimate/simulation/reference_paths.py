"""Which of a model's fused kernels transformers runs on its reference PyTorch path in this process.

State-space and linear-attention layers (Mamba, Mamba2, Falcon-Mamba, Jamba, Qwen3-Next, Qwen3.5-MoE,
NemotronH, LFM2, ...) call functions transformers decorates with `use_kernel_func_from_hub_with_fallback`
(transformers/integrations/hub_kernels.py): the package's fused kernel where it imports (mamba-ssm,
causal-conv1d, flash-linear-attention), else the reference implementation, token by token or chunk by
chunk in PyTorch ops ("correct but much slower", transformers' own warning). The decorator keeps its
choice in the wrapper's closure (`package`, `is_new_implementation`); read here, a simulation on this
machine can say what it ran instead of what a GPU machine with the packages runs: the reference path
keeps more activations and issues far more kernels, so the prediction errs high on both there.
Where the `kernels` package is installed (transformers requires it from 5.25), its decorator turns that
wrapper into an `nn.Module` instance whose `forward` calls it (kernels/_internals/layer/layer.py,
`_create_func_module`); the wrapper is read from that closure. transformers releases without that
decorator (4.x imports them at module level; 5.0 loads them with `lazy_load_kernel`; 5.17 has the decorator)
leave nothing to read: there the method says which packages the model's code names that do not import here,
and that this transformers cannot say which functions fell back (`unread`).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from typing import Any

from torch import nn


def reference_paths(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Distribution -> the functions of `model`'s modeling code that run on transformers' reference
    path here because the distribution does not import ({} for a model without such functions)."""
    found: dict[str, list[str]] = {}
    for module_name in sorted({type(module).__module__ for module in model.modules()}):
        for name, value in vars(sys.modules.get(module_name, object())).items():
            package = _fallen_back(value)
            if package is not None:
                found.setdefault(_distribution(package), []).append(name)
    return {distribution: tuple(sorted(names)) for distribution, names in sorted(found.items())}


def clause(model: nn.Module) -> str:
    """The clause for a prediction's method on `model`: the functions that fell back (`describe`), else,
    where this transformers has no wrapper to read, the kernel packages its code names (`unread`)."""
    return describe(reference_paths(model)) or unread(model)


# import name -> pip name of the fused-kernel packages transformers' modeling code falls back from
KERNEL_PACKAGES = {"mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d", "fla": "flash-linear-attention"}


def unread(model: nn.Module) -> str:
    """One clause ("" where there is nothing to say) where this transformers has no fallback wrapper to read
    (before 5.17) and `model`'s modeling code names kernel packages that do not import here."""
    try:
        from transformers.integrations import hub_kernels
    except ImportError:  # transformers 4.x
        hub_kernels = None
    if hasattr(hub_kernels, "use_kernel_func_from_hub_with_fallback"):
        return ""
    sources = []
    for module_name in sorted({type(module).__module__ for module in model.modules()}):
        try:
            sources.append(inspect.getsource(sys.modules[module_name]))
        except (KeyError, OSError, TypeError):
            continue
    named = sorted(pip for package, pip in KERNEL_PACKAGES.items() if importlib.util.find_spec(package) is None
                   and any(re.search(rf"\b(from|import)\s+{package}\b|is_{package}_available|\"{pip}\"", text)
                           for text in sources))
    if not named:
        return ""
    import transformers

    return (f"; {' and '.join(named)} not installed here and transformers {transformers.__version__} cannot say "
            "which functions ran on its reference PyTorch path instead (5.17 and later can): a GPU machine with "
            f"{'them' if len(named) > 1 else 'it'} may peak lower and step faster than predicted")


def describe(paths: dict[str, tuple[str, ...]]) -> str:
    """One clause for a prediction's method ("" where nothing fell back)."""
    if not paths:
        return ""
    return (f"; {' and '.join(paths)} not installed here: transformers' reference PyTorch path for "
            f"{_functions(paths)}, which a GPU machine with {'them' if len(paths) > 1 else 'it'} runs as fused "
            "kernels, keeping fewer activations and issuing fewer kernels (there the peak is lower and the "
            "step faster than predicted)")


def _functions(paths: dict[str, tuple[str, ...]]) -> str:
    names = [name for names in paths.values() for name in names]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _fallen_back(value: Any) -> str | None:
    """The package a hub-kernel wrapper falls back from, where it did (its closure says which)."""
    wrapper = _hub_wrapper(value)
    if wrapper is None:
        return None
    names = _nonlocals(wrapper)
    if names.get("is_new_implementation") is False and isinstance(names.get("package"), str):
        return names["package"]
    return None


def _hub_wrapper(value: Any) -> Any:
    """transformers' fallback wrapper: the value itself, or the function a `kernels` module calls."""
    if isinstance(value, nn.Module):
        value = _nonlocals(type(value).forward).get("func")
    return value if inspect.isfunction(value) and hasattr(value, "__wrapped__") else None


def _nonlocals(function: Any) -> dict[str, Any]:
    try:
        return dict(inspect.getclosurevars(function).nonlocals)
    except (TypeError, ValueError):
        return {}


def _distribution(package: str) -> str:
    """The pip name of an import name (`fla` -> flash-linear-attention), as transformers' warning gives it."""
    try:
        from transformers.integrations.hub_kernels import _PACKAGE_TO_DISTRIBUTION
    except ImportError:
        return package.replace("_", "-")
    return _PACKAGE_TO_DISTRIBUTION.get(package, package.replace("_", "-"))
