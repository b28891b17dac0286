"""Builds published.json (calibration rows of MEASURED peak GPU memory from public sources).
Every figure below is quoted from a file read via the search tool's read_file; see "source".
Run: python3 build_published.py  -> writes published.json next to this script."""
import json, os, copy

GB = 10**9
GiB = 2**30

def b(value, unit):
    return int(round(value * (GB if unit == "GB" else GiB)))

# ---------------------------------------------------------------- model configs
# dims verified from Lightning-AI/litgpt litgpt/config.py (read_file id 1877553054) unless noted
M = {
 "phi-1_5": dict(hf_id="microsoft/phi-1_5", hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192,
                 vocab=51200, notes="litgpt config: n_embd 2048, n_layer 24, n_head default 32, intermediate default 4*n_embd, padded_vocab 51200 (true vocab 50257), rotary_percentage 0.5, parallel residual + shared attention norm, lm_head bias, GELU MLP (not SwiGLU), untied lm_head",
                 dims_source="litgpt/config.py"),
 "phi-2": dict(hf_id="microsoft/phi-2", hidden=2560, layers=32, heads=32, kv_heads=32, intermediate=10240,
               vocab=51200, notes="litgpt config: n_embd 2560, n_layer 32, n_head default 32, intermediate default 4*n_embd, padded_vocab 51200, GELU MLP, parallel residual, untied lm_head with bias",
               dims_source="litgpt/config.py"),
 "stablelm-3b": dict(hf_id="stabilityai/stablelm-base-alpha-3b", hidden=4096, layers=16, heads=32, kv_heads=32,
                     intermediate=16384, vocab=50688, notes="litgpt Config defaults (GPT-NeoX style): n_embd 4096, n_layer 16, n_head 32, intermediate 4*4096, vocab 50254 padded to multiple of 512 = 50688, rotary 0.25, parallel residual, biases, GELU MLP, untied lm_head",
                     dims_source="litgpt/config.py (Config defaults)"),
 "llama2-7b": dict(hf_id="meta-llama/Llama-2-7b-hf", hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008,
                   vocab=32000, notes="SwiGLU MLP, RMSNorm, untied lm_head", dims_source="litgpt/config.py"),
 "llama2-13b": dict(hf_id="meta-llama/Llama-2-13b-hf", hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824,
                    vocab=32000, notes="SwiGLU MLP, RMSNorm, untied lm_head", dims_source="litgpt/config.py"),
 "llama2-70b": dict(hf_id="meta-llama/Llama-2-70b-hf", hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672,
                    vocab=32000, notes="SwiGLU, GQA 8 kv heads", dims_source="litgpt/config.py"),
 "llama3-8b": dict(hf_id="meta-llama/Meta-Llama-3-8B", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                   vocab=128256, notes="SwiGLU, GQA, untied lm_head", dims_source="litgpt/config.py"),
 "llama31-8b": dict(hf_id="meta-llama/Llama-3.1-8B", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                    vocab=128256, notes="same dims as Llama-3-8B; torchtitan builds its own llama3 8B flavor with these dims", dims_source="litgpt/config.py"),
 "llama31-70b": dict(hf_id="meta-llama/Llama-3.1-70B-Instruct", hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672,
                     vocab=128256, notes="", dims_source="litgpt/config.py"),
 "llama32-3b": dict(hf_id="meta-llama/Llama-3.2-3B", hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192,
                    vocab=128256, notes="tied embeddings (HF config; tying not stated in litgpt config); PEFT run reports num_total_params 3,212,749,824", dims_source="litgpt/config.py"),
 "mistral-7b": dict(hf_id="mistralai/Mistral-7B-v0.1", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                    vocab=32000, notes="sliding_window 4096 irrelevant at seq<=512", dims_source="litgpt/config.py"),
 "tinyllama": dict(hf_id="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", hidden=2048, layers=22, heads=32, kv_heads=4,
                   intermediate=5632, vocab=32000, notes="SwiGLU, GQA, untied", dims_source="litgpt/config.py"),
 "gemma-2b": dict(hf_id="google/gemma-2b", hidden=2048, layers=18, heads=8, kv_heads=1, intermediate=16384, vocab=256000,
                  notes="head_size 256, MQA, GeGLU MLP (GemmaMLP), tied embeddings, scale_embeddings", dims_source="litgpt/config.py"),
 "yi-34b": dict(hf_id="01-ai/Yi-34B", hidden=7168, layers=60, heads=56, kv_heads=8, intermediate=20480, vocab=64000,
                notes="DIMS NOT VERIFIED in this session (from memory of the HF config.json) - check before use", dims_source="unverified"),
}

rows = []
def add(**kw):
    r = dict(kw)
    r["model"] = copy.deepcopy(r["model"])
    rows.append(r)

# ============================================================ A. litgpt resource tables (Oct 2023)
RT_SRC = ("Lightning-AI/litgpt tutorials/resource-tables.md @ commit 4839345a97a0a90bc5f2361664b04d665c9a0e89 "
          "(doc says: Last updated 10/20/2023, LitGPT commit 8641822, A100-SXM4-40GB, PyTorch 2.1.0+cu121, bitsandbytes 0.41.1)")
RT_METRIC = ("allocated: finetune/lora.py of that era prints `Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB` "
             "after training (verified in Lightning-AI/litgpt finetune/lora.py @ cc190152085ac60fe708455b2df8877f82d37087). "
             "Peak is over the whole run (incl. validation + a 100-token generation, and model setup), never reset.")
RT_COMMON = dict(
    source=RT_SRC, grad_accum=None, precision="pure bf16 (--precision bf16-true: weights, LoRA params, grads and AdamW states all bf16)",
    optimizer="torch.optim.AdamW (weight_decay 0.01) on LoRA params only",
    activation_checkpointing="none", sharding="none", num_gpus=1, gpu="A100-SXM4-40GB", quantization="none",
    cpu_offload=False, metric="allocated", metric_evidence=RT_METRIC,
    other_flags={"lm_head_chunk_size": 128, "loss": "chunked_cross_entropy (chunk 128) - logits produced in 128-token chunks",
                 "dataset": "Alpaca (scripts/prepare_alpaca.py of that lit-gpt version), batches right-padded to longest sample in micro-batch; iteration 0 forces the longest sample",
                 "compile": False, "flash/sdpa": "torch SDPA (flash) via F.scaled_dot_product_attention"},
)
def rt_lora(model_key, L):
    return {"rank": 8, "alpha": 16, "dropout": 0.05, "targets": ["q", "v"],
            "note": f"lit-gpt LoRA on fused qkv (enable_lora=[q,False,v]); trainable params reported in table = {L}"}
