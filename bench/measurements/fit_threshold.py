"""The smallest CUDA budget each configuration trains under, against the dry-run's predicted peak.

A probe without a budget reports the caching allocator's most *reserved* bytes: on a roomy card the
allocator keeps every freed block cached, so that figure is above what the step needs. Under a budget
(the per-process memory fraction) it frees its cache and retries before it raises out-of-memory, so a
configuration fits budgets below its roomy peak. What a dry-run promises is a fit, so the figure it must
not fall short of is this threshold: found here by bisection, each step one real probe under
`memory_budget=L` with no safety margin (only a real out-of-memory fails it; the tuner's 10% margin is its
own rule) in a fresh child process (`autofit.probe.launch.probe_placed`, CHILD): in one process an OOM in
the backward can leave tensors allocated for every later probe (pytorch/pytorch#82218).

    python bench/measurements/fit_threshold.py [--steps 5] [--only gpt2-124m] [--held-out]   # needs a GPU
    python bench/measurements/fit_threshold.py --against bench/results/fit-threshold-cuda-h200-2026-11-27.json
        # no GPU: predict a recorded run's rows here

The estimator predicts both figures: the roomy peak (`Estimate.peak_bytes`) and what a fit needs
(`Estimate.need_bytes`: the caching allocator replayed under a shrinking limit, its cache released at the
limit, `autofit.estimate.cuda.training_replay.least_reserve`). `--against` predicts a recorded run's rows
on this machine (CPU kernels standing in for CUDA) and says where each prediction falls against the
measured interval.

Backs: bench/README.md#fit-threshold, cited by autofit/estimate/tolerance.py (the CUDA prediction
tolerance), autofit/estimate/cuda/training_replay.py (`least_reserve`) and autofit/devices/memory.py
(`CudaBudget.after_step`: the CUDA context grows through a fresh process's first steps); docs/dry-run.md's
and README.md's thresholds.
Results: bench/results/fit-threshold[-held-out]-cuda-<card>-<date>.json, written after every
configuration (device, date and torch inside: roomy peak, its parts, the threshold interval, the
prediction and both errors), and with --against fit-threshold-replay-<recorded>-<date>.json:
fit-threshold-cuda-2026-11-27.json (H100, confounded: see its caveat),
fit-threshold-cuda-h200-2026-11-27-share-on-entry.json, fit-threshold-cuda-h200-2026-11-27.json,
fit-threshold-held-out-cuda-h200-2026-11-27.json and their fit-threshold-replay-*.json."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench and autofit import

from autofit.config import Config  # noqa: E402
from autofit.estimate.estimator import Estimator, predict_peak  # noqa: E402
from autofit.probe.launch import probe_placed  # noqa: E402
from autofit.probe.run import run_probe  # noqa: E402
from autofit.devices.device import describe  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import default_strategies  # noqa: E402
from autofit.strategies.base import Placement  # noqa: E402
from bench.measurements.estimate_accuracy import GLOBAL_BATCH, measured_parts, model_named  # noqa: E402
from bench.suite.report import results_path  # noqa: E402

MIB = 2**20
# the estimate run's largest under-predictions of the roomy peak (bench/results/estimate-cuda-2026-11-27.json)
CASES = [("gpt2-124m", "bf16", "full", 4), ("gpt2-124m", "fp32", "full", 1), ("gpt2-124m", "bf16", "none", 4),
         ("llama-1.1b", "fp32", "full", 4), ("llama-1.1b", "bf16", "none", 1)]
# models no calibration used (bench.measurements.estimate_accuracy.held_out_models), bisected with --held-out
HELD_OUT_CASES = [("gpt2-355m", "fp32", "full", 1), ("gpt2-355m", "bf16", "none", 4),
                  ("qwen2-0.5b", "bf16", "full", 4), ("qwen2-0.5b", "fp32", "none", 1)]


def probe(model, batch, seq_len, config: Config, budget: int | None):
    """The roomy probe (no budget) here, to read its allocator's parts; a budgeted one in a fresh child."""
    spec = make_spec(model, batch, seq_len=seq_len, global_batch_size=GLOBAL_BATCH, device="cuda",
                     memory_budget=budget, safety_margin=0.0, warmup_steps=1, timed_steps=1)
    if budget is None:
        return spec, run_probe(spec, config, default_strategies())
    return spec, probe_placed(spec, config, default_strategies(), Placement.CHILD)


