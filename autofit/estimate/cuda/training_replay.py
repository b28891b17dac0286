"""What the caching allocator replays of a simulated step (`autofit.estimate.cuda.allocator`): the training
around it where torch's AdamW steps on the card (the weights, AdamW's states and its step's temporaries,
the micro-steps), and what the replay reserves beyond its allocated peak, on a roomy card and at the
least it runs in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autofit.config import Config
from autofit.estimate.simulation import disk_cache as kept
from autofit.estimate.cuda.allocator import ROUND_LARGE, CachingAllocator, Calls, Replay
from autofit.estimate.cuda.expandable import ExpandableAllocator
from autofit.strategies import completed


def reserve(replay: Replay) -> dict[str, Any]:
    """`ActivationPeak`'s reserve fields from `replay`: beyond its allocated peak, what a roomy card
    reserves (`fragmentation`) and the least it runs in (`least_fragmentation`: `least_reserve`), through
    the allocator `replay.expandable` names (expandable segments, or PyTorch's default fixed ones). Replayed
    once for the same events (`kept.RESERVES`, in the process and the cache's folder): a dry-run's AdamW
    rows replay two optimizer steps of training through a bisection, most of a second dry-run's time."""
    digest = replay.digest()
    found = kept.RESERVES.get(digest, shared=True)
    if found is None:
        calls = replay.calls(ExpandableAllocator if replay.expandable else CachingAllocator)
        roomy, passed = calls.replayed_past(calls.floor())  # where `least_reserve`'s pause is sought from
        found = {"fragmentation": roomy.peak_reserved - roomy.peak_allocated,
                 "least_fragmentation": least_reserve(calls, roomy, passed) - roomy.peak_allocated}
        kept.RESERVES.put(digest, found, shared=True)
    return {**found, "replay": replay}


def least_reserve(calls: Calls, roomy: Any, passed: tuple[Any, int] | None = None) -> int:
    """The fewest bytes the caching allocator's segments may total for a replay to run without running out
    of memory (`calls`: `Replay.calls`): found by bisection between the allocated and the reserved peak of
    its `roomy` run (no capacity), to `LEAST_RESERVE_PRECISION` of the reserve, each run resumed where the
    roomy one first passes the allocated peak (`Calls.until`: all of them alike up to there, about half of
    a training history's calls). Under a limit below its
    roomy reserve the allocator releases its cached segments and retries (`CachingAllocator`): on an H200
    (bench/README.md#fit-threshold), GPT-2 small's full-checkpointing step in
    fp32 at micro-batch 1 trained with its segments capped between 3,125 and 3,188 MiB (the process's
    budget less the 760 MiB outside the allocator), under the 3,314 it reserved on the roomy card; in bf16
    at micro-batch 4 between 5,389 and 5,518. `passed`: the roomy run as it stood short of its allocated
    peak (`Calls.replayed_past`), where the pause is sought from (the same pause, fewer calls replayed)."""
    low, high = roomy.peak_allocated, roomy.peak_reserved
    step = max(ROUND_LARGE, int(LEAST_RESERVE_PRECISION * high))
    paused = calls.until(low, passed) if high - low > step else None
    if paused is None or calls.resumed(paused, high - step) is None:
        return high  # most steps need about what they reserve: one replay says so
    high -= step
    while high - low > step:
        middle = (low + high) // 2
        low, high = (low, middle) if calls.resumed(paused, middle) is not None else (middle, high)
    return high


LEAST_RESERVE_PRECISION = 0.005  # of the reserve: 5 MiB of 1 GiB, 40 MiB of 8 GiB (a replay: 10-300 ms)


def replays_training(config: Config) -> bool:
    """Whether the caching allocator replays `config`'s step as training runs it, weights, gradients and
    AdamW's states included (`allocator.replay_training`): where torch's AdamW steps whole gradients on the
    card, as every strategy says (`Strategy.replays_training`). Else (engines' flat buffers, offloaded or
    8-bit states, a step in backward) the step's own events are replayed alone."""
    return all(strategy.replays_training(config) for strategy in completed())


def history(model: nn.Module, config: Config, ties: dict[int, int], deep: Any = None) -> tuple:
    """What training holds beside the step, as `replay_training` takes it: the weights (`resident`) and
    buffers, AdamW's states and its step's temporaries, and `config`'s micro-steps. `deep` (`simulate._Deep`): the
    events are its, at the whole depth, and so are the weights (`_Deep.tensors`)."""
    weights = list({ties[id(p)]: p for p in model.parameters()}.values())  # a tied weight once, as the card holds it
    buffers = list(model.buffers())
    if deep is not None:
        weights, buffers = deep.tensors(weights), deep.tensors(buffers)
    held = [*resident(model, weights), *(b.untyped_storage().nbytes() for b in buffers)]
    trained = [p.nbytes for p in weights if p.requires_grad]
    # AdamW: exp_avg and exp_avg_sq like each parameter (torch/optim/adamw.py `_init_group`); its foreach
    # step makes one more tensor per parameter (`_foreach_sqrt` of the second moments) and frees it
    states = [n for n in trained for _ in range(2)]
    return held, states, trained, config.grad_accum_steps


def resident(model: nn.Module, weights: list[torch.Tensor]) -> list[int]:
    """Bytes of each weight as training holds it on the card: where a strategy's simulated stand-in holds
    another weight than training does (a quantized layer's packed weight and constants), as that strategy
    says (`Strategy.resident_bytes`); else the weight's own storage."""
    strategies = completed()

    def held(module: nn.Module) -> int | None:
        return next((b for s in strategies if (b := s.resident_bytes(module)) is not None), None)

    packed = {id(m.weight): b for m in model.modules() if (b := held(m)) is not None}
    return [packed.get(id(w), w.untyped_storage().nbytes()) for w in weights]
