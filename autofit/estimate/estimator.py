"""Estimate: a candidate's peak memory per device, predicted without running it and without a GPU.

    peak = params + grads + optimizer states   (formulas: precision, ZeRO, FSDP2, 8-bit states, LoRA, NF4, offload)
         + gathered                            (ZeRO-3 / FSDP2: full weights of the blocks in use)
         + activations                         (the real forward + backward under fake tensors, tracked)
         + overhead                            (CUDA context, allocator rounding and fragmentation, buckets)

Model states come from formulas (`autofit.estimate.states`: the ZeRO paper's accounting); DDP's gradients
are bucket views, live for the whole step.

Activations are measured, not guessed (`autofit.estimate.simulation.step`): the model is built on the meta device,
materialised as fake tensors (shapes, no data), and one forward + backward runs under a dispatch mode
that counts every storage alive, as `autofit.devices.memory.CpuBudget` does for real tensors. Weight gradients are dropped as
soon as they are made, so the curve is activations alone; the bytes of gradients made so far are
recorded beside it. Deep Hugging Face models are simulated at two blocks (two units of k under every-k
checkpointing) and read as at their whole depth, the second block's events repeated once for every further
block (`autofit.estimate.simulation.deepen`; blocks unlike each other: simulated at one and two, extrapolated linearly
in depth); micro-batches past 2 at 1 and 2, extrapolated linearly in the micro-batch (the dry-run's plan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import torch

from autofit.config import Config
from autofit.estimate.facts import (ModelFacts, formula_activations, formula_covers,  # noqa: F401
                                    model_facts)  # ModelFacts and formula_activations are re-exported
from autofit.models.depth import depth_key, rebuild
from autofit.models.info import meta_model
from autofit.estimate.cuda import attention as cuda_attention, varied_lengths
from autofit.estimate.simulation import reference_paths
from autofit.estimate.simulation import step as simulate_module
from autofit.estimate.simulation import adapters as simulated_adapters
from autofit.estimate.simulation import disk_cache as kept, memo as simulations
from autofit.estimate.engines import EngineMemory, engine_memory
from autofit.estimate.prediction import Estimate, Fit, Memory
from autofit.strategies.memory import SEGMENTS_FACT, Breakdown
from autofit.estimate.simulation.step import ALLOCATOR_ROUNDING, ActivationPeak, simulate_step  # noqa: F401 (re-exported)
from autofit.estimate.cuda.training_replay import replays_training, reserve
from autofit.estimate.simulation.memo import workload_key
from autofit.estimate.states import States, cast_peak, gathered as gathered_weights, held_grads, model_states
from autofit.estimate.states import (optimizer_temporaries, own_adapters, simulated_layer_notes, sparse_grads,
                                     state_notes, step_transient)
from autofit.estimate.tolerance import FORMULA_UNDER_PREDICTION, bound_for, family_of
from autofit.errors import UsageError
from autofit.strategies import completed
from autofit.batches.synthetic_batches import TokenBatches

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy

MIB = 1024**2
# The engine's term shown as `Breakdown.gathered`, not in the overhead: ZeRO-3's gathered working set.
GATHERED_TERM = "zero3_gathered"
_MISSING = object()  # `Estimator._once`: not made yet
# Overhead terms on a CUDA device, each documented where the peak is assembled (`_overhead`).
# The CUDA context of a training process: the driver context plus every kernel module the step loads
# lazily (cuBLAS, attention, the optimizer's foreach kernels). Measured in a probe on one H100, torch
# 2.11 + CUDA 13 (bench/README.md#cuda-context): 742-768 MiB outside the allocator on tiny
# models. A bare context before any kernel loads is smaller: 287 MB (CUDA 11.7, pytorch/pytorch#86509),
# 426 MiB (torch 2.10 + CUDA 13, RTX 6000 Ada, unslothai/unsloth-zoo#1053); the larger figure is kept, an
# over-count being a margin and an under-count a promised fit that runs out of memory.
CUDA_CONTEXT_BYTES = 800 * MIB
CUBLAS_WORKSPACE_BYTES = 32 * MIB  # cuBLAS workspace per stream (Hopper default, 4 MiB x 8)
FRAGMENTATION = 0.05  # reserved-but-free share of the transient bytes where the step is not simulated
# Simulations expected to take this long (the first one's time x their count) pay for worker processes,
# each of which first imports torch and transformers and builds the model (~3 s for llama-2-7b on a 2-core
# x86_64 machine) on a CPU that is idle, and is then kept for the later ones of a dry-run (`Estimator.prefetch`).
SPREAD_AFTER_S = 5.0
SIM_DEPTHS = (1, 2)  # units simulated for deep models: blocks, or k of them where a strategy repeats every k
# (every k-th block checkpointed: the "_unit" its `simulated_as` names)
# Token lengths simulated for a token model without attention layers (Mamba), extrapolated linearly to the
# batch's length: nothing there grows faster than the length, and the sequential scan a CPU runs costs a
# simulated kernel per token (a one-block Mamba at 2,048 tokens took 443 s to plan, 51 s so). A model whose
# config names a `chunk_size` scans in chunks, each sequence padded to a whole number of them (Mamba2:
# transformers' modeling_mamba2.py `torch_forward`, `pad_size`): its lengths are two and three chunks (one
# chunk takes another path: fewer kernels, off the line) and the batch's length is rounded up to a chunk
# (at 64 and 128 tokens, both padded to 256, Mamba2 at 512 came out 42% under).
SIM_LENGTHS = (64, 128)


# -- the estimator ---------------------------------------------------------------------------------------
class Estimator:
    """Predicts `Estimate`s for the configurations of one spec, caching each simulated forward + backward
    by (precision, attention, checkpointing, micro-batch).

    `target` is the device type predicted for: "cuda" adds the CUDA overhead terms and simulates CUDA
    kernels where this torch build has CUDA (else CPU kernels stand in, and the reason says so);
    "cpu" predicts what `autofit.devices.memory.CpuBudget` measures.

    `deferred_sync`: the training loop reduces gradients on the last micro-batch of each step only
    (accelerate's `accumulate()` and the Trainer without `sync_each_batch`, Lightning's
    `no_backward_sync`, FSDP1's `no_sync`). Under FSDP that keeps every gradient unsharded between
    micro-batches (`_held_grads`). False: autofit's loop and its exports, which reduce every micro-batch.

    `full_depth`: simulate every block of a deep model instead of two and extrapolating (slower; for
    measuring what the depth extrapolation misses, as `bench/calibration/calibrate.py --full-depth` does).
    """

    def __init__(self, spec: "TrainSpec", target: str | None = None, extrapolate_batch: bool = False,
                 strategies: Sequence["Strategy"] = (), deferred_sync: bool = False, full_depth: bool = False):
        self.spec = spec
        self.full_depth = full_depth
        self.deferred_sync = deferred_sync
        self.strategies = tuple(strategies)
        self.summary = spec.summary()  # what an engine sizes its buffers by, as the probe and the export do
        self.target = target or spec.device.type
        # True: simulate micro-batches 1 and 2 only and extrapolate linearly (fast, for planning many
        # sizes; checkpointed runs come out a few percent low). False: simulate each micro-batch.
        self.extrapolate_batch = extrapolate_batch
        # what a worker process's own estimator is made with (`_helpers`): it predicts as this one does
        self._settings = {"target": self.target, "extrapolate_batch": extrapolate_batch,
                          "deferred_sync": deferred_sync, "full_depth": full_depth}
        self.sim_device = "cuda" if self.target == "cuda" and torch.cuda.is_available() else "cpu"
        # CPU kernels standing in for CUDA run attention as CUDA's kernel for that GPU would (Ampere or
        # later where no GPU profile says otherwise); None where the kernels are the target's own.
        self.cuda_ampere = (spec.target.bf16 if spec.target.cuda else True) \
            if self.target == "cuda" and self.sim_device == "cpu" else None
        self._meta = meta_model(spec.model_factory)
        targets = simulated_adapters.planned_targets(self._meta, self.strategies)
        self.facts = dataclasses.replace(model_facts(self._meta, targets), own_optimizer=spec.optimizer.costs)
        # LoRA's adapters go on these layers in the simulation (their paths inside a block:
        # `autofit.strategies.lora.is_adapted`)
        layers = targets or simulated_adapters.block_linears(self._meta)
        self._adapted = frozenset(simulated_adapters.within_block(name) for name in layers)
        self._adapter_dropout = simulated_adapters.planned_dropout(self.strategies)
        self._depth_key = depth_key(self._meta)
        self._tied = len(list(self._meta.named_parameters(remove_duplicate=False))) > len(list(self._meta.parameters()))
        self._cache: dict[tuple, tuple[ActivationPeak, str]] = {}
        self._lines: dict[tuple, tuple[ActivationPeak, str]] = {}  # extrapolated micro-batches (`_extrapolated`)
        self._reserves: dict[tuple, ActivationPeak] = {}  # a simulation replayed for another optimizer or accumulation
        self._varied: dict[str, tuple[dict, str]] = {}  # a replay's reserve after shorter batches (`activations`)
        self._workload = workload_key(self._meta, spec, self.sim_device + cuda_attention.describe(self.cuda_ampere)
                                      + (", full depth" if full_depth else ""), self._adapted, self._adapter_dropout)
        self._failed: set[tuple] = set()  # cache keys whose simulation failed (activations by formula)
        # what each step's simulation found, with the configuration that asked for it: sent to workers (`planned`)
        self._found: dict[tuple, tuple[Config, int, tuple[ActivationPeak | None, str]]] = {}
        self._simulating = completed(self.strategies)  # every strategy shaping a simulated step (`_facts_of`)
        self._shareable = simulations.shareable(self._meta, spec)
        self._family = family_of(self._meta)  # what the error bound is looked up by (`tolerance.bound_for`)
        self._steadied: dict[tuple, Any] | None = None  # `_once`'s, within `steady`
        self._workers: workers.Workers | None = None  # simulation workers kept within `steady` (`_helpers`)

    # -- activations ---------------------------------------------------------------------------------
    def activations(self, config: Config) -> tuple[ActivationPeak, str]:
        """The `ActivationPeak` at `config`'s micro-batch and how it was obtained (one phrase); on CUDA for
        batches of varied length (`TrainSpec.varied_lengths`), the reserve after shorter steps."""
        peak, how = self._activations(config)
        if not (self.spec.varied_lengths and self.target == "cuda" and peak.replay is not None):
            return peak, how
        key = peak.replay.digest()
        if key not in self._varied:
            low, high = self._line_points(config)
            line = [self._at_batch(config, mb)[0].replay for mb in (low, high)]
            self._varied[key] = varied_lengths.reserve_after_shorter(peak, *line, config.micro_batch_size, low, high)
        fields, said = self._varied[key]
        return dataclasses.replace(peak, **fields), how + said

    def _activations(self, config: Config) -> tuple[ActivationPeak, str]:
        mb = config.micro_batch_size
        if self._sizes(config) == (mb,):
            return self._at_batch(config, mb)
        # the allocator's events differ, or the allocator
        key = (self._key(config, 1), mb, self._replays_training(config), self._expandable(config))
        if key not in self._lines:
            self._lines[key] = self._extrapolated(config, mb)
        return self._lines[key]

    def _extrapolated(self, config: Config, mb: int) -> tuple[ActivationPeak, str]:
        """The activations at micro-batch `mb` read on the line through 1 and 2 (`_line_points`), the
        allocator replayed there."""
        for simulated in (1, 2):  # which line holds depends on how these went
            self._at_batch(config, simulated, reserved=False)
        low, high = self._line_points(config)
        # the points' events, not their reserves: the line's is replayed from events read on it
        (one, how_low), (two, how_high) = (self._at_batch(config, low, reserved=False),
                                           self._at_batch(config, high, reserved=False))
        how = how_high if self._key(config, high) in self._failed else how_low  # a failed point says why
        line = one.replayed_at(two, mb, low, high)  # the allocator replayed from events read on the line
        if line.replay is None:  # the two steps differ beyond their sizes: the line's reserve from theirs
            (one, _), (two, _) = self._at_batch(config, low), self._at_batch(config, high)
            line = one.replayed_at(two, mb, low, high)
            free = {field: simulate_module.free_at_peak(one, two, line, field)
                    for field in ("fragmentation", "least_fragmentation")}
            line = dataclasses.replace(line, **free)
        return line, f"{how}, micro-batch {low} and {high} extrapolated to {mb}"

    def _line_points(self, config: Config) -> tuple[int, int]:
        """The micro-batches a larger one is extrapolated from: 1 and 2, or 2 and 4 where a step of one
        sample failed and one of two did not (batch norm in training needs more than one value per channel:
        LeViT's head; every micro-batch past 2 read the formula's activations, or none)."""
        one, two = self._key(config, 1), self._key(config, 2)
        if one in self._failed and two in self._cache and two not in self._failed:
            return 2, 4
        return 1, 2

    @property
    def formula_bound(self) -> float | None:
        """How far the activation formula may under-predict this target's simulation (simulated / formula;
        the largest measured where the target's was not); None where the formula does not cover the
        model (`formula_covers`)."""
        if not formula_covers(self.spec.model.hf_config, self.spec.tokens_per_sample):
            return None
        return FORMULA_UNDER_PREDICTION.get(self.target, max(FORMULA_UNDER_PREDICTION.values()))

    def simulated(self, config: Config) -> bool:
        """Whether `config`'s activations were simulated (False: by formula, the simulation failed)."""
        self.activations(config)
        return not any(self._key(config, mb) in self._failed for mb in self._sizes(config))

    def prefetch(self, configs: Iterable[Config],
                 progress: Callable[[int, int], None] | None = None) -> None:
        """Simulate now what predicting `configs` will need, shared with worker processes when the
        simulations are slow and CPUs are spare (`autofit.estimate.simulation.workers`): the first one runs here and
        is timed; if the rest would take `SPREAD_AFTER_S` or more at its pace, they are shared out. Workers
        started within `steady` are kept until it ends: a later prefetch (a dry-run's next wave of levels)
        shares its jobs with them however quick. The predictions are the same either way.
        `progress(done, total)` hears of each simulation done here (the workers' shares count when they are
        collected)."""
        with self.steady():
            todo = {self._key(c, mb): (c, mb) for c in configs for mb in self._sizes(c)}
            todo = [job for key, job in todo.items() if key not in self._cache and not self._recalled(*job)]
        if not todo:
            return
        tell = progress or (lambda done, total: None)
        started = time.perf_counter()
        self._at_batch(*todo[0], reserved=False)
        tell(1, len(todo))
        rest = todo[1:]
        running = self._helpers(rest, time.perf_counter() - started)
        batch = running.share(rest) if running else None
        try:  # the workers claim jobs from the back, this process from the front (`Batch.mine`)
            for done, (config, mb) in enumerate(batch.mine() if batch else rest, start=2):
                self._at_batch(config, mb, reserved=False)  # simulated now, replayed when predicted
                tell(done, len(todo))
            for (config, mb), found in batch.collect() if batch else ():
                self._keep(config, mb, found)
        except BaseException:  # an interrupt (or a bug) here: the workers' results are not waited for
            self._close_helpers(running)
            raise
        if running is not self._workers:
            self._close_helpers(running)  # outside `steady`: nothing later would share them
        if batch:
            tell(len(todo), len(todo))

    def _helpers(self, rest: list[tuple[Config, int]], first_s: float) -> "workers.Workers | None":
        """The workers to share `rest` with: those kept within `steady` while any runs, else new ones where
        `rest` would take `SPREAD_AFTER_S` or more at the first simulation's pace (`first_s`) and CPUs are
        spare; None: all here."""
        from autofit.estimate.simulation import workers  # here: `python -m autofit.estimate.simulation.workers` imports this module

        if self._workers is not None and self._workers.alive():
            return self._workers if rest else None
        cheap = len(rest) < 2 or first_s * len(rest) < SPREAD_AFTER_S
        helpers = 0 if cheap else min(workers.spare_cpus(), len(rest) // 2)  # samples the CPUs for 0.2 s
        running = workers.start(self.spec, self.strategies, self._settings, helpers) \
            if helpers >= 1 else None  # else cheap, or no CPU to spare
        if running is not None and self._steadied is not None:
            self._close_helpers(self._workers)
            self._workers = running
        return running

    def _close_helpers(self, running: "workers.Workers | None") -> None:
        """End `running` (the kept workers too, where they are those)."""
        if running is not None:
            running.close()
        if running is self._workers:
            self._workers = None

    def planned(self, levels: Sequence[Sequence[Config]], plan: Callable[[int], Any]) -> list[Any]:
        """`plan(index)` for each of `levels` (each one level's configurations, as `best_fit` takes them), in
        order. Where workers are kept (`prefetch` within `steady`), they bisect the levels from the back
        meanwhile (`best_fit`), each with the simulated steps the caller holds, and send back the allocator's
        reserves they replayed (`training_replay.reserve`, most of a first plan's time): the caller's `plan`
        finds those made. What `plan` returns is the same either way."""
        running = self._workers if self._workers is not None and self._workers.alive() else None
        if running is None or len(levels) < 2:
            return [plan(index) for index in range(len(levels))]
        # levels replaying alike together (one step, allocator and history: one replay serves them all), so
        # that the caller's share and the workers' replay apart
        order = sorted(range(len(levels)), key=lambda index: self._replayed_alike(levels[index][0]))
        held = [found for key, found in self._found.items() if key not in running.sent]
        running.sent.update(self._found)
        batch = running.share_plans([levels[index] for index in order], held)
        try:  # the caller plans from the front until it meets a level a worker took (`Batch.mine`)
            done = {order[index]: plan(order[index]) for index, _ in enumerate(batch.mine())}
            for digest, found in batch.reserves().items():
                kept.RESERVES.put(digest, found)  # the worker wrote its file where the folder is shared
        except BaseException:
            self._close_helpers(running)
            raise
        return [done[index] if index in done else plan(index) for index in range(len(levels))]

    def _replayed_alike(self, config: Config) -> str:
        """What `config`'s allocator replays depend on but its micro-batch (as text, to sort by)."""
        return repr((self._key(config, 1), self._replays_training(config), self._expandable(config)))

    def adopt(self, held: Iterable[tuple[Config, int, tuple[ActivationPeak | None, str]]]) -> None:
        """Keep simulated steps another process found (each with the configuration and micro-batch that asked for
        it, as `_found` holds them), as if simulated here: a worker planning levels (`planned`) simulates nothing
        again."""
        for config, mb, found in held:
            self._keep(config, mb, found, simulated=False)

    def best_fit(self, sizes: Sequence[Config],
                 predict: Callable[[Config], Estimate] | None = None) -> tuple[int, Config | None]:
        """Where one level fits (`sizes`: its configurations, the micro-batch ascending): the index of the
        largest predicted to fit under the spec's limit (bisected: the need grows with the micro-batch; each
        told without an allocator replay where its `floor` does not fit), else 0; and the size above it
        where that one fits and its floor is not over the limit (a candidate near the limit), else None.
        Where the model states alone are over (`states_floor`), (0, None) at once. `predict`: the
        caller's, memoised (default `predict`)."""
        predict = predict or self.predict
        limit = self.spec.fit_limit
        fits = lambda estimate: estimate.fit_under(limit) is Fit.FITS  # noqa: E731 - at its error bound
        if self.states_floor(sizes[0]) > limit:
            return 0, None
        low, high = 0, len(sizes) - 1
        while low < high:
            mid = (low + high + 1) // 2
            floor = self.floor(sizes[mid])
            low, high = (mid, high) if (floor is None or fits(floor)) and fits(predict(sizes[mid])) else (low, mid - 1)
        if low + 1 == len(sizes) or not fits(predict(sizes[low])):
            return low, None
        floor = self.floor(sizes[low + 1])  # over by it: not near the limit
        return low, sizes[low + 1] if floor is None or floor.fit_under(limit) is not Fit.OVER else None

    def simulates_alike(self, a: Config, b: Config) -> bool:
        """Whether `a` and `b` run one simulated step (the same key at their micro-batches)."""
        return self._key(a, a.micro_batch_size) == self._key(b, b.micro_batch_size)

    def _sizes(self, config: Config) -> tuple[int, ...]:
        """The micro-batches simulated for `config`: its own, or those to extrapolate from (`_line_points`)."""
        mb = config.micro_batch_size
        return (mb,) if mb <= 2 or not self.extrapolate_batch else self._line_points(config)

    def _key(self, config: Config, mb: int) -> tuple:
        return self._once("key", (config, mb), lambda: self._made_key(config, mb))

    def _made_key(self, config: Config, mb: int) -> tuple:
        # a tied weight is one in a process without an engine, two under one (`simulate.fake_empty`)
        facts = self._facts_of(config)
        tied = self._tied and not facts.get("_untied")
        return (*simulations.simulation_key(facts, mb), own_adapters(self.facts, config), tied)

    def _facts_of(self, config: Config) -> dict[str, Any]:
        """What `config`'s simulated step depends on (`simulations.simulated_facts`), read anew for each call
        of `predict`, `floor` or `prefetch` (`steady`): the calibration sets what some strategies simulate
        (bitsandbytes' and peft's releases) between calls, not within one."""
        return self._once("facts", config, lambda: simulations.merged_facts(config, self._simulating))

    def _replays_training(self, config: Config) -> bool:
        """`training_replay.replays_training(config)`, once within `steady`."""
        return self._once("training", config, lambda: replays_training(config))

    def _once(self, what: str, arg: Any, make: Callable[[], Any]) -> Any:
        """`make()`, made once for (`what`, `arg`) within `steady` (every time outside it)."""
        if self._steadied is None:
            return make()
        found = self._steadied.get((what, arg), _MISSING)
        if found is _MISSING:
            found = self._steadied[what, arg] = make()
        return found

    @contextlib.contextmanager
    def steady(self) -> Iterator[None]:
        """Within: each configuration's facts, keys and history (`_once`) found once (a prediction keys its
        steps a dozen times over; a dry-run predicts thousands of configurations, and is steady throughout);
        the outermost call forgets them when it returns. Not across a change of what a strategy simulates
        (the calibration's patches between runs)."""
        outermost = self._steadied is None
        if outermost:
            self._steadied = {}
        try:
            yield
        finally:
            if outermost:
                self._steadied = None
                self._close_helpers(self._workers)  # the workers `prefetch` kept (`_helpers`)

    def _at_batch(self, config: Config, mb: int, reserved: bool = True) -> tuple[ActivationPeak, str]:
        """The simulated step at micro-batch `mb` as `config` replays it through the caching allocator (its
        optimizer, accumulation and allocator: `ActivationPeak.replayed_for`). `reserved=False`: the events
        `config` replays, not replayed (its `fragmentation` fields are the simulated step's own): what a
        line through two micro-batches reads before replaying its own events (`_extrapolated`), each
        replay a bisection of whole training histories through the allocator."""
        key = self._key(config, mb)
        if key not in self._cache and not self._recalled(config, mb):
            self._keep(config, mb, self.simulate(config, mb))
        peak, how = self._cache[key]
        replay = peak.replayed_for(config, self._replays_training(config)) or peak.replay
        expandable = self._expandable(config)
        if replay is None or (replay is peak.replay and expandable == replay.expandable):
            return peak, how
        if not reserved:
            return dataclasses.replace(peak, replay=dataclasses.replace(replay, expandable=expandable)), how
        # one simulation serves every optimizer, engine, accumulation and allocator setting; the allocator
        # replays each's events
        held = (key, replay.training[-1] if replay.training else 0, expandable)
        if held not in self._reserves:
            replay = dataclasses.replace(replay, expandable=expandable)
            self._reserves[held] = dataclasses.replace(peak, **reserve(replay))
        return self._reserves[held], how

    def _expandable(self, config: Config) -> bool:
        """Whether `config`'s allocator takes expandable segments (a strategy names it: `SEGMENTS_FACT`)."""
        return self._facts_of(config).get(SEGMENTS_FACT) == "expandable"

    def _shared(self) -> bool:
        """Whether this model's steps go through the cache on disk (`simulations.shareable`); not while a
        caller records the steps' events (`simulate.recorded_events`): a step read back records none."""
        return self._shareable and not simulate_module.recording()

    def _recalled(self, config: Config, mb: int) -> bool:
        """Whether this step was simulated before, in this process or (`_shared`) one before it: kept then."""
        found = simulations.SIMULATIONS.get((self._workload, self._key(config, mb)), self._shared())
        if found is not None:
            self._keep(config, mb, found, simulated=False)
        return found is not None

    def _keep(self, config: Config, mb: int, found: tuple[ActivationPeak | None, str], simulated: bool = True) -> None:
        """Keep a simulation's result (a new one for the process too, and where `_shared`, on disk); a failed
        one's activations come by formula."""
        key = self._key(config, mb)
        if key in self._cache:
            return
        if simulated:
            simulations.SIMULATIONS.put((self._workload, key), found, self._shared())
        self._found[key] = (config, mb, found)
        peak, how = found
        if peak is None:
            self._failed.add(key)
            peak = self._formula(config, mb)
        self._cache[key] = (peak, how)

    def simulate(self, config: Config, mb: int,
                 full_depth: bool | None = None) -> tuple[ActivationPeak | None, str]:
        """One simulated forward + backward of `config` at micro-batch `mb` (extrapolated in depth for deep
        models, unless `full_depth`, the estimator's own by default: every block simulated, slower; and in
        length for token models without attention, `SIM_LENGTHS`) and how it was obtained; (None, why)
        when it cannot be simulated."""
        batches = self.spec.batch_factory
        lengths = self._lengths()
        if lengths is None:
            return self._simulate(config, mb, full_depth, batches)
        *simulated, target = lengths
        (short, how), (long, _) = [self._simulate(config, mb, full_depth, dataclasses.replace(batches, seq_len=n))
                                   for n in simulated]
        if short is None or long is None:
            return short or long, how
        # The cache's free bytes at the peak do not follow the length: simulated whole, a two-block Mamba's
        # were 5.6, 10.4, 21.8, 16.3 MiB at 128, 256, 512, 1,024 tokens (full checkpointing: 9.0, 17.2, 13.5,
        # 18.0); the larger of the two short ones stands, a few MiB under at worst, where a line or the
        # share of the transients (`simulate.free_at_peak`) read 2.5-4x over.
        line = short.extrapolate(long, target, *simulated)
        padded = f" (padded to {target})" if target != batches.seq_len else ""
        return (dataclasses.replace(line, fragmentation=max(short.fragmentation, long.fragmentation),
                                    least_fragmentation=max(short.least_fragmentation, long.least_fragmentation)),
                f"{how}, at {simulated[0]} and {simulated[1]} tokens extrapolated to {batches.seq_len}{padded} "
                "(no attention layers: linear in the length)")

    def _lengths(self) -> tuple[int, int, int] | None:
        """(short, long, target) token lengths when this spec's steps are simulated short and extrapolated
        in length (`SIM_LENGTHS`): token batches autofit synthesized, longer than those, for a model without
        attention layers; else None."""
        batches = self.spec.batch_factory
        if self.spec.model.has_attention or not isinstance(batches, TokenBatches):
            return None
        chunk = getattr(self.spec.model.hf_config, "chunk_size", None)
        if isinstance(chunk, int) and chunk > 0:
            short, long, target = 2 * chunk, 3 * chunk, -(-batches.seq_len // chunk) * chunk
        else:
            (short, long), target = SIM_LENGTHS, batches.seq_len
        return (short, long, target) if target > long else None

    @functools.cached_property
    def _simulated_on(self) -> str:
        """What ran the simulated steps, for a prediction's method: CUDA, or CPU kernels standing in for it
        (and how), or the CPU; and for a CUDA target, the fused kernels transformers ran on their reference
        PyTorch path here (a CPU runs that path wherever it is planned for)."""
        if self.target != "cuda":
            return "CPU"
        reference = reference_paths.clause(self._meta)
        if self.sim_device == "cuda":
            return f"CUDA ({reference.removeprefix('; ')})" if reference else "CUDA"
        return (f"CPU kernels standing in for CUDA (this torch build has no CUDA"
                f"{cuda_attention.describe(self.cuda_ampere)}{reference})")

    def _simulate(self, config: Config, mb: int, full_depth: bool | None,
                  batches: Callable[[int], Any]) -> tuple[ActivationPeak | None, str]:
        full_depth = self.full_depth if full_depth is None else full_depth
        where = self._simulated_on
        k, total = self._facts_of(config).get("_unit", 1), self.facts.num_blocks  # blocks a unit of the step spans
        shallow, deep = (k * d for d in SIM_DEPTHS)
        try:
            if full_depth or not self._depth_key or total <= deep:
                return self._run(config, mb, None, batches), f"activations simulated under fake tensors on {where}"
            two = self._run(config, mb, deep, batches, deep=True)
            if two.whole_depth:
                return two, (f"activations simulated under fake tensors on {where} at {deep} of {total} blocks, "
                             "the second unit repeated to the whole depth")
            one = self._run(config, mb, shallow, batches)
        except UsageError:  # the model and batch give no loss to train (a meta forward could not tell)
            raise
        except Exception as exc:  # noqa: BLE001 - an op without a fake kernel: fall back to the formula
            bound = self.formula_bound
            return None, (f"simulation failed ({type(exc).__name__}: {' '.join(str(exc).split())[:120]}), activations by formula "
                          + (f"(up to {bound:.1f}x under the simulation where both ran)" if bound else
                             "(a formula for transformers with a sequence length or patches, not this model's "
                             "step: no bound)"))
        # Blocks unlike each other (Gemma's alternating layer kinds), units that do not divide the depth, or
        # activation offload (`_run`): each peak extrapolated in depth, the allocator's cache as the deeper
        # simulation left it
        return (one.extrapolate(two, total, shallow, deep).reserve_of(two),
                f"activations simulated under fake tensors on {where} at {shallow} and {deep} "
                f"of {total} blocks, extrapolated")

    def _run(self, config: Config, mb: int, depth: int | None, batches: Callable[[int], Any],
             deep: bool = False) -> ActivationPeak:
        """One simulation at `depth` blocks (None: the model's own); `deep`: two units of `depth` / 2 blocks,
        read as at the whole depth where the units divide it and are alike (`ActivationPeak.whole_depth`)."""
        if depth is None:
            model = meta_model(self.spec.model_factory)
        else:
            model = rebuild(self._meta, self._depth_key, depth)
        unit, total = (depth or 0) // 2, self.facts.num_blocks
        # where a strategy's step does not repeat alike (`SimulatedRun.repeatable`), it is not read deep
        wholly = deep and unit and total % unit == 0
        replay_depth = (unit, total // unit) if wholly else None
        return simulate_step(model, batches(mb), self.spec.loss_fn, config, device=self.sim_device,
                             adapted=None if own_adapters(self.facts, config) else self._adapted,
                             adapter_dropout=self._adapter_dropout, cuda_ampere=self.cuda_ampere,
                             replay_depth=replay_depth, strategies=self.strategies)

    def _formula(self, config: Config, mb: int) -> ActivationPeak:
        """The fallback when the step cannot be simulated: `formula_activations` (its error bound is
        `FORMULA_ERROR_BOUND`, measured against the simulation)."""
        total = formula_activations(self.spec.model.hf_config, self.facts, self.spec.tokens_per_sample, mb, config)
        return ActivationPeak(total, total, 0, 0, total, 0)

    def states_floor(self, config: Config) -> int:
        """Bytes per device that `config` holds whatever its activations: weights and optimizer states, and
        on CUDA the context and cuBLAS's workspace (a lower bound of its peak, from formulas alone; no
        simulation: where it is over the limit, the dry-run simulates the smallest micro-batch only)."""
        states = model_states(self.facts, config)
        fixed = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES if self.target == "cuda" else 0
        return states.params + states.optimizer + fixed

    # -- the peak -------------------------------------------------------------------------------------
    def predict(self, config: Config) -> Estimate:
        """The predicted peak per device of training `config` (bytes), its breakdown and its reason."""
        with self.steady():
            act, how = self.activations(config)
            return self._assembled(config, act, how, self.simulated(config))

    def floor(self, config: Config) -> Estimate | None:
        """`predict(config)` before the caching allocator's replay, where that is what predicting it waits on
        (a micro-batch read on the line through 1 and 2 whose line is not replayed yet): its allocator
        reserving nothing beyond its allocated bytes. Its `need_bytes` is then at most the prediction's, and
        its error bound the same, so where it does not fit (`Estimate.fit_under`) the prediction does not
        either, and where it is over the prediction is. None where it is not that cheaper: on a CPU target, a
        micro-batch simulated as it is, a line replayed already or not replayed at all, a step a strategy's
        own `memory` changes (a plug-in's: not known to grow with the reserve), or a bf16 cast's peak."""
        with self.steady():
            return self._floor(config)

    def _floor(self, config: Config) -> Estimate | None:
        from autofit.strategies.base import Strategy

        mb = config.micro_batch_size
        if (self.target != "cuda" or self._sizes(config) == (mb,)
                or (self._key(config, 1), mb, self._replays_training(config), self._expandable(config)) in self._lines
                or any(type(s).memory is not Strategy.memory for s in self.strategies)):
            return None
        for simulated in (1, 2):
            self._at_batch(config, simulated, reserved=False)
        low, high = self._line_points(config)
        (one, how), (two, _) = self._at_batch(config, low, reserved=False), self._at_batch(config, high, reserved=False)
        if one.replay is None or two.replay is None or {self._key(config, low), self._key(config, high)} & self._failed:
            return None
        line = dataclasses.replace(one.extrapolate(two, mb, low, high), fragmentation=0, least_fragmentation=0)
        floor = self._assembled(config, line, how, True)
        return floor if floor.peak_bytes > cast_peak(self.facts, config, self.target) else None

    def _assembled(self, config: Config, act: ActivationPeak, how: str, simulated: bool) -> Estimate:
        """The peak per device of `config` with activations `act` (obtained as `how` says)."""
        states = model_states(self.facts, config)
        notes = [how, *simulated_layer_notes(self.facts, config, self._adapter_dropout)]
        sparse = sparse_grads(config, act.sparse_grads) if self.facts.sparse_params else None
        if sparse is not None:  # the rows a micro-batch looks up, kept over the accumulation
            notes.append(f"sparse gradients: {_size(act.sparse_grads)} a micro-batch, kept over {config.grad_accum_steps}")
            states = dataclasses.replace(states, grads=states.grads + sparse)
        gathered, gathered_note = gathered_weights(self.facts, config)
        temp = optimizer_temporaries(self.facts, config, self.target)
        # DeepSpeed's buffers, ZeRO-3's gathered weights and a tied weight's gradient, by phase (engines.py)
        engine = engine_memory(self.facts, config, self.summary)
        held, held_note = held_grads(self.facts, config, states.grads, self.deferred_sync)
        states, held, temp, transient, step_note = step_transient(self.facts, config, states, held, temp, act, engine,
                                                                  self.target)
        notes += [note for note in (gathered_note, held_note, step_note) if note]
        terms = self._overhead(act, temp, simulated)
        overhead = sum(b for _, b in terms) + engine.held
        terms += [t for t in engine.terms if t[1] and t[0] != GATHERED_TERM]  # that one is `Breakdown.gathered`
        notes += [engine.note] if engine.note else []
        peak = states.params + gathered + states.optimizer + transient + overhead
        breakdown = _parts(dataclasses.replace(states, grads=held), temp, act.largest, overhead, gathered, engine, peak)
        for strategy in self.strategies:  # plug-in techniques say what they do to memory
            changed = strategy.memory(config, breakdown)
            peak, breakdown = peak + changed.total - breakdown.total, changed
        cast = cast_peak(self.facts, config, self.target)
        if cast > peak:
            notes.append(f"peak at the cast to bf16: {_size(cast)} (fp32 weights and buffers, and the largest "
                         "weight's bf16 copy)")
            peak = cast
        notes += state_notes(config, states, self.facts)
        if act.offloaded:
            notes.append(f"activation offload: {_size(act.offloaded)} of saved tensors in pinned host memory")
        bound, basis = self._bound(config, simulated, breakdown.activations, peak)
        slack = act.fragmentation - act.least_fragmentation if self.target == "cuda" and simulated else 0
        return Estimate(breakdown, int(peak), states.cpu + act.offloaded, notes[0], tuple(notes[1:]), tuple(terms),
                        simulated=simulated, error_bound=bound,
                        offloaded_activations=act.offloaded, kernels=act.kernels, release_slack=slack,
                        memory=Memory.RESERVED_CONTEXT if self.target == "cuda" else Memory.ALLOCATED,
                        bound_basis=basis, unbounded_bytes=CUDA_CONTEXT_BYTES if self.target == "cuda" else 0)

    def _bound(self, config: Config, simulated: bool, activations: int, peak: int) -> tuple[float | None, str]:
        """The peak's relative error bound and its basis: on CUDA the calibration's for the model's family and
        kernel (`tolerance.bound_for`), at least the activation formula's where the step was not simulated."""
        formula = 0.0 if simulated else self._peak_bound(activations, peak)
        if self.target != "cuda":
            return formula, "" if simulated else "the activation formula's bound"
        family = bound_for(self._family, config)
        if formula is None or formula > family.value:
            return formula, "the activation formula's bound"
        return family.value, family.basis

    def _peak_bound(self, activations: int, peak: int) -> float | None:
        """The relative error a peak with `activations` by formula may carry upwards (None: no bound)."""
        bound = self.formula_bound
        return None if bound is None else round((bound - 1) * activations / max(peak, 1), 4)

    def _overhead(self, act: ActivationPeak, temp: int, simulated: bool) -> list[tuple[str, int]]:
        """Overhead terms on CUDA (none on the CPU, where the budget counts tensors only). Fragmentation:
        what the caching allocator reserves beyond its most allocated bytes when the simulated step is
        replayed through it (`autofit.estimate.cuda.allocator`; the optimizer step's temporaries reuse the
        blocks the backward freed), else `FRAGMENTATION` of the transient bytes."""
        if self.target != "cuda":
            return []
        fragmentation = act.fragmentation if simulated else int(FRAGMENTATION * (act.largest + temp))
        terms = [("cuda_context", CUDA_CONTEXT_BYTES), ("cublas_workspace", CUBLAS_WORKSPACE_BYTES),
                 ("fragmentation", fragmentation)]
        return terms  # DeepSpeed's buffers: `autofit.estimate.engines`, on every device


def _parts(states: States, temp: int, activations: int, overhead: int, gathered: int, engine: EngineMemory,
           peak: int) -> Breakdown:
    """The peak's parts, each at its own most (not every part is live at the peak, so they sum to at
    least the peak): DeepSpeed's phase buffers beside the overhead, ZeRO-3's gathered weights beside
    FSDP2's, and transient bytes the backward holds beyond the activations' peak (its last gradients'
    inputs, a hook's step) counted as activations."""
    buffers = dict(engine.terms)
    gathered += buffers.pop(GATHERED_TERM, 0)
    overhead += sum(buffers.values()) - engine.held
    parts = Breakdown(states.params, states.grads, states.optimizer + temp, activations, overhead, gathered)
    return dataclasses.replace(parts, activations=activations + max(0, peak - parts.total))


def _size(nbytes: int) -> str:
    from autofit.units import format_size

    return format_size(nbytes)


def predictor_for(spec: "TrainSpec", strategies: Sequence["Strategy"] = ()) -> Callable[[Config], int | None]:
    """`predict(config)`: the predicted peak bytes of `config` on `spec.device`, or None where the
    estimator cannot tell (a failed simulation, whose formula is too coarse to prune by: the probe decides). One estimator per spec, so each (precision, attention,
    checkpointing, micro-batch) is simulated once."""
    estimator: list[Estimator] = []

    def predict(config: Config) -> int | None:
        try:
            if not estimator:
                estimator.append(Estimator(spec, strategies=strategies))
            estimate = estimator[0].predict(config)
            return estimate.need_bytes if estimate.simulated else None
        except Exception:  # noqa: BLE001 - a prediction only saves probes; without one, probe
            return None

    return predict


_ESTIMATORS: dict[int, tuple[weakref.ref, Estimator]] = {}


def predict_peak(spec: "TrainSpec", config: Config) -> Estimate:
    """The predicted peak of `config` on `spec.device` (an `Estimate`). Estimators are cached per spec,
    so predicting many configs simulates each (precision, attention, checkpointing) once."""
    entry = _ESTIMATORS.get(id(spec))
    if entry is None or entry[0]() is not spec:
        entry = (weakref.ref(spec), Estimator(spec))
        _ESTIMATORS[id(spec)] = entry
    return entry[1].predict(config)
