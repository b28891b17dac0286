"""FSDP1 against FSDP2 on the same model and loop, on two CPU ranks (gloo): the peak of two optimizer steps
of three micro-batches, gradients reduced on every micro-batch and deferred to the last one (FSDP1's
`no_sync()`, FSDP2's `set_requires_gradient_sync(False)`). autofit plans FSDP2; the calibration's FSDP1
rows (litgpt's Gemma-2B full fine-tune) are predicted with FSDP2's model, and this measures how far apart
the two engines are for a model whose root unit (embedding and head, untied) outweighs its blocks, and
what the estimator predicts for both (`predicted_peaks`: FSDP1's root unit simulated as it trains).

    python bench/calibration/fsdp1_vs_fsdp2.py     # writes results/fsdp1-vs-fsdp2-cpu.json

Bytes are counted by `autofit.devices.memory.CpuBudget` (every tensor storage made from the model's build
on), as autofit's CPU probes count them. No GPU: the CUDA caching allocator is not involved.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "fsdp1-vs-fsdp2-cpu.json"
VOCAB, HIDDEN, LAYERS, TOKENS, MICRO_BATCHES = 8000, 128, 2, 64, 3


def make_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=512,
                                        tie_word_embeddings=False))


def wrapped(engine: str):
    """The model under `engine`: FSDP1 wrapping each decoder layer and the root (as Lightning's
    FSDPStrategy(auto_wrap_policy={Block}) does, with its use_orig_params=True), or FSDP2's fully_shard on
    each layer and the root."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = make_model()
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                        device_id=torch.device("cpu"), use_orig_params=True, limit_all_gathers=True)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def predicted_peaks() -> dict[str, int]:
    """The estimator's rank peaks (target cpu) for the same model and loop, gradients reduced every
    micro-batch: the model as FSDP2 trains it, and with FSDP1's root unit simulated as it trains
    (`measured_code.fsdp1_flat_root`: its weights views of one flat parameter)."""
    import torch

    from autofit.config import Config
    from autofit.estimate.estimator import Estimator
    from autofit.job.train_spec import make_spec
    from bench.calibration.measured_code import fsdp1_flat_root

    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    config = Config(precision="fp32", sharding="fsdp_full", num_gpus=2, micro_batch_size=1,
                    grad_accum_steps=MICRO_BATCHES)
    peaks = {}
    for engine, factory in (("fsdp2", make_model), ("fsdp1", lambda: fsdp1_flat_root(make_model(), "model.layers"))):
        spec = make_spec(factory, lambda n: {"input_ids": ids.repeat(n, 1), "labels": ids.repeat(n, 1)},
                         device="cpu", memory_budget="1TiB")
        peaks[f"{engine}, every micro-batch"] = Estimator(spec, target="cpu").predict(config).peak_bytes
    return peaks


def reduce_context(model, engine: str, reduce: bool):
    if engine == "fsdp1":
        return contextlib.nullcontext() if reduce else model.no_sync()
    model.set_requires_gradient_sync(reduce)
    return contextlib.nullcontext()


def rank_peak(engine: str, deferred: bool) -> int:
    import torch

    from autofit.devices.memory import CpuBudget

    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with CpuBudget(None) as budget:
        model = wrapped(engine)
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            for i in range(MICRO_BATCHES):
                with reduce_context(model, engine, not deferred or i == MICRO_BATCHES - 1):
                    (model(input_ids=ids, labels=ids).loss / MICRO_BATCHES).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return budget.peak


def rank_main() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    peaks = {f"{engine}, {'deferred' if deferred else 'every micro-batch'}": rank_peak(engine, deferred)
             for engine in ("fsdp2", "fsdp1") for deferred in (False, True)}
    if dist.get_rank() == 0:
        print(json.dumps(peaks), flush=True)
    dist.destroy_process_group()


def main() -> None:
    from bench.cli import no_options

    no_options(__doc__)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOFIT_FSDP_RANK": "1"}
    started, load = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          __file__], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    peaks = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    model = make_model()
    root = sum(p.numel() for name, p in model.named_parameters() if ".layers." not in name) * 4
    total = sum(p.numel() for p in model.parameters()) * 4
    for name, peak in peaks.items():
        print(f"{name:28} peak {peak / 2**20:7.2f} MiB")
    for mode in ("every micro-batch", "deferred"):
        extra = peaks[f"fsdp1, {mode}"] - peaks[f"fsdp2, {mode}"]
        print(f"FSDP1 - FSDP2, {mode}: {extra / 2**20:.2f} MiB = {extra / root:.0%} of the root unit's fp32 weights")
    predicted = predicted_peaks()
    gap = predicted["fsdp1, every micro-batch"] - predicted["fsdp2, every micro-batch"]
    print(f"predicted FSDP1 - FSDP2, every micro-batch: {gap / 2**20:.2f} MiB")
    import torch

    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps({
        "what": "FSDP1 vs FSDP2 rank peak, same model and loop, two CPU ranks (gloo), bytes by CpuBudget",
        "date": started.isoformat(timespec="minutes"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_at_start": load, "torch": torch.__version__,
        "model": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "tied": False, "fp32_weight_bytes": total,
                  "root_unit_fp32_bytes": root},
        "tokens": TOKENS, "micro_batches": MICRO_BATCHES, "peaks": peaks,
        "predicted (estimator, target cpu)": predicted}, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    rank_main() if os.environ.get("AUTOFIT_FSDP_RANK") else main()
