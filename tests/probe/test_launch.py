"""Several ranks as child processes over gloo on the CPU: data parallel fits, an OOM on one rank, a hang,
bad input, and nothing left behind in the caller's process."""

import multiprocessing
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import autofit
from autofit.config import Config
from autofit.errors import UsageError
from autofit.probe.launch import check_ranks, died
from autofit.probe.outcome import ProbeStatus
from autofit.search.space import build_space
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch, Placement, default_strategies
from models import LinearBlocks, run_ranks

WIDTH = 64


class Blocks(LinearBlocks):
    """Three linear blocks; `trouble` makes one rank misbehave in forward ("oom" or "hang")."""

    def __init__(self, trouble=None):
        super().__init__(WIDTH, 3)
        self.trouble = trouble

    def forward(self, x):
        if self.trouble and dist.is_initialized() and dist.get_rank() == 1:
            if self.trouble == "oom":
                torch.empty(int(1.2 * 2**30), dtype=torch.uint8)  # over the 1 GiB budget (pages never touched)
            time.sleep(3600)
        return super().forward(x)


def ooming():
    return Blocks("oom")


def hanging():
    return Blocks("hang")


def make_batch(n):
    return torch.randn(n, WIDTH)


def _spec(model=Blocks, **kwargs):
    return make_spec(model, make_batch, device="cpu", num_gpus=2, global_batch_size=4, warmup_steps=1,
                     timed_steps=1, memory_budget="1GiB", **kwargs)


def _no_children_left():
    return not multiprocessing.active_children()


def test_oom_on_one_rank_is_oom_for_the_candidate_and_frees_the_other():
    spec = _spec(ooming)
    start = time.monotonic()
    result = run_ranks(spec, Config(num_gpus=2, micro_batch_size=2), [MicroBatch()], timeout=300)
    assert result.status is ProbeStatus.OOM and result.oom_kind == "cpu-budget"
    assert "1 of 2 ranks" in result.reason
    assert time.monotonic() - start < 120  # rank 0 was killed in its collective, not waited on for 300 s
    assert _no_children_left()


def test_hang_is_a_timeout_error_and_every_rank_is_reaped():
    spec = _spec(hanging)
    result = run_ranks(spec, Config(num_gpus=2, micro_batch_size=2), [MicroBatch()], timeout=5)
    assert result.status is ProbeStatus.ERROR and "timed out after 5 s" in result.reason
    assert _no_children_left()


def test_num_gpus_larger_than_visible_devices():
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(UsageError, match=f"num_gpus={visible + 1} but {visible} CUDA device"):
        check_ranks(torch.device("cuda"), visible + 1)
    check_ranks(torch.device("cpu"), 4)  # CPU ranks: any number


def test_autofit_rejects_too_many_gpus():
    if torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA device"):
            autofit.autofit(Blocks, make_batch, device="cuda", num_gpus=torch.cuda.device_count() + 1)
    else:
        with pytest.raises(UsageError):  # no CUDA at all: the device itself is refused first
            autofit.autofit(Blocks, make_batch, device="cuda", num_gpus=2)


def test_placement_comes_from_the_strategies():
    space = build_space(_spec(), default_strategies())
    assert space.placement(Config()) is Placement.IN_PROCESS
    assert space.placement(Config(num_gpus=2)) is Placement.RANKS
    assert space.placement(Config(sharding="zero2", num_gpus=2)) is Placement.RANKS
    assert space.placement(Config(sharding="fsdp_full", num_gpus=2)) is Placement.RANKS
    assert space.placement(Config(optimizer="paged_adamw8bit")) is Placement.CHILD


def test_a_killed_child_is_a_host_oom():
    died_config = Config(num_gpus=2)
    assert died(died_config, -9, "rank 1").oom_kind == "host-killed"
    assert died(died_config, 1, "child process").status is ProbeStatus.ERROR


def test_autofit_with_two_cpu_ranks_leaves_no_process_group():
    plan = autofit.autofit(Blocks, make_batch, device="cpu", num_gpus=2, global_batch_size=4,
                           strategies=[MicroBatch()], warmup_steps=1, timed_steps=1, max_probes=1)
    assert plan.fits and plan.config.num_gpus == 2
    probe = plan.probes[0]  # plain data parallel (DDP) on two gloo ranks
    assert probe.peak_bytes > 3 * WIDTH * WIDTH * 4  # at least the weights
    assert probe.samples_per_s == pytest.approx(4 / probe.step_seconds)
    assert "per rank" in probe.reason
    assert not dist.is_initialized()
    assert _no_children_left()
    if "deepspeed" in sys.modules:
        from deepspeed import comm

        assert comm.comm.cdb is None


