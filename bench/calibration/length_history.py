"""An experiment: torchtune's reserved rows replayed after a history of shorter batches.

    python bench/calibration/length_history.py    # ~6 min on 2 cores; writes results/length-history.json

The calibration replays one step through the model of the CUDA caching allocator from an empty cache.
torchtune's tutorial runs trained on Alpaca-cleaned, each batch padded to its longest sample up to 512
tokens (the rows' notes), so every step allocated other sizes, and the reserved peak the recipe logs is
that of the whole run: blocks cached by earlier, shorter steps are reused only where they are large
enough, and the longest step takes new segments beside them. Here each row's step is simulated at full
depth at several lengths, recorded allocation by allocation (`fsdp1_wrap.recorded_step`), and replayed
through one allocator: `HISTORY` steps at lengths drawn from `LENGTHS` (seeded), then the row's own. A
row's prediction swaps the estimator's fragmentation term for what that replay reserves beyond what it
allocates. The batches' real lengths and order are not published, so this shows how far a history can
move the figure, not which history ran; not part of the calibration's headline (README.md). Left out:
the optimizer's states and the adapters' gradients between steps (bf16 LoRA: tens of MB).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.estimate.cuda.allocator import CachingAllocator  # noqa: E402
from bench.calibration.fsdp1_wrap import held_beyond, recorded_step, replay, step_events  # noqa: E402
from bench.cli import no_options  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "length-history.json"
LENGTHS = tuple(range(96, 512, 32))  # tokens of the shorter batches a history draws from
HISTORY = 8  # steps before the longest one
SEEDS = range(5)


def history(seed: int) -> list[int]:
    """`HISTORY` batch lengths drawn from `LENGTHS`, the same for every row with the same seed."""
    draw = random.Random(seed)
    return [draw.choice(LENGTHS) for _ in range(HISTORY)]


def predict(row: dict) -> dict:
    """`row` predicted as the calibration does, and with its step replayed after each seed's history."""
    events, value, fragmentation, _ = step_events(row)
    recorded = {length: recorded_step({**row, "seq_len": length})
                for length in sorted({n for seed in SEEDS for n in history(seed)})}
    alone = value - fragmentation + held_beyond(replay(events))
    after = {}
    for seed in SEEDS:
        allocator = CachingAllocator()
        for length in history(seed):
            replay(recorded[length], allocator=allocator)
        after[seed] = value - fragmentation + held_beyond(replay(events, allocator=allocator))
    errors = {seed: round(v / row["value_bytes"] - 1, 4) for seed, v in after.items()}
    return {"id": row["id"], "measured_bytes": row["value_bytes"], "calibration_bytes": int(value),
            "calibration_error": round(value / row["value_bytes"] - 1, 4),
            "full_depth_alone_bytes": int(alone), "full_depth_alone_error": round(alone / row["value_bytes"] - 1, 4),
            "after_history_bytes": {str(seed): int(v) for seed, v in after.items()},
            "after_history_error": {str(seed): error for seed, error in errors.items()},
            "after_history_median_error": round(statistics.median(errors.values()), 4)}


def described(result: dict) -> str:
    """One line of the experiment's output for a row's `result`."""
    spread = result["after_history_error"].values()
    return (f"{result['id']:40} measured {result['measured_bytes'] / 2**30:6.2f} GiB: calibration "
            f"{result['calibration_error']:+.1%}, full depth alone {result['full_depth_alone_error']:+.1%}, "
            f"after a history {min(spread):+.1%} .. {max(spread):+.1%} "
            f"(median {result['after_history_median_error']:+.1%})")


def main() -> None:
    no_options(__doc__)
    from bench.calibration import calibrate

    torch.set_num_threads(1)
    started, load = time.time(), os.getloadavg()[0]
    results = []
    for row in calibrate.expressible_rows("torchtune-", "reserved"):
        results.append(predict(row))
        print(described(results[-1]), flush=True)
    calibrate.write_experiment(RESULT, __doc__, started, load, lengths=LENGTHS, history_steps=HISTORY,
                               histories={str(seed): history(seed) for seed in SEEDS}, rows=results)


if __name__ == "__main__":
    main()
