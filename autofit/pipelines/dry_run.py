"""Dry-run: plan for a GPU you do not have. Every candidate's peak per GPU is predicted (`autofit.estimate.estimator`),
nothing is trained and nothing real is allocated, and among the candidates that fit the one `autofit tune`
would keep on these predicted speeds is chosen (`_decided`: the tuner's margins).

    report = autofit.dry_run("llama-2-7b", seq_len=4096, global_batch_size=64, gpu="a100-80gb", num_gpus=8)
    report.chosen.config, report.chosen.peak_bytes, [c.fits for c in report.candidates]

Candidates are the levels of the same space the tuner walks (`autofit.search.space.build_space` for a
`Target` built from the GPU profile, every extra assumed installable there), each at its largest
micro-batch predicted to fit (its smallest when none does). The dry-run adds only its report; the
fitting candidates are ranked by predicted seconds per step (`autofit.estimate.cost_model`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autofit.config import Config
from autofit.errors import Param, UsageError
from autofit.estimate.cost_model import SECONDS_PER_KERNEL, host_seconds, step_seconds
from autofit.estimate.estimator import Estimator
from autofit.estimate.prediction import Estimate
from autofit.devices.gpus import GpuProfile, get_gpu, split_count
from autofit.estimate.states import unsharded_grads
from autofit.estimate.workload import workload
from autofit.search.decision import DEFAULT_EXACT_MARGIN, MarginKind, change_order, margin_between
from autofit.search.shortfall import Basis, Remedy, Shortfall
from autofit.search.space import Space, build_space
from autofit.job.target import Target
from autofit.units import format_size, parse_size

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy

DEFAULT_MAX_MICRO_BATCH = 64  # largest micro-batch planned when no global batch is given


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One planned configuration: its predicted peak per GPU, whether it fits, and its predicted speed."""

    config: Config
    estimate: Estimate
    fits: bool
    verdict: str  # one phrase: the fit (or the shortfall) in bytes, and the speed
    tier: int  # exactness tier (0 same math, 1 numerics, 2 trains adapters)
    step_seconds: float  # predicted seconds per optimizer step
    samples_per_s: float  # predicted global samples per second
    limit: int = 0  # the bytes per GPU it was planned under (0: none)

    @property
    def reason(self) -> str:
        """One line: the verdict and speed, then how the peak was predicted (`Estimate.reason`)."""
        return f"{self.verdict}; {self.estimate.reason}"

    @property
    def peak_bytes(self) -> int:
        """Predicted peak per GPU (bytes) under the limit (`Estimate.peak_under`)."""
        return self.estimate.peak_under(self.limit) if self.limit else self.estimate.peak_bytes

    def __repr__(self) -> str:
        """One line: the knobs, the peak, the verdict and the speed (the dataclass's spelled out the whole
        estimate; `reason` and `estimate` hold it)."""
        verdict = "fits" if self.fits else "does not fit"
        return (f"Candidate({self.config.describe()}: peak {format_size(self.peak_bytes)}/GPU, {verdict}, "
                f"~{self.samples_per_s:,.1f} samples/s)")

    def to_dict(self) -> dict[str, Any]:
        """JSON form: config, peak_bytes, fits, reason, breakdown (bytes), cpu_bytes, speed."""
        return {"config": self.config.to_dict(), "peak_bytes": self.peak_bytes,
                "need_bytes": self.estimate.need_bytes, "fits": self.fits,
                "reason": self.reason, "breakdown": self.estimate.breakdown.to_dict(),
                "overhead_terms": dict(self.estimate.terms), "cpu_bytes": self.estimate.cpu_bytes,
                "activations": "simulated" if self.estimate.simulated else "formula",
                "error_bound": self.estimate.error_bound,
                "tier": self.tier, "step_seconds": self.step_seconds, "samples_per_s": self.samples_per_s}