def test_combine_takes_the_worst_rank():
    from autofit.probe.launch import combine
    from autofit.probe.outcome import ProbeResult

    spec, config = _spec(), Config(num_gpus=2, micro_batch_size=2)
    fast = ProbeResult(config, ProbeStatus.FIT, "fits: peak 1 MiB", 2**20, 0.5, 8.0)
    slow = ProbeResult(config, ProbeStatus.FIT, "fits: peak 2 MiB", 2 * 2**20, 1.0, 4.0)
    both = combine(spec, config, [fast, slow])
    assert both.fits and both.peak_bytes == 2 * 2**20 and both.step_seconds == 1.0
    assert both.rank_peaks == (2**20, 2 * 2**20) and both.peak_rank == 1
    assert "set by rank 1 of 2" in both.reason
    assert type(both).from_dict(both.to_dict()) == both  # per-rank peaks survive the plan's JSON
    assert both.samples_per_s == pytest.approx(4.0)  # global batch 4 per 1.0 s step
    silent = ProbeResult(config, ProbeStatus.ERROR, "rank 1 did not report: timed out")
    assert combine(spec, config, [fast, silent]).status is ProbeStatus.ERROR
    oom = ProbeResult(config, ProbeStatus.OOM, "CPU budget exceeded", oom_kind="cpu-budget")
    worst = combine(spec, config, [silent, oom])
    assert worst.status is ProbeStatus.OOM and worst.reason.endswith("(on 1 of 2 ranks)")
    # a rank stopped as too slow leaves its peer's collective failing: the prune is the outcome
    pruned = ProbeResult(config, ProbeStatus.PRUNED, "too slow to win: stopped 5.0 s after its first step")
    left = ProbeResult(config, ProbeStatus.ERROR, "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection "
                                                  "closed by peer [127.0.0.1]:32408.")
    assert combine(spec, config, [left, pruned]).status is ProbeStatus.PRUNED
    nccl = ProbeResult(config, ProbeStatus.ERROR, "DistBackendError: NCCL error: remote process exited or there "
                                                  "was a network error")
    assert combine(spec, config, [nccl, pruned]).status is ProbeStatus.PRUNED
    assert combine(spec, config, [left, silent]).reason.startswith("rank 1 did not report")


SCRIPT = """
import torch, autofit
from torch import nn
print("TOP-LEVEL RAN")
make = lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
def loss(out, batch):
    return out.pow(2).mean()
plan = autofit.autofit(make, lambda n: torch.randn(n, 16), device="cpu", num_gpus=2, global_batch_size=4,
                       loss_fn=loss, memory_budget="256MiB", strategies=[], warmup_steps=1, timed_steps=1,
                       max_probes=1)
print("FITS", plan.fits, plan.peak_rank, plan.probes[0].rank_peaks)
"""


@pytest.mark.parametrize("how", ["stdin", "script without a main guard"])
def test_ranks_need_nothing_from_the_callers_main(how, tmp_path):
    import ast
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if how == "stdin":  # lambdas and a def of __main__ read from standard input (python3 - <<EOF)
        done = subprocess.run([sys.executable, "-"], input=SCRIPT, capture_output=True, text=True, env=env,
                              timeout=300, cwd=tmp_path)
    else:
        (tmp_path / "train.py").write_text(SCRIPT)
        done = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, env=env, timeout=300,
                              cwd=tmp_path)
    fits = next((line.split(" ", 3) for line in done.stdout.splitlines() if line.startswith("FITS ")), None)
    assert fits and fits[1] == "True", done.stdout + done.stderr[-3000:]
    peaks = ast.literal_eval(fits[3])  # the two ranks' peaks: the plan names the rank whose peak is the highest
    assert len(peaks) == 2 and peaks[int(fits[2])] == max(peaks), done.stdout
    assert done.stdout.count("TOP-LEVEL RAN") == 1  # the ranks did not re-run the caller's script
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_what_cannot_reach_the_ranks_is_one_usage_error_before_any_probe():
    import threading

    lock = threading.Lock()
    started = []

    class Counting:
        def starting(self, config, why):
            started.append(config)

        def finished(self, result):
            pass

    with pytest.raises(UsageError, match=r"the batch \(or make_batch factory\).*cannot be sent to the probe"):
        autofit.autofit(Blocks, lambda n, held=lock: make_batch(n), device="cpu", num_gpus=2, global_batch_size=4,
                        strategies=[MicroBatch()], progress=Counting())
    assert not started


KILLED_PARENT = """
import sys, torch
sys.path[:0] = {path!r}
from autofit.config import Config
from autofit.strategies import MicroBatch
from models import run_ranks
from test_launch import _spec, hanging
run_ranks(_spec(hanging), Config(num_gpus=2, micro_batch_size=2), [MicroBatch()], timeout=600)
"""


