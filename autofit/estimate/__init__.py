"""Estimation (docs/design.md): a candidate's peak memory per device predicted without a GPU: model states
by formula (`states`, the one joint formula module: ZeRO x offload x quantization x LoRA), activations by
running the step under fake tensors (`simulation/`), what a CUDA card holds beyond them (`cuda/`: the
caching allocator replayed, CUDA's attention, dropout and autocast), assembled by `estimator`, with the cost
model's seconds per step (`cost_model`, `workload`). Estimation ranks and prunes; the probe decides.
"""