rt = [
 ("litgpt-rt-phi15-lora-mb1", "phi-1_5", 1044, 1, "| 1.3 B | phi-1.5        | None         | 1               | 1,572,864            | 4.82 GB     | 1.62 min           |", 4.82, "1,572,864"),
 ("litgpt-rt-phi15-lora-mb2", "phi-1_5", 1044, 2, "| 1.3 B | phi-1.5        | None         | 2               | 1,572,864            | 6.76 GB     | 1.65 min           |", 6.76, "1,572,864"),
 ("litgpt-rt-phi15-lora-mb4", "phi-1_5", 1044, 4, "| 1.3 B | phi-1.5        | None         | 4               | 1,572,864            | 10.68 GB    | 1.70 min           |", 10.68, "1,572,864"),
 ("litgpt-rt-stablelm3b-lora-mb1", "stablelm-3b", 1034, 1, "| 3 B   | StableLM Alpha | None         | 1               | 2,097,152            | 9.69 GB     | 1.24 min           |", 9.69, "2,097,152"),
 ("litgpt-rt-stablelm3b-lora-mb4", "stablelm-3b", 1034, 4, "| 3 B   | StableLM Alpha | None         | 4               | 2,097,152            | 16.92 GB    | 1.50 min           |", 16.92, "2,097,152"),
 ("litgpt-rt-llama2-7b-lora-mb1", "llama2-7b", 1304, 1, "| 7 B   | Llama 2        | None         | 1               | 4,194,304            | 21.30 GB    | 2.36 min           |", 21.30, "4,194,304"),
 ("litgpt-rt-llama2-7b-lora-mb2", "llama2-7b", 1304, 2, "| 7 B   | Llama 2        | None         | 2               | 4,194,304            | 29.07 GB    | 2.52 min           |", 29.07, "4,194,304"),
 ("litgpt-rt-llama2-13b-lora-mb1", "llama2-13b", 1304, 1, "| 13 B  | Llama 2        | None         | 1               | 6,553,600            | 38.12 GB    | 3.19 min           |", 38.12, "6,553,600"),
]
for id_, mk, seq, mb, quote, val, L in rt:
    add(id=id_, **{**RT_COMMON, "grad_accum": 128 // mb}, quote=quote, model=M[mk], seq_len=seq, micro_batch=mb,
        lora=rt_lora(mk, L), value_bytes=b(val, "GB"), value_as_published=f"{val} GB (1 GB = 1e9 bytes)",
        expressible=True, quality="good",
        notes=(f"seq_len = longest Alpaca training example for this tokenizer as stated in the doc ({seq} tokens); the first "
               "micro-batch is padded to it. grad_accum = 128/micro_batch (batch_size 128 in script) - irrelevant for LoRA grads. "
               "Peak includes model load (bf16 weights loaded directly) and eval; eval/generation are inference-mode and smaller than training. "
               "Chunked lm_head means full [B,T,V] logits are never materialised at once in forward."))

# QLoRA row from the same table
add(id="litgpt-rt-llama2-7b-qlora-nf4-mb1", **{**RT_COMMON, "quantization": "nf4 (bitsandbytes, --quantize bnb.nf4, no double quant)",
    "optimizer": "bnb.optim.PagedAdamW (32-bit, paged; chosen automatically when --quantize bnb.* in that lora.py) on LoRA params"},
    quote="| 7 B   | Llama 2        | bnb.nf4      | 1               | 4,194,304            | 14.14 GB    | 3.68 min           |",
    model=M["llama2-7b"], seq_len=1304, micro_batch=1, lora=rt_lora("llama2-7b", "4,194,304"),
    value_bytes=b(14.14, "GB"), value_as_published="14.14 GB (1e9)", expressible=True, quality="caveat",
    notes=("NF4 via bnb Linear4bit on linear layers; embeddings/lm_head stay bf16 (lit-gpt quantization() context replaces Linear). "
           "Paged optimizer state lives in CUDA unified memory outside the PyTorch caching allocator, so it is NOT counted by max_memory_allocated "
           "(tiny for LoRA anyway). Weights were loaded to CPU first then quantized on move to GPU; a per-layer bf16 transient may be in the peak."))

# FSDP multi-GPU rows
RT_FSDP = {**RT_COMMON, "activation_checkpointing": "full (per transformer Block, FSDPStrategy activation_checkpointing_policy={Block})",
           "sharding": "FSDP1 FULL_SHARD via Lightning FSDPStrategy(auto_wrap_policy={Block}, state_dict_type='full', limit_all_gathers=True)"}
add(id="litgpt-rt-llama2-7b-lora-2xa100-fsdp-mb1", **{**RT_FSDP, "num_gpus": 2, "gpu": "A100 (table says '2 x A100'; header says A100-SXM4-40GB)"},
    quote="| 7 B   | Llama 2        | None         | 1               | 4,194,304            | 2 x A100 | 22.18 GB    | 5.93 min           |",
    model=M["llama2-7b"], seq_len=1304, micro_batch=1, lora=rt_lora("llama2-7b", "4,194,304"),
    value_bytes=b(22.18, "GB"), value_as_published="22.18 GB (1e9), rank-0 value", expressible=True, quality="suspect",
    notes=("Per-GPU value is HIGHER than the single-GPU no-checkpointing run (21.30 GB) although weights are sharded and AC is on, and it barely "
           "grows with micro-batch (mb2 22.47, mb4 23.39). Likely the peak was set outside the training step (e.g. full-state-dict checkpoint "
           "loading into the FSDP model on each rank, or the generation in validate()). Use only as an upper-bound sanity row."))
add(id="litgpt-rt-llama2-13b-lora-4xa100-fsdp-mb1", **{**RT_FSDP, "num_gpus": 4, "gpu": "A100 (table says '4 x A100'; header says A100-SXM4-40GB)"},
    quote="| 13 B  | Llama 2        | None         | 1               | 6,553,600            | 4 x A100 | 35.57 GB    | 10.25 min          |",
    model=M["llama2-13b"], seq_len=1304, micro_batch=1, lora=rt_lora("llama2-13b", "6,553,600"),
    value_bytes=b(35.57, "GB"), value_as_published="35.57 GB (1e9), rank-0 value", expressible=True, quality="suspect",
    notes="Same concern as the 2xA100 7B row: sharded 13B bf16 weights are ~6.5 GB/GPU yet 35.57 GB is reported; peak probably not the steady-state step.")

# ============================================================ B. litgpt config_hub README (2024, A10G)
CH_SRC = "Lightning-AI/litgpt config_hub/finetune/README.md @ commit 03ffc5515b251fb7e3a461efd0e3c163e45b6b3b"
CH_METRIC = ("allocated: litgpt/finetune/lora.py and litgpt/finetune/full.py print `Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB` "
             "after fit() (verified: litgpt/finetune/lora.py @ 01fe959c..., litgpt/finetune/full.py @ 0077627d...). Whole-run peak, never reset.")
CH_COMMON = dict(source=CH_SRC, precision="pure bf16 (precision: bf16-true)", activation_checkpointing="none", sharding="none",
                 num_gpus=1, gpu="A10G (24 GB)", quantization="none", cpu_offload=False, metric="allocated", metric_evidence=CH_METRIC,
                 optimizer="torch.optim.AdamW (bf16 states because params are bf16), betas (0.9,0.95), wd 0",
                 other_flags={"dataset": "litgpt.data.Alpaca2k, max_seq_length 512 (truncation); batches padded to longest sample in batch",
                              "lm_head_chunk_size": "128 in finetune/lora.py (chunked logits); full.py computes full logits then chunked_cross_entropy",
                              "compile": False})
def ch_lora(r, targets, dropout=0.05, alpha=16):
    return {"rank": r, "alpha": alpha, "dropout": dropout, "targets": targets, "note": "litgpt LoRA (fused qkv with per-q/k/v enable flags)"}
ch = [
 ("litgpt-hub-llama2-7b-lora-mb2", "llama2-7b", 2, 4, "| llama-2-7b/lora.yaml              | llama-2-7b             | 4      | 512            | 2                | 1xA10G  | 32.82 min        | $1.0 | 19.77 GB    | 0.802           | 2.230                 | 40.3%           |",
  19.77, ch_lora(32, ["q", "v"]), None, "config_hub/finetune/llama-2-7b/lora.yaml @ 56ac240732139626f6ab0e8191c15d396fda32c8 (lora_r 32, q+v, mb 2, global 8, max_seq_length 512, epochs 4 - matches README row)"),
 ("litgpt-hub-llama2-7b-qlora-mb2", "llama2-7b", 2, 4, "| llama-2-7b/qlora.yaml             | llama-2-7b             | 4      | 512            | 2                | 1xA10G  | 45.67 min        | $1.4 | 13.68 GB    | 0.814           | 2.258                 | 38.6%           |",
  13.68, ch_lora(32, ["q", "v"]), "nf4", "config_hub/finetune/llama-2-7b/qlora.yaml @ 0077627db0f53ca17d68ecc4e6d10f7a560601b5 (quantize bnb.nf4, lora_r 32, q+v, mb 2)"),
 ("litgpt-hub-llama3-8b-lora-mb1", "llama3-8b", 1, 8, "| llama-3-8b/lora.yaml              | llama-3-8b             | 2      | 512            | 1                | 1xA10G  | 14.79 min        | $0.4 | 19.73 GB    | 0.888           | 2.431                 | 62.4%           |",
  19.73, ch_lora(32, ["q", "v"]), None, "config_hub/finetune/llama-3-8b/lora.yaml @ 3352a7aad4dabb6f56be6429c27830b481691eb4 (lora_r 32, q+v, mb 1, global 8)"),
 ("litgpt-hub-llama3-8b-qlora-mb2", "llama3-8b", 2, 4, "| llama-3-8b/qlora.yaml             | llama-3-8b             | 2      | 512            | 2                | 1xA10G  | 22.24 min        | $0.7 | 17.41 GB    | 0.939           | 2.558                 | 62.2%           |",
  17.41, ch_lora(32, ["q", "v"]), "nf4", "config_hub/finetune/llama-3-8b/qlora.yaml @ 0077627db0f53ca17d68ecc4e6d10f7a560601b5 (bnb.nf4, lora_r 32, q+v, mb 2)"),
 ("litgpt-hub-mistral-7b-lora-mb2", "mistral-7b", 2, 4, "| mistral-7b/lora.yaml              | mistral-7b             | 4      | 512            | 2                | 1xA10G  | 31.01 min        | $0.9 | 20.66 GB    | 0.794           | 2.211                 | 57.9%           |",
  20.66, ch_lora(32, ["q", "v"]), None, "config_hub/finetune/mistral-7b/lora.yaml @ 0d207708b5a4de272c2eeb9e6592d355bed058f6 (lora_r 32, q+v, mb 2)"),
 ("litgpt-hub-phi2-lora-mb4", "phi-2", 4, 2, "| phi-2/lora.yaml                   | phi-2                  | 1      | 512            | 4                | 1xA10G  | 3.78 min         | $0.1 | 13.98 GB    | 0.819           | 2.269                 | 53.0%           |",
  13.98, ch_lora(8, ["q", "k", "v", "proj", "mlp", "head"]), None, "config_hub/finetune/phi-2/lora.yaml @ 14db26be671ae36c52d981727baee46f92df41c1 (lora_r 8, all linear incl. lm_head, mb 4, global 8)"),
 ("litgpt-hub-tinyllama-lora-mb8", "tinyllama", 8, 1, "| tiny-llama/lora.yaml              | tiny-llama             | 3      | 512            | 8                | 1xA10G  | 8.09 min         | $0.2 | 13.50 GB    | 1.039           | 2.826                 | 25.5%           |",
  13.50, ch_lora(32, ["q", "k", "v", "proj", "mlp", "head"]), None, "config_hub/finetune/tiny-llama/lora.yaml @ 089fc5c6ce6e6a61e1c1ef0d64b010ab0f460e4a (lora_r 32, all linear incl. lm_head, mb 8, global 8)"),
 ("litgpt-hub-stablelm3b-lora-mb1", "stablelm-3b", 1, 8, "| stablelm-base-alpha-3b/lora.yaml  | stablelm-base-alpha-3b | 4      | 512            | 1                | 1xA10G  | 13.07 min        | $0.4 | 8.58 GB     | 1.361           | 3.900                 | 25.9%           |",
  8.58, ch_lora(32, ["q", "v"]), None, "config_hub/finetune/stablelm-base-alpha-3b/lora.yaml @ 3352a7aad4dabb6f56be6429c27830b481691eb4 (lora_r 32, q+v, mb 1)"),
 ("litgpt-hub-stablelm3b-qlora-mb1", "stablelm-3b", 1, 8, "| stablelm-base-alpha-3b/qlora.yaml | stablelm-base-alpha-3b | 4      | 512            | 1                | 1xA10G  | 25.86 min        | $0.8 | 5.24 GB     | 1.388           | 4.009                 | 26.1%           |",
  5.24, ch_lora(32, ["q", "v"]), "nf4", "config_hub/finetune/stablelm-base-alpha-3b/qlora.yaml @ 141c8bfbca4d0280e8a746ac6fc7b898cfeca7f0 (bnb.nf4, lora_r 32, q+v, mb 1)"),
 ("litgpt-hub-gemma2b-lora-mb2", "gemma-2b", 2, 3, "| gemma-2b/lora.yaml                | gemma-2b               | 2      | 512            | 2                | 1xA10G  | 9.41 min         | $0.3 | 12.62 GB    | 0.981           | 2.666                 | 34.4%           |",
  12.62, ch_lora(8, ["q", "k", "v", "proj", "mlp", "head"], dropout=0.1), None, "config_hub/finetune/gemma-2b/lora.yaml @ 3352a7aad4dabb6f56be6429c27830b481691eb4 (lora_r 8, dropout 0.1, all linear incl. head, mb 2, global 6, wd 0.2)"),
]
for id_, mk, mb, ga, quote, val, lora, q, cfg in ch:
    extra = {}
    if q == "nf4":
        extra = {"quantization": "nf4 (bitsandbytes via Lightning BitsandbytesPrecision('nf4', bf16))",
                 "optimizer": "bnb.optim.PagedAdamW (32-bit paged) - litgpt instantiate_bnb_optimizer replaces torch AdamW when quantizing"}
    add(id=id_, **{**CH_COMMON, **extra}, quote=quote, model=M[mk], seq_len=512, micro_batch=mb, grad_accum=ga, lora=lora,
        value_bytes=b(val, "GB"), value_as_published=f"{val} GB (1e9)", config_file=cfg,
        expressible=True, quality="caveat" if q else "good",
        notes=("seq_len 512 is the truncation cap; batches are padded to the longest sample in the batch, so the peak is at 512 only if "
               "Alpaca2k has samples >= 512 tokens for this tokenizer (not verified). Config yaml read at a commit that may differ from "
               "the benchmarked one; the README row's mb/seq/epochs match the yaml read. "
               + ("NF4: paged optimizer state is outside the caching allocator (not in max_memory_allocated). " if q else "")
               + "Peak is whole-run (includes a short validation and a 100-token generate with a KV cache for batch 1)."))

# full finetunes from the same README
add(id="litgpt-hub-tinyllama-full-mb4", **{**CH_COMMON, "optimizer": "torch.optim.AdamW on all params (bf16 states), betas (0.9,0.95), wd 0"},
    quote="| tiny-llama/full.yaml              | tiny-llama             | 1      | 512            | 4                | 1xA10G  | 2.58 min         | $0.1 | 14.10 GB    | 1.088           | 2.968                 | 24.6%           |",
    model=M["tinyllama"], seq_len=512, micro_batch=4, grad_accum=8, lora=None,
    value_bytes=b(14.10, "GB"), value_as_published="14.10 GB (1e9)",
    config_file="config_hub/finetune/tiny-llama/full.yaml @ 089fc5c6ce6e6a61e1c1ef0d64b010ab0f460e4a (bf16-true, devices 1, mb 4, global 32, max_seq_length 512)",
    expressible=True, quality="good",
    notes=("Full finetune, single GPU, no AC. litgpt full.py: model(input_ids) materialises full bf16 logits [4,T,32000] then chunked_cross_entropy. "
           "Same seq_len caveat as other config_hub rows. The README also lists a 4xA10G run with the identical 14.10 GB (suspicious duplicate) - not included."))
add(id="litgpt-hub-gemma2b-full-4xa10g-fsdp-mb1", **{**CH_COMMON, "num_gpus": 4, "gpu": "A10G (24 GB) x4",
    "sharding": "FSDP1 FULL_SHARD via Lightning FSDPStrategy(auto_wrap_policy={Block}, state_dict_type='full', limit_all_gathers=True, cpu_offload=False)",
    "activation_checkpointing": "full (per Block)",
    "optimizer": "torch.optim.AdamW on all params (bf16 states), betas (0.9,0.95), wd 0"},
    quote="| gemma-2b/full.yaml                | gemma-2b               | 1      | 512            | 1                | 4xA10G  | 14.06 min        | $1.1 | 17.43 GB    | 1.021           | 2.777                 | 32.4%           |",
    model=M["gemma-2b"], seq_len=512, micro_batch=1, grad_accum=4, lora=None,
    value_bytes=b(17.43, "GB"), value_as_published="17.43 GB (1e9), rank-0",
    config_file="config_hub/finetune/gemma-2b/full.yaml @ 0fe99f85626a9846081750d8cbe7c18b69712f28 (devices 4, mb 1, global 16, max_seq_length 512, max_steps 50)",
    expressible=True, quality="caveat",
    notes=("FSDP over 4 GPUs with AC. gemma-2b has a 256000-token tied embedding (524M params) so the logits [1,T,256000] and the "
           "all-gathered embedding dominate non-layer memory. 4xA10G LoRA rows in the same README repeat the 1xA10G numbers exactly, which "
           "suggests some multi-GPU rows were not re-measured; this full row has devices: 4 in its yaml, so it probably was."))

# ============================================================ C. litgpt finetune_lora.md precision comparison (seq len unknown)
FL_SRC = "Lightning-AI/litgpt tutorials/finetune_lora.md @ commit 064fd523128cdc1bfc4d76cfeff67cb36078e56b (lit-gpt era, 2023)"
for id_, quote, val, prec in [
  ("litgpt-tut-stablelm3b-lora-mb4-bf16mixed", "| Default (bfloat16-mixed)                                | 33.50 GB         | 591.78s        | 0.9207    | 7.61 GB          |", 33.50,
   "bf16 autocast (bf16-mixed: fp32 weights/grads/optimizer, bf16 autocast compute)"),
  ("litgpt-tut-stablelm3b-lora-mb4-bf16true", "| --precision \"bf16-true\"                                 | 15.86 GB         | 592.14s        | 0.9180    | 7.61 GB          |", 15.86,
   "pure bf16 (bf16-true)"),
]:
    add(id=id_, source=FL_SRC, quote=quote, model=M["stablelm-3b"], seq_len=None, micro_batch=4, grad_accum=None, precision=prec,
        optimizer="torch.optim.AdamW on LoRA params", activation_checkpointing="none", sharding="none", num_gpus=1,
        gpu="unknown (tutorial says finetuning demonstrated on a single RTX 3090 24GB, but 33.50 GB exceeds 24 GB so the table was measured on a larger GPU)",
        lora={"rank": 8, "alpha": 16, "dropout": 0.05, "targets": ["q", "v"], "note": "lit-gpt defaults of that time (assumed, script defaults)"},
        quantization="none", cpu_offload=False, metric="allocated",
        metric_evidence="lit-gpt finetune/lora.py of that period printed torch.cuda.max_memory_allocated()/1e9 as 'Memory used' (same code family as row litgpt-rt-*); table column is 'Training Memory'.",
        value_bytes=b(val, "GB"), value_as_published=f"{val} GB (1e9)",
        expressible=False, quality="caveat",
        notes=("Not expressible: sequence length unknown (text says 'StableLM 3B model finetuned with LoRA on Alpaca for 5,000 iterations using a microbatch size of 4'; "
               "the Alpaca prep/truncation of that lit-gpt version was not verified and the 7B numbers in the same doc (20.60 GB at mb4) are inconsistent with the Oct-2023 "
               "resource table (mb4 OOM on 40 GB), so the effective seq len was probably shorter). Useful only as a bf16-mixed vs bf16-true ratio (33.50/15.86)."),
        other_flags={"dataset": "Alpaca", "iterations": 5000})

# ============================================================ D. torchtune tutorials
TT_LORA_SRC = "pytorch/torchtune docs/source/tutorials/lora_finetune.rst @ commit 14b59e7a1d0115eb2df8a009f8b7d5c7c41241a4 (table 'Trading off memory and model performance with LoRA')"
TT_QLORA_SRC = "pytorch/torchtune docs/source/tutorials/qlora_finetune.rst @ commit 0e44fed1e1683921cb03f989f6ba3cd0ee6c56f8"
TT_METRIC = ("reserved: the QLoRA tutorial's table labels the same LoRA baseline number (15.57 GB) as 'Peak memory reserved, training'. "
             "torchtune get_memory_stats of that era computed torch.cuda.max_memory_reserved(device) / 1e9 (GB = 1e9; later versions switched to 1024**3 / GiB).")
TT_COMMON = dict(precision="pure bf16 (dtype: bf16 - base weights, LoRA weights, grads, AdamW states in bf16)",
                 optimizer="torch.optim.AdamW (wd 0.01) on LoRA params", grad_accum=64,
                 activation_checkpointing="full (enable_activation_checkpointing: True, per transformer layer)",
                 sharding="none", num_gpus=1, gpu="unknown (not stated in the tutorial)", quantization="none",
                 cpu_offload=False, metric="reserved", metric_evidence=TT_METRIC, model=M["llama2-7b"], seq_len=512, micro_batch=2,
                 other_flags={"recipe": "lora_finetune_single_device", "config": "llama2/7B_lora_single_device (batch_size 2)",
                              "dataset": "alpaca_cleaned_dataset, max_seq_len default 512 (torchtune/datasets/_alpaca.py: max_seq_len: int = 512), padded to longest in batch",
                              "loss": "torch.nn.CrossEntropyLoss on full logits (early torchtune decoder returned fp32 logits)", "compile": False})
for id_, quote, val, lora in [
  ("torchtune-tut-llama2-7b-lora-qv-r8", "* - Q and V only / - 8 / - 16 / - **15.57 GB** / - 0.475", 15.57,
   {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}),
  ("torchtune-tut-llama2-7b-lora-all-r8", "* - all layers / - 8 / - 16 / - 15.87 GB / - 0.508", 15.87,
   {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "output_proj", "mlp(w1,w2,w3)", "output (lm_head)"]}),
  ("torchtune-tut-llama2-7b-lora-qv-r64", "* - Q and V only / - 64 / - 128 / - 15.86 GB / - 0.504", 15.86,
   {"rank": 64, "alpha": 128, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}),
  ("torchtune-tut-llama2-7b-lora-all-r64", "* - all layers / - 64 / - 128 / - 17.04 GB / - **0.514**", 17.04,
   {"rank": 64, "alpha": 128, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "output_proj", "mlp(w1,w2,w3)", "output (lm_head)"]}),
]:
    add(id=id_, source=TT_LORA_SRC, quote=quote + "  (RST list-table row, cells joined with ' / ')", **TT_COMMON, lora=lora,
        value_bytes=b(val, "GB"), value_as_published=f"{val} GB (1e9)", expressible=True, quality="caveat",
        notes=("'all layers' = the tutorial's config edit: lora_attn_modules ['q_proj','k_proj','v_proj','output_proj'], apply_lora_to_mlp True, "
               "apply_lora_to_output True. LoRA dropout default 0.0 in torchtune. GPU model and torchtune commit not stated. "
               "seq_len 512 is the truncation cap; Alpaca-cleaned does contain samples longer than 512 tokens so the cap is reached over an epoch (plausible, not verified)."))
