"""`autofit.autofit`: spec -> space -> walk (probes) -> confirmation (finalists re-measured) -> plan."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import torch

from autofit.config import Config
from autofit.estimate.estimator import predictor_for
from autofit.estimate.tolerance import tolerance_for
from autofit.plan import Plan, make_plan
from autofit.errors import UsageError
from autofit.probe import warm
from autofit.probe.launch import check_host_budget, check_ranks, probe_placed
from autofit.probe.outcome import ProbeResult, Skip, decided
from autofit.probe.payload import check_serialisable
from autofit.pipelines.host_memory import offload_skip
from autofit.search import confirm as confirmation, decision
from autofit.search.space import Space, build_space
from autofit.search.trials import TrialStore
from autofit.search.options import SearchOptions
from autofit.search.walk import Progress, Search, make_progress
from autofit.devices.device import device_memory, search_threads
from autofit.job.train_spec import LossFn, TrainSpec, make_spec
from autofit.strategies import EngineChoice, Placement, Strategy, default_strategies, resolve_strategies

LIVE_SHARE = 0.5  # live confirmation runs may hold at most this share of the free host memory together


def _keeps_rng(function: Callable[..., Plan]) -> Callable[..., Plan]:
    """`function` run with torch's random state saved and restored (the CPU's and every CUDA device's): the
    probes draw weights, batches and dropout masks, and the caller's next draw must not depend on them."""
    @functools.wraps(function)
    def kept(*args: Any, **kwargs: Any) -> Plan:
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            return function(*args, **kwargs)
    return kept


