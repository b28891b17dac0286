"""Time to answer: how long the commands people wait on take, each a fresh process timed from the outside.

Cases (issue 58's list; `--cases` picks, in this order):

- `dry-run-7b`: `autofit dry-run --model llama-2-7b --seq-len 4096 --global-batch-size 64 --gpu h100`, with a
  cache folder that starts empty (first use);
- `dry-run-7b-again`: the same asked again for another GPU (`--gpu a100-80gb`), reading that folder back;
- `dry-run-7b-notebook`: the dry-run of `dry-run-7b` asked in one Python process as a notebook asks it, once for an
  H100 and then for six other GPUs (`AGAIN_GPUS`), reading `dry-run-7b`'s cache folder: each later report's own
  seconds (`again_s`, imports paid once);
- `dry-run-70b`: `autofit dry-run --model llama-2-70b --num-gpus 8 --gpu a100-80gb`, a cache of its own;
- `dry-run-gpt2`: `autofit dry-run --model gpt2 --seq-len 512 --global-batch-size 32 --gpu rtx-4090` (a small
  model that fits plainly at its largest micro-batch), a cache of its own;
- `dry-run-7b-4090`: the 7B of `dry-run-7b` on one 24 GB card (`--gpu rtx-4090`: only state offloading fits),
  a cache of its own;
- `quickstart`: `python examples/quickstart.py` (a tiny GPT-2 tuned on the CPU; its probes run are counted, and
  its plan's torch threads and confirmation steps kept);
- `tune-classifier`: docs/tune.md's `autofit tune --model examples/classifier.py:make --global-batch-size 32
  --device cpu --memory-budget 3MiB --allow 0` (a plain PyTorch model, its plan, report and launcher files);
- `tests`: `python -m pytest -q` (the README's test command; named only: many minutes).

Each run records its wall seconds, the CPU seconds of its processes (`cpu_s`), exit code and, where the command says it, the training steps (probes)
run and the confirmation's rounds, for a dry-run a digest of its JSON report but for its `seconds` (`report_sha256`: equal digests, equal
predictions), and for a dry-run or a search the configuration chosen (`chosen`); the results file holds the machine, the load (`os.getloadavg`) before and after each run, the
commit and the date. With `--against REF` each case is run by that commit's tree too, alternated with this
checkout's, and the ratios (this checkout / REF) are written: prefer them to absolute seconds on a shared
machine. With `--repeat N` every case runs N times, in rounds (each round's cache folders its own), and its
median is kept beside each run's seconds. With `--competing K` each case is also run beside K CPU-bound processes per core (busy loops, started
just before it and killed after), right after its quiet run, as `CASE@competing`, and the ratios
(competing / quiet) are written.

    python bench/measurements/time_to_answer.py --cases dry-run-7b,dry-run-7b-again,quickstart \\
        --out bench/results/time-to-answer-<date>.json

Backs: README.md's dry-run timing (llama-2-7b at 4,096 tokens: first use, then asked again for another GPU),
before and after the simulation cache's key was made the same in every process.
Results: time-to-answer-2026-12-06-before.json (commit 285f9f0: every process simulated anew),
time-to-answer-2026-12-06-130e9dd.json (the key fixed: asked again, the steps are read back),
time-to-answer-2026-12-06.json (commit bbdb730: a step's key no longer re-sorts every strategy),
time-to-answer-quickstart-2026-12-06.json (examples/quickstart.py at load 4-11: 1,623 s for 12 probes, where a
quiet machine took 34-37 s: the search's cost under load, left to issue 57's decision under noise),
time-to-answer-2026-12-06-5f56558-vs-f65526e.json (`--against f65526e` at load ~10: a line's reserve replayed
from its own events only, and the bisection's floors: 0.948 first use, 0.844 asked again),
time-to-answer-2026-12-06-9e5913c-vs-0fc8652.json (`--against 0fc8652` at load 5-7, one run each: each configuration's planning work
done once; asked again 0.575, first use 1.29 within that load's noise), time-to-answer-2026-12-06-76475d2-vs-0fc8652.json (the same at load
3.1-3.6: asked again 0.69, first use 0.73), time-to-answer-2026-12-06-quiet-e0862db-vs-0fc8652.json (the same and
the quickstart on a quiet machine after the merge: 0.895 first use, 0.669 asked again, 0.955 quickstart),
time-to-answer-tests-2026-12-06-e0862db.json (the README's test command on a quiet machine: 777 s),
time-to-answer-2026-12-07-618f88d-vs-2e5a4b4.json (`--cases dry-run-7b,dry-run-70b --against 2e5a4b4` at load
2.9-4.7, one run each: the reserve's pause kept from the roomy replay, the expandable replay written out, the
workers' jobs claimed; 0.81 and 0.97), time-to-answer-2026-12-07-3721282-vs-2e5a4b4.json (the 7B again at
load 0.3-2.2: 0.90), time-to-answer-2026-12-07-quiet-cb9af10-vs-f2516d4.json (`--cases
dry-run-gpt2,dry-run-7b-4090,dry-run-7b,dry-run-7b-again --against f2516d4`, quiet: levels that could be neither
chosen nor the closest to fitting left out; 0.766, 0.884, 0.914, 1.04),
time-to-answer-2026-12-07-quiet-257e477-vs-6e208fe.json (`--cases dry-run-7b,dry-run-7b-again,dry-run-70b,dry-run-gpt2
--against 6e208fe`, quiet: the simulation workers kept for the whole dry-run; 0.808, 0.991, 0.777, 0.83),
time-to-answer-2026-12-07-quiet-028cb66-vs-dbefd8b.json (`--cases dry-run-7b,dry-run-7b-again,dry-run-70b,dry-run-gpt2,
dry-run-7b-4090 --against dbefd8b --repeat 3`, quiet: the kept workers bisect levels while the dry-run plans; medians
0.895, 0.994, 0.973, 0.967, 1.015, every report the same),
time-to-answer-quickstart-competing-2026-12-07-028cb66.json (`--cases quickstart --competing 2 --repeat 2`: the
quickstart quiet, 33.9 and 46.2 s, and beside two busy loops per core, 124.1 and 121.3 s; 11 probes in each),
time-to-answer-tests-2026-12-07-a0c3904.json (`--cases quickstart,tests`, quiet: the quickstart in 32.0 s with 11
probes, the README's test command in 457 s),
time-to-answer-quickstart-2026-12-07-2790677-vs-d3c0b54.json (`--cases quickstart --against d3c0b54 --repeat 3`, back
to back: the search's threads from the cores sampled, not the lagging load average; medians 39.8 and 51.1 s, 0.779),
time-to-answer-quickstart-competing-2026-12-07-9353f0f.json (`--cases quickstart --competing 2 --repeat 2`: medians
38.7 s quiet, 144.4 s competing, 3.73x), time-to-answer-quickstart-competing-2026-12-07-b7ee381-vs-d3c0b54.json (the
same once, alternated with d3c0b54: 3.88x against 2.77x, d3c0b54's quiet run at 1 thread),
time-to-answer-tests-2026-12-07-4c8c624.json (`--cases quickstart,tests`, quiet: the quickstart in 43.2 s with 11
probes, the README's test command in 581 s),
time-to-answer-tune-classifier-2026-12-07-819216b-vs-17e7401.json (`--cases tune-classifier --against 17e7401 --repeat 3`:
a plain PyTorch model's search no longer imports transformers; medians 6.64 and 8.96 s, 0.741),
time-to-answer-tests-2026-12-07-ba882be-vs-17e7401.json (`--cases tests --against 17e7401`: the README's test command
after it, 548.6 against 526.5 s, 1.042, within this machine's spread),
time-to-answer-tests-2026-12-07-9583781-vs-17e7401-cpu.json (the same again with each run's CPU seconds: 517.4 s and
980 CPU s against 501.6 s and 953, 1.031),
time-to-answer-2026-12-07-quiet-63a46c7.json (`--cases dry-run-7b,dry-run-7b-again,dry-run-70b,quickstart,tune-classifier --repeat 2`,
load 1.2-1.7: medians 29.5, 6.9, 23.0, 40.2 and 5.6 s),
time-to-answer-tests-2026-12-07-quiet-25f6834-vs-17e7401.json (`--cases tests --against 17e7401` a third time, in that hour: 464.3 s and 878
CPU s against 497.4 s and 942, 0.933),
time-to-answer-quickstart-2026-12-07-5d216af-vs-0e95189.json (`--cases quickstart --against 0e95189 --repeat 3`: live
confirmation rounds judged from the 4th; medians 36.3 and 43.4 s, 0.837),
time-to-answer-quickstart-2026-12-07-2fbce23-vs-0e95189.json (the same, `--repeat 2`, each run's choice recorded:
medians 38.7 and 43.3 s, 0.895),
time-to-answer-quickstart-2026-12-07-350bde3-vs-0e95189.json (`--repeat 3` after a level's start predicts from the largest
size down as well: medians 35.3 and 43.0 s, 0.820),
time-to-answer-tests-2026-12-07-2e57984-vs-e9978d8.json (`--cases tests --against e9978d8`: the exported Trainer script's
usage error without transformers' import, technique_names.py walking each module once; 539.1 s and 1,027 CPU s against
547.4 s and 1,035, 0.985, within the machine's spread),
time-to-answer-2026-12-07-4c88754-vs-4552b37.json (`--cases dry-run-7b,dry-run-7b-again,dry-run-70b,dry-run-gpt2
--against 4552b37 --repeat 2`, load 1.4-1.7: every strategy made once for `completed()`, a level's reliefs asked once;
medians 7.69 and 8.22 s asked again, 0.936, first use, 70B and gpt2 within noise, every report the same),
time-to-answer-notebook-2026-12-07-67d4f03-vs-4552b37.json (`--cases dry-run-7b,dry-run-7b-notebook --against 4552b37
--repeat 2`, this case added on 67d4f03, load 0.7-1.6: asked again in one process, six GPUs in 11.36 and 12.46 s,
1.28-2.82 s each, against 13.15 and 14.72 s, 1.48-3.49 s each),
time-to-answer-2026-12-07-cd19963-vs-60879cb.json (`--cases dry-run-7b,dry-run-7b-again,dry-run-gpt2,tune-classifier
--against 60879cb --repeat 2`, load 1.5-1.9: the console script ends without the interpreter's teardown; medians
40.1 vs 42.4 s first use, 0.946, 7.93 vs 9.13 s asked again, 0.868, gpt2 24.2 vs 26.1 s, 0.929, the classifier's
tune 6.39 vs 7.64 s, 0.836, every report and choice the same),
time-to-answer-2026-12-08-42da455-vs-0b8182c.json (`--cases dry-run-7b,dry-run-7b-again,dry-run-70b --against 0b8182c
--repeat 2`, load 1.0-1.8 on a machine about twice as slow as the day before's: the spec's loss check at one block;
medians 11.98 vs 13.05 s asked again, 0.918, the 70B 54.2 vs 55.3 s, 0.979, first use 73.1 vs 68.3 s, 1.071 within
this machine's noise (CPU 122 and 126 s against 123 and 111 s), every report the same),
time-to-answer-2026-12-08-quiet-66e83b8.json (every case but `dry-run-7b-4090`, `--repeat 2`, on a machine about
three times as fast: medians 32.9 s first use, 6.1 s asked again, 24.3 s the 70B, 38.8 s the quickstart, 489.1 and
549.8 s the README's test command)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]  # the checkout this script is in
sys.path.insert(0, str(ROOT))
from bench.measurements.dry_run_time import checkout  # noqa: E402  (a commit's tree, as that script takes it)
DRY_RUN_7B = ["-m", "autofit.cli.main", "dry-run", "--model", "llama-2-7b", "--seq-len", "4096",
              "--global-batch-size", "64", "--json"]
AGAIN_GPUS = ("a100-40gb", "h100", "l40s", "a10g", "rtx-4090", "a100-80gb")
NOTEBOOK = ("import json, autofit\n"  # no braces: a case's arguments are formatted with its tree and work folder
            "ask = dict(seq_len=4096, global_batch_size=64)\n"
            "autofit.dry_run('llama-2-7b', gpu='h100', **ask)\n"
            f"print(json.dumps(dict(again_s=[round(autofit.dry_run('llama-2-7b', gpu=gpu, **ask).seconds, 2) "
            f"for gpu in {AGAIN_GPUS!r}])))\n")
CASES = {  # name: (arguments after `python`, the cache folder it uses: runs sharing one read each other's)
    "dry-run-7b": ([*DRY_RUN_7B, "--gpu", "h100"], "7b"),
    "dry-run-7b-again": ([*DRY_RUN_7B, "--gpu", "a100-80gb"], "7b"),
    "dry-run-7b-notebook": (["-c", NOTEBOOK], "7b"),
    "dry-run-70b": (["-m", "autofit.cli.main", "dry-run", "--model", "llama-2-70b", "--num-gpus", "8",
                     "--gpu", "a100-80gb", "--json"], "70b"),
    "dry-run-gpt2": (["-m", "autofit.cli.main", "dry-run", "--model", "gpt2", "--seq-len", "512",
                      "--global-batch-size", "32", "--gpu", "rtx-4090", "--json"], "gpt2"),
    "dry-run-7b-4090": ([*DRY_RUN_7B, "--gpu", "rtx-4090"], "7b-4090"),
    "quickstart": (["{tree}/examples/quickstart.py", "--out", "{work}/quickstart"], "quickstart"),
    "tune-classifier": (["-m", "autofit.cli.main", "tune", "--model", "examples/classifier.py:make",
                         "--global-batch-size", "32", "--device", "cpu", "--memory-budget", "3MiB", "--allow", "0",
                         "--out", "{work}/classifier", "--force"], "classifier"),
    "tests": (["-m", "pytest", "-q", "-p", "no:cacheprovider"], "tests"),
}
TUNED = {"quickstart": "quickstart", "tune-classifier": "classifier"}  # a search's case: the folder of its plan.json
DEFAULT_CASES = ("dry-run-7b", "dry-run-7b-again", "dry-run-70b", "quickstart")
PROBES = re.compile(r"^(\d+) probes\. Chosen:", re.MULTILINE)  # examples/quickstart.py's summary line
ROUNDS = re.compile(r" over (\d+) rounds")  # its confirmation's rounds, where it says them


def _children_cpu() -> float:
    """User + system CPU seconds of this process's ended children and theirs (a case's processes, all of them):
    on a shared machine a steadier figure of a case's work than its wall time."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_case(name: str, tree: Path, work: Path) -> dict:
    """One case by `tree`'s code in a fresh process (cwd: the tree): wall seconds, exit code, probes run,
    the load around it, and for a dry-run its report's own seconds and chosen configuration."""
    arguments, cache = CASES[name]
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, *(a.format(tree=tree, work=work) for a in arguments)]
    env = {**os.environ, "PYTHONPATH": str(tree), "AUTOFIT_CACHE": str(work / f"cache-{cache}"),
           "COLUMNS": "200"}
    load_before = os.getloadavg()
    cpu = _children_cpu()
    started = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    found = {"wall_s": round(wall, 2), "cpu_s": round(_children_cpu() - cpu, 1), "rc": done.returncode,
             "load_before": load_before, "load_after": os.getloadavg()}
    probes = PROBES.search(done.stdout)
    if probes:
        found["probes_run"] = int(probes.group(1))
    rounds = ROUNDS.search(done.stdout)
    if rounds:
        found["confirmation_rounds"] = int(rounds.group(1))
    if arguments[:3] == ["-m", "autofit.cli.main", "dry-run"] and done.returncode in (0, 3, 4):
        report = json.loads(done.stdout)
        found.update(report_s=report["seconds"], candidates=len(report["candidates"]),
                     chosen=report["chosen"]["config"] if report["chosen"] else None,
                     report_sha256=hashlib.sha256(json.dumps({k: v for k, v in report.items() if k != "seconds"},
                                                             sort_keys=True).encode()).hexdigest())
    plan = work / TUNED.get(name, "") / "plan.json"
    if name in TUNED and done.returncode == 0 and plan.is_file():  # what the search ran at, and its cost
        written = json.loads(plan.read_text())
        confirmation = written.get("confirmation") or {}
        found.update(threads=confirmation.get("threads"), confirmation_steps=confirmation.get("steps"),
                     chosen=written.get("config"))
        found.setdefault("probes_run", sum(probe.get("skip") is None for probe in written.get("probes", ())))
    if name == "dry-run-7b-notebook" and done.returncode == 0:
        found["again_s"] = json.loads(done.stdout.strip().splitlines()[-1])["again_s"]
    if name == "tests":
        found["summary"] = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    if done.returncode not in (0, 3, 4):
        found["stderr_tail"] = done.stderr[-2000:]
    return found


