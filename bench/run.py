"""Run the benchmark suite and write bench/results/<device>-<date>.json and the table in bench/README.md.

    python bench/run.py                 # CPU scenarios (tiny models under CPU budgets), ~10 min on 2 cores
    python bench/run.py --gpu           # GPU scenarios (~125M-3B models, budgets for 16-80 GB cards)
    python bench/run.py --only gpt2-tiny@60% --robustness-steps 20 --no-tools   # a quick look
    python bench/run.py --threads 1 --competing-load 1   # with another CPU-bound process running
    python bench/run.py --threads 1 --busy               # two CPU-bound processes per core beside it

The suite's parts are in bench/suite/ (scenarios, the exhaustive oracle, the tools people use, the
re-measurement, the dry-run error, the README's tables); bench/README.md#the-suite says how the figures
are taken. Backs README.md's benchmark figures: bench/results/cpu-2026-11-22.json, cpu-2026-11-22-load1.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BUSY_PER_CORE = 2  # --busy: competing CPU-bound processes per core
sys.path.insert(0, str(HERE.parent))  # `python bench/run.py` from anywhere imports bench and autofit

import torch  # noqa: E402

from bench.suite.load import CompetingLoad  # noqa: E402
from bench.suite.report import update_readme  # noqa: E402
from autofit.strategies import default_strategies  # noqa: E402
from bench.suite.scenarios import cpu_rungs, cpu_scenarios, gpu_scenarios  # noqa: E402
from bench.suite.side_by_side import Options, log, run_scenario  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="run the GPU scenarios on cuda (needs a GPU)")
    parser.add_argument("--only", action="append", default=[], help="run only the scenario of this name (repeatable)")
    parser.add_argument("--robustness-steps", type=int, default=200, help="steps of the robustness run (0: skip)")
    parser.add_argument("--repetitions", type=int, default=5, help="rounds of the interleaved re-measurement")
    parser.add_argument("--no-tools", action="store_true", help="skip accelerate / Trainer / Lightning")
    parser.add_argument("--no-dry-run", action="store_true", help="skip predicted-vs-measured peaks")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--competing-load", type=int, default=0, metavar="N",
                        help="run N busy processes (matrix multiplies, one thread each) for the whole run")
    parser.add_argument("--busy", action="store_true",
                        help=f"a busy machine: {BUSY_PER_CORE} competing processes per core (--competing-load "
                             f"{BUSY_PER_CORE * (os.cpu_count() or 1)} here), a load of two or more per core "
                             "for the whole run")
    parser.add_argument("--no-large", action="store_true", help="skip the >= 50M-parameter CPU scenarios")
    parser.add_argument("--no-repeat", action="store_true", help="tune each scenario once (not twice)")
    parser.add_argument("--tag", default="", help="suffix of the results file name (<device>-<date>-<tag>.json)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="folder for the JSON results")
    parser.add_argument("--readme", type=Path, default=HERE / "README.md", help="README whose table is regenerated")
    parser.add_argument("--no-readme", action="store_true", help="do not touch the README")
    return parser.parse_args(argv)


def device_name(gpu: bool) -> str:
    """The GPU's name, or the CPU's model name and core count."""
    if gpu:
        return torch.cuda.get_device_name(0)
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def slug(gpu: bool) -> str:
    """File-name form of the device: "cpu" or e.g. "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-") if gpu else "cpu"


def versions() -> dict[str, str | None]:
    """Versions of the libraries the figures depend on."""
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "autofit", "transformers", "accelerate", "lightning", "deepspeed", "peft", "optuna"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    import autofit

    out["autofit"] = autofit.__version__
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the suite; write the JSON and the README table; return the exit status."""
    args = parse_args(argv)
    if args.busy:
        args.competing_load = max(args.competing_load, BUSY_PER_CORE * (os.cpu_count() or 1))
    if args.gpu and not torch.cuda.is_available():
        print("--gpu: no CUDA device is visible; run the CPU suite without --gpu.", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    scenarios = gpu_scenarios() if args.gpu else cpu_scenarios()
    if args.no_large:
        scenarios = [s for s in scenarios if not s.large]
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in scenarios})
        if unknown:
            print(f"--only {unknown}: no such scenario; known: {[s.name for s in scenarios]}", file=sys.stderr)
            return 2
        scenarios = [s for s in scenarios if s.name in args.only]
    options = Options(device="cuda" if args.gpu else "cpu", tools=not args.no_tools,
                      robustness_steps=args.robustness_steps, repetitions=args.repetitions,
                      dry_run=not args.no_dry_run, repeat=not args.no_repeat,
                      strategies=default_strategies if args.gpu else cpu_rungs)
    started = datetime.datetime.now(datetime.timezone.utc)
    header: dict[str, Any] = dict(
        device=device_name(args.gpu), device_kind=options.device, date=started.date().isoformat(),
        started_utc=started.isoformat(timespec="seconds"), command=" ".join(["python", "bench/run.py", *sys.argv[1:]]),
        versions=versions(), torch_threads=torch.get_num_threads(), load_before=os.getloadavg(),
        competing_load=args.competing_load, options={k: v for k, v in vars(options).items() if k != "strategies"},
        default_rungs=sorted({type(s).__name__ for s in options.strategies()}))
    log(f"{header['device']}, load {header['load_before']}, {len(scenarios)} scenarios, "
        f"{args.competing_load} competing process(es)")
    start = time.perf_counter()
    loads = []
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{slug(args.gpu)}-{header['date']}{'-' + args.tag if args.tag else ''}.json"
    with CompetingLoad(args.competing_load) as competing:
        results = []
        for scenario in scenarios:
            results.append(run_scenario(scenario, options))
            loads.append(os.getloadavg()[0])
            partial = {**header, "partial": True, "load_during": loads, "scenarios": results}
            path.with_suffix(".partial.json").write_text(json.dumps(partial, indent=2, default=str) + "\n")
    header.update(load_after=os.getloadavg(), load_during=loads, load_every_30s=competing.loads,
                  wall_s=time.perf_counter() - start, scenarios=results)
    path.write_text(json.dumps(header, indent=2, default=str) + "\n")
    path.with_suffix(".partial.json").unlink(missing_ok=True)
    log(f"wrote {path} ({header['wall_s']:.0f} s)")
    if not args.no_readme:
        update_readme(args.readme, header, path.relative_to(args.readme.parent) if path.is_relative_to(args.readme.parent) else path)
        log(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