@pytest.mark.parametrize("warm", ["1", "0"])
def test_ranks_leave_when_their_launcher_is_killed(tmp_path, warm):
    """Fresh ranks watch their launcher; forked ones watch the warm process, which watches the launcher:
    either way nothing is left once the launcher is killed, the warm process included."""
    import os
    import signal
    import subprocess

    here = os.path.dirname(__file__)
    parent = subprocess.Popen([sys.executable, "-c", KILLED_PARENT.format(path=[here, os.path.dirname(here), *sys.path])],
                              env=dict(os.environ, TMPDIR=str(tmp_path), AUTOFIT_WARM_PROBES=warm))
    probes, everything = [], []
    deadline = time.monotonic() + 120
    while len(probes) < 2 and time.monotonic() < deadline:  # wait until both ranks run
        time.sleep(1)
        everything = _descendants(parent.pid)
        probes = [p for p in everything if _is_probe(p)]
    assert len(probes) == 2
    assert (warm == "1") == any("autofit.probe.zygote" in " ".join(p.cmdline()) for p in everything)
    parent.send_signal(signal.SIGKILL)  # no finally runs in the launcher: the ranks must notice by themselves
    parent.wait()
    deadline = time.monotonic() + 30
    alive = [p.pid for p in everything]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [pid for pid in alive if _running(pid)]
    assert not alive
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")]  # the job came on a pipe


def _descendants(pid):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _is_probe(process):
    """A probe process: a fresh `python -m autofit.probe.child`, or one the warm process forked."""
    import psutil

    try:
        if "autofit.probe.child" in " ".join(process.cmdline()):
            return True
        parent = process.parent()
        return parent is not None and "autofit.probe.zygote" in " ".join(parent.cmdline())
    except psutil.NoSuchProcess:
        return False


def _running(pid):
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split()[2] != "Z"


QUIET = "import sys\nfrom autofit.probe.child import quiet_notices\nif sys.argv[1] == 'quiet':\n    quiet_notices()\n"


def _notices(script, how: str, needle: str) -> int:
    """Times `needle` is on the stderr of `script` run as a probe process would ('quiet') or not ('loud')."""
    run = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stderr.count(needle)


def test_a_probe_process_leaves_out_torchs_notices_of_deprecated_collectives(tmp_path):
    # DeepSpeed's ZeRO calls reduce_scatter_tensor and all_gather_into_tensor, which torch deprecates; a
    # catch_warnings anywhere resets the once-per-place registry, so the notice came at every call: 3,748
    # lines on stderr in one two-rank search. The probe process leaves them out; the script is a rank's calls.
    script = tmp_path / "collectives.py"
    script.write_text(
        QUIET + "import warnings, torch, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'init'}-' + sys.argv[1], rank=0, world_size=1)\n"
        "for _ in range(3):\n"
        "    with warnings.catch_warnings():\n        pass\n"
        "    dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4))\n"
        "dist.destroy_process_group()\n")
    assert _notices(script, "loud", "is deprecated") == 3  # what a rank printed: one per call
    assert _notices(script, "quiet", "is deprecated") == 0


def test_a_probe_process_leaves_out_transformers_notice_of_a_default_loss(tmp_path):
    # GPT2LMHeadModel's class names no loss, so transformers says, once per process, that it takes the
    # causal LM loss: once per probe and rank in a search. The probe process leaves it out.
    script = tmp_path / "gpt2.py"
    script.write_text(
        QUIET + "import torch\nfrom transformers import GPT2Config, GPT2LMHeadModel\n"
        "model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2))\n"
        "ids = torch.randint(0, 64, (2, 8))\n"
        "model(input_ids=ids, labels=ids).loss.backward()\n")
    assert _notices(script, "loud", "`loss_type=None` was set") == 1
    assert _notices(script, "quiet", "`loss_type=None` was set") == 0


def test_the_probe_entry_point_is_not_imported_before_it_runs():
    """`python -m autofit.probe.child` (and the warm process, `python -m autofit.probe.zygote`) import
    autofit first; were the module imported on the way (the launcher importing a name from it), runpy
    would warn on every rank's stderr that it was found in sys.modules before its execution."""
    import subprocess

    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                           "import sys, autofit, autofit.probe.launch, autofit.estimate.simulation.workers\n"
                           "assert 'autofit.probe.child' not in sys.modules, 'imported'\n"
                           "assert 'autofit.probe.zygote' not in sys.modules, 'imported'"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


