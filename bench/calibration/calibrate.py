"""The estimator against published, measured GPU training peaks (no GPU needed: every row is predicted).

    python bench/calibration/calibrate.py              # all rows; writes results/calibration.json
    python bench/calibration/calibrate.py --only litgpt-rt-phi15-lora-mb1

`published.json` holds the measured rows (source, quote, full setup, metric, bytes; README.md says how
they were collected and checked). Each row the estimator can express is turned into a model (its
published dimensions, weights in the dtype the run stored them), a batch, a loss as the run computed it,
LoRA targets and a `Config`, and predicted with the dry-run's estimator (`target="cuda"`). Like is
compared with like: `allocated` rows against the peak without the CUDA context and without allocator
fragmentation, `reserved` rows with fragmentation and without the context, `nvidia-smi` rows with both,
and figures taken right after the model was built against the model states alone. The error is
predicted / measured - 1 (negative: an under-prediction, a promised fit that would run out of memory).
Rows it cannot express are listed apart with what is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.config import Config, Engine  # noqa: E402
from autofit.estimate.estimator import CUDA_CONTEXT_BYTES, Estimator  # noqa: E402
from autofit.estimate.states import model_states  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import Lora  # noqa: E402
from bench.calibration import measured_code  # noqa: E402

HERE = Path(__file__).resolve().parent
ROWS = HERE / "published.json"
RESULT = HERE / "results" / "calibration.json"

# hub id -> (transformers config class, extra fields); dimensions come from each row.
ARCH = {
    # litgpt's phi computes GELU(tanh) in one op (F.gelu(approximate="tanh")), not transformers' "gelu_new"
    "microsoft/phi-1_5": ("PhiConfig", {"partial_rotary_factor": 0.5, "max_position_embeddings": 2048,
                                        "hidden_act": "gelu_pytorch_tanh"}),
    "microsoft/phi-2": ("PhiConfig", {"partial_rotary_factor": 0.4, "max_position_embeddings": 2048,
                                      "hidden_act": "gelu_pytorch_tanh"}),
    "stabilityai/stablelm-base-alpha-3b": ("GPTNeoXConfig", {"rotary_pct": 0.25, "max_position_embeddings": 4096,
                                                              "use_parallel_residual": True}),
    "meta-llama/Llama-2-7b-hf": ("LlamaConfig", {"max_position_embeddings": 4096}),
    "meta-llama/Llama-2-13b-hf": ("LlamaConfig", {"max_position_embeddings": 4096}),
    "meta-llama/Llama-2-70b-hf": ("LlamaConfig", {"max_position_embeddings": 4096}),
    "meta-llama/Meta-Llama-3-8B": ("LlamaConfig", {"max_position_embeddings": 8192, "rope_theta": 500000.0}),
    "meta-llama/Llama-3.2-3B": ("LlamaConfig", {"max_position_embeddings": 131072, "rope_theta": 500000.0,
                                                "tie_word_embeddings": True}),
    "mistralai/Mistral-7B-v0.1": ("MistralConfig", {"max_position_embeddings": 32768, "sliding_window": 4096}),
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": ("LlamaConfig", {"max_position_embeddings": 2048}),
    "google/gemma-2b": ("GemmaConfig", {"head_dim": 256, "max_position_embeddings": 8192}),
}
# A source's LoRA target names -> the transformers module names of each architecture (llama-style
# names by default; Phi and GPT-NeoX name their projections otherwise, GPT-NeoX fuses q, k and v).
TARGETS = {"q": ["q_proj"], "k": ["k_proj"], "v": ["v_proj"], "q_proj": ["q_proj"], "k_proj": ["k_proj"],
           "v_proj": ["v_proj"], "proj": ["o_proj"], "output_proj": ["o_proj"], "gate_proj": ["gate_proj"],
           "up_proj": ["up_proj"], "down_proj": ["down_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"],
           "mlp(w1,w2,w3)": ["gate_proj", "up_proj", "down_proj"], "head": ["lm_head"], "output (lm_head)": ["lm_head"]}
RENAMED = {"PhiConfig": {"o_proj": ["dense"], "gate_proj": [], "up_proj": ["fc1"], "down_proj": ["fc2"]},
           "GPTNeoXConfig": {"q_proj": ["query_key_value"], "k_proj": ["query_key_value"], "v_proj": ["query_key_value"],
                             "o_proj": ["dense"], "gate_proj": [], "up_proj": ["dense_h_to_4h"],
                             "down_proj": ["dense_4h_to_h"]}}
# litgpt rows not simulated with litgpt's code (its QLoRA rows, or litgpt not installed): cross-entropy on
# bf16 logits, as litgpt's chunked cross-entropy computes it.
BF16_LOSS = ("litgpt-",)
# Loops that reduce gradients on an optimizer step's last micro-batch only: litgpt's finetune scripts
# (0.4.0 finetune/full.py l.236, lora.py l.286: `with fabric.no_backward_sync(model, enabled=is_accumulating)`),
# which Lightning's FSDPStrategy turns into FSDP1's `no_sync()` (lightning/fabric/strategies/fsdp.py
# `_FSDPBackwardSyncControl`): every gradient stays unsharded until the last micro-batch.
DEFERRED_SYNC = ("litgpt-",)
# Loops that hold the previous iteration's logits, and through them its autograd graph, while the next
# forward runs: litgpt's fit() (`measured_code._previous_step`). Its config-hub runs draw shuffled batches,
# each padded to its longest sample up to the row's cap, so two batches at the cap in a row can occur: they
# are predicted so, the conservative reading (each result's `error_without_previous_step` is the other
# bound, a previous batch too short to matter). The resource tables' runs are left out: lit-gpt took the
# longest sample first and random ones after (the rows' notes: "iteration 0 forces the longest sample"), so
# their previous batch is never as long as the one that peaks.
PREVIOUS_STEP = ("litgpt-hub-",)
MODEL_CODE = {"litgpt": f"litgpt {measured_code.LITGPT_VERSION} (its model, LoRA and loss)",
              "litgpt_qlora": f"litgpt {measured_code.LITGPT_VERSION} (its model, LoRA and loss; NF4 under its "
                              "adapters on every linear layer, the head too)",
              "fsdp_qlora": "transformers classes with 4.38's fp32 logits and loss; LoRA rows: PEFT 0.10's bf16 adapters",
              "torchtune": "transformers classes with fp32 logits, torchtune's loss, bf16 adapters and per-layer RoPE caches",
              "transformers": "transformers classes of the architecture (today's code), autofit's LoRA formulas"}
NOT_EXPRESSIBLE = {  # row id prefix -> what the estimator lacks (beside the table's own `expressible: false`)
    "torchtitan-": "op-level selective activation checkpointing in torchtitan's 'op' mode, which recomputes every "
                   "second matmul (torchtitan activation_checkpoint.py `_custom_policy`); autofit's `ops` keeps every one",
    "fsdpqlora-yi34b": "Yi-34B dimensions are unverified in the table (taken from memory)",
}


# Rows the table marked inexpressible that the estimator now expresses, and why.
EXPRESSIBLE_NOW = {"fsdpqlora-llama2-70b-qlora-cpuoffload-ctx2048-bs2":
                   "FSDP CPU offload (parameters, gradients and optimizer states on the host) is modelled"}


def expressible(row: dict) -> str | None:
    """None when the estimator can express `row`, else what is missing."""
    for prefix, why in NOT_EXPRESSIBLE.items():
        if row["id"].startswith(prefix):
            return why
    if not row["expressible"] and row["id"] not in EXPRESSIBLE_NOW:
        return "the table marks it inexpressible: " + row["notes"][:160]
    if row["model"]["hf_id"] not in ARCH:
        return f"no transformers architecture mapped for {row['model']['hf_id']}"
    lora = row["lora"] if isinstance(row["lora"], dict) else None
    if lora and not (isinstance(lora["targets"], list) and all(t in TARGETS for t in lora["targets"])):
        return f"LoRA targets not pinned down by the source: {str(lora['targets'])[:120]}"
    return None


def build(class_name: str, fields: dict, upcast_logits: bool = False, lora: dict | None = None,
          lora_targets: tuple = (), torchtune: bool = False) -> torch.nn.Module:
    """The causal LM of `class_name`'s config, weights in bf16 (every row stores them so); its logits
    upcast to fp32 in the forward where the source's code did (`measured_code.upcast_logits`), with
    `lora`, bf16 LoRA adapters on `lora_targets` (`measured_code.bf16_adapters`), and for `torchtune`
    its RoPE cache in every layer (`measured_code.torchtune_rope_caches`)."""
    import transformers

    config = getattr(transformers, class_name)(**fields)
    cls = measured_code.upcast_logits(class_name) if upcast_logits else \
        getattr(transformers, class_name.replace("Config", "ForCausalLM"))
    model = cls(config).to(torch.bfloat16)
    model = measured_code.bf16_adapters(model, lora, list(lora_targets)) if lora else model
    if torchtune:  # after any cast: the caches stay fp32
        model = measured_code.torchtune_rope_caches(model, config.hidden_size // config.num_attention_heads)
    return model


def bf16_cross_entropy(output, batch):
    """Cross-entropy on the logits as the model returns them (bf16, not upcast), as litgpt does."""
    logits = output.logits
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


@functools.lru_cache(maxsize=None)
def tokens(vocab: int, seq: int, n: int, as_tuple: bool):
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))
    return (ids, ids.clone()) if as_tuple else {"input_ids": ids, "labels": ids.clone()}


class Batches:
    """make_batch(n) of token ids and labels, a tuple for a bf16 loss, a dict for transformers' own loss."""

    def __init__(self, vocab: int, seq: int, as_tuple: bool):
        self.vocab, self.seq, self.as_tuple = vocab, seq, as_tuple

    def __call__(self, n: int):
        return tokens(self.vocab, self.seq, n, self.as_tuple)


