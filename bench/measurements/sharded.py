"""Sharded scenarios on CPU ranks over gloo: autofit against exhaustive search, and the estimator's error.

    python bench/measurements/sharded.py                      # the suite (~25 min on 2 busy cores)
    python bench/measurements/sharded.py --only gpt2-1.3M@2x85%
    python bench/measurements/sharded.py --reestimate bench/results/sharded-cpu-<date>.json
        # the estimator's error again over the same probes (none run again)
    python bench/measurements/sharded.py --autofit-only   # autofit's probes alone (~3 min)

Each scenario is a GPT-2 whose exact fp32 training (`allow=0`) under plain data parallelism needs 16
bytes per parameter on each rank (weights 4, gradients 4, AdamW 8), with a per-rank budget that is a
fraction of that, so only sharding (ZeRO or FSDP2, both searched) can fit. Reported per scenario:
- autofit's choice, its probes and tuning time;
- the exhaustive search (every candidate of the same space, probed the same way, in launched ranks):
  its best fit and its time. Decision quality = autofit's throughput / the oracle's, as probed (one
  probe each; not re-measured back to back as bench/run.py does, so CPU noise of a few percent remains);
  cost = autofit's time / the exhaustive time;
- the estimator's error: predicted / measured per-rank peak - 1 for every candidate that ran its steps
  (fits, and OOMs inside the safety margin, whose peak is complete; an OOM stopped by the budget
  measured only a lower bound and is left out).

Backs: `ENGINE_TOLERANCE` in autofit/estimate/tolerance.py (the estimator's per-rank error on CPU ranks
with ZeRO and FSDP2, bench/README.md#engine-tolerance).
Results: bench/results/sharded-cpu-<date>.json: sharded-cpu-2026-12-06.json; --autofit-only:
sharded-autofit-cpu-2026-12-06.json,
sharded-autofit-cpu-2026-12-06-4622c96.json."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench and autofit import

import autofit  # noqa: E402
from autofit.estimate.estimator import Estimator  # noqa: E402
from autofit.estimate.tolerance import tolerance_for  # noqa: E402
from autofit.probe.outcome import ProbeStatus  # noqa: E402
from autofit.batches.synthetic_batches import TokenBatches  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import default_strategies  # noqa: E402
from bench import RESULTS  # noqa: E402
from bench.suite.oracle import exhaustive  # noqa: E402
from bench.suite.scenarios import make_gpt2  # noqa: E402

BYTES_PER_PARAM = 16  # exact fp32 data parallelism per rank: weights 4 + gradients 4 + AdamW 8


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A GPT-2 (n_layer, n_embd, n_head, vocab, positions) trained on `ranks` CPU ranks at `seq_len` tokens,
    with a per-rank budget of `fraction` x 16 bytes per parameter."""

    name: str
    gpt2: tuple[int, int, int, int, int]
    seq_len: int
    global_batch_size: int
    ranks: int
    fraction: float

    def factory(self) -> Any:
        """The model factory (module-level, seeded)."""
        return functools.partial(make_gpt2, *self.gpt2)

    def kwargs(self, num_params: int) -> dict[str, Any]:
        """`autofit.autofit`'s keyword arguments for this scenario."""
        return dict(global_batch_size=self.global_batch_size, device="cpu", num_gpus=self.ranks, allow=0,
                    memory_budget=int(self.fraction * BYTES_PER_PARAM * num_params), warmup_steps=2, timed_steps=1)


# The proportions (16.9M parameters, 15% of them in the embedding) are in tests/search/test_sharded.py;
# here a model small enough that the exhaustive search ends within minutes.
SCENARIOS = [Sharded("gpt2-1.3M@2x85%", (6, 128, 4, 512, 64), 32, 4, 2, 0.85)]


