"""Simulated steps shared between processes through a folder (autofit/estimate/simulation/memo.py): a library's
model read back by the next process, never a step of other code, never a model of one's own class; the
caching allocator's reserves (autofit/estimate/simulation/disk_cache.py `RESERVES`) by their events, whatever the model."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

import autofit.estimate.estimator as estimator_module
from autofit.config import Config
from autofit.estimate.cuda import allocator
from autofit.estimate.simulation import disk_cache as kept
from autofit.estimate.simulation import step as simulate
from autofit.estimate.simulation import memo as simulations
from autofit.estimate.estimator import Estimator
from autofit.job.train_spec import make_spec

CONFIG = Config(precision="bf16", attention="sdpa", checkpointing="full", micro_batch_size=2)


def llama():
    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, max_position_embeddings=256)


class Mine(nn.Module):
    """A model of one's own: its forward may change between two runs under the same name and shapes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))

    def forward(self, x):
        return self.layers(x)


@pytest.fixture
def process(monkeypatch, tmp_path):
    """A fresh process's cache over the folder `tmp_path / "cache"` (each call: the next process), and
    the simulations it ran."""
    runs = []
    real = estimator_module.simulate_step
    monkeypatch.setattr(estimator_module, "simulate_step", lambda *a, **k: runs.append(1) or real(*a, **k))

    def start():
        monkeypatch.setattr(simulations, "SIMULATIONS", simulations.Simulations(folder=tmp_path / "cache"))
        monkeypatch.setattr(kept, "RESERVES", kept.Reserves(folder=tmp_path / "cache" / "reserves"))
        runs.clear()
        return runs
    return start


def predict(model, batch=None, config=CONFIG):
    spec = make_spec(model, batch, seq_len=32 if batch is None else None, device="cpu",
                     global_batch_size=2 * config.grad_accum_steps,
                     memory_budget="4GiB", loss_fn=None if batch is None else (lambda out, _batch: out.square().mean()))
    estimator = Estimator(spec, target="cuda")
    estimator.predict(CONFIG)  # simulated as CONFIG: `config` shares its simulation, replayed for its own
    return estimator.predict(config)


def test_the_next_process_reads_a_librarys_model_back_and_simulates_nothing(process, tmp_path):
    runs = process()
    first = predict(llama())
    assert runs and list((tmp_path / "cache").glob("*.kept"))
    written = {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("*.kept")}
    runs = process()
    again = predict(llama())
    assert not runs
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("*.kept")} == written  # read, not rewritten
    assert again.peak_bytes == first.peak_bytes and again.need_bytes == first.need_bytes
    assert again.reason == first.reason


def test_other_code_reads_nothing_back(process, monkeypatch):
    process()
    predict(llama())
    runs = process()
    monkeypatch.setattr(kept, "code_version", lambda: "another autofit, torch or transformers")
    predict(llama())
    assert runs


def test_a_model_of_ones_own_is_kept_for_its_process_only(process, tmp_path):
    runs = process()
    predict(Mine, lambda n: torch.zeros(n, 32))
    assert runs and not list((tmp_path / "cache").glob("*.kept"))


def test_the_allocators_reserves_are_replayed_once_whatever_the_model(process, replays, tmp_path):
    # the events alone decide a replay: a model of one's own class is simulated again, not replayed again;
    # a library's step read back is replayed for another accumulation than the one simulated
    for model, batch in ((llama(), None), (Mine, lambda n: torch.zeros(n, 32))):
        process()
        first = predict(model, batch, CONFIG.replace(grad_accum_steps=2))
        assert replays and list((tmp_path / "cache" / "reserves").glob("*.kept"))
        replays.clear()
        runs = process()
        again = predict(model, batch, CONFIG.replace(grad_accum_steps=2))
        assert not replays and (runs or model is not Mine)
        assert again.need_bytes == first.need_bytes and again.peak_bytes == first.peak_bytes


def test_a_reserve_of_other_code_or_broken_is_replayed_again(process, replays, monkeypatch, tmp_path):
    process()
    first = predict(Mine, lambda n: torch.zeros(n, 32))  # simulated again in every process
    for path in (tmp_path / "cache" / "reserves").glob("*.kept"):
        path.write_bytes(path.read_bytes()[:10])  # a writer killed halfway
    replays.clear()
    process()
    assert predict(Mine, lambda n: torch.zeros(n, 32)).need_bytes == first.need_bytes and replays
    replays.clear()
    process()
    monkeypatch.setattr(kept, "code_version", lambda: "another autofit")
    predict(Mine, lambda n: torch.zeros(n, 32))
    assert replays


