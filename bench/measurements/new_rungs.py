"""The rungs no other tuner searches, against the ladder that existed before them, side by side.

For each scenario autofit tunes twice under the same budget: with the older rungs only (attention,
checkpointing none / every 2nd block / full, micro-batch) and with the new ones added (op-level and
every-4th checkpointing, the chunked loss). Every rung's choice is then re-trained beside its twin
without the new rungs (and beside the older ladder's choice, where it found one), interleaved
(`--rounds` rounds, the order alternating, median kept) under a roomy budget with the peaks measured:
the new rungs' memory saving and time cost, on the same machine at the same load.

    python bench/measurements/new_rungs.py                  # CPU, every scenario
    python bench/measurements/new_rungs.py --only chunked-loss --rounds 3

Backs: docs/new-rungs.md's comparison with the older ladder (the chunked loss fits a large-vocabulary
GPT-2 the older rungs cannot: 59% less memory measured at +8% time per step).
Results: bench/results/new-rungs-<device>-<date>.json: new-rungs-cpu-2026-11-22.json."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench and autofit import

import autofit  # noqa: E402
from autofit.config import Checkpointing as C  # noqa: E402
from autofit.config import Config  # noqa: E402
from autofit.probe.run import run_probe  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import FusedAttention, ActivationCheckpointing, ChunkedLoss, MicroBatch, default_strategies  # noqa: E402
from bench import RESULTS  # noqa: E402



class OlderCheckpointing(ActivationCheckpointing):
    """Checkpointing as it was before op-level and every-4th: none, every 2nd block, full."""

    def options(self, spec):
        return [o for o in super().options(spec) if o.value is not C.OPS and dict(o.also).get("checkpoint_every", 2) == 2]


def older_strategies() -> list:
    """The single-device rungs before the new ones that bear on activations: checkpointing (none, every
    2nd block, full) and the micro-batch. Precision is left out on the CPU (bf16 runs emulated here,
    several times slower: it never wins and only costs probes); a GPU run adds it to both ladders."""
    return [FusedAttention(), OlderCheckpointing(), MicroBatch()]


def every_strategy() -> list:
    """The same with the new rungs that bear on activations (activation offloading is GPU-only)."""
    return [FusedAttention(), ActivationCheckpointing(), ChunkedLoss(), MicroBatch()]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A model, its batch, a global batch and a budget (bytes) that the older ladder only just meets."""

    name: str
    model_factory: Callable[[], torch.nn.Module]
    global_batch_size: int
    budget: str
    seq_len: int | None = None
    intent: str = ""


def big_vocab_lm(vocab: int, seq: int) -> torch.nn.Module:
    """A 2-block GPT-2 whose logits dominate memory (vocabulary >> width), random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=seq,
                                      bos_token_id=0, eos_token_id=0))


SCENARIOS = {
    "chunked-loss": Scenario("chunked-loss", functools.partial(big_vocab_lm, 8192, 512), 4, "55MiB", 512,
                             "logits of an 8k vocabulary at 512 tokens dominate memory: no older rung brings "
                             "them under the budget (micro-batch 1 included), the chunked loss does"),
}

MAX_PROBES = 8  # per tuning: the scenario's decision needs few, the machine is shared
ROOMY = "4GiB"  # the budget the side-by-side re-training runs under (nothing near it)


def without_new_rungs(config: Config) -> Config:
    """`config` with each new rung replaced by what the older ladder had in its place: the twin whose
    difference is the new rungs' saving and cost."""
    twin = config.replace(loss="full", activation_offload="none", optimizer_step="after_backward")
    if config.checkpointing is C.OPS or config.checkpoint_every > 2:
        twin = twin.replace(checkpointing="none", checkpoint_every=1)
    return twin.replace(precision="bf16") if config.pure_bf16 else twin


def tune(scenario: Scenario, strategies: list) -> autofit.Plan:
    """autofit under the scenario's budget with `strategies` (the walk decides what to probe)."""
    return autofit.autofit(scenario.model_factory, global_batch_size=scenario.global_batch_size, device="cpu",
                           memory_budget=scenario.budget, seq_len=scenario.seq_len, strategies=strategies,
                           max_probes=MAX_PROBES)


def retrain(scenario: Scenario, configs: dict[str, Config], rounds: int) -> dict[str, dict[str, Any]]:
    """Each config re-probed `rounds` times under a roomy budget, interleaved (the order alternating):
    median seconds per step and the peak bytes."""
    spec = make_spec(scenario.model_factory, global_batch_size=scenario.global_batch_size, device="cpu",
                     memory_budget=ROOMY, seq_len=scenario.seq_len, warmup_steps=2, timed_steps=3)
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    peaks: dict[str, int] = {}
    for index in range(rounds):
        order = list(configs) if index % 2 == 0 else list(reversed(configs))
        for name in order:
            result = run_probe(spec, configs[name], default_strategies())
            assert result.fits, (name, result.reason)
            seconds[name].append(round(result.step_seconds, 4))
            peaks[name] = result.peak_bytes
    return {name: {"config": configs[name].describe(), "peak_bytes": peaks[name],
                   "step_seconds_median": statistics.median(seconds[name]), "step_seconds": seconds[name]}
            for name in configs}


def run(scenario: Scenario, rounds: int) -> dict[str, Any]:
    """Tune under the budget with the older ladder and with every rung; then re-train every-rung's choice
    beside its twin without the new rungs (and the older ladder's choice, when it had one)."""
    started = time.perf_counter()
    older, every = tune(scenario, older_strategies()), tune(scenario, every_strategy())
    assert every.fits, every.reason
    configs = {"every_rung": every.config, "twin_without_new_rungs": without_new_rungs(every.config)}
    if older.fits:
        configs["older_choice"] = older.config
    measured = retrain(scenario, configs, rounds)
    new, twin = measured["every_rung"], measured["twin_without_new_rungs"]
    return {"scenario": scenario.name, "intent": scenario.intent, "budget": scenario.budget,
            "global_batch_size": scenario.global_batch_size,
            "older_ladder": {"fits": older.fits, "config": older.config.to_dict() if older.fits else None,
                             "reason": older.reason, "probes": older.probes_run},
            "every_rung": {"fits": every.fits, "config": every.config.to_dict(), "reason": every.reason,
                           "probes": every.probes_run},
            "measured": measured,
            "memory_saving": 1 - new["peak_bytes"] / twin["peak_bytes"],
            "time_cost": new["step_seconds_median"] / twin["step_seconds_median"] - 1,
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios and write the results file; prints one line per scenario."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = [run(SCENARIOS[name], args.rounds) for name in (args.only or sorted(SCENARIOS))]
    document = {"device": "cpu", "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "load_before": load_before, "load_after": os.getloadavg(), "torch": torch.__version__,
                "autofit": autofit.__version__, "rounds": args.rounds, "scenarios": rows}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"new-rungs-cpu-{document['date'][:10]}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    for row in rows:
        older = row["older_ladder"]["config"] and Config.from_dict(row["older_ladder"]["config"]).describe()
        print(f"{row['scenario']}: older ladder {older or 'fits nothing'}; every rung "
              f"{row['measured']['every_rung']['config']}: {row['memory_saving']:.0%} less memory than its twin "
              f"without the new rungs, {row['time_cost']:+.0%} time per step ({path.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