def model_code(row: dict) -> str:
    """Whose code the row's step is simulated with (measured_code.py):
    - "litgpt": litgpt's own model, LoRA and loss (when installed); "litgpt_qlora" the same with NF4 base
      weights under litgpt's adapters (`autofit.estimate.states.own_adapters`);
    - "fsdp_qlora": transformers 4.38's forward and loss, and for LoRA rows PEFT 0.10's bf16 adapters
      (its QLoRA rows keep autofit's NF4 formulas, which count today's fp32 adapters);
    - "torchtune": fp32 logits and torchtune's loss, bf16 adapters;
    - "transformers": today's transformers classes of the architecture, autofit's LoRA formulas."""
    quantized = row["quantization"] != "none"
    if row["id"].startswith("litgpt-") and not measured_code.litgpt_missing():
        return "litgpt_qlora" if quantized else "litgpt"
    for prefix, code in (("fsdpqlora-", "fsdp_qlora"), ("torchtune-", "torchtune")):
        if row["id"].startswith(prefix):
            return code
    return "transformers"


def architecture(row: dict) -> tuple[str, dict]:
    """The transformers config class name of `row`'s model and its fields, from the published dimensions."""
    m = row["model"]
    class_name, extra = ARCH[m["hf_id"]]
    fields = {"hidden_size": m["hidden"], "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
              "intermediate_size": m["intermediate"], "vocab_size": m["vocab"], **extra}
    if class_name != "GPTNeoXConfig" and class_name != "PhiConfig":
        fields["num_key_value_heads"] = m["kv_heads"]
    return class_name, fields