@dataclasses.dataclass(frozen=True)
class DryRunReport:
    """What a dry-run predicts. `candidates`: the allowed ones, fitting first (fastest first), then the rest
    (smallest peak first). `chosen`: the predicted fastest fit, or None with `reason` saying what to allow."""

    model: str
    gpu: GpuProfile
    num_gpus: int
    global_batch_size: int | None
    fit_limit: int  # bytes a candidate may peak at per GPU: the GPU's memory less the safety margin
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    reason: str
    seconds: float  # wall time the planning took
    batch: str = ""  # the batch each candidate was predicted for (a synthesized one's shape: its length)
    shortfall: Shortfall | None = None  # why nothing fits, as fields (`reason` is its Python words)

    @property
    def rows(self) -> tuple[tuple[Candidate, ...], ...]:
        """The candidates as a table shows them: each with the later ones predicted alike (`twins`), in the
        order of `candidates` (the chosen row first)."""
        return twins(self.candidates)

    @property
    def fits(self) -> bool:
        """Whether some allowed candidate is predicted to fit."""
        return self.chosen is not None

    @property
    def unknown(self) -> bool:
        """Whether no verdict could be reached: nothing is predicted to fit, and the closest candidate's peak
        has no bound (its step could not be simulated, and the activation formula does not cover the model)."""
        return self.chosen is None and bool(self.candidates) and self.candidates[0].estimate.upper_bytes is None

    @property
    def formula_only(self) -> bool:
        """Whether the verdict rests on the activation formula (the step could not be simulated): the
        chosen candidate's, or with nothing fitting, the closest one's."""
        row = self.chosen or (self.candidates[0] if self.candidates else None)
        return row is not None and not row.estimate.simulated

    def __repr__(self) -> str:
        """One line a notebook can show: the target, the choice and the candidates counted (the dataclass's
        spelled out every candidate's estimate, megabytes for a large space). `autofit dry-run` renders
        the table; `to_dict` has everything."""
        chosen = repr(self.chosen) if self.chosen is not None else "None"
        fitting = sum(c.fits for c in self.candidates)
        return (f"DryRunReport({self.model} on {self.num_gpus} x {self.gpu.name}, fits={self.fits}, "
                f"chosen={chosen}, candidates={len(self.candidates)} ({fitting} fit), "
                f"reason={self.reason!r})")

    def to_dict(self) -> dict[str, Any]:
        """One JSON document: the candidates, the chosen one, and the target."""
        chosen = self.candidates.index(self.chosen) if self.chosen is not None else None
        return {"model": self.model, "gpu": self.gpu.name, "gpu_memory": self.gpu.memory_bytes,
                "num_gpus": self.num_gpus, "global_batch_size": self.global_batch_size,
                "batch": self.batch, "fit_limit": self.fit_limit, "fits": self.fits, "reason": self.reason,
                "verdict_basis": "none" if self.unknown else "formula" if self.formula_only else "simulation",
                "shortfall": self.shortfall.to_dict() if self.shortfall else None,
                "chosen": self.chosen.to_dict() if self.chosen else None, "chosen_index": chosen,
                "rows": [[self.candidates.index(c) for c in row] for row in self.rows],
                "candidates": [c.to_dict() for c in self.candidates], "seconds": round(self.seconds, 2)}


def twins(candidates: Sequence[Candidate]) -> tuple[tuple[Candidate, ...], ...]:
    """`candidates` grouped where every figure of their predictions is the same (peak and need per GPU, its
    parts, host bytes, fit, speed, tier: SDPA and flash-attention levels, most often), each group at its first
    member's place: one row of a table, naming the rest as alternatives (`alternative`)."""
    groups: dict[tuple, list[Candidate]] = {}
    for candidate in candidates:
        groups.setdefault(_figures(candidate), []).append(candidate)
    return tuple(tuple(group) for group in groups.values())


