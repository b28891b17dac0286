"""The estimator against measured per-rank peaks of the multi-rank engines on CPU ranks over gloo, by
accumulation: DDP, DeepSpeed ZeRO-1/2/3 and FSDP2, each at accumulation 1 and several micro-batches.

    python bench/measurements/engine_memory.py            # ~12 min on 2 cores
    python bench/measurements/engine_memory.py --quick    # one model, fp32 only
    python bench/measurements/engine_memory.py --label before
        --reestimate bench/results/engine-memory-cpu-<date>.json
        # this checkout's predictions of the same measured peaks, added beside them (run from an older
        # checkout to compare)

DeepSpeed's and FSDP2's buffers are the same Python code on the CPU as on a card (the allocations in
deepspeed/runtime/zero/stage_1_and_2.py and stage3.py do not depend on the device); what a card adds (the
CUDA context, the caching allocator's rounding) is the estimator's CUDA terms, calibrated apart
(bench/calibration). Each row: the configuration, the largest rank's measured peak (autofit's CPU
budget counts every live tensor storage), the prediction, and predicted / measured - 1 (above 0: a
conservative prediction; below: a promised fit that would run out).

Backs: autofit/estimate/engines.py (DeepSpeed's partition buffers and FSDP2's gathered blocks, as sized
there) and `ENGINE_TOLERANCE` in autofit/estimate/tolerance.py; README.md's and docs/heavy-rungs.md's
per-rank errors by accumulation and precision (90 probes, worst under-prediction 4.3%).
Results: bench/results/engine-memory-cpu-2026-11-29.json (the predictions before the buffers were sized
kept beside them, `--reestimate --label before`)."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench and autofit import

import torch  # noqa: E402
from torch import nn  # noqa: E402

from autofit.config import Config  # noqa: E402
from autofit.estimate.estimator import Estimator  # noqa: E402
from autofit.probe.launch import launch  # noqa: E402
from autofit.batches.synthetic_batches import TokenBatches  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import Placement, default_strategies  # noqa: E402
from bench import RESULTS  # noqa: E402
from bench.suite.scenarios import make_gpt2  # noqa: E402

RANKS, GLOBAL_BATCH = 2, 64
ENGINES = ("none", "zero1", "zero2", "zero3", "fsdp_grad_op", "fsdp_full")
SPLITS = ((32, 1), (8, 4), (1, 32))  # micro-batch x accumulation per rank


class Mlp(nn.Module):
    """Square linear layers: a rank's ZeRO partition boundary falls inside one of them."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        return self.out(self.layers(x))


def features(width: int, n: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(n, width), "y": torch.randint(0, 10, (n,))}


def classify(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch["y"])


MODELS = {  # name -> make_spec's model, batch and loss_fn
    "mlp-512x4": (functools.partial(Mlp, 512, 4), functools.partial(features, 512), classify),
    "mlp-256x6": (functools.partial(Mlp, 256, 6), functools.partial(features, 256), classify),
    "gpt2-1.3M": (functools.partial(make_gpt2, 6, 128, 4, 512, 64), TokenBatches(512, 32), None),
}


def _spec(name: str) -> Any:
    model, batch, loss_fn = MODELS[name]
    return make_spec(model, batch, loss_fn=loss_fn, global_batch_size=GLOBAL_BATCH, num_gpus=RANKS, device="cpu",
                     memory_budget="1GiB", allow=1, warmup_steps=2, timed_steps=1)


def rows(name: str, precisions: tuple[str, ...]) -> list[dict[str, Any]]:
    spec = _spec(name)
    estimator, out = Estimator(spec, strategies=default_strategies()), []
    for precision in precisions:
        for engine in ENGINES:
            for micro, accumulation in SPLITS:
                config = Config(precision=precision, sharding=engine, micro_batch_size=micro,
                                grad_accum_steps=accumulation, num_gpus=RANKS)
                result = launch(spec, config, default_strategies(), Placement.RANKS, 600, None)
                predicted = estimator.predict(config).peak_bytes
                row = dict(model=name, config=config.describe(), knobs=config.to_dict(), status=result.status.value,
                           measured_bytes=result.peak_bytes, rank_peaks=list(result.rank_peaks),
                           predicted_bytes=predicted,
                           relative_error=predicted / result.peak_bytes - 1 if result.peak_bytes else None)
                print(f"{name:10} {row['config']:55} {row['status']:5} measured {result.peak_bytes / 2**20:7.3f} MiB  "
                      f"predicted {predicted / 2**20:7.3f} MiB  {row['relative_error']:+.1%}", flush=True)
                out.append(row)
    return out


def reestimate(path: Path, label: str) -> None:
    """This checkout's predictions of the measured peaks in `path`, added beside the recorded ones as
    `predicted_bytes_<label>` / `relative_error_<label>`, with their summaries."""
    record = json.loads(path.read_text())
    for name in dict.fromkeys(p["model"] for p in record["points"]):
        estimator = Estimator(_spec(name), strategies=default_strategies())
        for point in (p for p in record["points"] if p["model"] == name):
            predicted = estimator.predict(Config.from_dict(point["knobs"])).peak_bytes
            point[f"predicted_bytes_{label}"] = predicted
            point[f"relative_error_{label}"] = predicted / point["measured_bytes"] - 1
    key = f"relative_error_{label}"
    record[f"summary_{label}"] = summary(record["points"], key)
    record[f"by_engine_{label}"] = {engine: summary([p for p in record["points"] if _engine(p["config"]) == engine], key)
                                    for engine in ENGINES}
    record[f"reestimated_{label}"] = datetime.date.today().isoformat()
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"summary": record[f"summary_{label}"], "by_engine": record[f"by_engine_{label}"]}, indent=1))


def summary(points: list[dict[str, Any]], key: str = "relative_error") -> dict[str, Any]:
    errors = [p[key] for p in points if p["status"] == "fit"]
    return dict(rows=len(errors), median_abs=statistics.median(abs(e) for e in errors),
                worst_abs=max(abs(e) for e in errors), largest_under=min(min(errors), 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reestimate", type=Path)
    parser.add_argument("--label", default="now")
    args = parser.parse_args()
    if args.reestimate:
        return reestimate(args.reestimate, args.label)
    plan = [("mlp-512x4", ("fp32",))] if args.quick else \
        [("mlp-512x4", ("fp32", "bf16")), ("mlp-256x6", ("fp32",)), ("gpt2-1.3M", ("fp32", "bf16"))]
    points = [row for name, precisions in plan for row in rows(name, precisions)]
    by_engine = {engine: summary([p for p in points if _engine(p["config"]) == engine]) for engine in ENGINES}
    record = dict(date=datetime.date.today().isoformat(), machine=f"{platform.node()} {platform.processor()} "
                  f"{os.cpu_count()} cores", load_before=os.getloadavg(), torch=torch.__version__,
                  deepspeed=_version("deepspeed"), ranks=RANKS, global_batch_size=GLOBAL_BATCH,
                  summary=summary(points), by_engine=by_engine, points=points)
    path = args.out or RESULTS / f"engine-memory-cpu-{record['date']}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"summary": record["summary"], "by_engine": by_engine}, indent=1))
    print(f"written {path}")


def _engine(described: str) -> str:
    return next((part.split("=")[1] for part in described.split(", ") if part.startswith("shard=")), "none")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