add(id="torchtune-tut-llama2-7b-lora-qv-r8-init", source=TT_QLORA_SRC,
    quote="GPU peak memory allocation: 13.96 GB / GPU peak memory reserved: 13.98 GB  ('Memory Stats after model init' for LoRA)",
    **{**TT_COMMON, "metric": "allocated"}, lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]},
    value_bytes=b(13.96, "GB"), value_as_published="13.96 GB (1e9) allocated after model init",
    expressible=True, quality="good",
    notes=("NOT a training-step peak: this is the static after-init footprint (bf16 weights + LoRA params) of the same LoRA config. "
           "Useful to calibrate the weights-only term (training peak reserved for the same run = 15.57 GB)."))
add(id="torchtune-tut-llama2-7b-qlora-train", source=TT_QLORA_SRC,
    quote="QLoRA                  9.13 GB                             9.29 GB   (columns: Peak memory reserved, model init | Peak memory reserved, training)",
    **{**TT_COMMON, "quantization": "nf4 (torchao NF4Tensor on LoRA-wrapped linears only; non-LoRA linears, embeddings and output stay bf16)"},
    lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targets": "UNCERTAIN - llama2/7B_qlora_single_device at tutorial time; the version read (commit 0031bfb0) has ['q_proj','v_proj','k_proj','output_proj'] + apply_lora_to_mlp True, apply_lora_to_output False"},
    value_bytes=b(9.29, "GB"), value_as_published="9.29 GB (1e9) reserved",
    expressible=True, quality="caveat",
    notes=("torchtune QLoRA quantizes ONLY the base weights of layers that carry LoRA adapters (per tutorial text), so which modules are NF4 "
           "depends on the target list - uncertain for the benchmarked config. The LoRA baseline of the same table is 15.57 GB reserved."))

