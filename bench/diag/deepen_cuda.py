"""What the depth synthesis (`autofit.estimate.simulation.deepen`) sees on a card: for three held-out configurations,
each call's events, marks, units and the sizes its two units allocated, pickled to $OUT (or /tmp) for
reading elsewhere, and whether it gave up (None: the units looked unlike).

    python bench/diag/deepen_cuda.py                 # on a GPU machine: fake tensors on CUDA
    DIAG_DEVICE=cpu python bench/diag/deepen_cuda.py # here: CPU kernels standing in, to compare

On the H200 (2026-11-27) it showed the first checkpointed block making two storages of no bytes that the
second did not, which made the synthesis give up on CUDA only (fixed in autofit/estimate/simulation/step.py).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import autofit.estimate.simulation.deepen as deepen_module  # noqa: E402
from autofit.config import Config  # noqa: E402
from autofit.estimate.estimator import Estimator  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from bench.cli import no_options  # noqa: E402
from bench.measurements.estimate_accuracy import GLOBAL_BATCH, held_out_models  # noqa: E402

CASES = [("gpt2-355m", "fp32", "full", 4), ("gpt2-355m", "fp32", "none", 4), ("qwen2-0.5b", "bf16", "full", 1)]
REAL = deepen_module.deepen


def watched(calls: list[dict]):
    """`deepen.deepen` that keeps what each call saw in `calls`."""
    def deepen(events, marks, units):
        result = REAL(events, marks, units)
        seen = {"bounds": marks.bounds(), "marks": vars(marks).copy(), "units": units, "none": result is None,
                "events": list(events)}
        if marks.bounds() is not None:
            steps = deepen_module._Instances(events, marks.bounds())
            sizes = lambda allocations: [steps.sizes[a] for a in allocations]  # noqa: E731
            first, second = steps.mallocs[deepen_module.FIRST], steps.mallocs[deepen_module.SECOND]
            seen.update(first=sizes(first), second=sizes(second), incoming=sizes(steps.incoming),
                        outgoing=sizes(steps.outgoing))
        calls.append(seen)
        print("deepen", units, "bounds", seen["bounds"], "gave up", result is None,
              {k: len(v) for k, v in seen.items() if isinstance(v, list)}, flush=True)
        return result
    return deepen


def main() -> None:
    no_options(__doc__)
    out, device = Path(os.environ.get("OUT", "/tmp")), os.environ.get("DIAG_DEVICE", "cuda")
    for name, precision, checkpointing, micro in CASES:
        model, batch, seq_len = held_out_models()[name]
        spec = make_spec(model, batch, seq_len=seq_len, global_batch_size=GLOBAL_BATCH, device=device,
                         memory_budget=None if device == "cuda" else "1TiB")
        calls: list[dict] = []
        deepen_module.deepen = watched(calls)
        try:
            config = Config(precision=precision, attention="sdpa", checkpointing=checkpointing,
                            micro_batch_size=micro, grad_accum_steps=GLOBAL_BATCH // micro)
            estimate = Estimator(spec, target="cuda").predict(config)
            print(name, config.describe(), f"{estimate.peak_bytes / 2**20:.0f} MiB", estimate.terms, flush=True)
        except Exception:  # noqa: BLE001 - a diagnostic: say what failed and go on
            traceback.print_exc()
        finally:
            deepen_module.deepen = REAL
        (out / f"deepen-{name}-{precision}-{checkpointing}-{micro}.pkl").write_bytes(pickle.dumps(calls))
    print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
