"""Benchmark harness and the measurements behind autofit's published figures (bench/README.md).

- `bench/run.py`, `bench/suite/`: the benchmark suite: autofit against exhaustive search and the
  batch-size finders people use today (`python bench/run.py` on the CPU, `--gpu` on a card).
- `bench/measurements/`: standalone measurements, each backing a claim its docstring names.
- `bench/calibration/`: the estimator against published GPU training peaks, and its experiments.
- `bench/diag/`: one-off diagnostics; they print, and write no results file.
- `bench/results/`: the committed results files (`RESULTS`); `bench/gpu_session.sh` runs a lent GPU's share.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository's root (autofit/, examples/, tests/)
RESULTS = Path(__file__).resolve().parent / "results"  # bench/results: every script's default output folder
