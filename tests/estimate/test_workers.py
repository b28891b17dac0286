"""Simulations shared with worker processes (`autofit.estimate.simulation.workers`) predict exactly what the caller
alone predicts; what a worker does not deliver, the caller simulates itself."""

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import autofit.estimate.estimator as estimator_module
from autofit.estimate.simulation import memo as kept_simulations
from autofit.config import Config
from autofit.estimate.simulation import workers
from autofit.estimate.estimator import Estimator
from autofit.job.train_spec import make_spec

CONFIGS = [Config(precision=p, attention="sdpa", checkpointing=c, micro_batch_size=mb)
           for p, c in (("fp32", "none"), ("bf16", "none"), ("fp32", "full")) for mb in (1, 4)]


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, max_position_embeddings=128)


def llama_factory():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama())


@pytest.fixture
def simulations(monkeypatch):
    """Fresh process-wide simulations, spreading forced (every simulation counts as slow, 2 spare CPUs),
    and the simulations the caller itself runs, counted."""
    monkeypatch.setattr(estimator_module, "SPREAD_AFTER_S", 0.0)
    monkeypatch.setattr(workers, "spare_cpus", lambda: 2)  # the caller and 2 workers share 5 of the 6
    here = []
    real = Estimator.simulate
    monkeypatch.setattr(Estimator, "simulate",
                        lambda self, config, mb, *rest: here.append(mb) or real(self, config, mb, *rest))
    return here


def fresh_estimator(monkeypatch, model=llama_factory, full_depth=False) -> Estimator:
    monkeypatch.setattr(kept_simulations, "SIMULATIONS", kept_simulations.Simulations())
    spec = make_spec(model, None, seq_len=64, global_batch_size=4, device="cpu", memory_budget="4GiB")
    return Estimator(spec, target="cuda", extrapolate_batch=True, full_depth=full_depth)


def expected(monkeypatch, full_depth=False) -> list:
    alone = fresh_estimator(monkeypatch, full_depth=full_depth)
    return [alone.predict(c) for c in CONFIGS]


@pytest.mark.parametrize("full_depth", [False, True])  # the workers simulate every block too
def test_workers_predict_what_the_caller_alone_predicts(monkeypatch, simulations, full_depth):
    want = expected(monkeypatch, full_depth)
    keys = len(simulations)  # 3 simulation keys x micro-batches 1 and 2
    simulations.clear()
    mine = workers.Batch.mine  # the caller claims one job of the rest: these quick ones it would take all
    monkeypatch.setattr(workers.Batch, "mine", lambda self: itertools.islice(mine(self), 1))
    shared = fresh_estimator(monkeypatch, full_depth=full_depth)
    shared.prefetch(CONFIGS)
    assert 0 < len(simulations) < keys  # the caller ran its share; the workers delivered the rest
    assert [shared.predict(c) for c in CONFIGS] == want
    assert len(simulations) < keys  # nothing was simulated again to predict


def test_a_job_is_claimed_once_the_caller_from_the_front_the_workers_from_the_back(tmp_path):
    import tempfile

    jobs = [(config, 1) for config in CONFIGS]
    shared = workers.Workers([], tempfile.TemporaryDirectory(dir=tmp_path))
    first, second = shared.share(jobs), shared.share(jobs)
    folder = Path(shared.folder.name)
    assert [workers.claim(folder, f"0-{index}") for index in (5, 4, 4)] == [True, True, False]  # a worker's two
    assert list(first.mine()) == jobs[:4]  # the caller's: up to the first a worker holds
    assert not any(workers.claim(folder, f"0-{index}") for index in range(6))  # each held by one process
    assert list(second.mine()) == jobs  # a later batch's jobs are claimed anew
    shared.close()