def varied_lengths(row: dict) -> bool:
    """Whether `row`'s source pads each batch to its own longest sample (its dataset's notes say so): predicted
    as `autofit dry-run --varied-lengths` predicts, the reserve after shorter batches."""
    return bool(re.search(r"padded to (the )?longest", (row.get("other_flags") or {}).get("dataset", "")))


def setup(row: dict, previous_step: bool = False, one_length: bool = False) -> tuple:
    """(spec, Config, strategies) expressing `row`, with the code `model_code(row)` names; `previous_step`:
    litgpt's model holds its previous iteration through the forward (`PREVIOUS_STEP`); `one_length`: every
    batch as long as the row's length, even where its source varied them (`varied_lengths`)."""
    varied = varied_lengths(row) and not one_length
    m = row["model"]
    class_name, fields = architecture(row)
    lora = row["lora"] if isinstance(row["lora"], dict) else None
    code = model_code(row)
    if code in ("litgpt", "litgpt_qlora"):
        # LoRA lives in litgpt's model (bf16 adapters, only they trainable): no Lora strategy. QLoRA: the
        # estimator quantizes the frozen linear layers under litgpt's own adapters (`own_adapters`).
        # its multi-GPU rows ran FSDP1, whose root unit is simulated as it trains (`fsdp1_flat_root`)
        config = _config(row, 0)
        factory = functools.partial(measured_code.build_litgpt, m["hf_id"].split("/")[-1], row["seq_len"], lora,
                                    fsdp1=litgpt_fsdp1(row, config), previous_step=previous_step)
        spec = make_spec(factory, Batches(m["vocab"], row["seq_len"], True), device="cpu", memory_budget="1TiB",
                         loss_fn=measured_code.litgpt_lora_loss if lora else measured_code.litgpt_full_loss,
                         varied_lengths=varied)
        return spec, config, []
    # bf16 adapters built into the model (PEFT 0.10, torchtune) where the base is not quantized
    in_model = lora if lora and code in ("fsdp_qlora", "torchtune") and row["quantization"] == "none" else None
    loss = {"torchtune": measured_code.torchtune_loss, "fsdp_qlora": None}.get(
        code, bf16_cross_entropy if row["id"].startswith(BF16_LOSS) else None)
    factory = functools.partial(build, class_name, fields, upcast_logits=code in ("fsdp_qlora", "torchtune"),
                                lora=in_model, lora_targets=tuple(targets(row, class_name)) if in_model else (),
                                torchtune=code == "torchtune")
    spec = make_spec(factory, Batches(m["vocab"], row["seq_len"], loss is not None), device="cpu",
                     memory_budget="1TiB", loss_fn=loss, varied_lengths=varied)
    strategies = [Lora(target_modules=targets(row, class_name), dropout=lora.get("dropout") or 0.0)] \
        if lora and not in_model else []
    return spec, _config(row, lora["rank"] if lora and not in_model else 0), strategies