# ============================================================ E. Answer.AI fsdp_qlora benchmarks (2x3090 / 2x4090)
FQ_SRC = "AnswerDotAI/fsdp_qlora benchmarks_03_2024.md @ commit 23fafdfb4af403d0808038adafbfd74de265d33a (benchmarks done Feb-Mar 2024)"
FQ_METRIC = ("reserved: train.py resets peak stats right before the training loop (torch.cuda.reset_peak_memory_stats) and reports "
             "torch.cuda.max_memory_reserved(local_rank)/2**30 'GiB' after epoch 0 (verified in AnswerDotAI/fsdp_qlora train.py @ 1a9fddfb...); "
             "the doc says the reported figure is 'peak reserved memory' and gives peak allocated separately for the LoRA rows.")
FQ_COMMON = dict(source=FQ_SRC, grad_accum=1,
    precision="pure bf16 (train.py --precision bf16 default: model loaded in bf16, LoRA params bf16, no autocast, no FSDP MixedPrecision)",
    optimizer="torch.optim.AdamW(betas=(0.9,0.95), eps=1e-5, weight_decay=0.1), not fused",
    activation_checkpointing="full, per LlamaDecoderLayer (use_gradient_checkpointing True; template command sets --reentrant_checkpointing True)",
    sharding="FSDP1 FULL_SHARD (sharding_strategy default full_shard), auto-wrap: decoder layers + each trainable LoRA leaf module, limit_all_gathers=True, use_orig_params=False",
    num_gpus=2, gpu="RTX 3090 24GB x2 (no NVLink, 280W)", cpu_offload=False, metric="reserved", metric_evidence=FQ_METRIC,
    other_flags={"dataset": "dummy (outputs longer than context, truncated -> every sample exactly context_length tokens)",
                 "attn": "sdpa", "template_cmd": "python train.py --model_name meta-llama/Llama-2-7b-hf --batch_size 1 --context_length 512 --train_type qlora --use_gradient_checkpointing True --reentrant_checkpointing True --use_cpu_offload False --log_to wandb --dataset dummy --dataset_samples 1024",
                 "loss": "HF LlamaForCausalLM labels -> loss (transformers ~4.38-4.40: logits upcast to fp32)"})
