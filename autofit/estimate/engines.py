"""What the multi-rank engines hold beyond the estimator's state formulas: DeepSpeed ZeRO's buffers (from
the same config dict the probe and the export use), ZeRO-3's gathered parameters, and a tied weight's
gradient kept whole through a checkpointed backward (DDP, ZeRO-3, FSDP2; the estimator models DDP's
bucket views and FSDP2's shards and gathered blocks itself). Bytes per rank; `P` below is the trainable parameter count, `N` the ranks, `h`
the bytes of a parameter in the compute dtype (2 in bf16/fp16 under DeepSpeed, else 4).

Each engine's memory is split by when it is live, because the peak is the largest of the phases:
- held: from the engine's construction on (buffers, DDP buckets, ZeRO-3's gradient partition);
- backward: only while gradients are made (ZeRO-2's reduce bucket, gathered ZeRO-3/FSDP2 parameters);
- step: only in the optimizer step (the fp32 gradient partition ZeRO's optimizer reads);
- epilogue: between the last backward and the step, with the step's gradients (ZeRO-1/2's partition
  buffers while the gradients are copied into the step's partition).

Sources (DeepSpeed 0.19.8, torch 2.13), checked against probes on CPU ranks (bench/measurements/engine_memory.py,
bench/results/engine-memory-cpu-*.json):
- ZeRO-1/2 (`runtime/zero/stage_1_and_2.py`): the parameters are flattened into one buffer (h P, the
  model's parameters become views of it); the fp32 master partition is a clone even in fp32 (4 P/N, l.570);
  the step reads an fp32 gradient partition (4 P/N). Gradients are reduced into a rank's partition buffer
  (`grads_in_partition`), which holds whole every parameter touching the partition
  (`zero_partition_elements`: P/N and the parameters across its boundaries). At stage 1 the gradients are
  whole (h P) until the backward's end reduces them into that buffer. At stage 2 they are reduced during
  the backward through a bucket of `reduce_bucket_size` elements (`setup_buckets`, one buffer without
  overlap_comm), the partition buffer made at the first reduce; with accumulation, the earlier
  micro-batches' buffer lives beside the next one's. A tied parameter (GPT-2's embedding and head) gets
  its gradient twice: one extra copy of it lives in the backward (measured).
- ZeRO-3 (`runtime/zero/stage3.py`): parameters, the fp32 master and a gradient partition buffer are
  partitions (h + 4 + h) P/N, held with one reduce bucket; gathered parameters: see `zero3_gathered`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import TYPE_CHECKING

from autofit.config import Checkpointing, Config, Engine
from autofit.estimate.states import model_states

if TYPE_CHECKING:
    from autofit.estimate.facts import ModelFacts


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """Bytes per rank an engine adds to the model states, by when they are live."""

    held: int = 0  # from the engine's construction on
    backward: int = 0  # while gradients are made
    step: int = 0  # in the optimizer step
    epilogue: int = 0  # after the last backward, before the step: no activations left, no optimizer temporaries yet
    grads_held: bool = False  # the gradients live from the start (DDP's bucket views), not made in the backward
    terms: tuple[tuple[str, int], ...] = ()  # named parts (bytes), for the estimate's breakdown
    note: str = ""


def engine_memory(facts: "ModelFacts", config: Config, elements: dict[str, int]) -> EngineMemory:
    """What `config`'s engine holds beyond `model_states`, with DeepSpeed's buffer sizes `elements`
    (flat name -> elements, `autofit.strategies.deepspeed_config.deepspeed_elements`)."""
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
        # offloaded, a parameter's gradient partition is copied back to the GPU and cast to fp32 there on its
        # way to the host (`partition_grads`, `_offload_grad_partition_at_boundary`, stage3.py)
        copies = (h + (4 if h < 4 else 0)) * max(facts.trainable_sizes, default=0) // n if config.offloads else 0
        terms = (("deepspeed_reduce_bucket", bucket), ("zero3_gathered", gathered), ("tied_grad_in_recompute", tied),
                 ("zero_fp32_grad_partition", fp32_grads), ("zero3_offload_grad_copies", copies))
        return EngineMemory(held=bucket, backward=gathered + tied + copies, step=fp32_grads, grads_held=True,
                            terms=terms, note="ZeRO-3 gathered parameters and buffers from the DeepSpeed config")
    # A tied parameter's gradient arrives twice; the first is kept whole while the second is made.
    tied = h * facts.tied_params
    note = f"ZeRO-{config.zero_stage} buffers from the DeepSpeed config"
    if config.offloads:  # the gradients go to the host's partition
        bucket = bucket if config.zero_stage == 2 else 0
        # each in-partition gradient is cast to fp32 on the GPU on its way to the host
        # (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`): one parameter's at a time, the largest at most
        cast = 4 * max(facts.trainable_sizes, default=0) if h < 4 else 0
        terms = (("deepspeed_reduce_bucket", bucket), ("zero_tied_grad_copy", tied), ("zero_offload_fp32_cast", cast))
        return EngineMemory(backward=bucket + tied + cast, terms=terms, note=note)
    whole = h * zero_partition_elements(facts, n)
    # The step's first moment (`step`, stage_1_and_2.py): the gradients, still views of the partition buffer,
    # flattened into a copy of the partition, and that copy cast to fp32 in 16-bit training (in fp32 the
    # cast is the copy itself); beyond the states' gradients (whole at stage 1, a partition at stage 2).
    flatten = whole + h * p // n + (fp32_grads if h < 4 else 0) - model_states(facts, config).grads
    if config.zero_stage == 1:  # reduced after the backward, into the partition buffer, the gradients still whole
        terms = (("zero_tied_grad_copy", tied), ("zero1_partition_buffer", whole), ("zero_fp32_grad_partition", fp32_grads))
        return EngineMemory(backward=tied, step=fp32_grads, epilogue=max(whole, flatten), terms=terms, note=note)
    # ZeRO-2 (stage_1_and_2.py): the rank's gradient buffer holds whole every parameter touching its partition;
    # after the first micro-batch, the earlier ones' sum lives beside it through the backward
    # (`all_grad_tensors`, views of the last buffer). The backward's epilogue copies them into the step's
    # flat partition (`averaged_gradients`, the states' grads) while both buffers and the bucket still live.
    # At accumulation 1 the buffer is counted as gradients appearing while activations are freed, as the
    # estimator counts plain gradients (measured within 2% on a GPT-2 at two ranks; whole from the first
    # reduce on, the backward's peak came out 9% over).
    boundary = max(0, whole - h * p // n)
    accumulated = whole if config.grad_accum_steps > 1 else 0
    terms = (("deepspeed_reduce_bucket", bucket), ("zero_tied_grad_copy", tied), ("zero2_partition_boundary", boundary),
             ("zero2_accumulated_grads", accumulated), ("zero_fp32_grad_partition", fp32_grads))
    return EngineMemory(backward=bucket + tied + boundary + accumulated, step=fp32_grads, grads_held=accumulated > 0,
                        epilogue=max(whole + accumulated + bucket, flatten), terms=terms, note=note)


def zero_partition_elements(facts: "ModelFacts", n: int) -> int:
    """The most gradient elements one rank's ZeRO-1/2 partition buffer holds. DeepSpeed flattens the trainable
    parameters in order, pads the whole to a multiple of 2N and cuts it into N equal partitions; a rank's
    buffer (`grads_in_partition`, made at the backward's first reduce in `copy_grads_in_partition`) holds
    every parameter that touches its partition whole (`get_partition_info`): a parameter across a boundary
    counts on both sides (a GPT-2's embedding, a third of its weights, spans one from four ranks on)."""
    return _partition_elements(tuple(size for size in facts.trainable_sizes if size) or (facts.trainable_params,), n)


@functools.lru_cache(maxsize=64)
def _partition_elements(sizes: tuple[int, ...], n: int) -> int:
    align = 2 * n
    part = -(-sum(sizes) // align) * align // n
    spans = list(zip(itertools.accumulate(sizes, initial=0), sizes))
    return max(sum(size for start, size in spans if start < (rank + 1) * part and start + size > rank * part)
               for rank in range(n))


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