def litgpt_fsdp1(row: dict, config: Config) -> bool:
    """Whether `row` ran litgpt on several GPUs: Lightning's FSDPStrategy, FSDP1 wrapping each Block, whose
    root unit `measured_code.fsdp1_flat_root` simulates as it trains."""
    return model_code(row) in ("litgpt", "litgpt_qlora") and config.engine is Engine.FSDP


def _config(row: dict, lora_rank: int) -> Config:
    """The row's training configuration as a `Config` (`lora_rank` 0: no adapters for autofit to add)."""
    sharding = row["sharding"].lower()
    # Every row trains bf16 weights without autocast (litgpt bf16-true, torchtune, fsdp_qlora, PEFT's
    # use_amp=False): autofit's precision="fp32" means no autocast, so the bf16 model computes in bf16.
    return Config(precision="fp32", attention="sdpa",
                  checkpointing="full" if row["activation_checkpointing"].startswith("full") else "none",
                  micro_batch_size=row["micro_batch"], grad_accum_steps=max(row["grad_accum"] or 1, 1),
                  lora=lora_rank,
                  quantization="nf4" if row["quantization"].startswith("nf4") else "none",
                  sharding="fsdp_full" if "full_shard" in sharding or "full shard" in sharding else "none",
                  offload="cpu" if row["cpu_offload"] else "none",
                  num_gpus=row["num_gpus"])