def run(scenario: Sharded, exhaustive_search: bool = True) -> dict[str, Any]:
    """autofit, the exhaustive search and the estimator's error for `scenario`, as a JSON-ready dict
    (`exhaustive_search=False`: autofit's part alone, with every probe it ran)."""
    factory, batches = scenario.factory(), TokenBatches(scenario.gpt2[3], scenario.seq_len)
    num_params = sum(p.numel() for p in factory().parameters())
    kwargs = scenario.kwargs(num_params)
    start = time.perf_counter()
    plan = autofit.autofit(factory, batches, **kwargs)
    autofit_s = time.perf_counter() - start
    if not exhaustive_search:
        return dict(name=scenario.name, num_params=num_params, ranks=scenario.ranks,
                    budget_bytes=kwargs["memory_budget"], autofit=dict(
                        config=plan.config.describe() if plan.fits else None, fits=plan.fits,
                        probes_run=plan.probes_run, wall_s=autofit_s, samples_per_s=plan.throughput,
                        peak_bytes=plan.peak_memory, reason=plan.reason,
                        probed=[dict(config=p.config.describe(), status=p.status.value, peak_bytes=p.peak_bytes,
                                     samples_per_s=p.samples_per_s) for p in plan.probes if p.source.value == "probed"]))
    spec = make_spec(factory, batches, **kwargs)
    oracle = exhaustive(spec, default_strategies())
    best = oracle.best
    estimator = Estimator(spec)
    errors = [_error(estimator, r.config, r.status.value, r.peak_bytes, r.rank_peaks) for r in oracle.results
              if r.status is ProbeStatus.FIT or (r.status is ProbeStatus.OOM and r.oom_kind == "margin")]
    quality = plan.throughput / best.samples_per_s if plan.fits and best else None
    return dict(
        name=scenario.name, num_params=num_params, ranks=scenario.ranks, budget_bytes=kwargs["memory_budget"],
        fit_limit_bytes=spec.fit_limit, autofit=dict(config=plan.config.describe() if plan.fits else None,
                                                     fits=plan.fits, probes_run=plan.probes_run, wall_s=autofit_s,
                                                     samples_per_s=plan.throughput, peak_bytes=plan.peak_memory,
                                                     peak_rank=plan.peak_rank),
        exhaustive=dict(candidates=len(oracle.results), counts=oracle.counts(), wall_s=oracle.wall_s,
                        best=best.config.describe() if best else None,
                        best_samples_per_s=best.samples_per_s if best else None),
        decision_quality=quality, cost_ratio=autofit_s / oracle.wall_s,
        estimator=dict(points=errors, worst=max((abs(e["relative_error"]) for e in errors), default=None),
                       tolerance=tolerance_for(spec.device, best.config if best else None)))


def _error(estimator: Estimator, config: Any, status: str, measured: int, rank_peaks: Any) -> dict[str, Any]:
    predicted = estimator.predict(config).peak_bytes
    return dict(config=config.describe(), status=status, measured_bytes=measured, rank_peaks=list(rank_peaks),
                predicted_bytes=predicted, relative_error=predicted / measured - 1)


def reestimate(path: Path) -> None:
    """Recompute the estimator's predictions in a results file against its measured peaks (the probes
    are not run again); the file records when."""
    from autofit.search.space import build_space

    record = json.loads(path.read_text())
    for out in record["scenarios"]:
        scenario = next(s for s in SCENARIOS if s.name == out["name"])
        spec = make_spec(scenario.factory(), TokenBatches(scenario.gpt2[3], scenario.seq_len),
                         **scenario.kwargs(out["num_params"]))
        space = build_space(spec, default_strategies())
        by_name = {space.at(level, size).describe(): space.at(level, size) for level in space.levels() for size in space.sizes}
        estimator = Estimator(spec)
        points = [_error(estimator, by_name[p["config"]], p["status"], p["measured_bytes"], p["rank_peaks"])
                  for p in out["estimator"]["points"]]
        out["estimator"].update(points=points, worst=max((abs(p["relative_error"]) for p in points), default=None),
                                reestimated=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    path.write_text(json.dumps(record, indent=2) + "\n")


def _versions() -> dict[str, str | None]:
    import importlib.metadata

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {name: version(name) for name in ("torch", "deepspeed", "transformers", "autofit")}


def main(argv: list[str] | None = None) -> int:
    """Run the sharded scenarios; write bench/results/sharded-cpu-<date>.json; print a summary line each."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], help="run only the scenario of this name")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--reestimate", type=Path, help="recompute the predictions of a results file, probing nothing")
    parser.add_argument("--autofit-only", action="store_true",
                        help="autofit's choice and probes alone, no exhaustive search (sharded-autofit-cpu-<date>.json)")
    args = parser.parse_args(argv)
    if args.reestimate:
        reestimate(args.reestimate)
        return 0
    from bench.run import device_name

    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    started = datetime.datetime.now(datetime.timezone.utc)
    record: dict[str, Any] = dict(device=device_name(False), started=started.isoformat(timespec="seconds"),
                                  command="python bench/measurements/sharded.py " + " ".join(argv or sys.argv[1:]),
                                  load_before=os.getloadavg(), versions=_versions(), scenarios=[])
    for scenario in chosen:
        out = run(scenario, not args.autofit_only)
        record["scenarios"].append(out)
        if args.autofit_only:
            print(f"{out['name']}: autofit {out['autofit']['config']} in {out['autofit']['probes_run']} probes "
                  f"({out['autofit']['wall_s']:.0f} s)", flush=True)
            continue
        print(f"{out['name']}: autofit {out['autofit']['config']} in {out['autofit']['probes_run']} probes "
              f"({out['autofit']['wall_s']:.0f} s); exhaustive {out['exhaustive']['best']} "
              f"({out['exhaustive']['wall_s']:.0f} s, {out['exhaustive']['candidates']} candidates); "
              f"quality {out['decision_quality']}, cost {out['cost_ratio']:.2f}, "
              f"estimator worst {out['estimator']['worst']}", flush=True)
    record["load_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sharded-{'autofit-' if args.autofit_only else ''}cpu-{started.date().isoformat()}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