class _Touches:
    """Unpickled, it makes the file `path`: what a job must never do where it is read."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.path),)


def _entry(module, stdin, *args, key=None):
    """`python -m module ARGS` fed `stdin`, with a result pipe as a probe process has and `key` as its launcher's
    secret (`JOB_KEY`; None: none in its environment): its exit code and stderr."""
    import os

    from autofit.probe.payload import JOB_KEY

    env = {name: value for name, value in os.environ.items() if name != JOB_KEY} | ({JOB_KEY: key} if key else {})
    read_fd, write_fd = os.pipe()
    try:
        done = subprocess.run([sys.executable, "-m", module, *args, str(write_fd)], input=stdin, pass_fds=(write_fd,),
                              capture_output=True, timeout=120, env=env)
    finally:
        os.close(read_fd)
        os.close(write_fd)
    return done.returncode, done.stderr.decode()


def test_a_job_is_json_fields_then_the_spec_and_what_does_not_check_out_is_never_unpickled(tmp_path):
    """A probe process's and a simulation worker's job (autofit/probe/payload.py): signed with its launcher's secret,
    then its fields as one line of JSON, checked before the serialised spec after it is read. A job signed by anyone
    else (a named pipe on standard input passes for a pipe), a pickle, or fields that are not the launcher's, end
    the process unread."""
    import io
    import os
    import pickle

    from autofit.probe.child import check_job
    from autofit.probe.payload import JOB_KEY, _signature, framed, new_key, unframed

    key = new_key()
    fields, data = unframed(io.BytesIO(framed({"timeout": 5.0}, b"\n\x80spec", key)), key)
    assert fields["timeout"] == 5.0 and sys.path[0] in fields["sys_path"] and data == b"\n\x80spec"
    path = list(sys.path)
    stranger = framed({"sys_path": [str(tmp_path)]}, b"\x80spec", new_key())  # another launcher's, or nobody's
    for job, secret in [(stranger, key), (stranger, None), (stranger[65:], key)]:
        with pytest.raises(ValueError, match="signed|environment"):
            unframed(io.BytesIO(job), secret)
    assert sys.path == path  # its import path was not taken
    for bad in (b"\x80\x04K\x01.", b'{"sys_path": "/tmp"}\n', b'{"sys_path": []}'):  # a pickle; a path; no line
        with pytest.raises(ValueError, match="fields"):
            unframed(io.BytesIO(_signature(key, bad) + bad), key)  # signed, and still refused
    state = {"flags": {"cudnn.benchmark": False, "fp32_precision": {"matmul": "ieee"}}, "cards": None}
    good = {"config": Config(micro_batch_size=2).to_dict(), "step_limit": None, "timeout": 5.0, "state": state}
    check_job(good)
    for field, value in [("config", {"micro_batch_size": 0}), ("timeout", "soon"), ("step_limit", -1),
                         ("state", {"flags": {"cudnn.benchmark": "yes"}, "cards": None}),
                         ("state", {"flags": {}, "cards": {"visible": 0, "buses": []}})]:
        with pytest.raises(ValueError, match=field if field != "state" else "parent's"):
            check_job({**good, field: value})

    marker = tmp_path / "unpickled"
    evil = pickle.dumps(_Touches(str(marker)))
    folder = tmp_path / "autofit-sim-x"
    folder.mkdir()
    code, err = _entry("autofit.probe.child", evil, key=key)
    assert code == 2 and "does not check out" in err and not marker.exists()
    code, err = _entry("autofit.probe.child", framed({**good, "timeout": "soon"}, evil, key), key=key)
    assert code == 2 and "timeout" in err and not marker.exists()
    code, _ = _entry("autofit.estimate.simulation.workers", framed({"settings": {"target": "tpu"}}, evil, key),
                     str(folder), key=key)
    assert code == 1 and not marker.exists()
    # jobs whose fields check out, through a pipe, signed by another launcher or with no secret here: never read
    for secret in (new_key(), None):
        code, err = _entry("autofit.probe.child", framed(good, evil, key), key=secret)
        assert code == 2 and ("signed" in err or "environment" in err) and not marker.exists(), err[-2000:]
        code, _ = _entry("autofit.estimate.simulation.workers", framed({"settings": {}}, evil, key), str(folder),
                         key=secret)
        assert code == 1 and not marker.exists()
    # a job that checks out and is signed, from a file instead of its launcher's pipe: never read, in either process
    job_file = tmp_path / "job"
    for module, job, exit_code, args in [("autofit.probe.child", framed(good, evil, key), 2, ()),
                                         ("autofit.estimate.simulation.workers", framed({"settings": {}}, evil, key), 1,
                                          (str(folder), "0"))]:
        job_file.write_bytes(job)
        with job_file.open("rb") as stdin:
            done = subprocess.run([sys.executable, "-m", module, *args, "1"], stdin=stdin, capture_output=True,
                                  timeout=120, env={**os.environ, JOB_KEY: key})
        assert done.returncode == exit_code and not marker.exists(), done.stderr.decode()[-2000:]
