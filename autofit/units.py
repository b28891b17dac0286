"""Byte sizes: parsing what users type ("20GiB", "512MB", 2**30) and formatting what autofit reports."""

from __future__ import annotations

import math

import re

from autofit.errors import UsageError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4,  # Kubernetes' spelling of the binary units
}
MIN_UNITLESS = 2**20  # a size typed without a unit under this many bytes is a unit left out
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE]\+?[0-9]+)?)\s*([a-zA-Z]*)\s*$")  # "1e9" too


def parse_size(value: int | float | str, what: str = "memory_budget") -> int:
    """Return `value` in bytes. Accepts a number of bytes or a string such as "20GiB", "1.5 GB", "512MiB".

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB; Kubernetes' Ki, Mi, Gi,
    Ti) powers of 1024. A unit ending in a small b ("Mb", "gb", "mib") is refused: a b is a bit, and whether bits
    or bytes were meant is the user's to say (the message spells both byte units).
    A string without a unit counts bytes, and is refused under `MIN_UNITLESS` (a unit left out).
    """
    if isinstance(value, bool):
        raise UsageError(f"{what} must be a size in bytes or a string like '20GiB', but got {value!r}.")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise UsageError(f"{what} must be a positive, finite number of bytes, but got {value!r}; pass bytes or "
                             "e.g. '20GiB'.")
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match and unit in _UNITS and len(unit) > 1 and match.group(2).endswith("b"):
            raise UsageError(_bits_or_bytes(value, match.group(1), match.group(2), what))
        if match and unit in _UNITS:
            size = int(float(match.group(1)) * _UNITS[unit])
            if size > 0:
                return _plausible(size, value, what) if unit == "" else size
    raise UsageError(
        f"{what} must be a size such as '20GiB', '512MB' or a number of bytes, but got {value!r}{_separators(value)}."
    )


def _bits_or_bytes(value: str, number: str, unit: str, what: str) -> str:
    """The refusal of a unit ending in a small b ("16Mb": megabits or megabytes?), with the byte spellings."""
    prefix = unit[0].upper()
    return (f"{what}={value!r}: {unit!r} ends in a small b, which is a bit, and autofit takes sizes in bytes: "
            f"write '{number}{prefix}iB' (x 1024**n) or '{number}{prefix}B' (x 1000**n) for bytes (a size in bits "
            f"is 8 times fewer bytes).")


def parse_length(value: int | str, what: str = "seq_len") -> int:
    """A sequence length as people type it: 4096, "4,096" or "4k" (k = 1,024, as context lengths are named:
    8k = 8,192, 128k = 131,072)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().replace(",", "").replace("_", "")
    scale = 1024 if text[-1:] in ("k", "K") else 1
    digits = text[:-1] if scale > 1 else text
    if isinstance(value, str) and digits.isdigit():
        return int(digits) * scale
    raise UsageError(f"{what}={value!r} is not a length: pass a whole number, e.g. 4096, or '4k' (k = 1,024).")


def _separators(value: object) -> str:
    """The fix for a size written with a decimal comma or digit separators ("4,5GiB", "4_000MB")."""
    if not isinstance(value, str) or not any(mark in value for mark in ",_'"):
        return ""
    dotted = value.strip().replace(",", ".").replace("_", "").replace("'", "")
    return f" (write decimals with a dot and no separators between digits: {dotted!r}?)" if _SIZE.match(dotted) else ""


def _plausible(size: int, value: str, what: str) -> int:
    """A size typed without a unit, refused under 1 MiB: `--gpu-memory 24` meant 24 GiB, not 24 bytes (a
    number passed from code is bytes at any size)."""
    if size < MIN_UNITLESS:
        number = str(value).strip()
        raise UsageError(f"{what}={value!r} is {size} bytes, too few to train anything: give a unit, e.g. "
                         f"'{number}GiB' or '{number}GB' (a number alone counts bytes).")
    return size


def is_unit(word: str) -> bool:
    """Whether `word` is a size unit alone ("GiB", "gb"): what a shell splits off `--gpu-memory 24 GiB`."""
    return word.lower() in _UNITS and word != "" and word.lower() != "b"


def format_size(num_bytes: int | float | None) -> str:
    """Human-readable binary size ("5.42 GiB"); "-" for None."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
