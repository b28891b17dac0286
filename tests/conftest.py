import os
import shutil
import sys
import tempfile

# Simulated steps are shared through a folder of this run's own (autofit/estimate/simulation/memo.py), set
# before autofit is imported: the xdist workers and the CLI processes tests start read one another's, and
# nothing of an earlier run or another checkout is read
_CACHE = None if "AUTOFIT_CACHE" in os.environ else tempfile.mkdtemp(prefix="autofit-test-cache-")
os.environ.setdefault("AUTOFIT_CACHE", _CACHE or "")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py is importable as `models`
torch.set_num_threads(1)  # tests share a small machine; timing is never asserted


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()


README_TEST = "tests/test_readme.py"
# Files whose tests take the longest (a dry-run of every level, searches over spawned ranks), started first
# after the README test's pages, longest first (as `--durations` of a whole run ranks them;
# the list only orders the run, it selects nothing, and a file missing from it still runs)
LONGEST = ("tests/search/test_space.py", "tests/pipelines/test_dry_run.py", "tests/estimate/test_adapted_layers.py",
           "tests/estimate/test_workers.py", "tests/search/test_every_option.py", "tests/probe/test_launch.py",
           "tests/search/test_tuner.py", "tests/estimate/test_estimator.py", "tests/export/test_torchrun.py",
           "tests/export/test_trainer.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (`--dist loadgroup`)
def pytest_collection_modifyitems(items):
    """What runs together on one worker (`--dist loadgroup` in pyproject.toml): each test file, so a
    module-scoped fixture (a dry-run several tests read) is made once; and the README test's blocks by page,
    in page order (a page's blocks share one copy of the repository, block after block), so its pages spread
    over the workers instead of holding one worker for all of them. The longest groups first (the README
    test's pages, each block a process of its own, then `LONGEST`; `--no-loadscope-reorder` keeps this
    order): a long group started last would leave the other worker idle at the end."""
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    first = (README_TEST, *LONGEST)
    items.sort(key=lambda item: next((i for i, path in enumerate(first) if item.nodeid.startswith(path)),
                                     len(first)))


def _group(item) -> str:
    """The README test's page of a block (its name up to the line: "tests/test_readme.py:docs/tune.md"),
    else the test's file."""
    path = item.nodeid.split("::")[0]
    block = item.callspec.params.get("block") if hasattr(item, "callspec") else None
    name = getattr(block, "name", None)  # "docs/tune.md:70-bash"
    return f"{path}:{name.rsplit(':', 1)[0]}" if path == README_TEST and name else path


def pytest_unconfigure(config):
    """The run's cache folder goes when the process that made it ends (the workers inherit it)."""
    if _CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(_CACHE, ignore_errors=True)