def test_a_broken_file_is_simulated_again(process, tmp_path):
    process()
    first = predict(llama())
    for path in (tmp_path / "cache").glob("*.kept"):
        path.write_bytes(path.read_bytes()[:100])  # a writer killed halfway
    runs = process()
    assert predict(llama()).peak_bytes == first.peak_bytes and runs


def test_recording_a_steps_events_simulates_it(process):
    process()
    predict(llama())
    runs = process()
    with simulate.recorded_events() as recorded:
        predict(llama())
    assert runs and recorded


def test_the_folder_is_named_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOFIT_CACHE", str(tmp_path))
    assert simulations.cache_folder() == tmp_path
    for off in ("off", "0", "No"):
        monkeypatch.setenv("AUTOFIT_CACHE", off)
        assert simulations.cache_folder() is None
    monkeypatch.delenv("AUTOFIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert simulations.cache_folder() == tmp_path / "autofit" / "simulations"


def test_the_oldest_files_go_past_the_limit(tmp_path):
    kept = simulations.Simulations(folder=tmp_path, files=3)
    peak = simulate.ActivationPeak(1, 1, 0, 0, 1, 0)
    for n in range(70):
        kept.put(("workload", n), (peak, "simulated"), shared=True)
    # pruned at the 1st and the 65th write to the newest 3, then 5 more written
    assert len(list(tmp_path.glob("*.kept"))) == 3 + 5
    fresh = simulations.Simulations(folder=tmp_path)
    assert fresh.get(("workload", 69), shared=True) is not None and fresh.get(("workload", 0), shared=True) is None


def test_pruning_leaves_other_files_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    kept = simulations.Simulations(folder=tmp_path, files=1)
    peak = simulate.ActivationPeak(1, 1, 0, 0, 1, 0)
    for n in range(2):
        kept.put(("workload", n), (peak, "simulated"), shared=True)
    kept.prune()
    assert (tmp_path / "notes.txt").read_text() == "mine" and len(list(tmp_path.glob("*.kept"))) == 1


class _RangePrinter(torch.nn.Linear):
    """A quantizer-like layer whose repr reads a buffer's value, as I-BERT's `QuantAct` prints its range."""

    def __init__(self):
        super().__init__(8, 8)
        self.register_buffer("high", torch.ones(()))

    def extra_repr(self):
        return f"high={self.high.item()}"


def test_a_model_whose_repr_reads_a_value_is_still_predicted():
    """The simulation's key held `repr(model)` of the meta model: a repr reading `.item()` raised out of the
    dry-run ("Tensor.item() cannot be called on meta tensors", I-BERT's default config)."""
    spec = make_spec(lambda: torch.nn.Sequential(_RangePrinter(), _RangePrinter()), lambda n: torch.randn(n, 8),
                     loss_fn=lambda output, batch: output.sum(), device="cpu", memory_budget="1GiB")
    assert Estimator(spec).predict(Config(micro_batch_size=2)).peak_bytes > 0


class _Planted:
    """What a malicious writer plants: unpickling it runs `open(marker, "w")`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_is_never_run_and_the_step_is_simulated_again(process, tmp_path):
    """The folder may be shared (issue 54 item 3): a pickle that runs code when loaded, planted under every
    entry's name (and under the names the cache once used), is read as bytes that do not check out."""
    import pickle
    process()
    first = predict(llama())
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Planted(marker))
    entries = list((tmp_path / "cache").rglob("*.kept"))
    assert entries
    for path in entries:
        path.write_bytes(payload)
        path.with_suffix(".pkl").write_bytes(payload)
    runs = process()
    again = predict(llama())
    assert runs and not marker.exists()
    assert again.peak_bytes == first.peak_bytes and again.need_bytes == first.need_bytes


def test_an_entry_of_the_right_form_with_wrong_events_is_simulated_again(tmp_path):
    """A file that decodes but whose fields are not what a simulation makes (an op that is no event, a size
    below zero, a peak that is not an integer) is as if absent."""
    from autofit.estimate.simulation import entry_file
    kept = simulations.Simulations(folder=tmp_path)
    replay = allocator.Replay.of([("malloc", 0, 512, None), ("free", 0, 512, None)])
    peak = simulate.ActivationPeak(1, 1, 0, 0, 1, 0, replay=replay)
    kept.put(("workload", 0), (peak, "simulated"), shared=True)
    assert simulations.Simulations(folder=tmp_path).get(("workload", 0), shared=True)[0].replay.ops == replay.ops
    (path,) = tmp_path.glob("*.kept")
    name = path.stem
    meta, arrays = entry_file.decode(name, path.read_bytes())
    broken = [
        (meta, {**arrays, "replay.ops": __import__("array").array("B", [7] * len(arrays["replay.ops"]))}),
        (meta, {**arrays, "replay.sizes": __import__("array").array("q", [-1] * len(arrays["replay.sizes"]))}),
        ({**meta, "peak": {**meta["peak"], "forward": 1.5}}, arrays),
        ({**meta, "peak": {**meta["peak"], "forward": "__import__('os')"}}, arrays),
        ({**meta, "extra": 1}, {**arrays, "replay.keys": arrays["replay.keys"][:1]}),
    ]
    for bad_meta, bad_arrays in broken:
        path.write_bytes(entry_file.encode(name, bad_meta, bad_arrays))
        assert simulations.Simulations(folder=tmp_path).get(("workload", 0), shared=True) is None
    path.write_bytes(entry_file.encode("0" * 64, meta, arrays))  # another entry's file copied over this one
    assert simulations.Simulations(folder=tmp_path).get(("workload", 0), shared=True) is None