def test_batches_and_results_are_data_and_what_does_not_check_out_is_dropped(monkeypatch, tmp_path):
    """The files workers and caller share are data (`entry_file`), never a pickle, each read field by field: a
    step, a reserve or a whole file that does not check out is as if undelivered (the caller simulates or replays
    it itself), and a batch that does not check out is refused (the worker exits)."""
    import array
    import pickle
    import tempfile

    from autofit.estimate.simulation import entry_file

    shared = workers.Workers([], tempfile.TemporaryDirectory(dir=tmp_path))
    folder = Path(shared.folder.name)
    shared.share([(config, 1) for config in CONFIGS[:2]])
    assert (folder / f"batch-0{entry_file.SUFFIX}").read_bytes().startswith(entry_file.MAGIC)
    assert workers._batch(workers._read(folder, "batch-0")) == {"jobs": [(CONFIGS[0], 1), (CONFIGS[1], 1)]}
    workers._write(folder, "bad-1", {"jobs": [[CONFIGS[0].to_dict(), 0]]}, {})  # micro-batch 0
    workers._write(folder, "bad-2", {"jobs": [[{"precision": "fp64"}, 1]]}, {})  # no such precision
    assert workers._batch(workers._read(folder, "bad-1")) is None
    assert workers._batch(workers._read(folder, "bad-2")) is None

    peak, how = fresh_estimator(monkeypatch).simulate(CONFIGS[0], 1)
    arrays = {}
    good = workers._encoded((peak, how), "found.0.", arrays)
    bad = workers._encoded((peak, how), "found.1.", arrays)
    sizes = arrays["found.1.replay.sizes"] = array.array("q", arrays["found.1.replay.sizes"])  # the peak's own: a copy
    sizes[0] = -1  # a negative size: not an event
    fine, wrong = {"fragmentation": 4096, "least_fragmentation": 0}, {"fragmentation": -1, "least_fragmentation": 0}
    meta = {"found": [{"index": 0, "found": good}, {"index": 1, "found": bad}, {"index": 1, "found": {"failed": "why"}},
                      {"index": 5, "found": {"failed": "out of range"}}, {"index": 0, "found": {"failed": 3}}],
            "reserves": {"a" * 64: fine, "b" * 64: wrong, "../c": fine}}
    workers._write(folder, "result-0-0", meta, arrays)
    result = workers._result(workers._read(folder, "result-0-0"), 2)
    (first, (back, said)), failed = result["found"][0], result["found"][1:]
    assert first == 0 and said == how and back.replay.digest() == peak.replay.digest() and back.largest == peak.largest
    assert failed == [(1, (None, "why"))]
    assert result["reserves"] == {"a" * 64: fine}
    (folder / f"result-0-1{entry_file.SUFFIX}").write_bytes(pickle.dumps(meta))  # a pickle: never loaded
    assert workers._result(workers._read(folder, "result-0-1"), 2) == {"found": [], "reserves": {}}

    import dataclasses

    odd = (dataclasses.replace(peak, peak=1.5), how)  # not a simulation's kind of number: stays behind
    shared.share_plans([CONFIGS[:2]], [(CONFIGS[0], 1, odd), (CONFIGS[1], 1, (peak, how)), (CONFIGS[2], 2, (None, "why"))])
    levels = workers._batch(workers._read(folder, "batch-1"))
    assert levels["levels"] == [CONFIGS[:2]]
    (config, mb, (sent, said)), failed = levels["held"]
    assert (config, mb, said) == (CONFIGS[1], 1, how) and sent.replay.digest() == peak.replay.digest()
    assert failed == (CONFIGS[2], 2, (None, "why"))
    shared.close()


def test_workers_started_within_steady_serve_every_later_prefetch(monkeypatch, simulations):
    """A dry-run prefetches wave after wave of levels within `Estimator.steady`: the workers started for the
    first are kept for the next (their imports paid once) and end with it."""
    want = expected(monkeypatch)
    keys = len(simulations)
    simulations.clear()
    started = []
    start = workers.start
    monkeypatch.setattr(workers, "start", lambda *args: started.append(start(*args)) or started[-1])
    mine = workers.Batch.mine  # the caller claims one job of each batch: the workers take the rest
    monkeypatch.setattr(workers.Batch, "mine", lambda self: itertools.islice(mine(self), 1))
    shared = fresh_estimator(monkeypatch)
    with shared.steady():
        shared.prefetch(CONFIGS[:3])
        shared.prefetch(CONFIGS[3:])
        assert len(started) == 1 and started[0].batches == 2 and started[0].alive()
    assert not started[0].alive() and not Path(started[0].folder.name).exists()
    assert 0 < len(simulations) < keys  # the caller ran its share of each; the workers delivered the rest
    assert [shared.predict(c) for c in CONFIGS] == want
    assert len(simulations) < keys