def targets(row: dict, class_name: str) -> list[str]:
    """The row's LoRA targets as the architecture names its modules."""
    renamed = RENAMED.get(class_name, {})
    names = [n for target in row["lora"]["targets"] for n in TARGETS[target]]
    return list(dict.fromkeys(m for n in names for m in renamed.get(n, [n])))


def predicted(row: dict, estimator: Estimator, config: Config) -> tuple[int, str]:
    """The prediction comparable with the row's metric, and what was subtracted."""
    if "after model init" in row["value_as_published"]:  # torchtune's, the peak while its builder ran
        m = row["model"]
        template = measured_code.torchtune_template_bytes(estimator.facts.block_params, m["hidden"] // m["heads"])
        return model_states(estimator.facts, config).params + template, "model states after init (weights, " \
            "adapters, RoPE caches) + the template layer torchtune's builder deep-copies"
    estimate = estimator.predict(config)
    terms = dict(estimate.terms)
    metric = row["metric"]
    if metric == "allocated":
        return estimate.peak_bytes - CUDA_CONTEXT_BYTES - terms.get("fragmentation", 0), "peak - context - fragmentation"
    card = card_bytes(row)
    if metric == "reserved" and card:  # the allocator releases its cache before it passes the card
        return estimate.peak_under(card) - CUDA_CONTEXT_BYTES, "peak under the card's memory - context"
    if metric == "reserved":
        return estimate.peak_bytes - CUDA_CONTEXT_BYTES, "peak - context"
    return estimate.peak_bytes, "peak"


# The cards rows name, as autofit's GPU profiles: a reserved figure cannot pass the card's memory, where the
# caching allocator gives back its cached segments and retries (`autofit.estimate.cuda.allocator.CachingAllocator`)
CARDS = {"RTX 3090 24GB": "rtx-3090", "NVIDIA L40S (48 GB)": "l40s", "A10G (24 GB)": "a10g",
         "A100-SXM4-40GB": "a100-40gb"}


def card_bytes(row: dict) -> int | None:
    """The memory of the card `row` was measured on, where the source names it; else None."""
    from autofit.devices.gpus import get_gpu

    name = next((profile for prefix, profile in CARDS.items() if row["gpu"].startswith(prefix)), None)
    return get_gpu(name).memory_bytes if name else None


def libraries_as_measured(row: dict) -> contextlib.ExitStack:
    """The libraries' behaviour `row`'s source ran, simulated: its bitsandbytes release, re-entrant
    checkpointing where it used it, NF4 double quantization or not, PEFT's adapters' dtype. A context manager."""
    bnb = measured_code.bitsandbytes_of(row["id"]) if row["quantization"] != "none" else None
    stack = contextlib.ExitStack()
    stack.enter_context(measured_code.bitsandbytes_release(bnb))
    stack.enter_context(measured_code.peft_adapters(row["id"]))
    stack.enter_context(measured_code.reentrant_checkpointing(reentrant(row)))
    stack.enter_context(measured_code.nf4_double_quant(row["id"]))
    return stack


def reentrant(row: dict) -> bool:
    """Whether `row`'s source checkpointed with re-entrant autograd (fsdp_qlora's template command)."""
    return "--reentrant_checkpointing True" in row["activation_checkpointing"]


def defers_sync(row: dict, config: Config) -> bool:
    """Whether `row`'s loop reduces gradients on the last micro-batch only, where that matters."""
    return row["id"].startswith(DEFERRED_SYNC) and config.needs_sync_each_micro_batch


def write_experiment(path: Path, doc: str, started: float, load: float, **fields) -> None:
    """An experiment's result file: what it is (its docstring's first line), when, where, then `fields`."""
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({
        "what": doc.splitlines()[0], "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_at_start": load,
        "torch": torch.__version__, "seconds": round(time.time() - started), **fields}, indent=1) + "\n")
    print(f"-> {path}")


