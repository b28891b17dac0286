"""What a dry-run's choice depends on: the simulated step keys a chain-lazy dry-run would need, against those the
dry-run simulates today (a design measured, not built).

The dry-run's choice (`autofit.pipelines.dry_run._decided`) walks the fitting candidates in the decision's order
(`autofit.search.decision.change_order`), each replacing the choice so far only where it is faster by the margin
it must clear; the choice so far only gets faster along the walk. So a level whose fastest possible step
(`_Planner.fastest`: at its largest micro-batch) could not replace the choice so far by the least margin it could
face (`margin_between`, taken as not near the limit) could never be chosen, whatever it is predicted to need. Each
case is dry-run as it is (its `best_levels` kept), then its levels are walked in that order, each predicted (read
from the dry-run's own candidates) only where it could replace the choice so far, and the simulated step keys are
counted each way (`Estimator._key` of every micro-batch a prediction asks for), with both choices.

    python bench/measurements/chain_lazy.py --out bench/results/chain-lazy-<date>-<commit>.json

`AUTOFIT_CACHE` as the dry-run reads it: a cache that holds the cases' steps makes this quick.

Backs: issue 58's closing note (what a dry-run that predicts only what its choice depends on would simulate).
Results: chain-lazy-2026-12-07-2fa9ce1.json (the 7B on an H100: 44 of 84 step keys; on an RTX 4090: 56 of 56;
llama-2-70b on 8 A100s: 14 of 56; the same choice in each)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout this script is in
sys.path.insert(0, str(ROOT))
from bench.measurements.time_to_answer import commit  # noqa: E402

CASES = {  # name: (model, dry_run's keywords)
    "llama-2-7b@h100": ("llama-2-7b", {"seq_len": 4096, "global_batch_size": 64, "gpu": "h100"}),
    "llama-2-7b@rtx-4090": ("llama-2-7b", {"seq_len": 4096, "global_batch_size": 64, "gpu": "rtx-4090"}),
    "llama-2-70b@8xa100-80gb": ("llama-2-70b", {"gpu": "a100-80gb", "num_gpus": 8}),
}


def measure(model: str, keywords: dict) -> dict:
    """Dry-run `model` as it is, then walk its levels chain-lazily (see the module): the counts and both choices."""
    from autofit.pipelines import dry_run as pipeline
    from autofit.search.decision import DEFAULT_EXACT_MARGIN, change_order, level_order, margin_between, standing

    kept: dict = {}
    planned = pipeline.best_levels

    def best_levels(space, planner, strategies, listener):  # the dry-run's own, its space and planner kept
        found = planned(space, planner, strategies, listener)
        kept.update(space=space, planner=planner, candidates=found)
        return found

    pipeline.best_levels = best_levels
    try:
        started = time.perf_counter()
        report = pipeline.dry_run(model, **keywords)
        seconds = time.perf_counter() - started
    finally:
        pipeline.best_levels = planned
    space, planner, estimator = kept["space"], kept["planner"], kept["planner"].estimator
    predicted = {c.config.replace(micro_batch_size=1, grad_accum_steps=1): c for c in kept["candidates"]}
    order = level_order(space)
    levels = sorted(space.levels(), key=lambda level: change_order(space, planner.largest(level), order=order))
    holder, needed, over = None, [], 0
    for level in levels:
        if planner.states_over(planner.smallest(level)):
            over += 1
            continue
        if holder is not None:
            least = margin_between(holder.standing, standing(space, planner.largest(level)), DEFAULT_EXACT_MARGIN)[0]
            if holder.step_seconds < planner.fastest(level) * (1 + least):
                continue  # it could not replace the choice so far: never chosen
        needed.append(level)
        found = predicted.get(level)
        if found is not None and found.fits and (holder is None or holder.step_seconds >= found.step_seconds * (
                1 + margin_between(holder.standing, found.standing, DEFAULT_EXACT_MARGIN)[0])):
            holder = found

    def keys(configs) -> set:
        return {estimator._key(config, mb) for config in configs for mb in estimator._sizes(config)}

    today = keys(config for level in predicted for config in planner.asks(level)
                 if not planner.states_over(planner.smallest(level)))
    lazy = keys(config for level in needed for config in planner.asks(level))
    return {"model": model, **keywords, "seconds": round(seconds, 1), "levels": len(levels),
            "states_over": over, "predicted_today": len(predicted), "needed": len(needed),
            "step_keys_today": len(today), "step_keys_needed": len(lazy),
            "choice_today": report.chosen.config.describe() if report.chosen else None,
            "choice_chain_lazy": holder.config.describe() if holder else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--out", type=Path, help="write the results there (JSON)")
    args = parser.parse_args()
    results = {"date": datetime.date.today().isoformat(), "commit": commit(ROOT),
               "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
               "python": platform.python_version(), "load_before": os.getloadavg(), "cases": {}}
    for name in args.cases.split(","):
        results["cases"][name] = measure(*CASES[name])
        print(name, json.dumps(results["cases"][name]), flush=True)
    results["load_after"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