LEVELS = [[Config(precision=p, attention="sdpa", checkpointing=c, micro_batch_size=mb) for mb in (1, 2, 4)]
          for p, c in (("fp32", "none"), ("bf16", "none"), ("fp32", "full"))]


def planned(monkeypatch, shared: bool) -> tuple[list, int]:
    """Each of `LEVELS` planned as a dry-run plans it (`Estimator.best_fit` and the candidates' predictions), by
    `Estimator.planned` within `steady` after a prefetch that keeps workers (or, not `shared`, none); and how many
    allocator reserves the caller replayed itself (fresh process-wide reserves)."""
    from autofit.estimate.cuda import training_replay
    from autofit.estimate.simulation import disk_cache

    monkeypatch.setattr(disk_cache, "RESERVES", disk_cache.Reserves())  # none kept, none read from a folder
    replayed = []
    least = training_replay.least_reserve
    monkeypatch.setattr(training_replay, "least_reserve", lambda *a: replayed.append(1) or least(*a))
    estimator = fresh_estimator(monkeypatch)

    def plan(index: int) -> tuple:
        best, above = estimator.best_fit(LEVELS[index])
        return best, above, estimator.predict(LEVELS[index][best]), above and estimator.predict(above)

    with estimator.steady():
        estimator.prefetch(config for level in LEVELS for config in level)
        assert (estimator._workers is not None) == shared
        replayed.clear()  # the prefetch's own: each simulation's replay
        return estimator.planned(LEVELS, plan), len(replayed)


def test_kept_workers_bisect_the_later_levels_and_send_back_their_reserves(monkeypatch, simulations):
    """Between a dry-run's waves the caller plans the levels (`Estimator.planned`): the kept workers bisect them
    from the back meanwhile, with the steps the caller holds, and the allocator's reserves they replay are the
    caller's to read. Each plan is what the caller alone finds, and the caller replays less."""
    with monkeypatch.context() as alone:
        alone.setattr(estimator_module, "SPREAD_AFTER_S", float("inf"))  # no worker
        want, replayed_alone = planned(alone, shared=False)
    mine = workers.Batch.mine  # the caller claims one job of each batch (one level): the worker takes the rest
    monkeypatch.setattr(workers.Batch, "mine", lambda self: itertools.islice(mine(self), 1))
    monkeypatch.setattr(workers, "spare_cpus", lambda: 1)  # one worker: what a 2-core machine starts
    found, replayed = planned(monkeypatch, shared=True)
    assert found == want
    assert replayed_alone > 0 and replayed < replayed_alone


def test_workers_that_start_late_leave_the_quick_jobs_to_the_caller(monkeypatch, simulations):
    want = expected(monkeypatch)
    keys = len(simulations)
    simulations.clear()
    shared = fresh_estimator(monkeypatch)
    shared.prefetch(CONFIGS)  # each a fraction of a second; a worker first imports torch and transformers
    assert len(simulations) >= keys - 1  # all here, or all but the last (a worker in time for it); a fixed
    # share would have left the caller the first and every third of the rest: 3 of 6
    assert [shared.predict(c) for c in CONFIGS] == want


def test_a_model_that_cannot_travel_is_simulated_by_the_caller(monkeypatch, simulations):
    want = expected(monkeypatch)
    keys = len(simulations)
    simulations.clear()
    lock = threading.Lock()  # cloudpickle cannot serialise a lock: the spec stays in this process

    def held_factory():
        with lock:
            return llama_factory()

    shared = fresh_estimator(monkeypatch, held_factory)
    shared.prefetch(CONFIGS)
    assert len(simulations) == keys
    assert [shared.predict(c) for c in CONFIGS] == want