def _figures(candidate: Candidate) -> tuple:
    estimate = candidate.estimate
    return (candidate.fits, candidate.peak_bytes, estimate.need_bytes, estimate.upper_bytes, estimate.simulated,
            tuple(estimate.breakdown.to_dict().items()), estimate.cpu_bytes, candidate.tier,
            candidate.step_seconds, candidate.samples_per_s)


def alternative(head: Candidate, twin: Candidate) -> str:
    """What `twin` changes from `head` in `Config.describe`'s words ("attn=flash"): how a row names a twin."""
    own = set(head.config.describe().split(", "))
    return ", ".join(part for part in twin.config.describe().split(", ") if part not in own) or twin.config.describe()


def dry_run(model: Any, batch: Any = None, *, gpu: str | GpuProfile = "h100-80gb", num_gpus: int | None = None,
            global_batch_size: int | None = None, seq_len: int | None = None, gpu_memory: int | str | None = None,
            allow: Any = None, optimizer: Any = "adamw", loss_fn: Any = None, safety_margin: float = 0.10,
            max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH, strategies: Sequence["Strategy"] | None = None,
            lora_targets: Sequence[str] | None = None, deferred_sync: bool = False,
            progress: Callable[[int, int], Any] | bool | None = None) -> DryRunReport:
    """Predict, without a GPU, which training configuration of `model` fits `gpu` and which is fastest.

    Args:
        model: a preset name ("llama-2-7b"), a config.json / model folder / "FILE.py:factory" string, a
            Hugging Face config, a zero-argument factory or an `nn.Module` (as `autofit.autofit` takes).
        batch: as `autofit.autofit`; None synthesizes token ids (or pixels) from a Hugging Face config.
        gpu: a profile name from `autofit gpus` (or a `GpuProfile`), with the count in front where you like:
            "8xa100-40gb" is `gpu="a100-40gb", num_gpus=8`.
        num_gpus: data-parallel GPUs (default: the count in `gpu`, else 1); ZeRO stages and FSDP2 are
            planned when more than one.
        global_batch_size: samples per optimizer step over all GPUs, kept exactly (micro-batch x
            accumulation x GPUs). None plans micro-batches 1..`max_micro_batch` without accumulation.
        seq_len: sequence length of a synthesized batch (at most the model's maximum).
        gpu_memory: bytes or "20GiB": the memory of each GPU, overriding the profile's.
        allow: exactness tiers as in `autofit.autofit` (None: tiers 0-1; {"lora"}: adapters too).
        safety_margin: share of the memory a fit must leave free (default 10%).
        strategies: the techniques to plan (default: all, as `autofit.autofit` searches them).
        lora_targets: module names LoRA adapts, e.g. ("q_proj", "v_proj"); None: every linear layer but
            the output head (the default LoRA strategy's choice).
        deferred_sync: plan for a training loop that reduces gradients on the last micro-batch of each step
            only (accelerate's `accumulate()`, the Trainer without `sync_each_batch`): FSDP2 with
            accumulation then holds every gradient unsharded. False: as autofit's loop and exports run,
            reducing after every micro-batch (the chosen FSDP2 plan's reason says what deferring would add).
        progress: called as `progress(done, total)` while the training steps are simulated (the slow part:
            seconds to minutes; `autofit dry-run` shows it on a terminal); True prints the count on stderr,
            one line rewritten in place (a notebook's cell output too), as `autofit.autofit(progress=True)`.

    Returns:
        A `DryRunReport` (values only; `autofit dry-run` renders it).
    """
    from autofit.strategies import default_strategies

    started = time.perf_counter()
    profile, num_gpus = _gpus(gpu, num_gpus)
    if gpu_memory is not None:
        profile = profile.with_memory(parse_size(gpu_memory, "gpu_memory"))
    spec, description = _spec(model, batch, profile, num_gpus, global_batch_size, seq_len, allow, optimizer,
                              loss_fn, safety_margin, max_micro_batch)
    chosen_strategies = list(strategies) if strategies is not None else default_strategies()
    if lora_targets is not None:
        chosen_strategies = _with_lora_targets(chosen_strategies, lora_targets)
    space = build_space(spec, chosen_strategies)
    estimator = Estimator(spec, target="cuda", extrapolate_batch=True, strategies=chosen_strategies,
                          deferred_sync=deferred_sync)
    planner = _Planner(space, estimator, profile)
    levels = list(space.levels())
    estimator.prefetch((config for level in levels for config in planner.asks(level)), _listener(progress))
    allowed = [planner.best_at(level) for level in levels]
    # A fit resting on a simulation ranks before one resting on the activation formula alone.
    fitting = sorted((c for c in allowed if c.fits), key=lambda c: (not c.estimate.simulated, c.step_seconds))
    rest = sorted((c for c in allowed if not c.fits), key=lambda c: c.peak_bytes)
    chosen = _decided(space, fitting) if fitting else None
    if chosen:
        reason, shortfall = spec.model.noting_weights(_chosen_reason(chosen, fitting) + _sync_note(chosen, estimator),
                                                      chosen.config.precision), None
    else:
        reason, shortfall = _nothing_fits(spec, profile, rest, _beyond(space, estimator, profile, chosen_strategies))
    first = [chosen] if chosen else []  # the choice heads the table, then the other fits by speed
    return DryRunReport(description, profile, spec.num_gpus, spec.global_batch_size, spec.fit_limit,
                        tuple(first + [c for c in fitting if c is not chosen] + rest), chosen, reason,
                        time.perf_counter() - started, spec.batch_description, shortfall)


