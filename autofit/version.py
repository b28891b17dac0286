"""autofit's version, and where its package lies (what a launched probe process puts on its path)."""

from pathlib import Path

__version__ = "0.1.0"
PACKAGE = Path(__file__).resolve().parent  # the autofit package folder