def expressible_rows(prefix: str, metric: str) -> list[dict]:
    """The rows the estimator expresses whose id starts with `prefix`, measured as `metric`."""
    return [r for r in json.loads(ROWS.read_text())
            if r["id"].startswith(prefix) and r["metric"] == metric and not expressible(r)]


def holds_previous_step(row: dict) -> bool:
    """Whether `row`'s loop is predicted holding its previous iteration through the next forward."""
    return row["id"].startswith(PREVIOUS_STEP) and model_code(row) in ("litgpt", "litgpt_qlora")


def prediction(row: dict, extrapolate_batch: bool = False, full_depth: bool = False,
               previous_step: bool = False, one_length: bool = False) -> tuple:
    """(predicted bytes, what was subtracted, Config, strategies) for `row` (`one_length`: as `setup`)."""
    spec, config, strategies = setup(row, previous_step, one_length)
    estimator = Estimator(spec, target="cuda", strategies=strategies, deferred_sync=defers_sync(row, config),
                          extrapolate_batch=extrapolate_batch, full_depth=full_depth)
    with libraries_as_measured(row):
        value, basis = predicted(row, estimator, config)
    return value, basis, config, strategies


def run_row(row: dict, extrapolate_batch: bool = False, full_depth: bool = False) -> dict:
    previous = holds_previous_step(row)
    value, basis, config, strategies = prediction(row, extrapolate_batch, full_depth, previous)
    bnb = measured_code.bitsandbytes_of(row["id"]) if row["quantization"] != "none" else None
    result = {"id": row["id"], "quality": row["quality"], "metric": row["metric"], "config": config.describe(),
              "model_code": MODEL_CODE[model_code(row)] + (f"; bitsandbytes {bnb}" if bnb else "")
              + ("; NF4 without double quantization" if bnb and row["id"].startswith(measured_code.PLAIN_NF4) else "")
              + ("; re-entrant checkpointing" if reentrant(row) else "")
              + ("; gradients reduced on the last micro-batch" if defers_sync(row, config) else "")
              + ("; FSDP1's root unit as one flat parameter" if litgpt_fsdp1(row, config) else "")
              + ("; the previous iteration held through the forward" if previous else "")
              + ("; batches of varied length (the reserve after shorter ones)"
                 if varied_lengths(row) and row["metric"] == "reserved" else ""),
              "lora_targets": strategies[0].target_modules if strategies else None,
              "measured_bytes": row["value_bytes"], "predicted_bytes": int(value), "compared": basis,
              "error": round(value / row["value_bytes"] - 1, 4)}
    if previous:
        without = prediction(row, extrapolate_batch, full_depth)[0]
        result["error_without_previous_step"] = round(without / row["value_bytes"] - 1, 4)
    if varied_lengths(row) and row["metric"] == "reserved":  # an allocated figure holds no reserve
        one = prediction(row, extrapolate_batch, full_depth, previous, one_length=True)[0]
        result["error_one_length"] = round(one / row["value_bytes"] - 1, 4)
    return result


def summary(rows: list[dict]) -> dict:
    errors = [r["error"] for r in rows]
    return {"rows": len(rows), "median_abs": round(statistics.median(abs(e) for e in errors), 4),
            "worst_abs": round(max(abs(e) for e in errors), 4),
            "largest_under": round(min(min(errors), 0.0), 4)} if rows else {"rows": 0}


