"""Probe processes forked by the warm process (autofit/probe/warm.py, autofit/probe/zygote.py): the same
outcome as a fresh process (figures, exit statuses, timeouts, environment, streams), an import-only warm
process, and fresh processes wherever it cannot serve."""

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from autofit.config import Config
from autofit.probe import warm
from autofit.probe.launch import launch
from autofit.probe.outcome import ProbeStatus
from autofit.probe.payload import payload
from autofit.job.train_spec import make_spec
from autofit.strategies import DataParallel, MicroBatch, Placement
from models import LinearBlocks, make_gpt2

WIDTH = 32
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm probe processes: Linux only")


def in_probe_process() -> bool:
    return "AUTOFIT_LAUNCHER_PID" in os.environ  # set by the launcher for its probe processes only


class Misbehaving(LinearBlocks):
    """Two linear blocks whose forward, in a probe process, does `what`: "kill" (SIGKILL itself, as the
    kernel's OOM killer would), "exit" (exit 3 without reporting), "hang", "print" (to stdout and stderr),
    "env" (raise unless the rank's environment and AUTOFIT_TEST_MARK=`mark` are there), or "files" (raise
    where the temporary folder holds anything)."""

    def __init__(self, what=None, mark=None):
        super().__init__(WIDTH, 2)
        self.what, self.mark = what, mark

    def forward(self, x):
        if in_probe_process():
            if self.what == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.what == "exit":
                os._exit(3)
            elif self.what == "hang":
                time.sleep(3600)
            elif self.what == "print":
                print("PROBE-STDOUT", flush=True)
                print("PROBE-STDERR", file=sys.stderr, flush=True)
            elif self.what == "env":
                _check_environment(self.mark)
            elif self.what == "files" and _written():
                raise RuntimeError(f"written: {_written()}")
        return super().forward(x)


def _written():
    """What the temporary folder holds, torch's compiler cache aside (torch may make it when imported)."""
    return [name for name in os.listdir(tempfile.gettempdir()) if not name.startswith("torchinductor_")]


def _check_environment(mark):
    rank = dist.get_rank() if dist.is_initialized() else None
    want = {"AUTOFIT_TEST_MARK": mark}
    if rank is not None:
        want.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", DS_ACCELERATOR="cpu")
    seen = {key: os.environ.get(key) for key in want}
    if seen != want:
        raise RuntimeError(f"environment {seen}, expected {want}")


def make_batch(n):
    return torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(n))


def _spec(what=None, mark=None, **kwargs):
    return make_spec(functools.partial(Misbehaving, what, mark), make_batch, device="cpu", global_batch_size=2,
                     warmup_steps=1, timed_steps=1, memory_budget="256MiB", **kwargs)


def _child(spec, timeout=300.0):
    return launch(spec, Config(micro_batch_size=2), [MicroBatch()], Placement.CHILD, timeout)


def _ranks(spec, timeout=300.0):
    return launch(spec, Config(num_gpus=2, micro_batch_size=1), [MicroBatch(), DataParallel()], Placement.RANKS,
                  timeout)


def _forks():
    return warm.current().forks if warm.current() is not None else 0


def test_a_probe_measures_the_same_forked_or_fresh(monkeypatch):
    spec = _spec(num_gpus=2)
    warm.stop()
    forked = _ranks(spec)
    assert _forks() == 2  # both ranks were forked
    monkeypatch.setenv(warm.SWITCH, "0")
    alone = _ranks(spec)
    assert _forks() == 2  # none with the switch off
    assert forked.status is alone.status is ProbeStatus.FIT
    # the same to a scalar or two: on a loaded machine a forked rank's peak has come out 4 or 8 bytes higher,
    # once in ten runs (a scalar live at the peak or not; its cause is not found); the zygote's own memory, or a
    # probe's missed, would be at least one of this model's tensors (its smallest: a 128-byte bias)
    pairs = [*zip(forked.rank_peaks, alone.rank_peaks), (forked.peak_bytes, alone.peak_bytes)]
    assert len(forked.rank_peaks) == len(alone.rank_peaks) == 2 and all(abs(f - a) <= 16 for f, a in pairs), pairs


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_probe_killed_by_sigkill_is_a_host_oom(monkeypatch, switch):
    monkeypatch.setenv(warm.SWITCH, switch)
    result = _child(_spec("kill"))
    assert result.status is ProbeStatus.OOM and result.oom_kind == "host-killed", result.reason
    assert "child process killed (SIGKILL)" in result.reason


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_probe_that_exits_without_reporting_is_an_error_with_its_code(monkeypatch, switch):
    monkeypatch.setenv(warm.SWITCH, switch)
    result = _child(_spec("exit"))
    assert result.status is ProbeStatus.ERROR and result.reason == "child process died with exit code 3"


def test_a_hung_forked_probe_is_killed_at_the_timeout_and_reaped():
    result = _ranks(_spec("hang", num_gpus=2), timeout=5)
    assert result.status is ProbeStatus.ERROR and "timed out after 5 s" in result.reason
    zygote = psutil.Process(warm.current().popen.pid)
    deadline = time.monotonic() + 10
    while zygote.children() and time.monotonic() < deadline:  # released zombies are reaped at once
        time.sleep(0.2)
    assert not zygote.children()