FQ_LORA = {"rank": 64, "alpha": 16, "dropout": 0.1, "targets": ["k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj"],
           "note": "PEFT LoraConfig; train.py defaults lora_rank 64, lora_alpha 16, lora_dropout 0.1, lora_target_modules 'all' -> this list (o_proj NOT included)"}
FQ_NF4 = "nf4 (bitsandbytes Linear4bit, quant_storage bf16, compute bf16) on all nn.Linear in model.model; lm_head and embeddings bf16"
fq = [
 ("fsdpqlora-llama2-7b-qlora-ctx512-bs1", "|   QLoRA    |      512       |       4.98        |  1,082   |", 4.98, "qlora", 512, 1, "reserved", {}),
 ("fsdpqlora-llama2-7b-qlora-ctx2048-bs1", "|   QLoRA    |      2048      |       5.21        |  1,564   |", 5.21, "qlora", 2048, 1, "reserved", {}),
 ("fsdpqlora-llama2-7b-lora-ctx512-bs1", "|    LoRA    |      512       |       10.24       |  2,597   |", 10.24, "lora", 512, 1, "reserved", {}),
 ("fsdpqlora-llama2-7b-lora-ctx512-bs1-alloc", "the peak allocated memory is 8.28 GiB vs 9.16 GiB, respectively", 8.28, "lora", 512, 1, "allocated", {}),
 ("fsdpqlora-llama2-7b-lora-ctx2048-bs1", "|    LoRA    |      2048      |       10.22       |  3,090   |", 10.22, "lora", 2048, 1, "reserved", {}),
 ("fsdpqlora-llama2-7b-lora-ctx2048-bs1-alloc", "the peak allocated memory is 8.28 GiB vs 9.16 GiB, respectively", 9.16, "lora", 2048, 1, "allocated", {}),
 ("fsdpqlora-llama2-7b-qlora-ctx2048-bs4", "|   QLoRA    |     4      |       11.22       |   998    |", 11.22, "qlora", 2048, 4, "reserved", {}),
 ("fsdpqlora-llama2-7b-qlora-ctx2048-bs10", "|   QLoRA    |     10     |       20.97       |   936    |", 20.97, "qlora", 2048, 10, "reserved", {}),
 ("fsdpqlora-llama2-7b-lora-ctx2048-bs4", "|    LoRA    |     4      |       16.14       |  1,366   |", 16.14, "lora", 2048, 4, "reserved", {}),
 ("fsdpqlora-llama2-7b-lora-ctx2048-bs6", "|    LoRA    |     6      |       21.35       |  1,199   |", 21.35, "lora", 2048, 6, "reserved", {}),
 ("fsdpqlora-llama2-7b-qlora-ddp-ctx2048-bs8", "|   QLoRA    | True |     8      |       20.94       |   875    |", 20.94, "qlora", 2048, 8, "reserved",
  {"sharding": "FSDP1 NO_SHARD (--sharding_strategy ddp; full model replica per GPU, grads all-reduced)"}),
 ("fsdpqlora-llama2-7b-lora-ddp-ctx2048-bs4", "|    LoRA    | True |     4      |       22.04       |   881    |", 22.04, "lora", 2048, 4, "reserved",
  {"sharding": "FSDP1 NO_SHARD (--sharding_strategy ddp; full model replica per GPU, grads all-reduced)"}),
]
for id_, quote, val, tt, ctx, bs, metric, over in fq:
    d = {**FQ_COMMON, **over}
    d["metric"] = metric
    add(id=id_, **d, quote=quote, model=M["llama2-7b"], seq_len=ctx, micro_batch=bs, lora=FQ_LORA,
        quantization=FQ_NF4 if tt == "qlora" else "none",
        value_bytes=b(val, "GiB"), value_as_published=f"{val} GiB (2**30)", expressible=True,
        quality="good",
        notes=(f"train_type={tt}. Table captions: '*Llama-2 7B with a batch size of one*' (ctx rows) / '*Llama-2 7B with Context Length of 2048*' (batch rows). "
               "Setup flags beyond the template command are inferred from train.py defaults of a later commit (1a9fddfb); LoRA rank/targets are defaults. "
               "Rank-0 value. Peak measured over the first epoch (1024 dummy samples)."))
