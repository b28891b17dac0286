"""What the OOM guard costs on a step that does not run out of memory, against the bare loop.

    python bench/guard_overhead.py                  # CPU; writes bench/results/guard-overhead-cpu-<date>.json
    python bench/guard_overhead.py --device cuda    # a GPU (device synchronised around every timed step)

Both loops do the same work per step: forward and backward over the same micro-batches with the same
sample weights, then AdamW's step. They run side by side in one process on twin models (same initial
weights), alternating step by step, so drift in the machine's load hits both alike. On the CPU the
clock is the thread's CPU time (torch on one thread), so other processes on a shared machine do not
count. The figure is the median over pairs of (guarded step time / bare step time) - 1; the target is
at most 1%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # `python bench/guard_overhead.py` from anywhere imports bench and autofit

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from autofit.guard import OomGuard  # noqa: E402
from bench.run import device_name, versions  # noqa: E402

# (name, width, depth, sequence length, samples per step, micro-batch, pairs / --pairs): "tiny" is a
# step of about a millisecond, where the guard's fixed cost per step and per micro-batch shows as
# much as it ever will; "small" and "medium" are steps of tens and hundreds of ms.
SCENARIOS = (("tiny", 16, 1, 4, 16, 4, 4.0), ("small", 64, 2, 32, 16, 4, 1.0), ("medium", 256, 4, 64, 16, 8, 0.3))


def make_model(width: int, depth: int, vocab: int = 512) -> nn.Module:
    blocks = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
              for _ in range(depth)]
    return nn.Sequential(nn.Embedding(vocab, width), *blocks, nn.Linear(width, vocab))


def loss_fn(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def bare_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, micro_batch: int) -> None:
    """The loop a user writes by hand: the same sample-weighted accumulation, no guard."""
    total = batch[0].shape[0]
    for start in range(0, total, micro_batch):
        chunk = (batch[0][start:start + micro_batch], batch[1][start:start + micro_batch])
        size = chunk[0].shape[0]
        (loss_fn(model(chunk[0]), chunk) * (size / total)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn, device: torch.device) -> float:
    """Seconds `fn` took. On the CPU (one thread) the calling thread's CPU time, which the other
    processes of a shared machine barely disturb; on CUDA wall time between device synchronisations."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def measure(scenario: tuple, device: torch.device, pairs: int, warmup: int) -> dict:
    name, width, depth, length, total, micro_batch, share = scenario
    pairs = max(int(pairs * share), 8)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = make_model(width, depth).to(device)
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4)))
    (bare_model, bare_opt), (guard_model, guard_opt) = models
    guard = OomGuard(guard_model, guard_opt, micro_batch_size=micro_batch, loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(0)
    bare_s, guard_s = [], []
    for index in range(warmup + pairs):
        ids = torch.randint(0, 512, (total, length + 1), generator=gen).to(device)
        batch = (ids[:, :-1], ids[:, 1:])
        runs = [("bare", lambda: bare_step(bare_model, bare_opt, batch, micro_batch)),
                ("guard", lambda: guard.step(batch))]
        for label, fn in runs if index % 2 == 0 else runs[::-1]:  # alternate which goes first
            seconds = timed(fn, device)
            if index >= warmup:
                (bare_s if label == "bare" else guard_s).append(seconds)
    ratios = sorted(g / b - 1 for g, b in zip(guard_s, bare_s))
    quartiles = statistics.quantiles(ratios, n=4)
    return {"scenario": name, "width": width, "depth": depth, "seq_len": length, "samples_per_step": total,
            "micro_batch": micro_batch, "pairs": pairs,
            "bare_step_ms_median": 1e3 * statistics.median(bare_s),
            "guard_step_ms_median": 1e3 * statistics.median(guard_s),
            "overhead_median": statistics.median(ratios), "overhead_p25": quartiles[0], "overhead_p75": quartiles[2],
            "overhead_of_medians": statistics.median(guard_s) / statistics.median(bare_s) - 1,
            "overhead_of_minimums": min(guard_s) / min(bare_s) - 1,  # the least disturbed step of each
            "guard_minus_bare_us_median": 1e6 * statistics.median(g - b for g, b in zip(guard_s, bare_s)),
            "recoveries": len(guard.recoveries)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pairs", type=int, default=100, help="timed (bare, guarded) step pairs (scaled per scenario)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads on the CPU")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    started, load_before = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()
    results = []
    for scenario in SCENARIOS:
        result = measure(scenario, device, args.pairs, args.warmup)
        results.append(result)
        print(f"{result['scenario']:7s} bare {result['bare_step_ms_median']:8.2f} ms  guard "
              f"{result['guard_step_ms_median']:8.2f} ms  overhead median {100 * result['overhead_median']:+.2f}% "
              f"(p25 {100 * result['overhead_p25']:+.2f}%, p75 {100 * result['overhead_p75']:+.2f}%), of minimums "
              f"{100 * result['overhead_of_minimums']:+.2f}%", file=sys.stderr)
    gpu = device.type == "cuda"
    header = {"benchmark": "guard-overhead", "device": device_name(gpu), "device_kind": device.type,
              "date": started.date().isoformat(), "started": started.isoformat(timespec="seconds"),
              "threads": args.threads if not gpu else None,
              "clock": "cuda-synchronised wall time" if gpu else "time.thread_time (CPU time of the calling thread)", "load_before_after": [load_before, os.getloadavg()],
              "versions": versions(), "target": "overhead <= 1% on a step without OOM", "scenarios": results}
    args.out.mkdir(parents=True, exist_ok=True)
    slug = "cpu" if not gpu else torch.cuda.get_device_name(device).lower().replace(" ", "-")
    path = args.out / f"guard-overhead-{slug}-{header['date']}.json"
    path.write_text(json.dumps(header, indent=2) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
