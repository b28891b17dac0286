"""What one in-process probe leaves on the card for the next: allocated, reserved and outside-allocator
bytes after each probe of a sequence, and the blocks still allocated with the Python lines that made them.

A probe's peak is the allocator's most reserved bytes plus what the process holds outside it. After a
probe releases its memory (gc, cuBLAS workspaces, empty_cache) a later probe should measure what a fresh
process would; a tensor that survives keeps its whole segment reserved, and a grown context counts in
every later peak. This runs the activation-offload GPU test's sequence (tests/strategies/
test_activation_offload.py), with its checkpointed configuration once first in a fresh process for
comparison, and records the CUDA caching allocator's snapshot after each probe
(`torch.cuda.memory._record_memory_history`, python stacks).

    python bench/measurements/probe_residue.py          # needs a GPU

Backs: bench/README.md#probe-residue, cited by autofit/probe/run.py (`LEFT_BEHIND_SLACK` and the check of
what a probe leaves: fitting probes leave nothing, so a leak is the OOM's) and tests/isolation.py.
Results: bench/results/probe-residue-<device>-<date>.json (device, date and torch inside):
probe-residue-cuda-h200-2026-11-27.json."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from autofit.config import Config  # noqa: E402
from autofit.estimate.estimator import predict_peak  # noqa: E402
from autofit.devices.memory import outside_allocator  # noqa: E402
from autofit.probe.run import run_probe  # noqa: E402
from autofit.devices.device import describe  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import default_strategies  # noqa: E402
from bench.suite.report import results_path  # noqa: E402
from models import long_gpt2  # noqa: E402
from bench.cli import no_options  # noqa: E402

MIB = 2**20
CHECKPOINTED = Config(attention="sdpa", checkpointing="full")
SEQUENCE = [CHECKPOINTED, Config(attention="sdpa"), Config(attention="sdpa", activation_offload="cpu"),
            CHECKPOINTED, Config(attention="sdpa", checkpointing="full", activation_offload="cpu"), CHECKPOINTED]


def surviving_blocks(limit: int = 12) -> list[dict]:
    """The allocated blocks of the allocator's snapshot, largest first, each with its segment's size and
    the innermost Python frames of its allocation."""
    blocks = []
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                      for f in block.get("frames", []) if f["filename"].endswith(".py")]
            blocks.append({"bytes": block["size"], "segment_bytes": segment["total_size"], "frames": frames[:6]})
    blocks.sort(key=lambda b: -b["bytes"])
    return blocks[:limit]


def state(device: torch.device) -> dict:
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "outside_allocator": outside_allocator(device), "blocks": surviving_blocks()}


def main() -> None:
    no_options(__doc__)
    device = torch.device("cuda", 0)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=500_000)
    spec = make_spec(long_gpt2, global_batch_size=1, device="cuda", seq_len=4096, warmup_steps=1, timed_steps=1)
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for config in SEQUENCE:
        result = run_probe(spec, config, default_strategies())
        after = state(device)
        rows.append({"describe": config.describe(), "status": result.status.value, "peak": result.peak_bytes,
                     "predicted": predict_peak(spec, config).peak_bytes, "left_behind": result.left_behind,
                     "after": after})
        print(f"{config.describe():55s} {result.status.value:4s} peak {result.peak_bytes / MIB:7.0f} MiB; after: "
              f"allocated {after['allocated'] / MIB:6.1f} reserved {after['reserved'] / MIB:6.1f} outside "
              f"{after['outside_allocator'] / MIB:6.1f} MiB", file=sys.stderr)
    out = {"what": __doc__.splitlines()[0], "device": describe(device), "date": now.isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(), "rows": rows}
    path = results_path("probe-residue", device)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
