import os
import shutil
import sys
import tempfile

# Simulated steps are shared through a folder of this run's own (autofit/estimate/simulation/memo.py), set
# before autofit is imported: the xdist workers and the CLI processes tests start read one another's, and
# nothing of an earlier run or another checkout is read
_CACHE = None if "AUTOFIT_CACHE" in os.environ else tempfile.mkdtemp(prefix="autofit-test-cache-")
os.environ.setdefault("AUTOFIT_CACHE", _CACHE or "")
# One thread in every process tests start (probe children and ranks, CLI runs, README blocks), as in this one
# (below): two workers on a small machine, each with children spinning several threads, wait on each other
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

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


def pytest_unconfigure(config):
    """The run's cache folder goes when the process that made it ends (the workers inherit it)."""
    if _CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture
def replays(monkeypatch):
    """The caching allocator's replays run (`Replay.calls`): one entry each."""
    from autofit.estimate.cuda import allocator

    runs = []
    real = allocator.Replay.calls
    monkeypatch.setattr(allocator.Replay, "calls", lambda self, *args: runs.append(1) or real(self, *args))
    return runs
