"""Every dry-run candidate's configuration and prediction, one line each, for diffing two checkouts.

    AUTOFIT_CACHE=/tmp/a PYTHONPATH=/path/to/checkout-a python scripts/dry_run_predictions.py > a.txt
    AUTOFIT_CACHE=/tmp/b PYTHONPATH=/path/to/checkout-b python scripts/dry_run_predictions.py > b.txt
    diff a.txt b.txt                        # empty: the same predictions

A line holds the case, the configuration, the predicted peak and need (bytes), whether it fits, the predicted
seconds per step, the breakdown (bytes), whether it was simulated, its error bound, the offloaded activations
(bytes) and the kernels counted. Give each checkout its own AUTOFIT_CACHE, or the second reads the first's
simulations. Cases (all by default): gpt2 (GPT-2 small, 256 tokens, global batch 8, A100 40 GB), llama (a
4-layer Llama-2 at width 512, 128 tokens, batch 4), llama8 (the same on 8 A100s, batch 16), qwen (Qwen2.5-0.5B
at 3 layers on a T4: fp16); all with allow="lora,numerics". Named only (minutes each on 2 cores): gpt2-1024
(GPT-2 small at 1,024 tokens, global batch 64, one H100), llama-2-7b (4,096 tokens, global batch 64, one H100),
llama-2-70b (8 A100 80 GB, micro-batches 1..64), as `autofit dry-run` plans them by default.
"""

from __future__ import annotations

import sys

import autofit
from autofit.models.presets import get_preset

CASES = ("gpt2", "llama", "llama8", "qwen")
LARGE = ("gpt2-1024", "llama-2-7b", "llama-2-70b")  # run when named


def show(name: str, report: autofit.DryRunReport) -> None:
    """Print `report`'s candidates sorted by configuration, then its choice."""
    for c in sorted(report.candidates, key=lambda c: c.config.describe()):
        e = c.estimate
        print(name, c.config.describe(), e.peak_bytes, e.need_bytes, c.fits, f"{c.step_seconds:.6g}",
              e.breakdown.to_dict(), e.simulated, e.error_bound, e.offloaded_activations, e.kernels, sep=" | ")
    print(name, "chosen:", report.chosen.config.describe() if report.chosen else None)


def small_llama():
    """Llama-2's architecture at 4 layers of width 512 (8 heads, an 8,000-token vocabulary)."""
    cfg = get_preset("llama-2-7b")
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads = 4, 512, 1376, 8
    cfg.num_key_value_heads, cfg.vocab_size = 8, 8000
    return cfg


def main(argv: list[str]) -> int:
    which = argv or list(CASES)
    unknown = sorted(set(which) - set(CASES) - set(LARGE))
    if unknown:
        print(f"unknown cases {unknown}; choose from {', '.join(CASES + LARGE)}", file=sys.stderr)
        return 2
    allow = "lora,numerics"
    if "gpt2" in which:
        show("gpt2", autofit.dry_run("gpt2", seq_len=256, global_batch_size=8, gpu="a100-40gb", allow=allow))
    if "llama" in which:
        show("llama", autofit.dry_run(small_llama(), seq_len=128, global_batch_size=4, gpu="a100-40gb", allow=allow))
    if "llama8" in which:
        show("llama8", autofit.dry_run(small_llama(), seq_len=256, global_batch_size=16, gpu="8xa100-40gb",
                                       allow=allow))
    if "qwen" in which:
        cfg = get_preset("qwen2.5-0.5b")
        cfg.num_hidden_layers = 3
        show("qwen", autofit.dry_run(cfg, seq_len=128, global_batch_size=4, gpu="t4-16gb", allow=allow))
    if "gpt2-1024" in which:
        show("gpt2-1024", autofit.dry_run("gpt2", seq_len=1024, global_batch_size=64, gpu="h100"))
    if "llama-2-7b" in which:
        show("llama-2-7b", autofit.dry_run("llama-2-7b", seq_len=4096, global_batch_size=64, gpu="h100"))
    if "llama-2-70b" in which:
        show("llama-2-70b", autofit.dry_run("llama-2-70b", gpu="a100-80gb", num_gpus=8))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
