"""What bench/ backs resolves: every section of bench/README.md and every results file that the package,
bench/ and the tests cite exists, bench/README.md's table names every script and every committed results file, and each
standalone measurement's docstring names the claim it backs and the results it wrote."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
README = BENCH / "README.md"
MEASUREMENTS = sorted(p for p in (BENCH / "measurements").glob("*.py") if p.name != "__init__.py")
RESULTS = sorted([*(BENCH / "results").glob("*.json"), *(BENCH / "calibration" / "results").glob("*.json")])


def cited_in() -> list[Path]:
    """The files whose citations must resolve: the package, bench/ and the tests."""
    files = [*(ROOT / "autofit").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    files += [p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh", ".md") and "vendor" not in p.parts]
    return sorted(files)


def anchor(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections() -> set[str]:
    return {anchor(line.lstrip("#")) for line in README.read_text().splitlines() if line.startswith("#")}


def table() -> list[list[str]]:
    """The rows of bench/README.md's table (script, claim, results), each cell as written."""
    text = README.read_text().split("## What backs what", 1)[1].split("\n#", 1)[0]
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return [row for row in rows[1:] if len(row) == 3]  # the header row first


def test_anchor_is_githubs():
    assert anchor(" CUDA attention") == "cuda-attention" and anchor("What backs what") == "what-backs-what"
    assert anchor("Fit threshold (H200)") == "fit-threshold-h200"


def test_every_section_cited_exists():
    cited = {(path.relative_to(ROOT).as_posix(), name) for path in cited_in()
             for name in re.findall(r"bench/README\.md#([\w-]+)", path.read_text())}
    assert {name for _, name in cited} >= {"tolerance", "fit-threshold", "cuda-context", "probe-residue",
                                          "allocator-history", "allocator-steps", "cuda-attention"}
    assert not {(where, name) for where, name in cited if name not in sections()}
    within = re.findall(r"\]\(#([\w-]+)\)", README.read_text())  # the table's own links
    assert within and not set(within) - sections()


def test_every_results_file_cited_exists():
    missing = set()
    for path in cited_in():
        for cited in re.findall(r"bench/(?:calibration/)?results/[^\s`'\"),;:\]]+", path.read_text()):
            cited = cited.rstrip(".")
            if "<" not in cited and cited.endswith(".json") and not list(ROOT.glob(cited)):
                missing.add((path.relative_to(ROOT).as_posix(), cited))
    assert not missing


def test_every_link_and_script_path_in_bench_resolves():
    text = README.read_text()
    links = [link for link in re.findall(r"\]\(([^)#\s]+)", text) if not link.startswith("http")]
    assert links and not [link for link in links if not (BENCH / link).exists()]
    named = set()
    for path in cited_in():
        named |= set(re.findall(r"(?<![\w/])bench/[\w/]+\.(?:py|sh)\b", path.read_text()))
    assert "bench/measurements/fit_threshold.py" in named
    assert not {name for name in named if not (ROOT / name).exists()}


def test_the_table_names_every_script_and_every_results_file():
    rows = table()
    scripts = {name for row in rows for name in re.findall(r"`([\w/.]+\.(?:py|sh))`", row[0])}
    expected = {p.relative_to(BENCH).as_posix() for folder in ("measurements", "calibration", "diag")
                for p in (BENCH / folder).iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"}
    assert not (expected | {"run.py", "gpu_session.sh"}) - scripts
    assert not {name for name in scripts if not (BENCH / name).exists()}
    assert any("`suite/`" in row[0] for row in rows)
    linked = {(BENCH / link).resolve() for row in rows for link in re.findall(r"\]\(([^)]+)\)", row[2])}
    assert not {p.relative_to(BENCH).as_posix() for p in RESULTS if p.resolve() not in linked}


@pytest.mark.parametrize("script", MEASUREMENTS, ids=lambda p: p.name)
def test_each_measurement_names_its_claim_and_its_results(script):
    doc = ast.get_docstring(ast.parse(script.read_text()))
    assert doc and "\nBacks: " in doc and "\nResults: " in doc, f"{script.name}: no Backs: / Results: paragraph"
    named = re.findall(r"[\w.-]+\.json", doc.split("\nResults: ", 1)[1])
    assert named, f"{script.name}: its Results: name no committed file"
    assert not [name for name in named if not (BENCH / "results" / name).exists()]
    assert f"python bench/measurements/{script.name}" in doc  # the command as run from the checkout's root