add(id="fsdpqlora-yi34b-qlora-ctx2048-bs2", **FQ_COMMON, quote="|   QLoRA    |    False    |     2      |       23.05       |  5,041   |",
    model=M["yi-34b"], seq_len=2048, micro_batch=2, lora=FQ_LORA, quantization=FQ_NF4,
    value_bytes=b(23.05, "GiB"), value_as_published="23.05 GiB (2**30)", expressible=True, quality="caveat",
    notes="Table caption '*Yi 34B with Context Length of 2048*', CPU Offload False column. Near the 24 GB capacity (allocator pressure). Yi-34B dims unverified.")
add(id="fsdpqlora-llama2-70b-qlora-cpuoffload-ctx2048-bs2", **{**FQ_COMMON, "cpu_offload": True},
    quote="|   QLoRA    |    True     |     2      |       14.92       |  11,795  |",
    model=M["llama2-70b"], seq_len=2048, micro_batch=2, lora=FQ_LORA, quantization=FQ_NF4,
    value_bytes=b(14.92, "GiB"), value_as_published="14.92 GiB (2**30)", expressible=False, quality="good",
    notes=("Not expressible by a params+grads+optimizer+activations model without a CPU-offload term: FSDP CPUOffload(offload_params=True) keeps "
           "sharded params, grads and optimizer state on CPU and only materialises one wrapped unit at a time on GPU. Activation offload was NOT on for this row."))

