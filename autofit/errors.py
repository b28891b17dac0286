"""Errors autofit raises at the user: each says the bad value and the fix."""


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
