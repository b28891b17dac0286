"""How long `autofit dry-run` takes, this checkout against another commit, side by side in one run.

The README's GPT-2 dry-run (a 4-block GPT-2 config.json, 512 tokens, global batch 32, an RTX 4090 profile,
`--json`) is run by each tree in turn, twice each with a cache folder of its own that starts empty: the
first run simulates and replays everything, the second reads back what the first kept (`AUTOFIT_CACHE`).
Each run is a fresh process, timed from the outside (wall seconds, imports included) and by the report's
own `seconds`; the two trees' reports must be the same but for their timings. Prints and writes the
times and their ratios (this checkout / the other), with the machine, its load and the date.

    python bench/measurements/dry_run_time.py --against 33751b3 --out bench/results/dry-run-time-<date>.json

Backs: README.md's dry-run timing (the README's GPT-2 `--json` dry-run, a first run and a second reading
back the kept allocator replays, against the tree before they were kept).
Results: bench/results/dry-run-time-2026-11-28.json (against 33751b3)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout this script is in
COMMAND = ["dry-run", "--model", "my-model/config.json", "--seq-len", "512", "--global-batch-size", "32",
           "--gpu", "rtx-4090", "--json"]


def checkout(ref: str, into: Path) -> Path:
    """The tree of commit `ref`, extracted into `into` (`git archive`)."""
    archive = into / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), ref], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def timed_run(tree: Path, cache: Path, work: Path) -> tuple[float, dict]:
    """One dry-run by `tree`'s code in a fresh process: (wall seconds, the JSON report)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "AUTOFIT_CACHE": str(cache)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autofit.cli.main", *COMMAND], cwd=work, env=env,
                          capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the commit to compare with (e.g. 33751b3)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of (first run, second run) per tree")
    parser.add_argument("--out", type=Path, help="write the results there (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="autofit-dry-run-time-") as folder:
        work = Path(folder)
        trees = {"this checkout": ROOT, args.against: checkout(args.against, work)}
        subprocess.run([sys.executable, "-c", "from transformers import GPT2Config; "
                        "GPT2Config(n_layer=4, n_embd=256, n_head=4).save_pretrained('my-model')"], cwd=work, check=True)
        load_before = os.getloadavg()
        times: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        reports = {}
        for round_ in range(args.rounds):
            for index, (name, tree) in enumerate(trees.items()):  # alternated: a change of load meets both
                cache = work / f"cache-{round_}-{index}"
                for run in ("first", "second"):
                    wall, report = timed_run(tree, cache, work)
                    times[name].setdefault(f"{run} wall s", []).append(round(wall, 2))
                    times[name].setdefault(f"{run} report s", []).append(report.pop("seconds"))
                    reports.setdefault(name, report)
                    print(f"{name}: {run} run {wall:.1f} s", flush=True)
        same = len({json.dumps(r, sort_keys=True) for r in reports.values()}) == 1
        mine, other = times["this checkout"], times[args.against]
        ratios = {key: round(statistics.median(mine[key]) / statistics.median(other[key]), 3) for key in mine}
        result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
                  "python": platform.python_version(), "load_before": load_before, "load_after": os.getloadavg(),
                  "command": "autofit " + " ".join(COMMAND), "against": args.against, "times": times,
                  "ratios (this checkout / against)": ratios, "same_reports": same}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if not same:
        sys.exit("the two trees' reports differ")


if __name__ == "__main__":
    main()
