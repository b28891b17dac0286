"""Predicted vs measured peak memory: `autofit.estimate.estimator.predict_peak` against the probe's measured peak.

    python bench/measurements/estimate_accuracy.py            # CPU: the CPU budget's measured peak (anywhere)
    python bench/measurements/estimate_accuracy.py --device cuda          # a GPU: the CUDA allocator's peak
    python bench/measurements/estimate_accuracy.py --device cuda --large  # and a 1.1B Llama and GPT-2 small
    python bench/measurements/estimate_accuracy.py --device cuda --held-out   # only models no calibration used
    python bench/measurements/estimate_accuracy.py --against bench/results/estimate-cuda-2026-11-22.json
        # no probe: predict here (CPU kernels standing in for CUDA, as a dry-run does) the peaks a GPU
        # run measured, beside what that run's own estimator said

Grid: a few tiny models (Llama-style and GPT-2-style Hugging Face decoders, a plain PyTorch residual MLP)
x precision (fp32, bf16) x activation checkpointing (none, full) x micro-batch (with accumulation); the
large ones at 1,024 tokens. Each point is one real probe (`autofit.probe.run.run_probe`: warm-up and
timed optimizer steps under the budget) and one prediction; the error is predicted / measured - 1. On
CUDA each peak is also recorded in its parts (allocated, reserved, outside the allocator).

Backs: `PREDICTION_TOLERANCE` in autofit/estimate/tolerance.py (bench/README.md#tolerance), the CUDA
context term (#cuda-context), the math-backend attention (#cuda-attention) and the allocator's history
(#allocator-history); README.md's and docs/dry-run.md's accuracy figures.
Results: bench/results/estimate-<device>-<date>.json (the device as `cpu` or `cuda-h200`; the first H100
runs wrote estimate-cuda-<date>.json), estimate-held-out-cuda-<card>-<date>.json with --held-out, and
with --against estimate-replay[-extrapolated]-<recorded>-<date>.json: estimate-cpu-2026-11-22.json,
estimate-cuda-2026-11-22.json, estimate-cuda-2026-11-27.json (and -parts), estimate-cuda-h200-2026-11-27.json,
estimate-held-out-cuda-h200-2026-11-27.json and their estimate-replay-*.json."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench and autofit import

from autofit.config import Config  # noqa: E402
from autofit.devices.device import describe  # noqa: E402
from autofit.estimate.estimator import Estimator, predict_peak  # noqa: E402
from autofit.probe.run import run_probe  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import default_strategies  # noqa: E402
from bench import RESULTS  # noqa: E402
from bench.suite.report import results_path  # noqa: E402

GLOBAL_BATCH = 4


class Block(nn.Module):
    """Residual MLP block."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class ResidualMLP(nn.Module):
    """A plain model (no Hugging Face): blocks in an nn.ModuleList, forward(x, y) returns the loss."""

    def __init__(self, width: int = 128, depth: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).mean(1), y)


def mlp_batch(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, 64, 128, generator=gen), "y": torch.randint(0, 10, (n,), generator=gen)}


def models(large: bool = False, held_out: bool = False) -> dict[str, tuple]:
    """name -> (model, batch, seq_len): tiny models, each simulated in full (no depth extrapolation), and
    with `large` a TinyLlama-sized one (1.1B: 22 layers, hidden 2048, GQA 4 heads of 32), whose depth is
    extrapolated as the dry-run does. `held_out`: only the models no calibration of the estimator has used
    (`held_out_models`)."""
    from transformers import GPT2Config, LlamaConfig

    if held_out:
        return held_out_models()
    llama = LlamaConfig(vocab_size=2000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=1024)
    gpt2 = GPT2Config(vocab_size=2000, n_embd=128, n_layer=4, n_head=4, n_positions=1024, eos_token_id=0,
                      bos_token_id=0)
    tiny = {"tiny-llama": (llama, None, 128), "tiny-gpt2": (gpt2, None, 128),
            "residual-mlp": (ResidualMLP, mlp_batch, None)}
    if not large:
        return tiny
    llama_1b = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    # GPT-2 small as transformers builds it: dropout 0.1 everywhere and gelu_new, what CUDA's dropout mask
    # and autocast's fp32 ops change (autofit/estimate/cuda/dropout.py, cuda_autocast.py) at full size
    return {**tiny, "llama-1.1b": (llama_1b, None, 1024), "gpt2-124m": (GPT2Config(), None, 1024)}