@_keeps_rng
def autofit(model: Any, batch: Any = None, *, global_batch_size: int | None = None, device: Any = None,
            memory_budget: int | str | None = None, num_gpus: int = 1, nodes: int = 1, allow: Any = None,
            optimizer: Any = "adamw", loss_fn: LossFn | None = None, seq_len: int | None = None,
            storage: Any = None, strategies: Sequence[Strategy] | None = None,
            progress: Progress | bool | None = None, engine: EngineChoice | str = EngineChoice.AUTO,
            nvme_path: Any = None, options: SearchOptions | None = None, safety_margin: float | None = None,
            max_probes: int | None = None, warmup_steps: int | None = None, timed_steps: int | None = None,
            max_micro_batch: int | None = None, probe_timeout: float | None = None, predict: bool | None = None,
            exact_margin: float | None = None) -> Plan:
    """Find the fastest training configuration that fits, by probing real training steps.

    Args:
        model: an `nn.Module` (never modified: each probe trains a deep copy), a zero-argument factory
            returning one (preferred: nothing is copied), or a Hugging Face config.
        batch: a sample batch at the largest shape the job will see (tensor, tuple (inputs, targets, ...)
            or dict of tensors), or `make_batch(num_samples) -> batch`. None synthesizes one for a
            Hugging Face model (token ids and labels at `seq_len`, or pixel values).
        global_batch_size: samples per optimizer step, kept exactly (micro-batch x accumulation x GPUs).
            None finds the micro-batch with the best throughput at accumulation 1.
        device: "cpu", "cuda" or "cuda:N"; default CUDA when present.
        memory_budget: bytes or a string like "20GiB" the plan may use; enforced for real (the CPU
            budget counts every tensor; on CUDA the allocator's per-process fraction). Default: the
            card's memory, or the free host RAM on the CPU.
        num_gpus: data-parallel ranks, over every node.
        nodes: machines the ranks span (num_gpus // nodes each): sharding within a node (hybrid FSDP2,
            ZeRO++) is searched beside sharding over every GPU. On CUDA one node's ranks run here and each
            probe says which figures it measured; on the CPU every rank runs (a rehearsal of every node).
        allow: exactness tiers beyond the default: None (tiers 0-1), a tier 0-2, or names such as
            {"lora"}; tier 1 = "numerics", tier 2 = "lora"/"quantization".
        optimizer: "adamw" (the optimizer rung may swap it for 8-bit / paged / Adafactor), another name
            (kept), an optimizer instance (its class and hyperparameters are reused), or a factory.
        loss_fn: `loss_fn(output, batch) -> scalar`; default `output.loss` or a scalar output.
        seq_len: sequence length of a synthesized batch.
        storage: optuna storage (URL or object) to record trials in; a search resumed with the same
            spec and storage re-probes nothing. Default: in memory.
        strategies: the techniques to search (default: all single-device rungs).
        progress: True prints a line on stderr as each probe starts and lands; or an object receiving
            `starting(config, why)` and `finished(result)` events (the CLI's table). Default: silent.
        engine: the sharding engines searched over several ranks: "auto" (ZeRO where DeepSpeed is
            installed, and FSDP2; the faster measured one wins), "deepspeed" or "fsdp" to pin one.
        nvme_path: a folder on a fast local disk for NVMe offload (DeepSpeed ZeRO-3); checked writable
            now, kept in the plan (`plan.spec["nvme_path"]`) and written by the exports.
        options: the search's own knobs as one value (`SearchOptions`: probe counts, steps per probe, the
            probe timeout, the safety and exactness margins, whether the estimator prunes); default
            `SearchOptions()`.
        safety_margin, max_probes, warmup_steps, timed_steps, max_micro_batch, probe_timeout, predict,
            exact_margin: shortcuts for the `SearchOptions` fields of those names (see it for each one's
            meaning and units); given beside `options`, they replace its fields. None: the options' value.

    Returns:
        A `Plan`: `fits`, `config`, `throughput` (samples/s, as confirmed), `tokens_per_second`,
        `peak_memory` (bytes), `reason`, every probe, and the `confirmation` (finalists re-measured back to
        back, see `autofit.search.confirm`).
    """
    opts = _options(options, safety_margin=safety_margin, max_probes=max_probes, warmup_steps=warmup_steps,
                    timed_steps=timed_steps, max_micro_batch=max_micro_batch, probe_timeout=probe_timeout,
                    predict=predict, exact_margin=exact_margin)
    listener = make_progress(progress)
    chosen = engine_strategies(strategies, engine, nvme_path)
    spec = make_spec(model, batch, global_batch_size=global_batch_size, device=device,
                     memory_budget=memory_budget, num_gpus=num_gpus, nodes=nodes, allow=allow, optimizer=optimizer,
                     loss_fn=loss_fn, seq_len=seq_len, safety_margin=opts.safety_margin,
                     warmup_steps=opts.warmup_steps, timed_steps=opts.timed_steps,
                     max_micro_batch=opts.max_micro_batch,
                     nvme_path=nvme_path if nvme_path is not None else _nvme_path_of(chosen))
    check_ranks(spec.device, spec.num_gpus // spec.target.nodes)  # over several nodes, one node's run here
    check_host_budget(spec)
    space = build_space(spec, chosen)
    if any(space.placement(level) is not Placement.IN_PROCESS for level in space.levels()):
        check_serialisable(spec, space.strategies)  # one UsageError now, not one error per candidate
    store = TrialStore(space, storage)

    def prober(config: Config, step_limit: float | None) -> ProbeResult:
        # an offload probe this machine's RAM or NVMe folder cannot hold
        skipped = offload_skip(spec, config, space.strategies)
        if skipped is not None:
            return skipped
        return probe_placed(spec, config, space.strategies, space.placement(config), opts.probe_timeout,
                            step_limit)

    predictor = _timed(predictor_for(spec, space.strategies), listener) if opts.predict else None
    tolerance = lambda config: tolerance_for(spec.device, config)  # noqa: E731 - sharded engines err more
    search = Search(space, store, prober, opts.max_probes, listener, predictor, tolerance)
    # fewer CPU threads on a busy machine, for every probe and round alike; the warm process launched probes fork
    # from ends with the search (`warm.stop`): a notebook does not keep its memory once the plan is made
    with search_threads(spec.device), warm.ending():
        results = search.run()
        probe = functools.partial(_follow_up, search, prober)
        results = confirmation.follow_near_limit(space, results, probe)
        results = confirmation.follow_numerics(space, results, probe)
        spent = confirmation.Spent()
        measure, rounds, method, window, threads = _measurer(spec, space, results, prober, spent)
        confirmed = confirmation.confirm(space, results, measure, rounds, opts.exact_margin, method, window, threads)
        if confirmed is not None:
            confirmed = dataclasses.replace(confirmed, steps=spent.steps)
    if callable(getattr(listener, "flush", None)):
        listener.flush()  # what it held back (the skips it counts), before the caller prints the plan
    return make_plan(space, results, predictor, confirmed)


def _options(options: SearchOptions | None, **shortcuts: Any) -> SearchOptions:
    """`options` (default `SearchOptions()`) with the shortcut keywords given (not None) replacing its fields."""
    if options is not None and not isinstance(options, SearchOptions):
        raise UsageError(f"options={options!r}: pass autofit.SearchOptions(...) (or its fields as keywords, "
                         "such as max_probes=10).")
    return (options or SearchOptions()).replace(**shortcuts)


def _timed(predict: Callable[[Config], int | None], listener: Progress) -> Callable[[Config], int | None]:
    """`predict`, each call's seconds told to the listener where it hears them (`PrintedProgress.predicted`)."""
    heard = getattr(listener, "predicted", None)
    if not callable(heard):
        return predict

    def timed(config: Config) -> int | None:
        started = time.perf_counter()
        try:
            return predict(config)
        finally:
            heard(time.perf_counter() - started)

    return timed


def _follow_up(search: Search, prober: Any, config: Config, why: str) -> ProbeResult:
    """Probe `config` after the walk (no deadline: it is measured to be compared), recorded in the trial
    store and shown like the walk's probes; a stored result is reused; within the same probe budget."""
    stored = search.store.lookup(config)
    if stored is not None:
        return stored
    if search.probes_run >= search.max_probes:
        return decided(config, Skip.BUDGET, f"probe budget of {search.max_probes} probes spent")
    search.progress.starting(config, why)
    result = prober(config, None)
    search.probes_run += 1
    search.store.record(result)
    search.progress.finished(result)
    return result


def _measurer(spec: TrainSpec, space: Space, results: Sequence[ProbeResult], prober: Any,
              spent: confirmation.Spent) \
        -> tuple[confirmation.Measure, confirmation.Rounds, decision.Method, decision.Window, int | None]:
    """How the finalists are re-measured (measure, rounds, its name, the window they are taken in, torch's
    CPU threads for all of them), counting the steps it takes in `spent`: live runs side by side when they
    all run in this process on the CPU and fit in host memory together, at the thread count the probes ran
    at, else whole probes (child processes, ranks, CUDA)."""
    fits = [r for r in results if r.fits]
    in_process = all(space.placement(r.config) is Placement.IN_PROCESS for r in fits)
    held = sum(sorted((r.peak_bytes for r in fits), reverse=True)[:2 * decision.LIVE_WINDOW.limit])
    if spec.device.type == "cpu" and in_process and held <= LIVE_SHARE * device_memory(spec.device):
        threads = torch.get_num_threads()
        return (confirmation.live_measure(spec, space.strategies, threads, spent), confirmation.LIVE_ROUNDS,
                decision.Method.LIVE_RUNS, decision.LIVE_WINDOW, threads)
    return (confirmation.probe_measure(prober, spent), confirmation.PROBE_ROUNDS, decision.Method.PROBES,
            decision.PROBE_WINDOW, None)


def engine_strategies(strategies: Sequence[Strategy] | None, engine: EngineChoice | str,
                      nvme_path: Any = None) -> list[Strategy]:
    """The strategies searched: the given ones or every rung, with the sharding engines narrowed to
    `engine` ("auto", "deepspeed", "fsdp"); `nvme_path` goes to the offload rung."""
    engine = EngineChoice.parse(engine, "engine")
    for named in (s for s in default_strategies(engine) if getattr(s, "engine", None) == engine.value):
        missing = named.not_installed()  # `Strategy.not_installed`: the engine asked for cannot run here
        if missing:
            raise UsageError(missing)
    chosen = resolve_strategies(strategies) if strategies is not None else default_strategies(engine)
    # an engine's strategy is one that names its `engine` (as `default_strategies` reads it)
    chosen = [s for s in chosen if engine is EngineChoice.AUTO or getattr(s, "engine", None) in (None, engine.value)]
    if nvme_path is not None:
        chosen = [s.writing_to(nvme_path) for s in chosen]  # `Strategy.writing_to`: the offload rung's folder
    return chosen


def _nvme_path_of(strategies: Sequence[Strategy]) -> str | None:
    return next((s.nvme_path for s in strategies if getattr(s, "nvme_path", None)), None)
