"""What returning a probe's memory costs: the garbage collection after each probe, looking only at what the
probe made (autofit's, `autofit.probe.oom.collecting_new_objects`) against a full collection of the process.

    python bench/measurements/probe_release.py

A process that imported transformers and built one of its models (as a notebook has) runs probes of a
small MLP on the CPU, taking turns: a probe as autofit runs it, then the same probe with every object of
the process looked at (the freeze replaced by nothing), for fitting probes and for probes that run out of
the CPU budget. The figures are medians of the wall time per probe, side by side in one run, and their ratio.

Backs: autofit/probe/oom.py's `collecting_new_objects` (a small MLP's probe 0.03 s against 0.40 s) and
README.md's probe release figures (0.002 s against 0.36 s for a probe that runs out of the budget).
Results: bench/results/probe-release-<date>.json: probe-release-2026-11-28.json."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench and autofit import

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autofit.probe.run as probe_run  # noqa: E402
from autofit import Config  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import default_strategies  # noqa: E402
from bench import RESULTS  # noqa: E402
from bench.run import device_name, versions  # noqa: E402


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 64), torch.randint(0, 10, (n,))


def loss_fn(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch[1])


def a_users_process() -> nn.Module:
    """What a notebook holds beside the probes: transformers imported and a GPT-2 model built."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4))


def timed(spec, config, strategies, full: bool) -> float:
    """Seconds of one probe; `full`: its release collects the whole process, as before the freeze."""
    kept = probe_run.collecting_new_objects
    if full:
        probe_run.collecting_new_objects = contextlib.nullcontext
    try:
        started = time.perf_counter()
        probe_run.run_probe(spec, config, strategies)
        return time.perf_counter() - started
    finally:
        probe_run.collecting_new_objects = kept


def side_by_side(kind: str, budget: str, strategies: list, pairs: int) -> dict:
    """`pairs` probes of the MLP under `budget` as autofit runs them and as many with a full collection,
    taking turns; their medians and ratio."""
    spec = make_spec(make_mlp, make_batch, global_batch_size=8, device="cpu", memory_budget=budget,
                     loss_fn=loss_fn, warmup_steps=1, timed_steps=1)
    config = Config(micro_batch_size=8)
    timed(spec, config, strategies, full=False)  # warm: the first probe of a process settles
    ours, full = [], []
    for _ in range(pairs):
        ours.append(timed(spec, config, strategies, full=False))
        full.append(timed(spec, config, strategies, full=True))
    ours_s, full_s = statistics.median(ours), statistics.median(full)
    row = {"probe": kind, "budget": budget, "pairs": pairs, "autofit_s_median": ours_s,
           "full_collection_s_median": full_s, "ratio": ours_s / full_s}
    print(f"{kind:5s} autofit's {row['autofit_s_median']:.4f} s  full collection "
          f"{row['full_collection_s_median']:.4f} s  ratio {row['ratio']:.3f}", file=sys.stderr)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15, help="(autofit's, full collection) probe pairs per kind")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started, load_before = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()
    held = a_users_process()
    strategies = default_strategies()
    rows = [side_by_side(kind, budget, strategies, args.pairs)
            for kind, budget in (("fits", "1GiB"), ("oom", "256KiB"))]
    record = {"benchmark": "probe-release", "device": device_name(False), "date": started.date().isoformat(),
              "started": started.isoformat(timespec="seconds"), "load_before_after": [load_before, os.getloadavg()],
              "objects_tracked": len(gc.get_objects()),
              "held_model_parameters": sum(p.numel() for p in held.parameters()),
              "clock": "time.perf_counter (wall)", "versions": versions(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"probe-release-{record['date']}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(args.out / f"probe-release-{record['date']}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