def _listener(progress: Callable[[int, int], Any] | bool | None) -> Callable[[int, int], Any] | None:
    """`dry_run`'s `progress` as the estimator hears it: True prints the count on stderr."""
    if progress is True:
        return lambda done, total: print(f"\r{done} of {total} training steps simulated", file=sys.stderr,
                                         end="\n" if done == total else "", flush=True)
    if progress is not None and progress is not False and not callable(progress):
        raise UsageError(f"progress={progress!r}: pass True (the count on stderr), False, or a function "
                         "progress(done, total).")
    return progress or None


def _with_lora_targets(strategies: list["Strategy"], targets: Sequence[str]) -> list["Strategy"]:
    """`strategies` with the LoRA strategy adapting `targets` (its ranks kept)."""
    from autofit.strategies.lora import Lora

    return [Lora(s.ranks, target_modules=targets, alpha=s.alpha, dropout=s.dropout) if isinstance(s, Lora) else s
            for s in strategies]


def _gpus(gpu: str | GpuProfile, num_gpus: int | None) -> tuple[GpuProfile, int]:
    """The profile and the GPU count that `gpu` ("a100-40gb", "8xa100-40gb") and `num_gpus` say together."""
    if isinstance(gpu, GpuProfile):
        return gpu, 1 if num_gpus is None else num_gpus
    count, name = split_count(gpu)
    if count is not None and num_gpus is not None and count != num_gpus:
        raise UsageError("{given} says {count} GPUs but {ranks}: give the count once ({once}, or {joined}).",
                         given=Param("gpu", gpu), count=str(count), ranks=Param("num_gpus", num_gpus),
                         once=f"--gpu {name} --num-gpus N", joined=f"--gpu {count}x{name}")
    return get_gpu(name), next(n for n in (count, num_gpus, 1) if n is not None)