# ============================================================ F. torchtitan Dec-2024 H100 benchmarks
TI_SRC = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ commit 31a17bfdb70bab6f62a13d21816a5339b911d6e3 (torch 1963fc8 2024/12/23, torchtitan 9dec370 2024/12/26)"
TI_METRIC = ("reserved: torchtitan DeviceMemoryMonitor logs device_memory_stats['reserved_bytes.all.peak'] converted with _to_gib (1024**3) as 'Memory(GiB)' "
             "(verified in pytorch/torchtitan torchtitan/metrics.py @ 021137a7...); doc: 'memory readings are stable across the whole training process'. Peak stats are reset at each log interval.")
TI_COMMON = dict(source=TI_SRC, model=M["llama31-8b"], seq_len=8192, micro_batch=2, grad_accum=1,
    precision="FSDP2 mixed precision (torchtitan default: sharded fp32 params, bf16 param all-gather/compute, fp32 gradient reduce); loss computed on logits cast to fp32",
    optimizer="torch.optim.AdamW (fp32 states, sharded)",
    activation_checkpointing="selective (doc: 'Selective activation checkpointing'; llama3_8b.toml default selective_ac_option='op')",
    lora=None, quantization="none", cpu_offload=False, metric="reserved", metric_evidence=TI_METRIC,
    gpu="H100 96GB HBM2e (Grand Teton, 500W)")
add(id="torchtitan-llama31-8b-fsdp8-bs2-seq8192", **TI_COMMON, sharding="FSDP2 full shard over 8 GPUs", num_gpus=8,
    quote="**Table 1** 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. Selective activation checkpointing. ... | FSDP | 5,762 | 82.4 |",
    value_bytes=b(82.4, "GiB"), value_as_published="82.4 GiB (2**30)", expressible=True, quality="caveat",
    other_flags={"compile": False, "float8": False, "dataset": "c4 (packed, fixed seq_len)"},
    notes=("Pretraining from scratch, full parameters. seq_len from train_configs/llama3_8b.toml (seq_len = 8192; read at commits 08a5a9f3 and 0011fb90). "
           "Whether AC option was 'op' or layer-interval is not stated in the benchmark (toml default 'op'). Reserved includes fragmentation. "
           "Large share of memory is output logits: 2*8192*128256 fp32 ~ 8.4 GB plus bf16 copy and grad."))
add(id="torchtitan-llama31-8b-fsdp8-compile-bs2-seq8192", **TI_COMMON, sharding="FSDP2 full shard over 8 GPUs", num_gpus=8,
    quote="| FSDP + torch.compile | 6,667 | 77.0 |  (Table 1: Llama 3.1 8B, 8 GPUs, local batch 2, selective AC)",
    value_bytes=b(77.0, "GiB"), value_as_published="77.0 GiB (2**30)", expressible=False, quality="good",
    other_flags={"compile": True, "float8": False},
    notes="Not expressible: torch.compile (per-block compile) changes activation storage (fusion). Delta vs eager row = -5.4 GiB.")
add(id="torchtitan-llama31-8b-fsdp128-bs2-seq8192", **TI_COMMON, sharding="FSDP2 full shard over 128 GPUs", num_gpus=128,
    quote="**Table 3** 1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch size 2, global batch size 256. Selective activation checkpointing. ... | FSDP | 5,605 | 67.0 |",
    value_bytes=b(67.0, "GiB"), value_as_published="67.0 GiB (2**30)", expressible=True, quality="caveat",
    other_flags={"compile": False, "float8": False},
    notes=("Pairs with the 8-GPU row: only the shard count changes (8 -> 128). Sharded state (fp32 param + fp32 grad + 2 fp32 Adam = 16 B/param, 8.03e9 params) "
           "shrinks by 16*8.03e9*(1/8-1/128) = 15.06e9 B = 14.0 GiB; observed delta 15.4 GiB - a direct check of the sharding term."))

