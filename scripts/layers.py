"""The import graph of autofit's sub-packages, checked against the layers of docs/design.md.

    python scripts/layers.py          # the graph, the cycles, and any import that points up a layer
    python scripts/layers.py --json   # the same as one JSON document

Every import counts, top-level or inside a function; those under `if TYPE_CHECKING:` do not (they run for
type checkers only). The one edge allowed to point up is `plan.export()`'s facade (`plan` -> `export`,
whose files read a plan). Exits 1 when an import points up a layer or two sub-packages import each other.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "autofit"

# Bottom to top: a unit may import units of its own layer or below it, never above (docs/design.md).
LAYERS = (
    ("errors", "units", "version", "files"),
    ("config",),
    ("devices",),
    ("models",),
    ("batches",),
    ("job",),
    ("strategies",),
    ("probe",),
    ("estimate",),
    ("search",),
    ("plan", "export", "report", "prepare"),
    ("guard", "pipelines"),
    ("cli",),
)
FACADE = {("plan", "export")}  # Plan.export() calls the exporters, which read plans
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str | None:
    """The sub-package (or top-level module) `module` belongs to; None for the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "autofit" else None


def imports(path: pathlib.Path) -> list[str]:
    """The autofit modules `path` imports, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in
               ast.unparse(block.test) for node in ast.walk(block)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("autofit"):
            if node.module == "autofit":
                found += [f"autofit.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("autofit")]
    return found


def graph() -> dict[str, set[str]]:
    """Unit -> the units it imports (itself and the root's names left out)."""
    edges: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = unit_of(".".join(("autofit", *path.relative_to(ROOT).with_suffix("").parts)))
        if source is None or source == "__init__":
            continue
        for module in imports(path):
            target = unit_of(module)
            if target in LEVEL and target != source:
                edges.setdefault(source, set()).add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of units that import one another (strongly connected components of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a unit to one of a higher layer (or a unit no layer lists), the facade excepted."""
    return sorted((source, target) for source, targets in edges.items() for target in targets
                  if (source, target) not in FACADE and LEVEL.get(target, 99) > LEVEL.get(source, 99))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    edges = graph()
    loops = [c for c in cycles(edges) if set(c) != {"plan", "export"}]
    up = upward(edges)
    unlisted = sorted({unit for unit in edges} - set(LEVEL))
    if args.json:
        print(json.dumps({"graph": {k: sorted(v) for k, v in sorted(edges.items())}, "cycles": loops,
                          "upward": up, "unlisted": unlisted}, indent=2))
    else:
        for source in sorted(edges, key=lambda u: (LEVEL.get(u, 99), u)):
            print(f"{source:<11} -> {', '.join(sorted(edges[source], key=lambda u: (LEVEL.get(u, 99), u)))}")
        print(f"cycles: {loops or 'none'} (the plan <-> export facade allowed)")
        print(f"imports pointing up a layer: {up or 'none'}")
        if unlisted:
            print(f"units no layer lists: {unlisted}")
    return 1 if loops or up or unlisted else 0


if __name__ == "__main__":
    sys.exit(main())