def _spec(model: Any, batch: Any, profile: GpuProfile, num_gpus: int, global_batch_size: int | None,
          seq_len: int | None, allow: Any, optimizer: Any, loss_fn: Any, safety_margin: float,
          max_micro_batch: int) -> tuple["TrainSpec", str]:
    from autofit.job.train_spec import make_spec

    description = None
    if isinstance(model, str):
        from autofit.models.names import factory_loss_fn, resolve_model

        loss_fn = loss_fn or factory_loss_fn(model)  # a (model, make_batch, loss_fn) factory's loss
        model, file_batch, description = resolve_model(model)
        batch = batch if batch is not None else file_batch
    # The spec is built on the CPU (nothing is probed) for the profile's Target: its memory is the budget.
    spec = make_spec(model, batch, global_batch_size=global_batch_size, device="cpu",
                     memory_budget=profile.memory_bytes, num_gpus=num_gpus, allow=allow, optimizer=optimizer,
                     loss_fn=loss_fn, seq_len=seq_len, safety_margin=safety_margin, max_micro_batch=max_micro_batch,
                     target=Target.from_profile(profile, num_gpus))
    return spec, description or spec.model.name


def _beyond(space: Space, estimator: Estimator, profile: GpuProfile,
            strategies: Sequence["Strategy"]) -> list[Candidate]:
    """The levels the next tiers would add (what an allow= would open), each at its smallest micro-batch:
    when nothing allowed fits, whether a level fits at all is the question (its smallest size answers
    it, with the fewest simulations). A level whose model states alone are over the limit cannot open
    anything: it is left out unsimulated (`_Planner.states_over`)."""
    tiers = sorted({e.tier for e in space.excluded if e.tier is not None})
    if not tiers:
        return []
    wider = build_space(dataclasses.replace(space.spec, max_tier=tiers[-1]), strategies)
    planner = _Planner(wider, estimator, profile)
    known = set(space.levels())
    smallest = [wider.at(level, wider.sizes_at(level)[0]) for level in wider.levels() if level not in known]
    smallest = [config for config in smallest if not planner.states_over(config)]
    estimator.prefetch(smallest)
    return [planner.candidate(config) for config in smallest]


class _Planner:
    """Finds each level's largest fitting micro-batch and predicts its speed."""

    def __init__(self, space: Space, estimator: Estimator, gpu: GpuProfile):
        self.space, self.spec, self.estimator, self.gpu = space, space.spec, estimator, gpu
        self.work = workload(self.spec, estimator.facts.num_params, estimator.facts.num_blocks)

    def asks(self, level: Config) -> list[Config]:
        """The configurations `best_at(level)` may predict: the smallest size alone when the model
        states alone are over the limit (no size fits), else every size."""
        sizes = self.space.sizes_at(level)
        if self.states_over(self.space.at(level, sizes[0])):
            sizes = sizes[:1]
        return [self.space.at(level, size) for size in sizes]

    def states_over(self, config: Config) -> bool:
        """Whether `config`'s model states alone (`Estimator.states_floor`, a lower bound of its peak) are
        over the fit limit: then it fits at no size."""
        return self.estimator.states_floor(config) > self.spec.fit_limit

    def best_at(self, level: Config) -> Candidate:
        """The level at its largest micro-batch predicted to fit, else at its smallest."""
        sizes = self.space.sizes_at(level)
        if self.states_over(self.space.at(level, sizes[0])):
            return self.candidate(self.space.at(level, sizes[0]))  # model states alone are over: no size fits
        low, high = 0, len(sizes) - 1  # memory grows with the size: bisect for the last that fits
        while low < high:
            mid = (low + high + 1) // 2
            if self._fits(self.estimator.predict(self.space.at(level, sizes[mid]))):
                low = mid
            else:
                high = mid - 1
        return self.candidate(self.space.at(level, sizes[low]))

    def _fits(self, estimate: Estimate) -> bool:
        upper = estimate.upper_bytes  # a formula's peak must fit at its error bound, and have one
        return upper is not None and upper <= self.spec.fit_limit

    def candidate(self, config: Config) -> Candidate:
        """`config` predicted: its estimate, fit, speed and reason."""
        estimate = self.estimator.predict(config)
        fits = self._fits(estimate)
        seconds = step_seconds(self.spec, config, self.gpu, self.estimator.facts, self.work,
                               estimate.offloaded_activations, estimate.kernels)
        samples = config.global_batch_size / seconds
        head = _verdict(estimate, fits, self.spec.fit_limit)
        host = host_seconds(config, self.estimator.facts, estimate.kernels)
        bound = f"; bound by the host issuing {round(host / SECONDS_PER_KERNEL):,} ops a step" if host >= seconds else ""
        return Candidate(config, estimate, fits, f"{head}, ~{samples:,.1f} samples/s ({self.work.how}{bound})",
                         self.space.tier(config), seconds, samples, self.spec.fit_limit)


