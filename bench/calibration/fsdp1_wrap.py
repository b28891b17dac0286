"""An experiment: fsdp_qlora's reserved rows replayed from what FSDP1's wrapping left cached.

What FSDP1's wrapping leaves in the CUDA caching allocator's cache before the first step, and how the
rows move when the step is replayed from it.

    python bench/calibration/fsdp1_wrap.py     # ~2 min on 2 cores; writes results/fsdp1-wrap.json

fsdp_qlora's train.py (@ 1a9fddfb) builds the model on rank 0's CPU (`low_memory`), wraps it in FSDP1
with `sync_module_states=True`, and calls `torch.cuda.reset_peak_memory_stats` before its training loop
without emptying the cache: its `max_memory_reserved` starts from what the wrapping left cached. For each
unit, in the order FSDP1 wraps them (`_recursive_wrap`: children before their parent, the root last),
torch/distributed/fsdp/_init_utils.py `_init_param_handle_from_module`:
- moves the unit's parameters to the GPU one by one (`_move_module_to_device`, breadth first from the
  unit, nested units skipped); rank 1 materializes its meta parameters in the same order;
- broadcasts them from rank 0 (`_sync_module_params_and_buffers` -> `_broadcast_coalesced` with
  `PARAM_BROADCAST_BUCKET_SIZE`, 250 MiB): torch/csrc/distributed/c10d/comm.cpp `broadcast_coalesced`
  groups tensors in order into buckets closed once they reach 250 MiB (`compute_bucket_assignment_by_size`),
  flattens each bucket of several tensors into a new one (a bucket of one tensor is a view of it), and
  keeps at most two buckets in flight;
- flattens them into one flat parameter (`FlatParamHandle`: `torch.cat` in `parameters()` order);
- shards it (`FlatParamHandle.shard`: this rank's chunk cloned, the unsharded storage resized to 0;
  NO_SHARD keeps it whole; CPU offload moves the shard to the host) and drops the moved parameters.
`wrap_events` writes that sequence; `tests/bench/test_fsdp1_wrap.py` checks it against the storages real
FSDP1 makes on the CPU as rank 1 of 2 (torch's fake process group). The step is then the estimator's simulated forward + backward at the
model's full depth, recorded allocation by allocation (`autofit.estimate.simulation.step.recorded_events`) and replayed
`STEPS` times from that cache; a row's prediction swaps the estimator's fragmentation term for what this
replay reserves beyond what it allocates. Not part of the calibration's headline: see README.md.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.estimate.cuda.allocator import CachingAllocator  # noqa: E402
from bench.cli import no_options  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "fsdp1-wrap.json"
BUCKET = 250 * 1024 * 1024  # PARAM_BROADCAST_BUCKET_SIZE (torch/distributed/fsdp/_init_utils.py)
IN_FLIGHT = 2  # broadcast_coalesced's `max_in_flight`
STEPS = 2
# The source's own figure for its QLoRA row at 512 tokens: "It's actually about 3.72GiB (see
# `reserved_after_model_wrap`)" (benchmarks_03_2024.md @ 23fafdfb), logged right after FSDP(...).
QUOTED_AFTER_WRAP = ("fsdpqlora-llama2-7b-qlora-ctx512-bs1", 3.72 * 2**30)


class Unit(collections.namedtuple("Unit", "params buffers synced flat")):
    """One FSDP1 unit's tensor bytes: its parameters and its buffers in the order they reach the GPU
    (`_move_states_to_device`: parameters, then buffers, each breadth first), the tensors in the order
    they are broadcast (buffers, then parameters), and the parameters in the flat one's order."""


