"""One training step run under fake tensors, its live bytes counted (`step`): the model made runnable there
(`runnable`, `known_values`, `healthy_checks`, `stand_in_losses`, `sized_kernels`), LoRA's adapters as peft
builds them (`adapters`), a deep model read from two blocks (`deepen`), the fused kernels transformers ran
on their reference path here (`reference_paths`), simulated steps kept (`memo`, on disk: `disk_cache`) and
spread over worker processes (`workers`).
"""
