"""What the multi-rank engines hold beyond the estimator's state formulas: DeepSpeed ZeRO's buffers (from
the same config dict the probe and the export use), ZeRO-3's gathered parameters, and a tied weight's
gradient kept whole through a checkpointed backward (DDP, ZeRO-3, FSDP2; the estimator models DDP's
bucket views and FSDP2's shards and gathered blocks itself). Bytes per rank; `P` below is the trainable parameter count, `N` the ranks, `h`
the bytes of a parameter in the compute dtype (2 in bf16/fp16 under DeepSpeed, else 4).

Each engine's memory is split by when it is live, because the peak is the largest of the phases:
- held: from the engine's construction on (buffers, DDP buckets, ZeRO-3's gradient partition);
- backward: only while gradients are made (ZeRO-2's reduce bucket, gathered ZeRO-3/FSDP2 parameters);
- step: only in the optimizer step (the fp32 gradient partition ZeRO's optimizer reads).

Sources (DeepSpeed 0.19.8, torch 2.13), checked against probes on CPU ranks (bench/results/sharded-*.json):
- ZeRO-1/2 (`runtime/zero/stage_1_and_2.py`): the parameters are flattened into one buffer (h P, the
  model's parameters become views of it); the fp32 master partition is a clone even in fp32 (4 P/N, l.570);
  at stage 1 the gradients are whole (h P) until the step reduces them; at stage 2 they are reduced
  through a bucket of `reduce_bucket_size` elements (`setup_buckets`, one buffer without overlap_comm)
  into a partition (h P/N); the step reads an fp32 gradient partition (4 P/N). A tied parameter (GPT-2's
  embedding and head) gets its gradient twice: one extra copy of it lives in the backward (measured).
- ZeRO-3 (`runtime/zero/stage3.py`): parameters, the fp32 master and a gradient partition buffer are
  partitions (h + 4 + h) P/N, held with one reduce bucket; gathered parameters: see `zero3_gathered`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autofit.config import Checkpointing, Config, Engine

if TYPE_CHECKING:
    from autofit.estimate.facts import ModelFacts


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """Bytes per rank an engine adds to the model states, by when they are live."""

    held: int = 0  # from the engine's construction on
    backward: int = 0  # while gradients are made
    step: int = 0  # in the optimizer step
    grads_held: bool = False  # the gradients live from the start (DDP's bucket views), not made in the backward
    terms: tuple[tuple[str, int], ...] = ()  # named parts (bytes), for the estimate's breakdown
    note: str = ""


def engine_memory(facts: "ModelFacts", config: Config, elements: dict[str, int]) -> EngineMemory:
    """What `config`'s engine holds beyond `model_states`, with DeepSpeed's buffer sizes `elements`
    (flat name -> elements, `autofit.export.deepspeed.deepspeed_elements`)."""
    if config.adapters or config.num_gpus < 1:
        return EngineMemory()
    if config.engine is Engine.DEEPSPEED:
        return _zero(facts, config, elements)
    if config.engine is Engine.FSDP:
        return _fsdp(facts, config)
    if config.num_gpus > 1:  # DDP: its bucket views are the estimator's (gradients held all step)
        tied = _tied_grad(facts, config, 4)
        return EngineMemory(backward=tied, terms=(("tied_grad_in_recompute", tied),))
    return EngineMemory()


def _tied_grad(facts: "ModelFacts", config: Config, nbytes: int) -> int:
    """A tied weight's first gradient (GPT-2's head, made first in the backward), whole, while the backward
    recomputes checkpointed blocks: it is only reduced once the embedding's gradient has arrived, at the
    end. Without checkpointing the peak comes before it is made. (Measured on CPU ranks; the simulation
    drops weight gradients as they are made, so it cannot see this one.)"""
    return nbytes * facts.tied_params if config.checkpointing is not Checkpointing.NONE else 0


def _zero(facts: "ModelFacts", config: Config, elements: dict[str, int]) -> EngineMemory:
    p, n, h = facts.trainable_params, max(config.num_gpus, 1), _half(config)
    bucket = h * min(elements.get("reduce_bucket_size", 0), p)
    fp32_grads = 0 if config.offloads else 4 * p // n  # with offload the step reads them on the host
    if config.zero_stage == 3:  # the gradient partition (the states' grads) is held from the start too
        gathered, tied = zero3_gathered(facts, config, elements), _tied_grad(facts, config, h)
        terms = (("deepspeed_reduce_bucket", bucket), ("zero3_gathered", gathered), ("tied_grad_in_recompute", tied),
                 ("zero_fp32_grad_partition", fp32_grads))
        return EngineMemory(held=bucket, backward=gathered + tied, step=fp32_grads, grads_held=True, terms=terms,
                            note="ZeRO-3 gathered parameters and buffers from the DeepSpeed config")
    # A tied parameter's gradient arrives twice; the first is kept whole while the second is made.
    tied = h * facts.tied_params
    bucket = bucket if config.zero_stage == 2 else 0
    terms = (("deepspeed_reduce_bucket", bucket), ("zero_tied_grad_copy", tied), ("zero_fp32_grad_partition", fp32_grads))
    return EngineMemory(backward=bucket + tied, step=fp32_grads, terms=terms,
                        note=f"ZeRO-{config.zero_stage} buffers from the DeepSpeed config")


def zero3_gathered(facts: "ModelFacts", config: Config, elements: dict[str, int]) -> int:
    """Bytes of parameters ZeRO-3 holds gathered in the backward, in the compute dtype. Measured on CPU
    ranks, DeepSpeed keeps what the forward gathered until the backward has used it again, up to
    `max_live_parameters` (never below the largest tensor, which is fetched whole): the whole model
    when it is under that bound, however short the reuse distance."""
    live = elements.get("max_live_parameters", facts.num_params)
    return _half(config) * min(facts.num_params, max(live, facts.largest_param))


def _fsdp(facts: "ModelFacts", config: Config) -> EngineMemory:
    tied = _tied_grad(facts, config, 4)  # the root's gradients are reduced at the end of the backward
    return EngineMemory(backward=tied, terms=(("tied_grad_in_recompute", tied),))


def _half(config: Config) -> int:
    """Bytes of a parameter as DeepSpeed trains it: 16-bit under bf16/fp16, else fp32."""
    return 2 if config.half_precision else 4