def units(model: nn.Module, is_unit: Callable[[nn.Module], bool],
          nbytes: Callable[[str, torch.Tensor], int] = lambda name, t: t.nbytes) -> list[Unit]:
    """`model`'s FSDP1 units as an auto-wrap policy `is_unit` makes them, the root (the rest) last;
    `nbytes(name, tensor)` is a tensor's size on the GPU (a quantized weight's packed bytes)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:  # post-order, as `_recursive_wrap` wraps children first
        for child in module.children():
            visit(child)
        if module is not model and is_unit(module):
            found.append(module)

    visit(model)
    names = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    size = lambda t: nbytes(names[id(t)], t)  # noqa: E731
    done: set[int] = set()  # tensors of units already wrapped
    wrapped = []
    for module in [*found, model]:
        params, buffers = [], []
        queue = collections.deque([module])
        while queue:  # breadth first, not into units already wrapped (`_move_module_to_device`)
            current = queue.popleft()
            params += [p for p in current.parameters(recurse=False) if id(p) not in done]
            buffers += [b for b in current.buffers(recurse=False) if id(b) not in done]
            queue.extend(c for c in current.children() if c not in found)
        ordered = [p for p in module.parameters() if id(p) not in done]
        synced = [b for b in module.buffers() if id(b) not in done]
        wrapped.append(Unit([size(p) for p in params], [size(b) for b in buffers],
                            [size(t) for t in synced + ordered], [size(p) for p in ordered]))
        done.update(id(t) for t in params + buffers)
    return wrapped


def buckets(sizes: list[int], limit: int = BUCKET) -> list[list[int]]:
    """Indices of `sizes` grouped as `compute_bucket_assignment_by_size` groups them (one dtype and device)."""
    out, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total >= limit:
            out.append(current)
            current, total = [], 0
    return out + ([current] if current else [])


def wrap_events(wrapped: list[Unit], world: int, sharded: bool = True, offload: bool = False,
                bucket: int = BUCKET) -> list[tuple[str, int, int]]:
    """("malloc", key, bytes) / ("free", key, 0) on one rank's GPU while FSDP1 wraps `wrapped`: sharded
    over `world` ranks (FULL_SHARD) or not (NO_SHARD), the shards moved to the host with CPU offload,
    broadcast in buckets of `bucket` bytes."""
    keys: Iterator[int] = iter(range(1, 1 << 62))
    events: list[tuple[str, int, int]] = []

    def malloc(size: int) -> int:
        key = next(keys)
        events.append(("malloc", key, size))
        return key

    def free(key: int | None) -> None:
        if key is not None:
            events.append(("free", key, 0))

    for unit in wrapped:
        params = [malloc(size) for size in unit.params]
        for size in unit.buffers:  # moved for good: buffers are not flattened
            malloc(size)
        in_flight: list[int | None] = []
        for group in buckets(unit.synced, bucket):
            if len(in_flight) >= IN_FLIGHT:
                free(in_flight.pop(0))
            in_flight.append(malloc(sum(unit.synced[i] for i in group)) if len(group) > 1 else None)
        for key in in_flight:
            free(key)
        flat = malloc(sum(unit.flat))
        if sharded:
            chunk = -(-sum(unit.flat) // world)  # torch.chunk: ceil; the last rank's is padded to it
            shard = malloc(chunk)
            free(flat)
            if offload:
                free(shard)
        for key in params:
            free(key)
    return events


def replay(events: list[tuple[str, int, int]], allocator: CachingAllocator | None = None,
           times: int = 1) -> CachingAllocator:
    """`events` through `allocator` (a new one by default) `times` times, keys fresh each time."""
    allocator = allocator or CachingAllocator()
    serial = iter(range(1 << 62, 1 << 63))
    for _ in range(times):
        live: dict[int, int] = {}
        for kind, key, size in events:
            if kind == "malloc":
                live[key] = next(serial)
                allocator.malloc(live[key], size)
            elif key in live:
                allocator.free(live.pop(key))
    return allocator


def held_beyond(allocator: CachingAllocator) -> int:
    """What `allocator` reserved at its peak beyond the most it allocated: the fragmentation term."""
    return allocator.peak_reserved - allocator.peak_allocated


# -- fsdp_qlora's reserved rows --------------------------------------------------------------------------
def fsdp_qlora_units(row: dict) -> list[Unit]:
    """The row's model as fsdp_qlora wraps it: PEFT 0.10's bf16 adapters on the row's targets (for QLoRA
    too: PEFT cast them to the base weight's dtype, bf16 `quant_storage`), NF4 weights packed two to a byte
    on every linear layer of the decoder (train.py `replace_linear`, `skip_modules=["lm_head"]`), each
    trainable leaf and each decoder layer a unit (train.py `get_wrapping_policy`), the root last."""
    from autofit.models.info import find_blocks
    from bench.calibration import calibrate, measured_code

    class_name, fields = calibrate.architecture(row)
    with torch.device("meta"):
        model = calibrate.build(class_name, fields)
        model = measured_code.bf16_adapters(model, row["lora"], calibrate.targets(row, class_name))
    _, blocks = find_blocks(model)
    quantized = set()
    if row["quantization"] != "none":
        quantized = {f"{name}.weight" for name, module in model.named_modules()
                     if isinstance(module, nn.Linear) and "lora_" not in name and not name.endswith("lm_head")}

    return units(model, fsdp_qlora_policy(type(blocks[0])),
                 lambda name, t: t.numel() // 2 if name in quantized else t.nbytes)


def fsdp_qlora_policy(block: type) -> Callable[[nn.Module], bool]:
    """fsdp_qlora's auto-wrap policy for LoRA (train.py `get_wrapping_policy`): a leaf module with a
    trainable weight (each LoRA adapter), or a decoder layer (`block`)."""
    def is_unit(module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        leaf = not list(module.children()) and weight is not None and weight.requires_grad
        return leaf or isinstance(module, block)

    return is_unit


def step_events(row: dict) -> tuple[list[tuple[str, int, int]], int, int, float]:
    """The row's simulated step at full depth, allocation by allocation (`recorded_step`); the
    calibration's prediction (bytes, comparable with the row's metric), the estimator's fragmentation term
    in it, and the NF4 constants the GPU held since loading (bytes)."""
    from autofit.estimate.estimator import Estimator
    from autofit.estimate.states import quantization_constants
    from bench.calibration import calibrate

    spec, config, strategies = calibrate.setup(row)
    estimator = Estimator(spec, target="cuda", strategies=strategies)
    with calibrate.libraries_as_measured(row):
        value, _ = calibrate.predicted(row, estimator, config)
        fragmentation = dict(estimator.predict(config).terms).get("fragmentation", 0)
    return recorded_step(row), value, fragmentation, quantization_constants(estimator.facts, config)


def recorded_step(row: dict) -> list[tuple[str, int, int]]:
    """The allocation events of the row's step simulated at full depth, as (kind, key, bytes): one step's
    mallocs and frees, its gradients dropped as they come."""
    from autofit.estimate.estimator import Estimator
    from autofit.estimate.simulation.step import recorded_events
    from bench.calibration import calibrate

    spec, config, strategies = calibrate.setup(row)
    estimator = Estimator(spec, target="cuda", strategies=strategies)
    with calibrate.libraries_as_measured(row), recorded_events() as steps:
        estimator.simulate(config, config.micro_batch_size, full_depth=True)
    return [(event[0], event[1], event[2] if event[0] == "malloc" else 0) for event in steps[-1]
            if event[0] in ("malloc", "free")]


def predict(row: dict) -> dict:
    """The row predicted three ways: as the calibration does; with the step replayed at full depth from an
    empty cache; and replayed from what the wrapping left cached."""
    events, value, fragmentation, constants = step_events(row)
    sharded, offload = "ddp" not in row["id"], bool(row["cpu_offload"])
    wrap = wrap_events(fsdp_qlora_units(row), row["num_gpus"], sharded=sharded, offload=offload)
    wrapped = replay(wrap)
    after_wrap = wrapped.reserved
    plain, seeded = replay(events, times=STEPS), replay(events, allocator=wrapped, times=STEPS)
    figures = {"calibration": value,
               "full depth": value - fragmentation + held_beyond(plain),
               "full depth, from the wrapping's cache": value - fragmentation + held_beyond(seeded)}
    return {"id": row["id"], "measured_bytes": row["value_bytes"],
            "reserved_after_wrap_bytes": after_wrap + constants,
            "free_after_wrap_bytes": after_wrap - wrapped.allocated,
            "predicted_bytes": {k: int(v) for k, v in figures.items()},
            "error": {k: round(v / row["value_bytes"] - 1, 4) for k, v in figures.items()}}


def main() -> None:
    no_options(__doc__)
    from bench.calibration import calibrate

    torch.set_num_threads(1)
    started, load = time.time(), os.getloadavg()[0]
    table = calibrate.expressible_rows("fsdpqlora-", "reserved")
    results = []
    for row in table:
        result = predict(row)
        results.append(result)
        print(f"{row['id']:50} measured {row['value_bytes'] / 2**30:6.2f} GiB, after wrap "
              f"{result['reserved_after_wrap_bytes'] / 2**30:5.2f} GiB reserved ("
              f"{result['free_after_wrap_bytes'] / 2**30:4.2f} free); "
              + ", ".join(f"{k} {v:+.1%}" for k, v in result["error"].items()), flush=True)
    quoted_id, quoted = QUOTED_AFTER_WRAP
    replayed = next(r["reserved_after_wrap_bytes"] for r in results if r["id"] == quoted_id)
    print(f"{quoted_id}: reserved after the wrapping {replayed / 2**30:.2f} GiB replayed, "
          f"{quoted / 2**30:.2f} GiB quoted by the source ({replayed / quoted - 1:+.1%})")
    calibrate.write_experiment(RESULT, __doc__, started, load, steps=STEPS, quoted_after_wrap={
        "id": quoted_id, "quoted_bytes": int(quoted), "replayed_bytes": replayed}, rows=results)


if __name__ == "__main__":
    main()
