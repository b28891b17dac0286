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