def test_a_worker_that_fails_delivers_nothing_and_the_caller_simulates_its_share(monkeypatch, simulations):
    want = expected(monkeypatch)
    keys = len(simulations)
    simulations.clear()
    shared = fresh_estimator(monkeypatch)
    with monkeypatch.context() as patched:
        patched.setattr(sys, "executable", "/bin/false")  # every worker exits at once with status 1
        shared.prefetch(CONFIGS)
    assert [shared.predict(c) for c in CONFIGS] == want
    assert len(simulations) == keys


def test_cheap_simulations_are_neither_spread_nor_wait_for_a_cpu_sample(monkeypatch, simulations):
    monkeypatch.setattr(estimator_module, "SPREAD_AFTER_S", float("inf"))  # every simulation counts as cheap
    monkeypatch.setattr(workers, "spare_cpus", lambda: pytest.fail("the CPUs were sampled for cheap simulations"))
    monkeypatch.setattr(workers, "start", lambda *a: pytest.fail("workers were started for cheap simulations"))
    heard = []
    estimator = fresh_estimator(monkeypatch)
    estimator.prefetch(CONFIGS, lambda done, total: heard.append((done, total)))
    assert len(simulations) == 6  # every one here, in turn, each counted for the dry-run's progress line
    assert heard == [(done, 6) for done in range(1, 7)]
    simulations.clear()
    [estimator.predict(c) for c in CONFIGS]
    assert not simulations  # predicting them asks for nothing more


@pytest.mark.parametrize("threshold, spread", [(5.0, True), (5.5, False)])
def test_quick_simulations_are_spread_when_together_they_are_slow(monkeypatch, simulations, threshold, spread):
    """The first simulation is timed (1 s on this fake clock, each one quick); the other five would take
    5 s at that pace: shared out from a `SPREAD_AFTER_S` of 5 s, not from 5.5 s."""
    import types

    ticks = iter([0.0])
    monkeypatch.setattr(estimator_module, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks, 1.0)))
    monkeypatch.setattr(estimator_module, "SPREAD_AFTER_S", threshold)
    started = []
    monkeypatch.setattr(workers, "start", lambda *args: started.append(args) or None)  # none starts
    fresh_estimator(monkeypatch).prefetch(CONFIGS)
    assert bool(started) == spread


class Sleeper(torch.nn.Module):
    """A model whose forward sleeps where `SLEEP` is set: a simulation that runs until it is killed."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        if os.environ.get("SLEEP"):
            time.sleep(600)
        return self.linear(x).sum()


KILLED_CALLER = """
import os, sys, torch
sys.path[:0] = {path!r}
from autofit.config import Config
from autofit.estimate.simulation import workers
from autofit.job.train_spec import make_spec
from test_workers import Sleeper
spec = make_spec(Sleeper, torch.randn(2, 4), device="cpu", memory_budget="1GiB")
os.environ["SLEEP"] = "1"  # in the worker, not in the checks above
workers.start(spec, [], {{"target": "cuda"}}).share([(Config(micro_batch_size=2), 2)]).collect()
"""


def test_workers_leave_with_their_job_files_when_the_caller_is_killed(tmp_path):
    """A caller killed by SIGKILL runs no `finally`: its worker notices by itself, removes the folder that
    held the job (the serialised model) and exits, instead of simulating on for nobody."""
    import psutil

    here = os.path.dirname(__file__)
    caller = subprocess.Popen([sys.executable, "-c", KILLED_CALLER.format(path=[here, *sys.path])],
                              env=dict(os.environ, TMPDIR=str(tmp_path)))
    deadline, started = time.monotonic() + 120, []
    # the job folder first: a child seen before it may be a helper the imports run (ldconfig), not the worker
    while not (list(tmp_path.glob("autofit-sim-*")) and (started := psutil.Process(caller.pid).children())) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert started and list(tmp_path.glob("autofit-sim-*"))
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive
    assert not list(tmp_path.glob("autofit-sim-*"))
