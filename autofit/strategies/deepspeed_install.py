"""The DeepSpeed library on this machine: its installed version and why it cannot serve a feature.

DeepSpeed is the engine of two techniques, ZeRO (`autofit.strategies.zero`) and NVMe offload
(`autofit.strategies.offload`); both ask here, neither through the other.
"""

from __future__ import annotations

import importlib.metadata

MIN_VERSION = "0.14"  # the `deepspeed` extra's floor (pyproject); the probes were run with 0.19.8 only


def installed_version() -> str | None:
    """DeepSpeed's installed version, or None."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problem(version: str | None, feature: str, minimum: str = MIN_VERSION) -> str | None:
    """Why DeepSpeed `version` cannot serve `feature`: not installed, or older than `minimum`; else None."""
    from packaging.version import Version

    if version is None:
        return f"{feature} needs DeepSpeed, which is not installed: pip install 'autofit[deepspeed]'"
    if Version(version) < Version(minimum):
        return (f"DeepSpeed {version} is too old for {feature} (autofit needs >= {minimum}); "
                f"pip install -U 'deepspeed>={minimum}'")
    return None