def test_the_rank_environment_and_the_callers_reach_forked_probes(monkeypatch):
    monkeypatch.setenv("AUTOFIT_TEST_MARK", "first")
    result = _ranks(_spec("env", "first", num_gpus=2))
    assert result.status is ProbeStatus.FIT, result.reason
    first = warm.current().popen.pid
    monkeypatch.setenv("AUTOFIT_TEST_MARK", "second")  # what imports may read: a new warm process
    result = _child(_spec("env", "second"))
    assert result.status is ProbeStatus.FIT, result.reason
    assert warm.current().popen.pid != first
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_probe_reads_its_job_on_standard_input_and_nothing_is_written(monkeypatch, tmp_path, switch):
    """The job (the spec serialised: the user's code, a model's weights) reaches the probe process through a
    pipe, never a file that another process could read or swap for its own."""
    monkeypatch.setenv(warm.SWITCH, switch)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read from TMPDIR again, here and in the probe process
    result = _child(_spec("files"))
    assert result.status is ProbeStatus.FIT, result.reason
    assert not _written()


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_probes_output_goes_to_the_callers_stderr(monkeypatch, capfd, switch):
    monkeypatch.setenv(warm.SWITCH, switch)
    assert _child(_spec("print")).status is ProbeStatus.FIT
    out, err = capfd.readouterr()
    assert "PROBE-STDOUT" in err and "PROBE-STDERR" in err and "PROBE" not in out  # stdout stays the caller's


def test_the_warm_process_only_imports(monkeypatch):
    # OpenMP's pool (2 threads here) would show as a second thread had the warm process run a torch op
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert _child(_spec()).status is ProbeStatus.FIT  # a new warm process: the environment changed
    before = warm.current().describe()
    assert before["threads"] == 1 and before["unsafe_modules"] == [] and not before["cuda_initialised"]
    for _ in range(3):
        assert _child(_spec()).status is ProbeStatus.FIT
    after = warm.current().describe()
    assert after["pid"] == before["pid"] and after["threads"] == 1
    assert after["resident_bytes"] - before["resident_bytes"] < 8 * 2**20  # forking leaves nothing behind
    control = subprocess.run([sys.executable, "-c", "import os, torch; x = torch.randn(512, 512); x @ x; "
                              "print(len(os.listdir('/proc/self/task')))"], capture_output=True, text=True,
                             env=dict(os.environ), check=True)
    assert int(control.stdout) > 1  # what a torch op does: the check above could see it


def test_a_warm_process_that_cannot_start_leaves_probes_fresh(monkeypatch):
    warm.stop()
    monkeypatch.setattr(warm, "COMMAND", ("-c", "import sys; sys.exit(5)"))  # ends before it answers
    monkeypatch.setattr(warm, "_off", None)
    result = _child(_spec())
    assert result.status is ProbeStatus.FIT
    assert "ended (exit code 5)" in warm.off_reason() and warm.current() is None
    assert _child(_spec()).status is ProbeStatus.FIT and warm.current() is None  # fresh from now on


def test_a_lost_warm_process_is_replaced():
    assert _child(_spec()).status is ProbeStatus.FIT
    lost = warm.current().popen.pid
    os.kill(lost, signal.SIGKILL)
    assert _child(_spec()).status is ProbeStatus.FIT
    assert warm.current().popen.pid != lost and warm.current().forks == 1


def test_an_import_that_makes_forking_unsafe_is_named():
    from autofit.probe.zygote import unsafe

    assert "deepspeed is imported" in unsafe({"deepspeed": object()}, "")
    assert "libcuda.so" in unsafe({}, "7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n")
    assert unsafe({"torch": torch}, "7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/libgomp.so.1\n") is None


def test_the_modules_a_job_names_are_warmed_and_the_users_are_not():
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (as a launcher that built the model has it)

    spec = make_spec(make_gpt2, global_batch_size=2, device="cpu", num_gpus=2, seq_len=16, memory_budget="1GiB")
    job = payload(spec, [MicroBatch()])
    named = warm.modules_named(job)
    assert "transformers.models.gpt2.configuration_gpt2" in named and "models" in named
    warmed = dict(warm.warm_list(job))
    assert "transformers.models.gpt2.modeling_gpt2" in warmed  # the configuration's sibling
    assert "models" not in warmed and "torch" in warmed and "autofit.probe.child" in warmed
    assert warmed["torch"] == torch.__file__
    assert not [name for name in warmed if name.split(".")[0] in ("deepspeed", "bitsandbytes")]


def test_the_modules_of_a_pickle_are_read_without_copying_its_weights():
    import pickletools

    import cloudpickle

    model = make_gpt2()  # an instance: its weights travel in the pickle
    data = cloudpickle.dumps((model, {"extra": torch.randn(64, 64)}))
    expected, strings = [], []
    for op, arg, _ in pickletools.genops(data):  # the reference: every opcode read, weights copied
        if op.name == "STACK_GLOBAL":
            expected.append(strings[-2])
        if isinstance(arg, str) and "UNICODE" in op.name:
            strings.append(arg)
        elif op.name in ("BINGET", "LONG_BINGET"):
            strings.append(None)  # a memo fetch: the module named again (its first mention counted already)
    named = warm.modules_named(data)
    assert set(named) >= {m for m in expected if m is not None}
    assert "transformers.models.gpt2.modeling_gpt2" in named and "torch._utils" in named


def test_a_search_ends_the_warm_process_its_probes_forked_from(monkeypatch):
    """A notebook keeps no warm process once its plan is made: the search's probes forked from one, which
    ends with the search."""
    import autofit

    warm.stop()
    forks = []
    started = warm.start
    monkeypatch.setattr(warm, "start", lambda *a, **k: forks.append(started(*a, **k)) or forks[-1])
    plan = autofit.autofit(functools.partial(Misbehaving), make_batch, device="cpu", global_batch_size=2, num_gpus=2,
                           memory_budget="256MiB", warmup_steps=1, timed_steps=1, max_probes=1,
                           strategies=[MicroBatch(), DataParallel()])
    assert plan.fits and any(f is not None for f in forks)  # its ranks were forked warm
    assert warm.current() is None