def held_out_models() -> dict[str, tuple]:
    """Models kept out of the estimator's calibration, their peaks measured after the estimator was fixed
    (commit in the results file): GPT-2 medium (24 layers, hidden 1,024) and a Qwen2-0.5B-sized decoder
    (24 layers, hidden 896, GQA 14 heads on 2, a 151,936-token vocabulary, tied embeddings, biased q/k/v),
    both at 1,024 tokens."""
    from transformers import GPT2Config, Qwen2Config

    qwen2 = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                        max_position_embeddings=1024)
    return {"gpt2-355m": (GPT2Config(n_embd=1024, n_layer=24, n_head=16), None, 1024),
            "qwen2-0.5b": (qwen2, None, 1024)}


def model_named(name: str) -> tuple:
    """(model, batch, seq_len) of any model this bench knows, for replaying a recorded row."""
    return {**models(large=True), **held_out_models()}[name]


def configs(hf: bool) -> list[Config]:
    attention = "sdpa" if hf else "default"
    grid = []
    for precision in ("fp32", "bf16"):
        for checkpointing in ("none", "full"):
            for micro in (GLOBAL_BATCH, 1):
                grid.append(Config(precision=precision, attention=attention, checkpointing=checkpointing,
                                   micro_batch_size=micro, grad_accum_steps=GLOBAL_BATCH // micro))
    return grid


def measured_parts(device: str) -> dict[str, int]:
    """The last probe's peak in its parts on CUDA: the caching allocator's most allocated and most reserved
    bytes, and what this process holds beyond the allocator (context, workspaces), with how it was measured."""
    if not device.startswith("cuda"):
        return {}
    from autofit.devices.memory import accounting, outside_allocator

    where = torch.device(device)
    return {"max_allocated": torch.cuda.max_memory_allocated(where), "max_reserved": torch.cuda.max_memory_reserved(where),
            "outside_allocator": outside_allocator(where), "accounting": accounting(where)}


def measure(device: str, large: bool = False, only: list[str] | None = None, held_out: bool = False) -> list[dict]:
    rows = []
    for name, (model, batch, seq_len) in models(large, held_out).items():
        if only and name not in only:
            continue
        spec = make_spec(model, batch, seq_len=seq_len, global_batch_size=GLOBAL_BATCH, device=device,
                         memory_budget="16GiB" if device == "cpu" else None, warmup_steps=1, timed_steps=1)
        for config in configs(spec.model.is_hf):
            started = time.perf_counter()
            predicted = predict_peak(spec, config)
            predict_s = time.perf_counter() - started
            measured = run_probe(spec, config, default_strategies())
            if not measured.fits or not measured.peak_bytes:
                print(f"skip {name} {config.describe()}: {measured.reason}", file=sys.stderr)
                continue
            error = predicted.peak_bytes / measured.peak_bytes - 1
            rows.append({"model": name, "config": config.to_dict(), "describe": config.describe(),
                         "predicted_bytes": predicted.peak_bytes, "measured_bytes": measured.peak_bytes,
                         "error": round(error, 5), "predict_seconds": round(predict_s, 3),
                         "breakdown": predicted.breakdown.to_dict(), "overhead_terms": dict(predicted.terms),
                         "measured_parts": measured_parts(device), "reason": predicted.reason})
            print(f"{name:13s} {config.describe():45s} predicted {predicted.peak_bytes / 2**20:9.2f} MiB "
                  f"measured {measured.peak_bytes / 2**20:9.2f} MiB  error {error:+.2%}", file=sys.stderr)
    return rows


def replay(recorded: dict, extrapolate_batch: bool = False) -> list[dict]:
    """The rows of a recorded GPU run (`measure` on CUDA) predicted again here, without probing, for a CUDA
    target: on a machine without CUDA the dry-run's case, CPU kernels standing in; with
    `extrapolate_batch`, micro-batches above 2 read on the line through 1 and 2, as the dry-run reads them."""
    estimators: dict[str, Estimator] = {}
    rows = []
    for row in recorded["rows"]:
        if row["model"] not in estimators:
            model, batch, seq_len = model_named(row["model"])
            spec = make_spec(model, batch, seq_len=seq_len, global_batch_size=GLOBAL_BATCH, device="cpu",
                             memory_budget="1TiB")
            estimators[row["model"]] = Estimator(spec, target="cuda", extrapolate_batch=extrapolate_batch)
        estimate = estimators[row["model"]].predict(Config.from_dict(row["config"]))
        error = estimate.peak_bytes / row["measured_bytes"] - 1
        rows.append({"model": row["model"], "describe": row["describe"], "measured_bytes": row["measured_bytes"],
                     "predicted_bytes": estimate.peak_bytes, "error": round(error, 5),
                     "predicted_by_the_run": row["predicted_bytes"], "error_of_the_run": row["error"],
                     "reason": estimate.reason})
        print(f"{row['model']:13s} {row['describe']:45s} measured {row['measured_bytes'] / 2**30:7.2f} GiB, predicted "
              f"here {estimate.peak_bytes / 2**30:7.2f} GiB {error:+.1%} (by the run {row['error']:+.1%})", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--large", action="store_true", help="add a 1.1B Llama and GPT-2 small at 1,024 tokens "
                        "(a GPU's worth)")
    parser.add_argument("--held-out", action="store_true", help="only the models no calibration used (GPT-2 "
                        "medium, a Qwen2-0.5B-sized decoder): results-file name estimate-held-out-...")
    parser.add_argument("--only", action="append", help="measure only this model (repeatable)")
    parser.add_argument("--against", type=Path, help="a recorded GPU run's results: predict its rows here, no probe")
    parser.add_argument("--extrapolate-batch", action="store_true",
                        help="with --against: micro-batches above 2 extrapolated from 1 and 2, as the dry-run does")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    if args.against:
        return write_replay(args.against, started, args.extrapolate_batch)
    rows = measure(args.device, args.large, args.only, args.held_out)
    errors = [abs(r["error"]) for r in rows]
    now = datetime.datetime.now(datetime.timezone.utc)
    device = torch.device(args.device)
    result = {"device": describe(device), "device_type": device.type, "date": now.isoformat(timespec="seconds"),
              "torch": torch.__version__, "python": platform.python_version(), "points": len(rows),
              "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
              "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    path = results_path("estimate-held-out" if args.held_out else "estimate", device)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(rows)} points on {result['device']}: median |error| {result['median_abs_error']:.2%}, "
          f"worst {result['worst_abs_error']:.2%} -> {path}")


def write_replay(path: Path, started: float, extrapolate_batch: bool = False) -> None:
    recorded = json.loads(path.read_text())
    rows = replay(recorded, extrapolate_batch)
    errors = [r["error"] for r in rows]
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"what": "peaks measured on a GPU, predicted on this machine without probing (a dry-run's estimate"
                      + (", micro-batches above 2 extrapolated from 1 and 2)" if extrapolate_batch else ")"),
              "measured": {"file": path.name, "device": recorded["device"], "torch": recorded["torch"],
                           "date": recorded["date"]},
              "machine": f"{platform.machine()}, {describe(torch.device('cpu'))}", "torch": torch.__version__,
              "cuda_here": torch.cuda.is_available(), "date": now.isoformat(timespec="seconds"),
              "median_abs_error": statistics.median(abs(e) for e in errors), "worst_abs_error": max(map(abs, errors)),
              "largest_under": min(min(errors), 0.0), "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    how = "-extrapolated" if extrapolate_batch else ""
    out = RESULTS / f"estimate-replay{how}-{path.stem}-{now.date().isoformat()}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(rows)} measured peaks predicted here: median |error| {result['median_abs_error']:.2%}, worst "
          f"{result['worst_abs_error']:.2%}, largest under-prediction {result['largest_under']:.2%} -> {out}")


if __name__ == "__main__":
    main()
