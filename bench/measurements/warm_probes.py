"""Warm probe processes against fresh ones: each case run with `AUTOFIT_WARM_PROBES=1` and `=0` in turn
(alternated, `--pairs` times), each a fresh process timed from the outside, with the load before and
after each run; the ratios (warm / fresh) are the figures to read on a shared machine.

Cases (`--cases` picks):

- `ranks`: one process runs `--probes` two-rank probes of the tests' GPT-2 (tests/models.py `make_gpt2`,
  transformers imported) on the CPU and prints each probe's seconds, and with warm processes the warm
  process's threads and resident bytes after them (`autofit.probe.zygote.describe`);
- `quickstart`: `python examples/quickstart.py` (its probes run in the caller's process on the CPU: a
  control that warm processes should leave as it is);
- `test-launch`, `test-every-option`: `python -m pytest -q -n0` of tests/probe/test_launch.py and
  tests/search/test_every_option.py (probes in launched ranks).

    python bench/measurements/warm_probes.py --pairs 3 --out bench/results/warm-probes-<date>.json

Backs: docs/search.md's sentence on warm probe processes.
Results: warm-probes-2026-12-07.json (commit 99941fe, 3 pairs at load 1.7-6.1),
warm-probes-2026-12-07-quiet.json (commit 44e78e6, `--cases ranks,test-every-option --pairs 1`, load 1.7-2.1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANKS = """
import json, sys, time
sys.path.insert(0, "tests")
from models import make_gpt2
from autofit.config import Config
from autofit.job.train_spec import make_spec
from autofit.probe import warm
from autofit.probe.launch import launch
from autofit.strategies import DataParallel, MicroBatch, Placement
spec = make_spec(make_gpt2, global_batch_size=2, device="cpu", num_gpus=2, seq_len=16, memory_budget="1GiB",
                 warmup_steps=1, timed_steps=1)
seconds, peaks = [], []
for _ in range({probes}):
    started = time.perf_counter()
    result = launch(spec, Config(num_gpus=2, micro_batch_size=1), [MicroBatch(), DataParallel()], Placement.RANKS)
    seconds.append(round(time.perf_counter() - started, 2))
    peaks.append(result.rank_peaks)
    assert result.fits, result.reason
zygote = warm.current().describe() if warm.current() else None
print("RESULT " + json.dumps({{"probe_seconds": seconds, "rank_peaks": peaks, "warm_process": zygote}}))
"""
CASES = {
    "ranks": [sys.executable, "-c", RANKS],
    "quickstart": [sys.executable, "examples/quickstart.py", "--out", "{work}/quickstart"],
    "test-launch": [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider",
                    "tests/probe/test_launch.py"],
    "test-every-option": [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider",
                          "tests/search/test_every_option.py"],
}


def run(case: str, switch: str, work: Path, probes: int) -> dict:
    """`case` in a fresh process with AUTOFIT_WARM_PROBES=`switch`: wall seconds, exit code, load, output."""
    command = [part.format(work=work, probes=probes) for part in CASES[case]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOFIT_WARM_PROBES": switch,
           "AUTOFIT_CACHE": str(work / f"cache-{case}")}
    load_before = os.getloadavg()
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    found = {"wall_s": round(time.perf_counter() - started, 2), "rc": done.returncode, "load_before": load_before,
             "load_after": os.getloadavg()}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            found.update(json.loads(line[len("RESULT "):]))
        elif " probes. Chosen:" in line or " passed" in line:
            found["summary"] = line.strip()
    if done.returncode:
        found["stderr_tail"] = done.stderr[-2000:]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--pairs", type=int, default=3, help="warm/fresh pairs per case, alternated")
    parser.add_argument("--probes", type=int, default=4, help="two-rank probes in the `ranks` case")
    parser.add_argument("--out", type=Path, help="write the results there (JSON)")
    args = parser.parse_args()
    cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        sys.exit(f"--cases names {unknown}: choose from {', '.join(CASES)}")
    runs: dict[str, dict[str, list[dict]]] = {case: {"warm": [], "fresh": []} for case in cases}
    with tempfile.TemporaryDirectory(prefix="autofit-warm-probes-") as folder:
        for case in cases:
            for pair in range(args.pairs):
                order = ("warm", "fresh") if pair % 2 == 0 else ("fresh", "warm")  # each goes first in turn
                for name in order:
                    found = run(case, "1" if name == "warm" else "0", Path(folder), args.probes)
                    runs[case][name].append(found)
                    print(f"{case} {name}: {found['wall_s']:.1f} s (rc {found['rc']}, "
                          f"load {found['load_before'][0]:.2f})", flush=True)
    ratios = {case: [round(w["wall_s"] / f["wall_s"], 3) for w, f in zip(runs[case]["warm"], runs[case]["fresh"])]
              for case in cases}
    result = {"date": datetime.date.today().isoformat(), "commit": _commit(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
              "python": platform.python_version(), "runs": runs, "ratios (warm / fresh), per pair": ratios}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
