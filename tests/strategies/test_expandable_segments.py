"""The allocator rung (autofit/strategies/allocator.py): expandable segments offered on CUDA targets only, a
probe with them in a child process, the setting applied before the model's first allocation, and every
export setting it. The card is the CUDA test double (tests/cuda_double.py): nothing here ran on a GPU."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import torch
from cuda_double import GiB, FakeCuda, FakeGpu
from models import LinearBlocks

from autofit.config import Allocator, Config
from autofit.devices.gpus import get_gpu
from autofit.job.target import Target
from autofit.job.train_spec import make_spec
from autofit.search.space import build_space
from autofit.strategies import ExpandableSegments, MicroBatch, Placement, completed
from autofit.strategies.allocator import ENVIRONMENT, SETTING
from autofit.strategies.run import TrainRun

EXPANDABLE = Config(allocator="expandable_segments")


def _cpu_spec():
    return make_spec(lambda: LinearBlocks(16, 2), lambda n: torch.randn(n, 16), device="cpu", memory_budget="1GiB",
                     loss_fn=lambda out, batch: out.square().mean())


def test_a_cpu_target_is_not_offered_it_and_is_told_why():
    options = ExpandableSegments().options(_cpu_spec())
    assert [o.value for o in options] == [Allocator.DEFAULT, Allocator.EXPANDABLE]
    assert not options[1].available and "CUDA caching allocator" in options[1].reason
    space = build_space(_cpu_spec(), [ExpandableSegments(), MicroBatch()])
    assert {level.allocator for level in space.levels()} == {Allocator.DEFAULT}
    assert any(e.config.allocator is Allocator.EXPANDABLE and "CUDA" in e.reason for e in space.excluded)


def test_a_cuda_target_is_offered_it_at_tier_0_and_its_probe_runs_in_a_child():
    import dataclasses

    spec = dataclasses.replace(_cpu_spec(), target=Target.from_profile(get_gpu("a100-80gb"), 1))
    options = ExpandableSegments().options(spec)
    assert [(o.value, o.tier, o.available) for o in options] == [(Allocator.DEFAULT, 0, True),
                                                                 (Allocator.EXPANDABLE, 0, True)]
    assert SETTING in options[1].reason
    space = build_space(spec, [ExpandableSegments(), MicroBatch()])
    placed = {level.allocator: space.placement(level) for level in space.levels()}
    assert placed == {Allocator.DEFAULT: Placement.IN_PROCESS, Allocator.EXPANDABLE: Placement.CHILD}
    assert "alloc=expandable_segments" in EXPANDABLE.describe()


def test_it_applies_first_and_sets_the_allocator_before_the_model_is_placed():
    assert type(completed()[0]) is ExpandableSegments  # rung 0: before anything allocates
    with FakeCuda([FakeGpu(total=80 * GiB)]) as cuda:
        spec = make_spec(lambda: LinearBlocks(16, 2), lambda n: torch.randn(n, 16), device="cuda",
                         loss_fn=lambda out, batch: out.square().mean())
        run = TrainRun(spec=spec, config=EXPANDABLE, model=LinearBlocks(16, 2))
        ExpandableSegments().apply(run)
        assert ("set_allocator_settings", SETTING) in cuda.calls and cuda.allocator_settings == SETTING
        assert ("empty_cache",) not in cuda.calls  # nothing was held: nothing to give back
        cuda.calls.clear()
        ExpandableSegments().apply(TrainRun(spec=spec, config=Config(), model=LinearBlocks(16, 2)))
        assert not any(call[0] == "set_allocator_settings" for call in cuda.calls)  # the default sets nothing


def test_in_a_running_process_it_switches_on_gives_back_the_cache_and_says_what_stays(caplog):
    with FakeCuda([FakeGpu(total=80 * GiB)]) as cuda:
        spec = make_spec(lambda: LinearBlocks(16, 2), lambda n: torch.randn(n, 16), device="cuda",
                         loss_fn=lambda out, batch: out.square().mean())
        cuda.reserved[0] = 3 * GiB  # the user's process has been allocating
        with caplog.at_level(logging.WARNING, logger="autofit.prepare"):
            ExpandableSegments().apply(TrainRun(spec=spec, config=EXPANDABLE, model=LinearBlocks(16, 2)))
        assert cuda.allocator_settings == SETTING
        assert ("empty_cache",) in cuda.calls
        assert "3072 MiB" in caplog.text and f"{ENVIRONMENT}={SETTING}" in caplog.text


def test_the_simulated_step_is_shared_and_its_replay_named():
    strategy = ExpandableSegments()
    assert strategy.simulated_as(EXPANDABLE, {}) == {"_segments": "expandable"}  # left out of the key
    assert strategy.simulated_as(Config(), {}) == {}


def _plan(config: Config):
    """A plan around `config` as a CUDA tune would record it (figures plausible, nothing measured)."""
    from autofit import Plan, ProbeResult, ProbeStatus

    probe = ProbeResult(config, ProbeStatus.FIT, "peak 40 MiB of 64 MiB", peak_bytes=40 * 2**20, step_seconds=0.5,
                        samples_per_s=8.0)
    summary = {"model": "GPT2LMHeadModel", "device": "cuda:0", "memory_budget": 64 * 2**20,
               "global_batch_size": config.global_batch_size}
    return Plan(True, config, 8.0, 1024.0, 40 * 2**20, "the only configuration that fits", (probe,), summary,
                autofit_version="0.1.0")


def test_the_exports_set_it(tmp_path):
    plan = _plan(Config(micro_batch_size=2, grad_accum_steps=2, allocator="expandable_segments"))
    script = plan.export("torchrun", tmp_path / "torchrun")[0]
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import json, os, sys
        json.dump({"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}, open(sys.argv[1], "w"))
    """))
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop(ENVIRONMENT, None)
    done = subprocess.run(["bash", str(script), str(tmp_path / "train.py"), str(tmp_path / "env.json")], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "env.json").read_text())["conf"] == SETTING  # the launched job has it
    launch = next(p for p in plan.export("accelerate", tmp_path / "accelerate") if p.name.endswith(".sh"))
    assert f"export {ENVIRONMENT}={SETTING}" in launch.read_text()
    trainer = next(p for p in plan.export("trainer", tmp_path / "trainer") if p.suffix == ".py")
    text = trainer.read_text()
    assert "expandable_segments()" in text and text.index("expandable_segments()") < text.index("Trainer(model=")
    deepspeed = json.loads(plan.export("deepspeed", tmp_path / "deepspeed")[0].read_text())
    assert any("expandable_segments()" in line for line in deepspeed["autofit"]["apply_in_script"])
