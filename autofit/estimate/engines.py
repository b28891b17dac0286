"""What the multi-rank engines hold beyond the estimator's state formulas, by phase, as each engine's
strategy says (`Strategy.engine_memory`: DeepSpeed ZeRO's buffers and ZeRO-3's gathered parameters in
`autofit.strategies.zero`, a tied weight's gradient kept whole through a checkpointed backward under FSDP2 in
`autofit.strategies.fsdp`); plain DDP's tied gradient here (the estimator models DDP's bucket views and
FSDP2's shards and gathered blocks itself). Bytes per rank.

Each engine's memory is split by when it is live, because the peak is the largest of the phases
(`EngineMemory`, in `autofit.strategies.memory`):
- held: from the engine's construction on (buffers, DDP buckets, ZeRO-3's gradient partition);
- backward: only while gradients are made (ZeRO-2's reduce bucket, gathered ZeRO-3/FSDP2 parameters);
- step: only in the optimizer step (the fp32 gradient partition ZeRO's optimizer reads);
- epilogue: between the last backward and the step, with the step's gradients (ZeRO-1/2's partition
  buffers while the gradients are copied into the step's partition).

A strategy that trains something other than the model's weights (`Strategy.trains`: LoRA's adapters) adds
no engine term: the adapters' buffers are negligible beside the frozen base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autofit.config import Config
from autofit.estimate.states import model_states
from autofit.strategies import completed
from autofit.strategies.memory import EngineFacts, EngineMemory

if TYPE_CHECKING:
    from autofit.estimate.facts import ModelFacts

__all__ = ["EngineMemory", "engine_memory"]


def engine_memory(facts: "ModelFacts", config: Config, summary: dict[str, Any]) -> EngineMemory:
    """What `config`'s engine holds beyond `model_states`, as the strategy running it says
    (`Strategy.engine_memory`); `summary`: the spec's (`TrainSpec.summary`), which sizes an engine's buffers
    as the probe and the export size them."""
    strategies = completed()
    if config.num_gpus < 1 or any(s.trains(config, facts) is not None for s in strategies):
        return EngineMemory()
    engine = EngineFacts(facts=facts, summary=summary, state_grads=model_states(facts, config).grads,
                         recomputes=any(s.recomputed_blocks(config) for s in strategies))
    found = next((m for s in strategies if (m := s.engine_memory(config, engine)) is not None), None)
    if found is not None:
        return found
    if config.num_gpus > 1:  # DDP: its bucket views are the estimator's (gradients held all step)
        tied = engine.tied_grad(4)
        return EngineMemory(backward=tied, terms=(("tied_grad_in_recompute", tied),))
    return EngineMemory()