# ============================================================ G. PEFT method comparison (MetaMathQA)
PE_METRIC = ("reserved (whole run): results JSON 'cuda_memory_max' = torch.cuda.max_memory_reserved() at the end of the run minus the (near-zero) reserved memory at init "
             "(verified in the matching utils.py version, read_file id 2496975797: `cuda_memory_final = torch.cuda.max_memory_reserved()`; "
             "`\"cuda_memory_max\": (cuda_memory_final - cuda_memory_init)`). Peak stats are never reset, so it covers training AND the periodic "
             "validation/test generation (batch_size_eval 50, max_length 800) and the wiki-loss passes. run.py calls torch.cuda.empty_cache() every 10 steps.")
PE_COMMON = dict(model=M["llama32-3b"], seq_len=768, micro_batch=4, grad_accum=1, activation_checkpointing="none",
                 sharding="none", num_gpus=1, gpu="NVIDIA L40S (48 GB)", quantization="none", cpu_offload=False,
                 metric="reserved", metric_evidence=PE_METRIC,
                 other_flags={"compile": False, "attn_implementation": "null (transformers default, sdpa)", "use_amp": False,
                              "dataset": "MetaMathQA, tokenizer model_max_length 768, BucketIterator (sorted long->short within buckets of 80), padded to longest in batch",
                              "transformers": "4.52.4", "torch": "2.7.1+cu126", "peft": "0.15.2.dev0"})
add(id="peft-mc-llama32-3b-lora-r32-qv", source="huggingface/peft method_comparison/MetaMathQA/results/lora--llama-3.2-3B-rank32.json @ commit 0a179c1e8659ab4f7df0369b9b03943cfe470ff1",
    quote="\"cuda_memory_max\": 22273851392,", **PE_COMMON,
    precision="bf16 weights (dtype bfloat16, no AMP); LoRA adapter weights upcast to fp32 (autocast_adapter_dtype: true)",
    optimizer="torch.optim.AdamW (lr 1e-4, wd 0.1) on LoRA params (fp32 states); grad_norm_clip 1.0",
    lora={"rank": 32, "alpha": 64, "dropout": 0.0, "targets": ["q_proj", "v_proj"], "trainable_params": 9175040},
    value_bytes=22273851392, value_as_published="22273851392 bytes", expressible=False, quality="caveat",
    notes=("Flagged not expressible as a training-step figure: the max may be set during batched generation (eval batch 50, static cache, up to 800 tokens) "
           "rather than the train step; the same run's post-step 'mem reserved avg' is ~11.9e9 and 'mem allocated avg' ~6.92e9. seq_len 768 is the truncation cap."))
add(id="peft-mc-llama32-3b-full-ft", source="huggingface/peft method_comparison/MetaMathQA/results/full-finetuning--llama-3.2-3B-lr_0.00001.json @ commit 0a179c1e8659ab4f7df0369b9b03943cfe470ff1",
    quote="\"cuda_memory_max\": 37241225216,", **PE_COMMON,
    precision="pure bf16 (dtype bfloat16, no AMP; AdamW states bf16)", optimizer="torch.optim.AdamW (lr 1e-5) on all 3,212,749,824 params; grad_norm_clip 1.0",
    lora=None, value_bytes=37241225216, value_as_published="37241225216 bytes", expressible=True, quality="caveat",
    notes=("Full finetune, single GPU, no gradient checkpointing. Post-step 'mem allocated avg' ~26.06e9 (= bf16 weights+grads+2 Adam states ~ 8 B/param * 3.21e9 = 25.7e9), "
           "'mem reserved avg' ~33.1e9. Whole-run max (includes eval) - for full FT the train step is very likely the max. Tied embeddings."))

# ============================================================ H. torchtune README (Llama 3.1) - metric unknown
add(id="torchtune-readme-llama31-70b-lora-8xa100", source="pytorch/torchtune README.md @ commit 0031bfb080bd35ec533c412df883cf2bf7bf7fe4 ('Memory and training speed' table)",
    quote="| Llama 3.1 70B | LoRA | 8x A100 | 27.6 GiB  | 3497  |  (note: 'all the below numbers are provided for batch size 2 (without gradient accumulation), a dataset packed to sequence length 2048, and torch compile enabled')",
    model=M["llama31-70b"], seq_len=2048, micro_batch=2, grad_accum=1, precision="pure bf16 (dtype bf16)",
    optimizer="torch.optim.AdamW fused (per llama3_1/70B_lora.yaml read at commit 0502cc55; may differ from benchmarked config)",
    activation_checkpointing="full (enable_activation_checkpointing True in the config read)",
    sharding="FSDP2 full shard (lora_finetune_distributed)", num_gpus=8, gpu="A100 (80GB assumed, not stated)",
    lora={"rank": 16, "alpha": 32, "dropout": 0.0, "targets": ["q_proj", "v_proj", "output_proj", "mlp"], "note": "from config read at a later commit; not guaranteed to match the benchmark"},
    quantization="none", cpu_offload=False, metric="unknown",
    metric_evidence="README says 'Peak Memory per GPU' without stating allocated/reserved/active; torchtune logs all three (GiB with 1024**3 in this era).",
    value_bytes=b(27.6, "GiB"), value_as_published="27.6 GiB", expressible=False, quality="caveat",
    other_flags={"compile": True, "packed": True, "loss": "CEWithChunkedOutputLoss"},
    notes="Not expressible: torch.compile on, metric unknown, exact config at benchmark time not pinned. Kept as the only LoRA-70B-on-FSDP reference point.")

# ---------------------------------------------------------------- write
ids = [r["id"] for r in rows]
assert len(ids) == len(set(ids)), "duplicate ids"
KEYS = ["id", "source", "config_file", "quote", "model", "seq_len", "micro_batch", "grad_accum", "precision", "optimizer",
        "activation_checkpointing", "sharding", "num_gpus", "gpu", "lora", "quantization", "cpu_offload", "other_flags",
        "metric", "metric_evidence", "value_bytes", "value_as_published", "expressible", "quality", "notes"]
out = []
for r in rows:
    o = {k: r.get(k) for k in KEYS}
    extra = set(r) - set(KEYS)
    assert not extra, extra
    out.append(o)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published.json")
with open(path, "w") as f:
    json.dump(out, f, indent=2)
print(len(out), "rows;", sum(o["expressible"] for o in out), "expressible;",
      {q: sum(o["quality"] == q for o in out) for q in ("good", "caveat", "suspect")})
