"""How far the ascending history of `--varied-lengths` is from other histories of the same rows.

    python bench/calibration/varied_lengths.py    # ~10 min on 2 cores; writes results/varied-lengths.json

`autofit dry-run --varied-lengths` (autofit/estimate/cuda/varied_lengths.py) predicts a job whose batches are
padded each to its own longest sample as the caching allocator's reserve after an ascending history of
shorter steps, as many as the largest token-linear tensor has 2 MiB roundings (at most 64), read on the
micro-batch line. For every reserved row whose source pads per batch (`calibrate.varied_lengths`), this
replays on a roomy card, beside the one-length step and the product's history: ascending histories of
other step counts (`RUNGS`), and the product's lengths shuffled (`SEEDS`), the order a shuffled data set
gives. Each figure is the calibration's prediction with its fragmentation term swapped for that replay's;
the error is against the measured figure. Nothing here is fitted: it says how far the choice of history
moves the figure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.estimate.cuda import varied_lengths  # noqa: E402
from autofit.estimate.estimator import CUDA_CONTEXT_BYTES, Estimator  # noqa: E402
from bench.cli import no_options  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "varied-lengths.json"
RUNGS = (8, 16, 32, 48, 128)  # other ascending histories (steps), beside the product's
SEEDS = range(5)  # shuffles of the product's lengths


def roomy_reserve(replay) -> int:
    """What `replay` reserves beyond its allocated peak on a roomy card."""
    run = replay.calls().replayed()
    return run.peak_reserved - run.peak_allocated


def predict(row: dict) -> dict:
    """`row`'s prediction with its fragmentation term from each history."""
    from bench.calibration import calibrate

    spec, config, strategies = calibrate.setup(row, one_length=True)
    estimator = Estimator(spec, target="cuda", strategies=strategies,
                          deferred_sync=calibrate.defers_sync(row, config))
    with calibrate.libraries_as_measured(row):
        estimate = estimator.predict(config)
        peak = estimator.activations(config)[0]
        low, high = estimator._line_points(config)  # noqa: SLF001 - the two steps the product reads its line from
        one, two = (estimator._at_batch(config, mb)[0].replay for mb in (low, high))  # noqa: SLF001
    mb, base = config.micro_batch_size, estimate.peak_bytes - CUDA_CONTEXT_BYTES - peak.fragmentation
    product = varied_lengths.rungs_for(one, two, mb, low, high)

    def error(fragmentation: int) -> float:
        return round((base + fragmentation) / row["value_bytes"] - 1, 4)

    ladders = {n: error(roomy_reserve(varied_lengths.after_shorter(
        peak.replay, varied_lengths.shorter_steps(one, two, mb, low, high, rungs=n)))) for n in (product, *RUNGS)}
    steps = varied_lengths.shorter_steps(one, two, mb, low, high, rungs=product)
    shuffled = {}
    for seed in SEEDS:
        order = list(steps)
        random.Random(seed).shuffle(order)
        shuffled[seed] = error(roomy_reserve(varied_lengths.after_shorter(peak.replay, tuple(order))))
    return {"id": row["id"], "measured_bytes": row["value_bytes"], "one_length_error": error(peak.fragmentation),
            "product_steps": product, "ascending_error": {str(n): e for n, e in ladders.items()},
            "shuffled_error": {str(s): e for s, e in shuffled.items()},
            "shuffled_median_error": round(statistics.median(shuffled.values()), 4)}


def main() -> None:
    no_options(__doc__)
    from bench.calibration import calibrate

    torch.set_num_threads(1)
    started, load = time.time(), os.getloadavg()[0]
    rows = [r for r in json.loads(calibrate.ROWS.read_text()) if r["metric"] == "reserved"
            and calibrate.varied_lengths(r) and not calibrate.expressible(r)]
    results = []
    for row in rows:
        results.append(predict(row))
        print(json.dumps(results[-1]), flush=True)
    calibrate.write_experiment(RESULT, __doc__, started, load, rungs=RUNGS, seeds=list(SEEDS), rows=results)


if __name__ == "__main__":
    main()
