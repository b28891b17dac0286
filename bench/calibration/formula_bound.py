"""How far the activation formula (the fallback when a step cannot be simulated) is from the simulation.

    python bench/calibration/formula_bound.py        # writes bench/calibration/results/formula-bound.json

For preset models x sequence lengths x precision x checkpointing x target (a CPU budget, a CUDA GPU),
the activations of one micro-batch are simulated under fake tensors (`Estimator.activations`) and
computed by `formula_activations`; the ratio simulated / formula is recorded. Its largest value per
target is `FORMULA_UNDER_PREDICTION` in autofit/estimate/tolerance.py: a peak that rests on the formula
is reported with that bound. Nothing is allocated and no GPU is needed (CPU kernels stand in for CUDA,
as in every dry-run here).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.config import Config  # noqa: E402
from autofit.estimate.estimator import Estimator, formula_activations  # noqa: E402
from autofit.batches.synthetic import max_positions  # noqa: E402
from autofit.models.presets import get_preset  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from bench.cli import no_options  # noqa: E402

MODELS = ("gpt2", "qwen2.5-0.5b", "llama-2-7b", "phi-2", "bert-base", "t5-small", "vit-base")
SEQ_LENS = (512, 2048)
TARGETS = ("cpu", "cuda")  # a CPU budget's own kernels; CUDA's, CPU kernels standing in as in a dry-run here
RESULT = Path(__file__).resolve().parent / "results" / "formula-bound.json"


def configs(fused: bool) -> list[Config]:
    """bf16 with and without full checkpointing, and fp32 without."""
    attention = "sdpa" if fused else "default"
    return [Config(precision="bf16", attention=attention), Config(precision="bf16", attention=attention,
                                                                  checkpointing="full"),
            Config(precision="fp32", attention=attention)]


def rows_for(name: str) -> list[dict]:
    """Simulated and formula activations of `name` at each sequence length and config."""
    rows = []
    hf = get_preset(name)
    lengths = sorted({min(s, max_positions(hf) or s) for s in SEQ_LENS}) if hasattr(hf, "vocab_size") else [None]
    for seq, target in ((seq, target) for seq in lengths for target in TARGETS):
        spec = make_spec(hf, seq_len=seq, device="cpu", memory_budget="1TiB")
        estimator = Estimator(spec, target=target)
        for config in configs(bool(spec.model.attention)):
            simulated = estimator.activations(config)[0].largest
            formula = formula_activations(spec.model.hf_config, estimator.facts, spec.tokens_per_sample, 1, config)
            rows.append({"model": name, "seq_len": seq, "target": target, "config": config.describe(),
                         "simulated_bytes": simulated, "formula_bytes": formula,
                         "simulated_over_formula": round(simulated / formula, 3)})
            print(f"{name:14} {seq or '-':>5} {target:4} {config.describe():40} x{simulated / formula:.2f}", flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    ratios = [row["simulated_over_formula"] for row in rows]
    return {"points": len(rows), "median": statistics.median(ratios), "worst_under": max(ratios),
            "worst_over": min(ratios)}


def main() -> None:
    no_options(__doc__)
    torch.set_num_threads(1)
    started = time.time()
    rows = [row for name in MODELS for row in rows_for(name)]
    summaries = {target: summary([row for row in rows if row["target"] == target]) for target in TARGETS}
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps({
        "what": "activations of one micro-batch: simulated under fake tensors / formula_activations",
        "date": datetime.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores", "load_at_start": os.getloadavg()[0], "torch": torch.__version__,
        "seconds": round(time.time() - started), "summary": summaries, "rows": rows}, indent=1) + "\n")
    for target, numbers in summaries.items():
        print(f"{target}: {numbers['points']} points, simulated / formula median {numbers['median']:.2f}, worst "
              f"under-prediction x{numbers['worst_under']:.2f}, worst over-prediction x{numbers['worst_over']:.2f}")
    print(f"-> {RESULT}")


if __name__ == "__main__":
    main()