def _verdict(estimate: Estimate, fits: bool, limit: int) -> str:
    """"fits: 12 GiB of 20 GiB (60%)", "over by ...", and for a formula's peak its bound; where it fits
    only with the allocator's cache released at the limit, what a roomy card would reserve."""
    peak, need = estimate.peak_under(limit), estimate.need_bytes
    if estimate.upper_bytes is None:
        return (f"unknown: the step could not be simulated and the activation formula does not cover this model; "
                f"{format_size(need - estimate.breakdown.activations)} without its activations")
    head = f"fits: {format_size(peak)} of {format_size(limit)} ({peak / limit:.0%})" if fits else \
        f"over by {format_size(estimate.upper_bytes - limit)}: needs {format_size(need)} of {format_size(limit)}"
    if fits and peak < estimate.peak_bytes:
        head += (f", the caching allocator releasing its cache to stay under (it needs {format_size(need)}; "
                 f"a roomy card would reserve up to {format_size(estimate.peak_bytes)})")
    if estimate.simulated:
        return head
    return (f"{head}, by formula only (not simulated): up to {format_size(estimate.upper_bytes)} at its "
            f"error bound (+{estimate.error_bound:.0%})")


def _decided(space: Space, fitting: list[Candidate]) -> Candidate:
    """The choice among `fitting` (ordered by predicted speed, simulated fits first) by the tuner's rule
    (`autofit.search.decision.decide`) on predicted speeds: from the least change to the most, a candidate
    that changes more replaces the choice only when predicted faster by the margin it must clear
    (`DEFAULT_EXACT_MARGIN` for a numerics change, `NOISE_MARGIN` otherwise), so the dry-run names what
    `autofit tune` would keep. Fits resting on a simulation are chosen before formula-only ones."""
    basis = [c for c in fitting if c.estimate.simulated] or fitting
    holder, *others = sorted(basis, key=lambda c: change_order(space, c.config))
    for challenger in others:
        if holder.step_seconds >= challenger.step_seconds * (1 + _margin(holder, challenger)[0]):
            holder = challenger
    return holder


def _margin(safer: Candidate, riskier: Candidate) -> tuple[float, MarginKind]:
    return margin_between((safer.tier, False), (riskier.tier, False), DEFAULT_EXACT_MARGIN)


_MARGIN_WORDS = {MarginKind.EXACTNESS: "a numerics change must clear",
                 MarginKind.NEAR_LIMIT: "a fit nearer the limit must clear",
                 MarginKind.NOISE: "any other change must clear"}


def _chosen_reason(chosen: Candidate, fitting: list[Candidate]) -> str:
    others = len(fitting) - 1
    if not chosen.estimate.simulated:
        return (f"by formula only (the step could not be simulated: {chosen.estimate.method}): "
                f"{chosen.config.describe()} is predicted to peak at {format_size(chosen.peak_bytes)}, up to "
                f"{format_size(chosen.estimate.upper_bytes)} at the formula's error bound; run autofit tune "
                "on the GPU to measure it")
    fastest = fitting[0]
    if fastest is not chosen:
        margin, kind = _margin(chosen, fastest)
        return (f"{chosen.config.describe()}, ~{chosen.samples_per_s:,.1f} samples/s, peak "
                f"{format_size(chosen.peak_bytes)}, of {len(fitting)} fitting candidate(s): "
                f"{fastest.config.describe()} is predicted {chosen.step_seconds / fastest.step_seconds - 1:.1%} "
                f"faster, under the {margin:.0%} margin {_MARGIN_WORDS[kind]}, as autofit tune decides")
    return (f"predicted fastest of {len(fitting)} fitting candidate(s): {chosen.config.describe()}, "
            f"~{chosen.samples_per_s:,.1f} samples/s, peak {format_size(chosen.peak_bytes)}"
            + (f" ({_others(chosen, fitting)})" if others else ""))


