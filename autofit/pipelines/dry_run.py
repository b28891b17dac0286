"""Dry-run: plan for a GPU you do not have. Every candidate's peak per GPU is predicted (`autofit.estimate.estimator`),
nothing is trained and nothing real is allocated, and among the candidates that fit the one `autofit tune`
would keep on these predicted speeds is chosen (`_decided`: the tuner's margins).

    report = autofit.dry_run("llama-2-7b", seq_len=4096, global_batch_size=64, gpu="a100-80gb", num_gpus=8)
    report.chosen.config, report.chosen.peak_bytes, [c.fits for c in report.candidates]
    autofit.dry_run("llama-2-70b", seq_len=4096, global_batch_size=512, gpu="h100", nodes=4, gpus_per_node=8)

Candidates are the levels of the same space the tuner walks (`autofit.search.space.build_space` for a
`Target` built from the GPU profile, every extra assumed installable there), each at its largest
micro-batch predicted to fit (its smallest when none does). The dry-run adds only its report; the
fitting candidates are ranked by predicted seconds per step (`autofit.estimate.cost_model`). Over several
nodes the strategies add their hierarchical sharding beside sharding over every GPU, the cost model charges
each collective to the link it crosses, and the chosen reason says what crossing nodes costs (`nodes_note`).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from typing import TYPE_CHECKING, Any, Callable, Sequence

from autofit.config import Config
from autofit.errors import Param, UsageError
from autofit.estimate.cost_model import SECONDS_PER_KERNEL, step_cost
from autofit.estimate.estimator import Estimator
from autofit.estimate.prediction import Estimate, Fit
from autofit.devices.gpus import GpuProfile, Layout, get_gpu, layout, split_count
from autofit.estimate.workload import workload
from autofit.search.decision import DEFAULT_EXACT_MARGIN, MarginKind, change_order, level_order, margin_between
from autofit.search.shortfall import Basis, Remedy, Shortfall
from autofit.search.space import Space, build_space
from autofit.strategies import compute_dtype
from autofit.job.target import Target
from autofit.pipelines.candidate import Candidate, twins
from autofit.pipelines.host_memory import host_note, host_shortfall, over_host
from autofit.pipelines.levels import best_levels
from autofit.pipelines.notes import edge_note, nodes_note, sync_note
from autofit.units import format_size, parse_size

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.base import Strategy

DEFAULT_MAX_MICRO_BATCH = 64  # largest micro-batch planned when no global batch is given


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
    # the candidate the decision would have taken before `chosen` were its need known exactly: near the limit
    # (`Candidate.near_limit`), so left to a probe on the card (None: no such one)
    near_choice: Candidate | None = None
    layout: Layout | None = None  # the nodes the GPUs are on, and the network between them (None: one node)

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
    def near_limit(self) -> tuple[Candidate, ...]:
        """The candidates that fit as predicted but not at their error bound (`Candidate.near_limit`): with
        nothing chosen, the ones `autofit tune` on the card would decide."""
        return tuple(c for c in self.candidates if c.near_limit)

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
        index = {id(c): i for i, c in reversed(list(enumerate(self.candidates)))}  # the first of each, as `index`
        chosen = index[id(self.chosen)] if self.chosen is not None else None
        return {"model": self.model, "gpu": self.gpu.name, "gpu_memory": self.gpu.memory_bytes,
                "num_gpus": self.num_gpus, "nodes": self.layout.nodes if self.layout else 1,
                "gpus_per_node": self.layout.per_node if self.layout else self.num_gpus,
                "inter_node_gbps": self.layout.inter_node_gbps if self.layout else None,
                "network": self.layout.network if self.layout else "", "global_batch_size": self.global_batch_size,
                "batch": self.batch, "fit_limit": self.fit_limit, "fits": self.fits, "reason": self.reason,
                "memory": self.candidates[0].estimate.memory.value if self.candidates else None,
                "near_limit": len(self.near_limit),
                "verdict_basis": "none" if self.unknown else "formula" if self.formula_only else "simulation",
                "shortfall": self.shortfall.to_dict() if self.shortfall else None,
                "chosen": self.chosen.to_dict() if self.chosen else None, "chosen_index": chosen,
                "near_choice": self.near_choice.to_dict() if self.near_choice else None,
                "rows": [[index[id(c)] for c in row] for row in self.rows],
                "candidates": [c.to_dict() for c in self.candidates], "seconds": round(self.seconds, 2)}


def dry_run(model: Any, batch: Any = None, *, gpu: str | GpuProfile = "h100-80gb", num_gpus: int | None = None,
            nodes: int | None = None, gpus_per_node: int | None = None, node_network: str | None = None,
            inter_node_gbps: float | None = None, global_batch_size: int | None = None, seq_len: int | None = None, gpu_memory: int | str | None = None,
            allow: Any = None, optimizer: Any = "adamw", loss_fn: Any = None, safety_margin: float = 0.10,
            max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH, strategies: Sequence["Strategy"] | None = None,
            lora_targets: Sequence[str] | None = None, deferred_sync: bool = False,
            progress: Callable[[int, int], Any] | bool | None = None,
            host_memory: int | str | None = None, varied_lengths: bool = False) -> DryRunReport:
    """Predict, without a GPU, which training configuration of `model` fits `gpu` and which is fastest.

    Args:
        model: a preset name ("llama-2-7b"), a config.json / model folder / "FILE.py:factory" string, a
            Hugging Face config, a zero-argument factory or an `nn.Module` (as `autofit.autofit` takes).
        batch: as `autofit.autofit`; None synthesizes token ids (or pixels) from a Hugging Face config.
        gpu: a profile name from `autofit gpus` (or a `GpuProfile`), with the count in front where you like:
            "8xa100-40gb" is `gpu="a100-40gb", num_gpus=8`.
        num_gpus: data-parallel GPUs over every node (default: the count in `gpu`, else nodes x
            gpus_per_node, else 1); ZeRO stages and FSDP2 are planned when more than one.
        nodes: machines the GPUs are on (default 1); over several, hybrid FSDP2 and ZeRO++ (sharding within
            a node) are planned beside sharding over every GPU, each collective charged to the link it crosses.
        gpus_per_node: GPUs on each node (default: num_gpus / nodes, else the profile's node type: 8 on
            HGX boards).
        node_network: the network between nodes, a profile from `autofit gpus` ("ib-ndr", "efa-p5"; default
            the node type's).
        inter_node_gbps: GB/s (10^9 bytes/s) each GPU sends across nodes, instead of a network profile (a
            400 Gb/s NIC per GPU: 50).
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

        host_memory: bytes or "512GiB": the RAM of each node; a candidate whose offloaded states need more is
            ruled out (`autofit.pipelines.host_memory`). None: none is, and a chosen plan needing more than a
            typical node of the GPU has says so in its reason.
        varied_lengths: each batch is padded to its own longest sample, up to `seq_len`: the reserved peak
            is predicted after a run of shorter batches (docs/dry-run.md, "Batches of varied length").

    Returns:
        A `DryRunReport` (values only; `autofit dry-run` renders it).
    """
    from autofit.strategies import default_strategies

    started = time.perf_counter()
    profile, count = _gpus(gpu, num_gpus)
    if gpu_memory is not None:
        profile = profile.with_memory(parse_size(gpu_memory, "gpu_memory"))
    where = layout(profile, count, nodes, gpus_per_node, node_network, inter_node_gbps)
    spec, description = _spec(model, batch, profile, where, global_batch_size, seq_len, allow, optimizer,
                              loss_fn, safety_margin, max_micro_batch)
    spec = dataclasses.replace(spec, varied_lengths=bool(varied_lengths))
    chosen_strategies = list(strategies) if strategies is not None else default_strategies()
    if lora_targets is not None:
        chosen_strategies = [s.adapting(lora_targets) for s in chosen_strategies]  # `Strategy.adapting`
    space = build_space(spec, chosen_strategies)
    estimator = Estimator(spec, target="cuda", extrapolate_batch=True, strategies=chosen_strategies,
                          deferred_sync=deferred_sync)
    planner = _Planner(space, estimator, profile)
    host = parse_size(host_memory, "host_memory") if host_memory is not None else None
    with estimator.steady():  # nothing changes what a strategy simulates meanwhile: facts found once a configuration
        allowed, over = over_host(best_levels(space, planner, chosen_strategies, _listener(progress)), host)
    # A fit resting on a simulation ranks before one resting on the activation formula alone.
    fitting = sorted((c for c in allowed if c.fits), key=lambda c: (not c.estimate.simulated, c.step_seconds))
    rest = sorted((c for c in allowed if not c.fits), key=lambda c: c.peak_bytes)
    chosen = _decided(space, fitting) if fitting else None
    near_choice = _near_choice(space, fitting, [*allowed, *planner.near_above], chosen)
    if chosen:
        said = (_chosen_reason(chosen, fitting) + sync_note(chosen, estimator) + nodes_note(chosen, allowed)
                + edge_note(near_choice))
        reason, shortfall = spec.model.noting_weights(said, compute_dtype(chosen.config) is not None), None
        reason += host_note(chosen, profile, spec.num_gpus) if host is None else ""
    elif over and host is not None:
        reason, shortfall = host_shortfall(over, host), None
    else:
        reason, shortfall = _nothing_fits(spec, profile, rest, _beyond(space, estimator, profile, chosen_strategies))
    first = [chosen] if chosen else []  # the choice heads the table, then the other fits by speed
    return DryRunReport(description, profile, spec.num_gpus, spec.global_batch_size, spec.fit_limit,
                        tuple(first + [c for c in fitting if c is not chosen] + rest), chosen, reason,
                        time.perf_counter() - started, spec.batch_description, shortfall, near_choice,
                        where if where.nodes > 1 else None)


def _listener(progress: Callable[[int, int], Any] | bool | None) -> Callable[[int, int], Any] | None:
    """`dry_run`'s `progress` as the estimator hears it: True prints the count on stderr."""
    if progress is True:
        return lambda done, total: print(f"\r{done} of {total} training steps simulated", file=sys.stderr,
                                         end="\n" if done == total else "", flush=True)
    if progress is not None and progress is not False and not callable(progress):
        raise UsageError(f"progress={progress!r}: pass True (the count on stderr), False, or a function "
                         "progress(done, total).")
    return progress or None


def _gpus(gpu: str | GpuProfile, num_gpus: int | None) -> tuple[GpuProfile, int | None]:
    """The profile and the GPU count that `gpu` ("a100-40gb", "8xa100-40gb") and `num_gpus` say together
    (None where neither gives one)."""
    if isinstance(gpu, GpuProfile):
        return gpu, num_gpus
    count, name = split_count(gpu)
    if count is not None and num_gpus is not None and count != num_gpus:
        raise UsageError("{given} says {count} GPUs but {ranks}: give the count once ({once}, or {joined}).",
                         given=Param("gpu", gpu), count=str(count), ranks=Param("num_gpus", num_gpus),
                         once=f"--gpu {name} --num-gpus N", joined=f"--gpu {count}x{name}")
    return get_gpu(name), count if count is not None else num_gpus


def _spec(model: Any, batch: Any, profile: GpuProfile, where: Layout, global_batch_size: int | None,
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
                     memory_budget=profile.memory_bytes, num_gpus=where.count, allow=allow, optimizer=optimizer,
                     loss_fn=loss_fn, seq_len=seq_len, safety_margin=safety_margin, max_micro_batch=max_micro_batch,
                     target=Target.from_profile(profile, where.count, where.nodes, where.inter_node_gbps))
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
        # each level's next micro-batch above its best fit, where that one is near the limit (`best_at`)
        self.near_above: list[Candidate] = []
        self._predicted: dict[Config, Estimate] = {}  # `predict`'s: a bisection's fit is predicted again as its row

    def predict(self, config: Config) -> Estimate:
        """`Estimator.predict(config)`, once per configuration of this plan."""
        found = self._predicted.get(config)
        if found is None:
            found = self._predicted[config] = self.estimator.predict(config)
        return found

    def smallest(self, level: Config) -> Config:
        """`level` at its smallest micro-batch."""
        return self.space.at(level, self.space.sizes_at(level)[0])

    def largest(self, level: Config) -> Config:
        """`level` at its largest micro-batch."""
        return self.space.at(level, self.space.sizes_at(level)[-1])

    def asks(self, level: Config) -> list[Config]:
        """The configurations `best_at(level)` may predict: the smallest size alone when the model
        states alone are over the limit (no size fits), else every size."""
        sizes = self.space.sizes_at(level)
        if self.states_over(self.smallest(level)):
            sizes = sizes[:1]
        return [self.space.at(level, size) for size in sizes]

    def fastest(self, level: Config, kernels: int = 0) -> float:
        """A lower bound of `level`'s predicted step seconds at any micro-batch, where a micro-step launches at
        least `kernels`: at its largest (the fewest micro-steps, each the most utilised), without the activations
        a simulation finds copied to the host."""
        return step_cost(self.spec, self.largest(level), self.gpu, self.estimator.facts, self.work,
                         kernels=kernels).seconds

    def alike(self, a: Config, b: Config) -> bool:
        """Whether levels `a` and `b` at their largest micro-batch run one simulated step at one predicted cost
        (they differ in what only the allocator's replay sees)."""
        a, b = self.largest(a), self.largest(b)
        cost = lambda config: step_cost(self.spec, config, self.gpu, self.estimator.facts, self.work)  # noqa: E731
        return self.estimator.simulates_alike(a, b) and cost(a) == cost(b)

    def states_over(self, config: Config) -> bool:
        """Whether `config`'s model states alone (`Estimator.states_floor`, a lower bound of its peak) are
        over the fit limit: then it fits at no size."""
        return self.estimator.states_floor(config) > self.spec.fit_limit

    def best_at(self, level: Config) -> Candidate:
        """The level at its largest micro-batch predicted to fit, else at its smallest (`Estimator.best_fit`);
        the size above a fit kept in `near_above` where it is near the limit."""
        best, near = self._best(level)
        self.near_above += [near] if near is not None else []
        return best

    def best_of(self, levels: Sequence[Config]) -> list[Candidate]:
        """`best_at` of each of `levels`, the allocator's replays shared with the estimator's workers where it
        keeps some (`Estimator.planned`)."""
        found = self.estimator.planned([self._sizes(level) for level in levels], lambda index: self._best(levels[index]))
        self.near_above += [near for _, near in found if near is not None]
        return [best for best, _ in found]

    def _best(self, level: Config) -> tuple[Candidate, Candidate | None]:
        """`best_at`'s candidate, and the size above it where that one is near the limit."""
        sizes = self._sizes(level)
        best, above = self.estimator.best_fit(sizes, self.predict)
        near = self.candidate(above) if above is not None else None
        return self.candidate(sizes[best]), near if near is not None and near.near_limit else None

    def _sizes(self, level: Config) -> list[Config]:
        """`level` at each of its micro-batches, the smallest first."""
        return [self.space.at(level, size) for size in self.space.sizes_at(level)]

    def _fits(self, estimate: Estimate) -> bool:
        # a peak must fit at its error bound (the family's calibrated one, or the formula's), and have one
        return estimate.fit_under(self.spec.fit_limit) is Fit.FITS

    def candidate(self, config: Config) -> Candidate:
        """`config` predicted: its estimate, fit, speed and reason."""
        estimate = self.predict(config)
        fits = self._fits(estimate)
        cost = step_cost(self.spec, config, self.gpu, self.estimator.facts, self.work, estimate.offloaded_activations,
                         estimate.kernels)
        seconds = cost.seconds
        samples = config.global_batch_size / seconds
        head = _verdict(estimate, fits, self.spec.fit_limit)
        bound = f"; bound by the host issuing {round(cost.host / SECONDS_PER_KERNEL):,} ops a step" \
            if cost.host >= seconds else ""
        if config.nodes > 1:
            bound += f"; {cost.across_nodes:.3g} s of its {seconds:.3g} s step across nodes"
        return Candidate(config, estimate, fits, f"{head}, ~{samples:,.1f} samples/s ({self.work.how}{bound})",
                         self.space.tier(config), seconds, samples, self.spec.fit_limit, self.space.numerics(config),
                         cost)


def _verdict(estimate: Estimate, fits: bool, limit: int) -> str:
    """"fits: 12 GiB of 20 GiB (60%), up to 12.5 GiB at its +4% bound", "near
    the limit: ...", "over by ...", and whether it rests on the formula; where it fits only with the
    allocator's cache released at the limit, what a roomy card would reserve."""
    peak, need = estimate.peak_under(limit), estimate.need_bytes
    if estimate.upper_bytes is None:
        return (f"unknown: the step could not be simulated and the activation formula does not cover this model; "
                f"{format_size(need - estimate.breakdown.activations)} without its activations")
    # which memory and what the bound rests on: the table's note, the summary and the JSON say (`memory`, `bound_basis`)
    bound = f"up to {format_size(estimate.upper_bytes)} at its +{estimate.error_bound:.0%} bound"
    if fits:
        head = f"fits: {format_size(peak)} of {format_size(limit)} ({peak / limit:.0%})"
    elif estimate.fit_under(limit) is Fit.NEAR_LIMIT:
        head = f"near the limit: needs {format_size(need)} of {format_size(limit)}, {bound}; a probe decides"
    else:
        head = f"over by {format_size(need - limit)}: needs {format_size(need)} of {format_size(limit)}"
    if fits and peak < estimate.peak_bytes:
        head += (f", the caching allocator releasing its cache to stay under (it needs {format_size(need)}; "
                 f"a roomy card would reserve up to {format_size(estimate.peak_bytes)})")
    near = not fits and estimate.fit_under(limit) is Fit.NEAR_LIMIT  # its bound said already
    if estimate.simulated:
        return head  # a simulated fit's bound is its row's own field (the table's column, the JSON)
    return f"{head}, by formula only (not simulated)" + ("" if near else f": {bound}")


def _decided(space: Space, fitting: list[Candidate]) -> Candidate:
    """The choice among `fitting` (ordered by predicted speed, simulated fits first) by the tuner's rule
    (`autofit.search.decision.decide`) on predicted speeds: from the least change to the most, a candidate
    that changes more replaces the choice only when predicted faster by the margin it must clear
    (`DEFAULT_EXACT_MARGIN` for a numerics change, `NOISE_MARGIN` otherwise), so the dry-run names what
    `autofit tune` would keep. Fits resting on a simulation are chosen before formula-only ones."""
    basis = [c for c in fitting if c.estimate.simulated] or fitting
    order = level_order(space)
    holder, *others = sorted(basis, key=lambda c: change_order(space, c.config, order=order))
    for challenger in others:
        if holder.step_seconds >= challenger.step_seconds * (1 + _margin(holder, challenger)[0]):
            holder = challenger
    return holder


def _margin(safer: Candidate, riskier: Candidate) -> tuple[float, MarginKind]:
    return margin_between(safer.standing, riskier.standing, DEFAULT_EXACT_MARGIN)


_MARGIN_WORDS = {MarginKind.EXACTNESS: "a numerics change must clear",
                 MarginKind.NEAR_LIMIT: "a fit nearer the limit must clear",
                 MarginKind.NOISE: "any other change must clear"}


def _chosen_reason(chosen: Candidate, fitting: list[Candidate]) -> str:
    others = len(fitting) - 1
    if not chosen.estimate.simulated:
        return (f"by formula only (the step could not be simulated: {chosen.estimate.method}): "
                f"{chosen.config.describe()} is predicted to peak at {format_size(chosen.peak_bytes)}, up to "
                f"{format_size(chosen.estimate.upper_bytes)} at its error bound; run autofit tune "
                "on the GPU to measure it")
    fastest = fitting[0]
    if fastest is not chosen:
        margin, kind = _margin(chosen, fastest)
        return (f"{chosen.config.describe()}, ~{chosen.samples_per_s:,.1f} samples/s, peak "
                f"{_peak_words(chosen)}, of {len(fitting)} fitting candidate(s): "
                f"{fastest.config.describe()} is predicted {chosen.step_seconds / fastest.step_seconds - 1:.1%} "
                f"faster, under the {margin:.0%} margin {_MARGIN_WORDS[kind]}, as autofit tune decides")
    return (f"predicted fastest of {len(fitting)} fitting candidate(s): {chosen.config.describe()}, "
            f"~{chosen.samples_per_s:,.1f} samples/s, peak {_peak_words(chosen)}"
            + (f" ({_others(chosen, fitting)})" if others else ""))


def _peak_words(chosen: Candidate) -> str:
    """"21.3 GiB reserved + context (error bound +4%, decoder/fused: 54 calibration rows)"."""
    estimate = chosen.estimate
    return (f"{format_size(chosen.peak_bytes)} {estimate.memory.value} (error bound +{estimate.error_bound:.0%}, "
            f"{estimate.bound_basis})")


def _others(chosen: Candidate, fitting: list[Candidate]) -> str:
    """The other fits beside the fastest chosen: those predicted as fast (a tie the fewest changes win,
    `_decided`) and the slower ones."""
    ties = sum(c is not chosen and c.step_seconds <= chosen.step_seconds for c in fitting)
    slower = len(fitting) - 1 - ties
    if not ties:
        return f"{slower} other(s) fit, slower"
    return (f"{len(fitting) - 1} other(s) fit: {ties} predicted as fast, with more changes"
            + (f", {slower} slower" if slower else ""))


def _near_choice(space: Space, fitting: list[Candidate], predicted: list[Candidate],
                 chosen: Candidate | None) -> Candidate | None:
    """The candidate the decision takes from the fits and the near-limit ones of `predicted` together, where it
    is a near-limit one (it would be chosen were its need known exactly); None where the choice stands either
    way."""
    near = [c for c in predicted if c.near_limit and c.estimate.simulated]
    if chosen is None or not near:
        return None
    both = sorted([*fitting, *near], key=lambda c: (not c.estimate.simulated, c.step_seconds))
    decided = _decided(space, both)
    return decided if decided.near_limit else None


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
