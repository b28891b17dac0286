"""Every causal-LM type transformers knows, dry-run from its default config: which are simulated, which rest
on the formula, and which are refused, with the reason (what a new user typing any hub id would meet).

    python bench/diag/architecture_scan.py               # all of them: ~25 min on 2 cores
    python bench/diag/architecture_scan.py llama qwen3_5  # some

Each type's `AutoConfig.for_model(type)` (transformers' defaults, often not a released checkpoint's: some do
not build in transformers itself) is written to a config.json naming its causal-LM class and dry-run at 256
tokens, 4 samples a step, on an A100-80GB, fp32/bf16 and micro-batches only. Prints one line per type.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.pipelines.dry_run import dry_run  # noqa: E402
from autofit.strategies import MicroBatch, MixedPrecision  # noqa: E402

SECONDS_EACH = 240


def scan(model_type: str, architecture: str) -> str:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    config.architectures = [architecture]
    path = os.path.join(tempfile.mkdtemp(), "config.json")
    config.to_json_file(path)
    report = dry_run(path, seq_len=256, global_batch_size=4, gpu="a100-80gb", strategies=[MixedPrecision(), MicroBatch()])
    simulated = [c.estimate.simulated for c in report.candidates]
    why = next((c.estimate.method for c in report.candidates if not c.estimate.simulated), "")
    return f"fits={report.fits} simulated={sum(simulated)}/{len(simulated)} {why}"


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError(f"over {SECONDS_EACH} s")))
    for model_type in args.types or sorted(CAUSAL_LM):
        started = time.time()
        signal.alarm(SECONDS_EACH)
        try:
            result = scan(model_type, CAUSAL_LM[model_type])
        except Exception as exc:  # noqa: BLE001 - each type's failure is a row of the scan
            result = f"ERR {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        finally:
            signal.alarm(0)
        print(f"{model_type}\t{time.time() - started:.0f}s\t{result}", flush=True)


if __name__ == "__main__":
    main()
