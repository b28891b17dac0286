"""Estimate: how far a predicted peak may be trusted, measured, and so how far over a limit a candidate
may be predicted before the tuner skips it without a probe."""

from __future__ import annotations

import torch

from autofit.config import Config, Engine


# Relative error allowed to a predicted peak before it prunes a candidate: the estimator's measured
# worst over-prediction (a prune is wrong only when the true peak is lower than predicted).
# CPU: worst error against the CPU budget's measured peak 4.1% over 24 points (under-predicted; the worst
# over-prediction is 0.9%): bench/results/estimate-cpu-2026-11-22.json.
# CUDA: against 40 published GPU training peaks (bench/calibration/results/calibration.json, like compared
# with like: allocated vs reserved, each simulated with the code its source ran), the worst
# over-prediction of a run without a sharding engine is +1.3% (25 rows, litgpt's resource-table QLoRA row;
# with FSDP1's, +6.5%, which ENGINE_TOLERANCE covers; litgpt's config-hub QLoRA rows, +1.5% .. +6.4%, are
# left out: each is the upper bound of a batch order the source does not give, with old bitsandbytes' kept
# inputs); against 40 peaks measured on an H100 (2026-11-27) and predicted without CUDA, as a dry-run
# predicts (bench/results/estimate-replay-estimate-cuda-2026-11-27-2026-11-27.json), +3.1%, and the same
# configurations measured on an H200 that day, +3.1% (bench/results/estimate-cuda-h200-2026-11-27.json). So a candidate
# predicted more than 5% over the limit is skipped. The estimator still under-predicts some published runs
# (median |error| 1.2%, down to -20%: reserved figures, FSDP1's the most) and the H100's/H200's by up to -6.7%
# (the allocator's reserve at full depth, replayed from two blocks): an under-prediction never prunes,
# it makes a probe that runs out of memory, which the tuner records and steps back from.
PREDICTION_TOLERANCE = {"cpu": 0.05, "cuda": 0.05}

# The activation formula's worst under-prediction of the simulated activations (simulated / formula),
# over preset models x sequence lengths x checkpointing, per target: bench/calibration/formula_bound.py,
# results in bench/calibration/results/formula-bound.json (2026-11-26: CPU x4.05, CUDA x2.52, both T5-small
# at 512 tokens; the CPU keeps dropout noise in the activations' dtype, CUDA a one-byte mask). A peak
# resting on the formula is reported with this bound.
FORMULA_UNDER_PREDICTION = {"cpu": 4.1, "cuda": 2.6}


# Several ranks with an engine (ZeRO, FSDP2) on CPU ranks: measured against probes on 2 and 4 CPU ranks of
# three models (issue 12's note, docs/heavy-rungs.md, bench/results/sharded-cpu-*.json); see ENGINE_TOLERANCE.
ENGINE_TOLERANCE = {"cpu": 0.10, "cuda": 0.25}


def tolerance_for(device: torch.device, config: Config | None = None) -> float:
    """The estimator's measured relative error on `device`'s kind (see PREDICTION_TOLERANCE), for
    `config` when given: configs with a sharding engine have their own (ENGINE_TOLERANCE)."""
    if config is not None and config.engine is not Engine.TORCH:
        return ENGINE_TOLERANCE.get(device.type, 0.25)
    return PREDICTION_TOLERANCE.get(device.type, 0.25)
