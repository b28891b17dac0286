import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py is importable as `models`
torch.set_num_threads(1)  # tests share a small machine; timing is never asserted


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()


def pytest_collection_modifyitems(items):
    """The README test first: its blocks run in page order on one worker (`--dist loadfile`) and take the
    longest, so starting it first keeps the other worker from waiting on it at the end."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_readme.py"))
