"""Errors autofit raises at the user: each says the bad value and the fix."""

import dataclasses
import difflib
from typing import Any, Iterable, Protocol

_NAME_ONLY = object()  # `Param` without a value


@dataclasses.dataclass(frozen=True)
class Param:
    """One of autofit's parameters named in a message, with a value (given, or suggested), said where the
    message is shown: in Python's words (`seq_len=512`, `allow={'numerics'}`) or the command line's
    (`--seq-len 512`, `--allow numerics`). Without a value it names the parameter alone."""

    name: str  # the keyword, as `autofit.autofit` and `autofit.dry_run` take it
    value: Any = _NAME_ONLY

    def words(self, cli: bool = False) -> str:
        """`name=value` (Python's repr of the value), or `--name value` for the command line (a set of names
        comma-separated, as `--allow lora,numerics` takes them; a string quoted as a shell reads it)."""
        if not cli:
            return self.name if self.value is _NAME_ONLY else f"{self.name}={self.value!r}"
        flag = "--" + self.name.replace("_", "-")
        if self.value is _NAME_ONLY:
            return flag
        if isinstance(self.value, (set, frozenset, list, tuple)):
            return f"{flag} {','.join(sorted(map(str, self.value)))}"
        return f"{flag} {self.value!r}" if isinstance(self.value, str) else f"{flag} {self.value}"


class Worded(Protocol):
    """A value a message names that is said differently in Python and on the command line (a `Param`; why
    nothing fits, `autofit.search.shortfall.Shortfall`)."""

    def words(self, cli: bool = False) -> str:
        """Python's words, or the command line's with `cli`."""


class AutofitError(Exception):
    """Base class of every error autofit raises on purpose."""


class UsageError(AutofitError, ValueError):
    """Bad input from the user (a value, a file, a model that cannot be trained as given).

    The CLI maps it to exit code 2. A message that names autofit's parameters keeps them as fields: each
    is a `{placeholder}` of `message` given as a `Param` (or another `Worded` value), so `str(error)` says them
    in Python's words and `error.words(cli=True)` in the command line's (`UsageError("{given} is not known",
    given=Param("optimizer", "adam9"))`). A placeholder given a string takes it as it is (a value the user
    typed, braces and all); literal braces in `message` itself are doubled, as `str.format` reads them.
    """

    def __init__(self, message: str, **params: Worded | str):
        self.template = message
        self.params = params
        super().__init__(self.words())

    def words(self, cli: bool = False) -> str:
        """The message, each parameter said in Python's words or, with `cli`, the command line's."""
        if not self.params:
            return self.template
        return self.template.format(**{key: param if isinstance(param, str) else param.words(cli)
                                        for key, param in self.params.items()})


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
