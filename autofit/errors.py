"""Errors autofit raises at the user: each says the bad value and the fix."""

import difflib
from typing import Iterable


class AutofitError(Exception):
    """Base class of every error autofit raises on purpose."""


class UsageError(AutofitError, ValueError):
    """Bad input from the user (a value, a file, a model that cannot be trained as given).

    The CLI maps it to exit code 2.
    """


class MissingExtraError(AutofitError, ImportError):
    """An optional dependency is absent; the message names the extra that installs it."""

    def __init__(self, package: str, extra: str, purpose: str):
        self.package = package
        self.extra = extra
        super().__init__(
            f"{purpose} needs {package}, which is not installed: pip install 'autofit[{extra}]'"
        )


class CudaContextBroken(AutofitError):
    """A sticky CUDA error (device-side assert, illegal memory access) poisoned this process's CUDA context:
    every later CUDA call fails the same way, so no further probe can run here. Names the candidate."""

    def __init__(self, candidate: str, cause: str):
        self.candidate = candidate
        self.cause = cause
        hint = ("A device-side assert is most often an index out of range: token ids >= the vocabulary size, or "
                "labels >= the number of classes; check the batch, or run with CUDA_LAUNCH_BLOCKING=1 to see the "
                "failing op." if "device-side assert" in cause else
                "Run with CUDA_LAUNCH_BLOCKING=1 to see the failing op.")
        super().__init__(f"The CUDA context broke while probing {candidate}: {cause}. Every later CUDA call in this "
                         f"process would fail the same way, so the search stops here. {hint}")


def did_you_mean(value: object, names: Iterable[str]) -> str:
    """" (did you mean 'adamw8bit'?)" for a value typed close to one of `names` (any case), else ""."""
    names = list(names)
    lowered = {name.lower(): name for name in names}
    close = difflib.get_close_matches(str(value).strip().lower(), list(lowered), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(lowered[c]) for c in close)}?)" if close else ""