def _others(chosen: Candidate, fitting: list[Candidate]) -> str:
    """The other fits beside the fastest chosen: those predicted as fast (a tie the fewest changes win,
    `_decided`) and the slower ones."""
    ties = sum(c is not chosen and c.step_seconds <= chosen.step_seconds for c in fitting)
    slower = len(fitting) - 1 - ties
    if not ties:
        return f"{slower} other(s) fit, slower"
    return (f"{len(fitting) - 1} other(s) fit: {ties} predicted as fast, with more changes"
            + (f", {slower} slower" if slower else ""))


def _sync_note(chosen: Candidate, estimator: Estimator) -> str:
    """For FSDP2 with accumulation: the prediction reduces gradients after every micro-batch, and what a
    loop that defers the reduce would add."""
    config = chosen.config
    if not config.needs_sync_each_micro_batch or estimator.deferred_sync:
        return ""
    more = unsharded_grads(estimator.facts, config) - chosen.estimate.breakdown.grads
    return (f". Its peak has the gradients reduced after every micro-batch, as autofit's loop and exports do "
            f"(sync_each_batch); a loop that waits for the last one (accelerate's accumulate(), the Trainer's "
            f"default) holds every gradient unsharded: {format_size(more)} more per GPU")


def _nothing_fits(spec: "TrainSpec", gpu: GpuProfile, rest: list[Candidate],
                  beyond: list[Candidate]) -> tuple[str, Shortfall | None]:
    """Why nothing fits (a `Shortfall`, and its Python words): "No candidate fits ...; the smallest needs ...
    Pass allow=... / use more GPUs ... to go further."; or, where the closest candidate's peak has no bound,
    that no verdict can be reached (no shortfall)."""
    unbounded = [c for c in rest if c.estimate.upper_bytes is None]
    if unbounded:
        floor = min(unbounded, key=lambda c: c.estimate.need_bytes - c.estimate.breakdown.activations)
        return (f"Cannot predict whether {spec.model.name} fits: its training step could not be simulated "
                f"({floor.estimate.method}). Without activations, the least any candidate holds is "
                f"{format_size(floor.estimate.need_bytes - floor.estimate.breakdown.activations)} "
                f"({floor.config.describe()}); run autofit tune on the GPU to measure it."), None
    smallest = min(rest, key=lambda c: c.estimate.need_bytes) if rest else None
    found = dict(limit=spec.fit_limit, capacity=gpu.memory_bytes, margin=spec.safety_margin, gpu=gpu.name)
    if smallest is not None:
        found.update(smallest=smallest.config, need=smallest.estimate.need_bytes, basis=Basis.PREDICTED)
    opened = sorted((c for c in beyond if c.fits), key=lambda c: (c.tier, c.peak_bytes))
    overhead = smallest.estimate.breakdown.overhead if smallest is not None else 0
    if opened:
        shortfall = Shortfall(**found, remedy=Remedy.ALLOW, tier=opened[0].tier, opened=opened[0].config,
                              opened_peak=opened[0].peak_bytes)
    elif overhead >= spec.fit_limit:  # the CUDA context and workspaces: no sharding or smaller model helps
        shortfall = Shortfall(**found, remedy=Remedy.LARGER_GPU, overhead=overhead,
                              overhead_terms=tuple(term for term, _ in smallest.estimate.terms))
    else:
        shortfall = Shortfall(**found, remedy=Remedy.MORE_MEMORY, more_gpus=spec.num_gpus < 8)
    return shortfall.words(), shortfall