def threshold(name: str, precision: str, checkpointing: str, micro: int, steps: int) -> dict:
    model, batch, seq_len = model_named(name)
    config = Config(precision=precision, attention="sdpa", checkpointing=checkpointing, micro_batch_size=micro,
                    grad_accum_steps=GLOBAL_BATCH // micro)
    spec, roomy = probe(model, batch, seq_len, config, None)
    parts = measured_parts("cuda")
    predicted = predict_peak(spec, config)
    low = parts["max_allocated"] + parts["outside_allocator"]  # below this nothing can fit
    high = roomy.peak_bytes
    tries = []
    for _ in range(steps):
        middle = (low + high) // 2
        _, result = probe(model, batch, seq_len, config, middle)
        tries.append({"budget": middle, "status": result.status.value, "peak": result.peak_bytes,
                      "phase": result.phase, "oom_kind": result.oom_kind, "alloc_retries": result.alloc_retries})
        print(f"  {name} {config.describe()} at {middle / MIB:8.0f} MiB: {result.status.value}", file=sys.stderr)
        if result.fits:
            high = middle
        else:
            low = middle
    return {"model": name, "describe": config.describe(), "config": config.to_dict(),
            "roomy_peak": roomy.peak_bytes, "roomy_parts": parts, "fits_at": high, "fails_at": low,
            "predicted": predicted.peak_bytes, "predicted_need": predicted.need_bytes,
            "overhead_terms": dict(predicted.terms),
            "error_vs_roomy": round(predicted.peak_bytes / roomy.peak_bytes - 1, 5),
            "error_vs_threshold": round(predicted.peak_bytes / high - 1, 5), "tries": tries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="bisection steps per configuration")
    parser.add_argument("--only", action="append", help="only this model (repeatable)")
    parser.add_argument("--held-out", action="store_true", help="the models no calibration used (HELD_OUT_CASES): "
                        "results-file name fit-threshold-held-out-...")
    parser.add_argument("--against", type=Path, help="a recorded GPU run: predict its rows here, no probe")
    args = parser.parse_args()
    if args.against:
        return replay(args.against)
    started, now = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc)
    result = {"what": __doc__.splitlines()[0], "device": describe(torch.device("cuda")),
              "date": now.isoformat(timespec="seconds"), "torch": torch.__version__,
              "python": platform.python_version(), "rows": []}
    path = results_path("fit-threshold-held-out" if args.held_out else "fit-threshold", "cuda")
    for case in HELD_OUT_CASES if args.held_out else CASES:
        if args.only and case[0] not in args.only:
            continue
        row = threshold(*case, args.steps)
        result["rows"].append(row)
        result["seconds"] = round(time.perf_counter() - started, 1)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{row['model']:11s} {row['describe']:42s} roomy {row['roomy_peak'] / MIB:7.0f} MiB, fits at "
              f"{row['fits_at'] / MIB:7.0f} (fails at {row['fails_at'] / MIB:7.0f}), predicted "
              f"{row['predicted'] / MIB:7.0f}: {row['error_vs_threshold']:+.1%} of the threshold, "
              f"{row['error_vs_roomy']:+.1%} of the roomy peak", file=sys.stderr)


def replay(path: Path) -> None:
    """Predict a recorded run's configurations here, without a GPU: the roomy peak against the measured one,
    what a fit needs against the measured interval (fails at, fits at]."""
    recorded, started = json.loads(path.read_text()), time.perf_counter()
    rows = []
    for row in recorded["rows"]:
        model, batch, seq_len = model_named(row["model"])
        spec = make_spec(model, batch, seq_len=seq_len, global_batch_size=GLOBAL_BATCH, device="cpu",
                         memory_budget="1TiB")
        predicted = Estimator(spec, target="cuda").predict(Config.from_dict(row["config"]))
        need, fails, fits = predicted.need_bytes, row["fails_at"], row["fits_at"]
        where = "within" if fails < need <= fits else ("under" if need <= fails else "over")
        rows.append({"model": row["model"], "describe": row["describe"], "roomy_peak": row["roomy_peak"],
                     "fails_at": fails, "fits_at": fits, "predicted": predicted.peak_bytes,
                     "predicted_need": need, "need_vs_interval": where,
                     "error_vs_roomy": round(predicted.peak_bytes / row["roomy_peak"] - 1, 5),
                     "need_vs_threshold": round(need / fits - 1, 5)})
        print(f"{row['model']:11s} {row['describe']:42s} fails at {fails / MIB:6.0f}, fits at {fits / MIB:6.0f} MiB: "
              f"needs {need / MIB:6.0f} predicted ({where}); roomy {row['roomy_peak'] / MIB:6.0f}, predicted "
              f"{predicted.peak_bytes / MIB:6.0f}", file=sys.stderr)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = path.with_name(f"fit-threshold-replay-{path.stem.removeprefix('fit-threshold-')}-{now.date().isoformat()}.json")
    out.write_text(json.dumps({"what": "a recorded bisection's configurations predicted here, no GPU",
                               "measured": {"file": path.name, "device": recorded["device"], "date": recorded["date"]},
                               "machine": f"{platform.machine()}, {describe(torch.device('cpu'))}",
                               "torch": torch.__version__, "date": now.isoformat(timespec="seconds"),
                               "seconds": round(time.perf_counter() - started, 1), "rows": rows}, indent=2) + "\n")
    print(f"-> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