def merge(path: Path, done: list[dict], seconds: int, load: float) -> None:
    """`done` (results of some rows) written into the results file at `path` in place of those rows' old
    results, its summary recomputed and the run noted in its "merged" list."""
    found = json.loads(path.read_text())
    new = {r["id"]: r for r in done}
    rows = [new.pop(r["id"], r) for r in found["rows"]] + list(new.values())
    found["summary"] = {"headline (good + caveat rows)": summary([r for r in rows if r["quality"] != "suspect"]),
                        "good rows": summary([r for r in rows if r["quality"] == "good"]),
                        "suspect rows (figure inconsistent with its own setup)":
                            summary([r for r in rows if r["quality"] == "suspect"])}
    found["rows"] = rows
    found.setdefault("merged", []).append({"date": datetime.date.today().isoformat(), "rows": sorted(r["id"] for r in done),
                                           "load_at_start": load, "seconds": seconds})
    path.write_text(json.dumps(found, indent=1) + "\n")
    print(f"-> {path} ({len(done)} rows merged)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="row ids to predict (default: all)")
    parser.add_argument("--extrapolate-batch", action="store_true",
                        help="predict as `autofit dry-run` does: micro-batches above 2 extrapolated from "
                             "simulations at 1 and 2 (default: each row's micro-batch simulated)")
    parser.add_argument("--merge", action="store_true",
                        help="with --only: write those rows into the results file in place of their old results "
                             "(the others kept as they are) and recompute its summary")
    parser.add_argument("--full-depth", action="store_true",
                        help="simulate every block of each model instead of two, extrapolated (what the "
                             "depth extrapolation misses; slower)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started, load = time.time(), os.getloadavg()[0]
    table = [r for r in json.loads(ROWS.read_text()) if not args.only or r["id"] in args.only]
    done, apart = [], []
    for row in table:
        why = expressible(row)
        if why:
            apart.append({"id": row["id"], "missing": why})
            continue
        try:
            result = run_row(row, args.extrapolate_batch, args.full_depth)
        except Exception as exc:  # noqa: BLE001 - a row that cannot be predicted is reported, never dropped
            apart.append({"id": row["id"], "missing": f"prediction failed: {type(exc).__name__}: {exc}"[:300]})
            print(f"{row['id']:48} FAILED {type(exc).__name__}: {exc}"[:200], flush=True)
            continue
        done.append(result)
        print(f"{result['id']:48} {result['quality']:8} {result['metric']:9} measured "
              f"{row['value_bytes'] / 2**30:7.2f} GiB predicted {result['predicted_bytes'] / 2**30:7.2f} GiB "
              f"{result['error']:+7.1%}" + (f" ({result['error_without_previous_step']:+.1%} without the previous step)"
                                            if "error_without_previous_step" in result else ""), flush=True)
    headline = [r for r in done if r["quality"] != "suspect"]
    report = {"headline (good + caveat rows)": summary(headline), "good rows": summary([r for r in done if r["quality"] == "good"]),
              "suspect rows (figure inconsistent with its own setup)": summary([r for r in done if r["quality"] == "suspect"])}
    for name, s in report.items():
        if s["rows"]:
            print(f"{name}: {s['rows']} rows, median |error| {s['median_abs']:.1%}, worst {s['worst_abs']:.1%}, "
                  f"largest under-prediction {s['largest_under']:.1%}")
    for row in apart:
        print(f"not expressible: {row['id']}: {row['missing']}")
    what = "estimator (target cuda) vs published measured GPU training peaks"
    out = RESULT
    if args.extrapolate_batch:
        what += ", micro-batches above 2 extrapolated from 1 and 2 as autofit dry-run does"
        out = RESULT.with_name("calibration-extrapolated-batch.json")
    if args.full_depth:
        what += ", every block simulated (no extrapolation in depth)"
        out = out.with_name(out.stem + "-full-depth.json")
    if args.only and args.merge:
        merge(out, done, round(time.time() - started), load)
    if args.only:
        return
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "what": what, "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (CPU kernels stand in for CUDA in the simulation)",
        "load_at_start": load, "torch": torch.__version__, "seconds": round(time.time() - started),
        "summary": report, "rows": done, "not_expressible": apart}, indent=1) + "\n")


if __name__ == "__main__":
    main()
