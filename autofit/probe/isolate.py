"""Probes that touch process-global state (bitsandbytes paging, DeepSpeed, several ranks) run in a child
process with a timeout, so the caller's process is left as it was. The child is always reaped."""

from __future__ import annotations

import multiprocessing
import pickle
from typing import Any, Sequence

from autofit.config import Config
from autofit.probe.run import ProbeResult, ProbeStatus
from autofit.spec.train import TrainSpec

DEFAULT_TIMEOUT = 600.0  # seconds; a probe is a few training steps, so this only stops a hang


def run_isolated(spec: TrainSpec, config: Config, strategies: Sequence[Any],
                 timeout: float = DEFAULT_TIMEOUT, step_limit: float | None = None) -> ProbeResult:
    """`run_probe` in a fresh child process (spawned, not forked: CUDA cannot be forked)."""
    payload = pickled(spec, config, strategies, step_limit)
    if isinstance(payload, ProbeResult):
        return payload
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(payload, sender), daemon=True)
    child.start()
    sender.close()
    try:
        if receiver.poll(timeout):
            return ProbeResult.from_dict(receiver.recv())
        return ProbeResult(config, ProbeStatus.ERROR, f"probe timed out after {timeout:.0f} s")
    except EOFError:
        child.join(5)
        return _died(config, child.exitcode)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()


def pickled(spec: TrainSpec, config: Config, strategies: Sequence[Any],
            step_limit: float | None) -> bytes | ProbeResult:
    """What a child process needs to run the probe, or the error result saying why it does not pickle."""
    try:
        return pickle.dumps((spec, config, list(strategies), step_limit))
    except Exception as exc:  # noqa: BLE001 - lambdas, local classes, open handles
        return ProbeResult(config, ProbeStatus.ERROR,
                           f"cannot probe in a child process: the spec does not pickle ({exc}); "
                           "define the model and batch factories at module level")


def _died(config: Config, exitcode: int | None) -> ProbeResult:
    if exitcode == -9:  # SIGKILL: the kernel's OOM killer, most likely
        return ProbeResult(config, ProbeStatus.OOM, "child process killed (SIGKILL), likely out of host memory",
                           oom_kind="host-killed")
    return ProbeResult(config, ProbeStatus.ERROR, f"child process died with exit code {exitcode}")


def _child(payload: bytes, sender: Any) -> None:
    from autofit.probe.run import run_probe

    spec, config, strategies, step_limit = pickle.loads(payload)
    try:
        result = run_probe(spec, config, strategies, step_limit)
    except Exception as exc:  # noqa: BLE001 - bad input found in the child still comes back as a result
        result = ProbeResult(config, ProbeStatus.ERROR, f"{type(exc).__name__}: {exc}")
    sender.send(result.to_dict())
    sender.close()
