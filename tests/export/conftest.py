"""Plans to export. Knobs that cannot be probed on this CPU machine (ZeRO, offload, 8-bit optimizers) are
exported from hand-made plans; the CLI tests export a plan measured for real."""

from __future__ import annotations

import pytest

from autofit import Config, Plan, ProbeResult, ProbeStatus


def make_plan(config: Config | None = None, *, device: str = "cpu", fits: bool = True, **spec) -> Plan:
    """A plan around `config` with plausible figures (bytes, samples/s)."""
    config = config or Config(micro_batch_size=2, grad_accum_steps=2)
    status = ProbeStatus.FIT if fits else ProbeStatus.OOM
    probe = ProbeResult(config, status, "peak 40 MiB of 64 MiB" if fits else "CPU budget exceeded",
                        peak_bytes=40 * 2**20, step_seconds=0.5, samples_per_s=8.0 if fits else None,
                        oom_kind=None if fits else "cpu-budget")
    summary = {"model": "GPT2LMHeadModel", "device": device, "memory_budget": 64 * 2**20,
               "global_batch_size": config.global_batch_size, **spec}
    if not fits:
        return Plan(False, None, None, None, None, "No candidate fits 57.60 MiB; allow numerics.", (probe,), summary,
                    autofit_version="0.1.0")
    return Plan(True, config, 8.0, 1024.0, 40 * 2**20, "the only configuration that fits", (probe,), summary,
                autofit_version="0.1.0")


@pytest.fixture
def plan_for():
    return make_plan


@pytest.fixture(autouse=True)
def environment_as_it_was():
    """The process environment restored after each test: transformers 4.x's `TrainingArguments(fsdp=...)` sets
    ACCELERATE_USE_FSDP and FSDP_* in os.environ, which made every later Trainer in the process (and the
    scripts it starts) build an FSDP plugin, refused on a CPU ("no available devices found")."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