def test_no_write_goes_through_a_link(tmp_path):
    """A link planted where the folder or an entry should be is neither followed nor written through: the
    file it points at is left as it was, and the process keeps its own value."""
    target = tmp_path / "victim"
    target.write_text("theirs")
    peak = simulate.ActivationPeak(1, 1, 0, 0, 1, 0)
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    through_folder = simulations.Simulations(folder=tmp_path / "linked")
    through_folder.put(("workload", 0), (peak, "simulated"), shared=True)
    assert not list((tmp_path / "elsewhere").iterdir())
    assert through_folder.get(("workload", 0), shared=True) is not None  # kept for the process
    folder = tmp_path / "cache"
    kept = simulations.Simulations(folder=folder)
    kept.put(("workload", 1), (peak, "simulated"), shared=True)
    (path,) = folder.glob("*.kept")
    path.unlink()
    path.symlink_to(target)
    assert simulations.Simulations(folder=folder).get(("workload", 1), shared=True) is None  # not read through
    kept.put(("workload", 1), (peak, "simulated"), shared=True)  # renamed over the link, not written into it
    assert target.read_text() == "theirs" and not path.is_symlink()
    assert simulations.Simulations(folder=folder).get(("workload", 1), shared=True) is not None


_WORKLOAD = """
from transformers import LlamaConfig
from autofit.estimate.estimator import Estimator
from autofit.job.train_spec import make_spec
spec = make_spec(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, max_position_embeddings=256),
                 None, seq_len=32, device="cpu", global_batch_size=2, memory_budget="4GiB")
print(Estimator(spec, target="cuda")._workload)
"""


def test_two_processes_file_a_librarys_model_under_one_name():
    """The key a step is filed under is the same in every process: the default loss's code was keyed by the
    repr of its comprehension's code object (its address), so no process read another's steps back."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "AUTOFIT_CACHE": "off"}
    keys = {subprocess.run([sys.executable, "-c", _WORKLOAD], env=env, capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert len(keys) == 1 and len(keys.pop()) == 64


def test_a_functions_code_is_keyed_alike_in_every_process_and_apart_from_other_code():
    def loss(output, batch):
        return sum(x for x in output if frozenset({"a", "b"}))

    def other(output, batch):
        return sum(y for y in output if frozenset({"a", "c"}))

    assert simulations._code(loss) != simulations._code(other)
    assert "0x" not in simulations._constant(loss.__code__.co_consts)  # no address of a nested code object


def test_a_line_past_two_replays_its_own_events_not_its_points(process, replays):
    # micro-batch 8 is read on the line through 1 and 2 (a dry-run's plan): its reserve is replayed from the
    # events on that line, so the points are not replayed for its accumulation (each a bisection of training
    # histories through the allocator); its prediction is what it is with them replayed first
    spec = make_spec(llama(), None, seq_len=32, device="cpu", global_batch_size=24, memory_budget="4GiB")
    process()
    estimator = Estimator(spec, target="cuda", extrapolate_batch=True)
    for mb in (1, 2):  # simulated at 1 and 2 for one micro-step a step
        estimator.predict(CONFIG.replace(micro_batch_size=mb, grad_accum_steps=1))
    replays.clear()
    line = estimator.predict(CONFIG.replace(micro_batch_size=8, grad_accum_steps=3))
    assert len(replays) == 1  # the line's events alone
    process()
    eager = Estimator(spec, target="cuda", extrapolate_batch=True)
    for mb in (1, 2):  # the points replayed for micro-batch 8's accumulation first, as before
        eager._at_batch(CONFIG.replace(micro_batch_size=8, grad_accum_steps=3), mb)
    again = eager.predict(CONFIG.replace(micro_batch_size=8, grad_accum_steps=3))
    assert (again.peak_bytes, again.need_bytes, again.reason) == (line.peak_bytes, line.need_bytes, line.reason)
