"""README.md and docs/*.md run word for word, so they cannot drift from the code.

Every fenced block of every page is one test, in page order:
- ```python blocks run as scripts (`python block.py`), ```bash blocks as commands (`bash -e`), each page
  in its own copy of the repository (so `examples/...` and relative paths resolve as they do for a reader
  in a checkout, and what a block writes — runs/, launch/ — is there for the blocks after it);
- blocks in another language (json, yaml, text, console, ...) are shown, not run; a ```json block must
  parse (`...` placeholders aside); a fence without a language fails: say what it is;
- an HTML comment on the line before a block marks what cannot run here, and the test says why:
  `<!-- readme-test: skip network: why -->` (never run), `<!-- readme-test: skip suite: why -->` (a
  command that runs this test suite, which would run itself), `<!-- readme-test: gpu -->` (runs with
  `-m gpu` on a CUDA machine), `<!-- readme-test: slow -->` (runs with `-m slow`).

The code under test is this checkout's (PYTHONPATH), the interpreter this one; nothing is installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash"}
MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<kind>skip network|skip suite|gpu|slow)\s*(?::\s*(?P<why>.*?))?\s*-->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^`\s]*)\s*$")
COPY_IGNORE = shutil.ignore_patterns(".git", "runs", "launch", "__pycache__", "*.egg-info", ".pytest_cache",
                                     "trainer_output", "bench_results_*")
TIMEOUT = 900  # seconds per block: a stuck command fails instead of hanging the suite


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts (1-based line of the fence), its language and text,
    and the marker on the line before it."""

    page: Path
    line: int
    lang: str
    code: str
    marker: str | None = None
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}-{self.lang or 'unlabeled'}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, in order."""
    lines = page.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.name}:{index + 1}: a code fence is never closed"
        indent = len(opening["indent"])
        code = "\n".join(line[indent:] for line in lines[index + 1:end]) + "\n"
        marker = MARKER.search(lines[index - 1]) if index else None
        found.append(Block(page, index + 1, opening["lang"], code, marker["kind"] if marker else None,
                           (marker["why"] or "") if marker else ""))
        index = end + 1
    return found


def _param(block: Block):
    if block.marker == "skip network":
        marks = [pytest.mark.skip(reason=f"needs a network: {block.why or 'marked skip network'}")]
    elif block.marker == "skip suite":
        marks = [pytest.mark.skip(reason=f"runs the test suite: {block.why or 'marked skip suite'}")]
    elif block.marker == "gpu":
        marks = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason=f"needs a GPU: {block.why or 'marked gpu'}")]
    elif block.marker == "slow":
        marks = [pytest.mark.slow]
    else:
        marks = []
    return pytest.param(block, marks=marks, id=block.name)


ALL = [block for page in PAGES for block in blocks(page)]


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory):
    """One copy of the repository per page, made when the page's first block runs."""
    made: dict[Path, Path] = {}

    def checkout(page: Path) -> Path:
        if page not in made:
            made[page] = tmp_path_factory.mktemp(page.stem) / "repo"
            shutil.copytree(ROOT, made[page], ignore=COPY_IGNORE)
        return made[page]

    return checkout


def environment() -> dict[str, str]:
    """This interpreter first on PATH (`python`, `autofit`), this checkout's code, no display needed."""
    bin_dir = os.path.dirname(sys.executable)
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": python_path,
            "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("block", [_param(b) for b in ALL])
def test_block_runs_as_written(block: Block, checkouts):
    if block.lang not in RUN:
        _check_shown(block)
        return
    where = checkouts(block.page)
    if block.lang == "python":
        script = where / f"readme_block_{block.page.stem}_{block.line}.py"
        script.write_text(block.code)
        command = [sys.executable, script.name]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    done = subprocess.run(command, cwd=where, env=environment(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, (
        f"{block.name} exited {done.returncode}:\n{block.code}\n--- stdout ---\n{done.stdout[-3000:]}\n"
        f"--- stderr ---\n{done.stderr[-5000:]}")


def _check_shown(block: Block) -> None:
    """A block that is shown, not run: it must say what it is; JSON must parse."""
    assert block.lang, (f"{block.name}: a code fence without a language. Label it ```bash or ```python to run it "
                        "(this test runs those), or ```text / ```json / ```yaml for content that is not run.")
    if block.lang == "json":
        text = re.sub(r"\.\.\.", "null", block.code)
        json.loads(text)


def test_the_pages_hold_runnable_blocks():
    """The collection above found the pages' blocks (a regex that matched nothing would pass vacuously)."""
    readme = [b for b in ALL if b.page.name == "README.md"]
    assert sum(b.lang in RUN for b in readme) >= 5
    assert all(b.page.exists() for b in ALL)
