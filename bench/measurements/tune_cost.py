"""A tune's cost, this checkout against another commit: bench CPU scenarios tuned by each tree in turn.

Each run is a fresh process at one torch thread (the suite's `--threads 1`) that measures the scenario's
baseline peak, sets its budget and calls `autofit.autofit` as `bench/run.py` does; the two trees alternate,
`--pairs` times, so a load that comes and goes meets both. A run records its wall seconds, the process's CPU
seconds (steadier than wall on a shared machine), the probes run, the confirmation's rounds per finalist, the
training steps the search spent (`plan.steps_spent`, where the tree counts them), the choice, and the load
before and after. The results file holds the machine, the date, both commits and the
ratio of the medians (this checkout / against) per scenario.

    python bench/measurements/tune_cost.py --against 5e3c735 --pairs 3 \\
        --out bench/results/tune-cost-<date>-<commit>-vs-5e3c735.json

Backs: issue 57's check that the confirmation's stopping rule (rounds until a comparison's interval is narrow
enough, within a time cap) costs no more than the fixed rounds before it.
Results: tune-cost-2026-12-06-busy-0fc8652-vs-5e3c735.json (load 5-6);
tune-cost-2026-12-06-busy-7deddf5-vs-bd55c02.json (the rounds stopping once nothing open can change the choice);
tune-cost-2026-12-06-quiet-e0862db-vs-5e3c735.json (quiet, load 0.3-0.9: 1.016);
tune-cost-2026-12-07-quiet-74641ab-vs-0e95189.json (live rounds judged from the 4th, not the 7th: 0.954 and 0.979)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout this script is in
sys.path.insert(0, str(ROOT))
from bench.measurements.dry_run_time import checkout  # noqa: E402
from bench.measurements.time_to_answer import commit  # noqa: E402

# run by each tree's own code (cwd and PYTHONPATH: the tree), so only names both trees have are used
ONE_TUNE = """
import json, os, sys, time
import torch
torch.set_num_threads(1)
import autofit
from bench.suite.scenarios import budget_for, cpu_rungs, cpu_scenarios
scenario = next(s for s in cpu_scenarios() if s.name == sys.argv[1])
budget, _ = budget_for(scenario, "cpu")
load, wall, cpu = os.getloadavg()[0], time.perf_counter(), time.process_time()
plan = autofit.autofit(scenario.model_factory, scenario.batch_factory, strategies=(scenario.strategies or cpu_rungs)(),
                       **scenario.autofit_kwargs("cpu", budget))
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
rounds = [len(f.rounds) for f in plan.confirmation.finalists] if plan.confirmation else []
print(json.dumps(dict(wall_s=round(wall, 2), cpu_s=round(cpu, 2), probes=plan.probes_run, rounds=rounds,
                      steps=getattr(plan, "steps_spent", None),  # counted since steps were recorded
                      choice=plan.config.describe() if plan.fits else None, load_before=round(load, 2),
                      load_after=round(os.getloadavg()[0], 2))))
"""


def tune(tree: Path, scenario: str, cache: Path) -> dict:
    """One tune of `scenario` by `tree`'s code in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(tree), "AUTOFIT_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", ONE_TUNE, scenario], cwd=tree, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        return {"rc": done.returncode, "stderr_tail": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    """Medians of a tree's runs of one scenario."""
    good = [r for r in runs if "wall_s" in r]
    return {"median_wall_s": statistics.median(r["wall_s"] for r in good) if good else None,
            "median_cpu_s": statistics.median(r["cpu_s"] for r in good) if good else None,
            "probes": sorted({r["probes"] for r in good}), "choices": sorted({r["choice"] or "" for r in good}),
            "steps": sorted({r["steps"] for r in good if r.get("steps") is not None})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the commit whose tree tunes too, alternated")
    parser.add_argument("--scenarios", default="nanogpt@50%", help="comma-separated bench CPU scenario names")
    parser.add_argument("--pairs", type=int, default=3, help="runs per tree and scenario, alternated")
    parser.add_argument("--out", type=Path, help="write the results there (JSON)")
    args = parser.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="autofit-tune-cost-") as folder:
        work = Path(folder)
        trees = {"this checkout": ROOT, args.against: checkout(args.against, work)}
        runs: dict[str, dict[str, list[dict]]] = {name: {s: [] for s in scenarios} for name in trees}
        for scenario in scenarios:
            for pair in range(args.pairs):
                for index, (name, tree) in enumerate(trees.items()):
                    found = tune(tree, scenario, work / f"cache-{index}-{pair}")
                    runs[name][scenario].append(found)
                    print(f"{name}: {scenario} {json.dumps(found)}", flush=True)
    result = {"date": datetime.date.today().isoformat(), "commit": commit(ROOT), "against": args.against,
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
              "python": platform.python_version(), "runs": runs,
              "summary": {name: {s: summary(r) for s, r in per.items()} for name, per in runs.items()}}
    mine, other = result["summary"]["this checkout"], result["summary"][args.against]
    result["ratios (this checkout / against)"] = {
        s: {key: round(mine[s][key] / other[s][key], 3) for key in ("median_wall_s", "median_cpu_s")
            if mine[s][key] and other[s][key]} for s in scenarios}
    print(json.dumps(result["ratios (this checkout / against)"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
