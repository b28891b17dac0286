"""The bottom of the flow (docs/design.md): the devices a plan is measured on or planned for. Which device to
tune on and what it supports (`device`), how memory is counted and capped there (`memory`: the CPU budget that
raises `torch.OutOfMemoryError`, the CUDA per-process fraction; `nvml`), the process-wide backend flags a probe
hands to its children (`flags`), and the GPU profiles a dry-run plans for without the card (`gpus`).
"""
