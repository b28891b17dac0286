"""An experiment on the estimator's allocator model: how much of the caching allocator's reserve above its
allocated bytes, measured on an H100, does a replay of whole training steps at the model's full depth
explain, against the estimator's replay of the same history at the one and two blocks it simulates?

    python bench/measurements/allocator_steps.py            # ~1 min on 2 cores
    python bench/measurements/allocator_steps.py --depths   # one configuration replayed at 2 .. 12 blocks

Training reserves after its history: the weights are placed first, each step's gradients stay until the
optimizer step, AdamW's states are made at the first step and a foreach temporary per weight at every
step, in the blocks the activations freed, so the next step's activations take new segments
(`autofit.estimate.cuda.allocator.replay_training`). The estimator replays that history on its one- and
two-block simulations (`autofit.estimate.simulation.step`) and carries the two-block figure to the whole
depth; here each configuration is simulated at its full depth (CPU kernels standing in for CUDA), its
events replayed the same way, and both compared with `max_memory_reserved - max_memory_allocated` as the
H100 measured it (bench/results/estimate-cuda-2026-11-27-parts.json). `--depths` replays one of those
configurations (GPT-2 small, fp32, full checkpointing, micro-batch 4) with its model cut to each depth of
`DEPTHS`: the reserve against depth, which a line through two depths would not give.

Backs: bench/README.md#allocator-steps and #allocator-history, cited by autofit/estimate/simulation/deepen.py
(the reserve is not linear in depth, so the two blocks' events are repeated to the whole depth) and
autofit/estimate/cuda/allocator.py (`replay_training`: the history, not one step, sets the reserve).
Results: bench/results/allocator-steps-<date>.json and, with --depths, allocator-steps-depths-<date>.json:
allocator-steps-2026-11-27.json, allocator-steps-depths-2026-12-06.json; allocator-steps-2026-11-22.json,
the experiment's first form, replayed the 1.1B Llama's whole peaks against estimate-cuda-2026-11-22.json."""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench and autofit import

from autofit.config import Config  # noqa: E402
from autofit.estimate.simulation import step as simulate  # noqa: E402
from autofit.estimate.estimator import Estimator  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from bench.measurements.estimate_accuracy import GLOBAL_BATCH, model_named  # noqa: E402
from bench import RESULTS  # noqa: E402

MEASURED = RESULTS / "estimate-cuda-2026-11-27-parts.json"
MIB = 2**20
DEPTHS = (2, 4, 6, 8, 10, 12)  # blocks of GPT-2 small (12 in all) replayed with --depths
DEPTH_ROW = ("gpt2-124m", "fp32, attn=sdpa, ckpt=full, mb=4x1, opt=adamw")  # the measured row it replays


def full_depth_reserve(name: str, config: Config, depth: int | None = None) -> int:
    """Reserved minus allocated bytes (bytes) of training steps replayed at `name`'s full depth, or with its
    model cut to `depth` blocks."""
    from transformers import AutoModelForCausalLM

    model_config, _, seq_len = model_named(name)
    if depth is not None:
        model_config = copy.deepcopy(model_config)
        model_config.num_hidden_layers = depth
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    ids = torch.zeros(config.micro_batch_size, seq_len, dtype=torch.long)
    peak = simulate.simulate_step(model, {"input_ids": ids, "labels": ids}, lambda out, batch: out.loss, config,
                                  device="cpu", cuda_ampere=True)
    return peak.fragmentation


def by_depth() -> dict:
    """`DEPTH_ROW`'s configuration replayed at each of `DEPTHS`, beside its reserve measured at full depth."""
    row = next(r for r in json.loads(MEASURED.read_text())["rows"] if (r["model"], r["describe"]) == DEPTH_ROW)
    config, parts = Config.from_dict(row["config"]), row["measured_parts"]
    rows = []
    for depth in DEPTHS:
        rows.append({"blocks": depth, "replayed": full_depth_reserve(row["model"], config, depth)})
        print(f"{row['model']} {row['describe']} at {depth:2d} blocks: reserve {rows[-1]['replayed'] / MIB:6.0f} MiB",
              flush=True)
    return {"model": row["model"], "describe": row["describe"],
            "measured_at_full_depth": parts["max_reserved"] - parts["max_allocated"], "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", action="store_true", help="replay one configuration at each depth of DEPTHS")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    if args.depths:
        write("allocator-steps-depths", by_depth(), started)
        return
    rows, estimators = [], {}
    for row in json.loads(MEASURED.read_text())["rows"]:
        name, config = row["model"], Config.from_dict(row["config"])
        if name not in estimators:
            model, batch, seq_len = model_named(name)
            spec = make_spec(model, batch, seq_len=seq_len, global_batch_size=GLOBAL_BATCH, device="cpu",
                             memory_budget="1TiB")
            estimators[name] = Estimator(spec, target="cuda")
        parts = row["measured_parts"]
        measured = parts["max_reserved"] - parts["max_allocated"]
        estimated = dict(estimators[name].predict(config).terms)["fragmentation"]
        full = full_depth_reserve(name, config)
        rows.append({"model": name, "describe": row["describe"], "measured": measured, "full_depth": full,
                     "estimator": estimated, "measured_then_estimated": row["overhead_terms"]["fragmentation"]})
        print(f"{name:11s} {row['describe']:45s} reserve measured {measured / MIB:6.0f} MiB, full-depth replay "
              f"{full / MIB:6.0f}, estimator {estimated / MIB:6.0f} (one step alone {rows[-1]['measured_then_estimated'] / MIB:5.0f})",
              flush=True)
    write("allocator-steps", {"rows": rows}, started)


def write(kind: str, figures: dict, started: float) -> None:
    """bench/results/<kind>-<date>.json: what was measured against, the machine, the date and `figures`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    out = RESULTS / f"{kind}-{now.date().isoformat()}.json"
    out.write_text(json.dumps({"what": __doc__.splitlines()[0], "measured": MEASURED.name,
                               "date": now.isoformat(timespec="seconds"), "machine": platform.machine(),
                               "torch": torch.__version__, "seconds": round(time.perf_counter() - started, 1),
                               **figures}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
