"""BERT-large on a card: the allocated, reserved and nvidia-smi peaks of a training step, with and without
expandable segments, beside what the dry-run predicts (issue 55's item 5: the reserve the estimator replays,
and the bound it gives an encoder with each attention kernel, checked on today's torch and transformers).

    python bench/measurements/bert_large_reserve.py                   # on a GPU: measure, then predict
    python bench/measurements/bert_large_reserve.py --predict FILE    # anywhere: predict a measured file again
    python bench/measurements/bert_large_reserve.py --predict-only    # anywhere: the grid's predictions alone

Grid: `BertForSequenceClassification` (bert-large-uncased's dimensions: 24 layers, 1,024 wide, 16 heads,
2 labels) at 512 tokens, micro-batch 4, AdamW, attention eager and SDPA, precision fp32, fp16 autocast (with
a GradScaler) and bf16 autocast (where the card has bf16), the caching allocator's default segments and
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`. Each point runs in a child process of its own (the
allocator's setting is read when CUDA starts; no cache left by the point before), capped at 16 GiB of the
card by `torch.cuda.set_per_process_memory_fraction` to stand in for the 16 GB pre-Ampere card of the
published figures, for three optimizer steps; an out-of-memory error is recorded as such. Peaks:
`max_memory_allocated`, `max_memory_reserved`, and the process's memory as NVML reports it (what nvidia-smi
shows: the context and workspaces too), polled every 5 ms. The prediction is the dry-run's (`Estimator(...,
target="cuda", extrapolate_batch=True)` for a v100-16gb profile): its peak is "reserved + context", compared
with the NVML peak, and its error bound (`Estimate.error_bound`, `bound_basis`) says whether the miss is
inside it. Nothing of this has run on a GPU yet: no card was lent to the session that wrote it.

Backs: nothing yet; once run, the check of `autofit.estimate.tolerance.UNCALIBRATED_BOUND` for an encoder
with eager and fused attention, and of the expandable-segments replay (autofit/estimate/cuda/expandable.py).
Results: bench/results/bert-large-reserve-<card>-<date>.json (`bench/gpu_session.sh bert-reserve`); with
--predict-only, the predictions a card is to be measured against: bert-large-reserve-predicted-2026-12-06.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
CAP = 16 * 2**30  # the stand-in card's memory
SEQ, BATCH, STEPS = 512, 4, 3
ATTENTION = ("eager", "sdpa")
PRECISION = {"fp32": None, "fp16": "float16", "bf16": "bfloat16"}  # name -> autocast dtype
ALLOCATOR = {"default": "", "expandable_segments": "expandable_segments:True"}


def bert_config(large: bool = True):
    """bert-large-uncased's dimensions (or a 2-layer one for tests: `large=False`)."""
    from transformers import BertConfig

    if large:
        return BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                          num_labels=2)
    return BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=2)


def one(attention: str, precision: str, large: bool = True) -> dict:
    """One point in this process (its allocator set by the parent's environment): the three peaks."""
    import torch
    from transformers import BertForSequenceClassification

    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP / torch.cuda.get_device_properties(0).total_memory))
    peak, stop = [0], threading.Event()
    threading.Thread(target=_poll_nvml, args=(peak, stop), daemon=True).start()
    model = BertForSequenceClassification(bert_config(large), attn_implementation=attention).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    dtype = PRECISION[precision] and getattr(torch, PRECISION[precision])
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), device="cuda")
    labels = torch.randint(0, 2, (BATCH,), device="cuda")
    found = {"attention": attention, "precision": precision}
    try:
        for _ in range(STEPS):
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(input_ids=ids, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        found["out_of_memory"] = False
    except torch.OutOfMemoryError as error:
        found.update(out_of_memory=True, error=str(error).splitlines()[0])
    time.sleep(0.05)
    stop.set()
    found.update(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved(),
                 nvml_peak=peak[0])
    return found


def _poll_nvml(peak: list, stop: threading.Event) -> None:
    """This process's memory as NVML reports it (nvidia-smi's figure), its peak kept in `peak[0]`."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
    while not stop.is_set():
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory:
                peak[0] = max(peak[0], process.usedGpuMemory)
        time.sleep(0.005)


def measure(large: bool = True) -> list[dict]:
    """Every point, each in a child process with its allocator setting."""
    import torch

    rows = []
    for allocator, setting in ALLOCATOR.items():
        for attention in ATTENTION:
            for precision in PRECISION:
                if precision == "bf16" and not torch.cuda.is_bf16_supported():
                    continue
                env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": setting}
                done = subprocess.run([sys.executable, __file__, "--one", attention, precision]
                                      + ([] if large else ["--small"]), env=env, capture_output=True, text=True,
                                      timeout=600)
                row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
                    {"attention": attention, "precision": precision, "failed": done.stderr[-2000:]}
                rows.append({"allocator": allocator, **row})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def predict(rows: list[dict], large: bool = True) -> list[dict]:
    """The dry-run's prediction for each measured point: reserved + context against the NVML peak."""
    from autofit.config import Config
    from autofit.devices.gpus import get_gpu
    from autofit.estimate.estimator import Estimator
    from autofit.job.target import Target
    from autofit.job.train_spec import make_spec
    from autofit.strategies import default_strategies

    profile = get_gpu("v100-16gb")
    spec = make_spec(bert_config(large), seq_len=SEQ, device="cpu", memory_budget=CAP,
                     target=Target.from_profile(profile, 1))
    estimator = Estimator(spec, target="cuda", extrapolate_batch=True, strategies=default_strategies())
    made = []
    for row in rows:
        config = Config(precision=row["precision"], attention=row["attention"], micro_batch_size=BATCH,
                        allocator=row["allocator"])
        estimate = estimator.predict(config)
        measured = row.get("nvml_peak") or 0
        made.append({**row, "predicted_bytes": estimate.peak_bytes, "need_bytes": estimate.need_bytes,
                     "memory": estimate.memory.value, "error_bound": estimate.error_bound,
                     "bound_basis": estimate.bound_basis,
                     "error": round(estimate.peak_bytes / measured - 1, 4) if measured else None})
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=2, metavar=("ATTENTION", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--small", action="store_true", help="a 2-layer BERT (tests)")
    parser.add_argument("--predict", type=Path, help="a measured results file: predict its points again")
    parser.add_argument("--predict-only", action="store_true", help="no card: the grid's predictions alone")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, large=not args.small)))
        return 0
    import torch

    started = time.time()
    if args.predict:
        document = json.loads(args.predict.read_text())
    elif args.predict_only:
        document = {"device": "predicted", "torch": torch.__version__, "cap_bytes": CAP,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "rows": [{"allocator": a, "attention": n, "precision": p}
                             for a in ALLOCATOR for n in ATTENTION for p in PRECISION]}
    else:
        document = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "cap_bytes": CAP, "rows": measure(large=not args.small)}
    document["rows"] = predict(document["rows"], large=not args.small)
    document["predicted_on"] = {"cuda": torch.cuda.is_available(), "load": os.getloadavg()[0],
                                "seconds": round(time.time() - started, 1)}
    card = document["device"].lower().replace("nvidia ", "").replace(" ", "-")
    document["predicted_on"]["machine"] = f"{os.uname().machine} {os.cpu_count()} cores"
    path = args.predict or ROOT / "bench" / "results" / f"bert-large-reserve-{card}-{document['date'][:10]}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
