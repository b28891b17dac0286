"""Rung 3, activation offloading: what autograd saves for backward waits in pinned host memory.

The model's forward runs under `torch.autograd.graph.save_on_cpu(pin_memory=True)`: every tensor saved
for backward is copied to the host in the forward and back to the device when backward needs it, so the
activations leave the GPU. Alone it moves everything the forward saves; on top of full checkpointing
(the rule table pairs it with none or full) it moves what checkpointing keeps -- the blocks' inputs,
`layers x tokens x hidden` values, which dominate at long sequences. Buys those bytes of device memory;
costs a device-to-host copy in the forward and a host-to-device copy in the backward on the compute
stream (PCIe-bound, not overlapped), and as much pinned host RAM. Same math (tier 0). Only on a GPU:
on the CPU the activations are already on the host.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autofit.config import ActivationOffload as A
from autofit.config import Config
from autofit.strategies.base import Option, Strategy

if TYPE_CHECKING:
    from autofit.strategies.run import TrainRun
    from autofit.job.train_spec import TrainSpec


class ActivationOffloading(Strategy):
    """none, cpu (pinned host memory)."""

    field = "activation_offload"
    rung = 3  # with checkpointing: both trade a cost for activation memory
    order = 1

    def relieves(self, config: Config) -> Config | None:
        # the copies out and back only add time at the same micro-batch
        return config.replace(activation_offload=A.NONE) if config.activation_offload is not A.NONE else None

    def options(self, spec: "TrainSpec") -> list[Option]:
        target = spec.target
        why_not = None if target.cuda else \
            f"activation offloading moves saved tensors from a GPU to the host; the target {target.name} is the host"
        return [Option(A.NONE, 0, "saved activations stay on the device"),
                Option(A.CPU, 0, why_not or "saved activations to pinned host memory (with full checkpointing: the "
                       "block inputs), back in backward", available=why_not is None)]

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return a.offloads_activations or not b.offloads_activations

    def apply(self, run: "TrainRun") -> None:
        if not run.config.offloads_activations or run.live:  # a live model's forward is the user's (the guard)
            return
        if run.simulated:
            run.forward_contexts.append(simulated)
            # a saved tensor's device storage is freed once the units after it no longer hold it, two or more
            # units on (a residual): two units cannot show which unit frees what (their events repeated read
            # the forward up to 1.6x over on tiny GPT-2 and Llama, 8 blocks)
            run.repeatable = False
        else:
            enable(run.model)

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        return {"activation_offload": config.activation_offload.value}

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if not config.offloads_activations:
            return []
        return ["from autofit.strategies.activation_offload import enable as offload_activations",
                "offload_activations(model)  # saved activations to pinned host memory"]


def enable(model: nn.Module) -> nn.Module:
    """Run `model`'s forward under `save_on_cpu(pin_memory=True)` from now on. Returns `model`."""
    forward = model.forward

    @functools.wraps(forward)
    def offloaded(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return forward(*args, **kwargs)

    model.forward = offloaded
    return model


def simulated(counter: Any) -> Any:
    """What `torch.autograd.graph.save_on_cpu` does to device memory, for a step under fake tensors: a tensor
    saved for backward leaves the device (its device storage is freed unless something else holds it) and
    comes back in backward as a new device tensor. Its host copy is counted in `counter.offloaded`, not on
    the device, and each way is one copy kernel (`counter.kernels`; `save_on_cpu`: `packed.copy_(tensor)`
    out, `tensor.to(device)` back)."""

    def pack(tensor: torch.Tensor) -> tuple:
        counter.offloaded += tensor.numel() * tensor.element_size()
        counter.kernels += 1
        return tensor.shape, tensor.dtype, tensor.device

    def unpack(saved: tuple) -> torch.Tensor:
        shape, dtype, device = saved
        counter.kernels += 1
        return torch.empty(shape, dtype=dtype, device=device)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