def merged(runs: list[dict]) -> dict:
    """One case's runs as one: the first's fields and the median wall seconds, and with more than one run each's
    seconds (`walls`), each run whole (`runs`), whether their reports were the same (`same_report`, for a
    dry-run) and whether they chose the same configuration (`same_choice`)."""
    if len(runs) == 1:
        return runs[0]
    walls = [found["wall_s"] for found in runs]
    found = {**runs[0], "wall_s": statistics.median(walls), "walls": walls, "runs": runs}
    if "report_sha256" in found:
        found["same_report"] = len({run.get("report_sha256") for run in runs}) == 1
    if "chosen" in found:
        found["same_choice"] = len({json.dumps(run.get("chosen"), sort_keys=True) for run in runs}) == 1
    return found


@contextlib.contextmanager
def competing(per_core: int) -> Iterator[None]:
    """`per_core` CPU-bound processes per core (Python busy loops) running until the block ends."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(per_core * (os.cpu_count() or 1))]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--against", help="a commit whose tree runs each case too, alternated with this checkout")
    parser.add_argument("--out", type=Path, help="write the results there (JSON)")
    parser.add_argument("--work", type=Path, help="a folder to keep the cache folders in (default: a temporary one)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every case N times (rounds alternated, each with cache folders of its own): medians")
    parser.add_argument("--competing", type=int, default=0, metavar="K",
                        help="also run each case beside K CPU-bound processes per core (CASE@competing)")
    args = parser.parse_args()
    cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        sys.exit(f"--cases names {unknown}: choose from {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="autofit-time-to-answer-") as folder:
        work = args.work or Path(folder)
        trees = {"this checkout": ROOT}
        if args.against:
            trees[args.against] = checkout(args.against, work)
        runs: dict[str, dict[str, list[dict]]] = {name: {} for name in trees}
        for round_ in range(args.repeat):
            for case in cases:
                for index, (name, tree) in enumerate(trees.items()):  # alternated: a change of load meets both
                    for label, beside, folder in ((case, 0, f"tree-{index}-{round_}"),
                                                  (f"{case}@competing", args.competing, f"tree-{index}-{round_}-competing")):
                        if label == case or beside:
                            with competing(beside):  # cache folders of its own: a first use is one for both
                                found = run_case(case, tree, work / folder)
                            runs[name].setdefault(label, []).append(found)
                            print(f"{name}: {label} {found['wall_s']:.1f} s (rc {found['rc']})", flush=True)
        times = {name: {label: merged(found) for label, found in labels.items()} for name, labels in runs.items()}
    result = {"date": datetime.date.today().isoformat(), "commit": commit(ROOT),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
              "python": platform.python_version(), "cases": {case: " ".join(CASES[case][0]) for case in cases},
              "competing_per_core": args.competing, "times": times}
    if args.against:
        mine, other = times["this checkout"], times[args.against]
        result["ratios (this checkout / against)"] = {case: round(mine[case]["wall_s"] / other[case]["wall_s"], 3)
                                                      for case in cases}
    if args.competing:
        result["ratios (competing / quiet)"] = {f"{name}: {case}": round(found[f"{case}@competing"]["wall_s"]
                                                                        / found[case]["wall_s"], 3)
                                               for name, found in times.items() for case in cases}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
