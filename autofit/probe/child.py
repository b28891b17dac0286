"""The probe process: `python -m autofit.probe.child RESULT_FD`, started by `autofit.probe.launch`.

An autofit entry point, not a re-run of the user's `__main__`: the job comes on standard input, never through
a file, signed with the secret its launcher put in its environment alone (`autofit.probe.payload.unframed`: a job
anyone else wrote is refused unread): its fields as JSON, checked before anything else is read
(`check_job`; a job that does not check out ends the process with exit status 2, unread), then the spec and
the strategies serialised with cloudpickle (lambdas, closures, notebook and standard-input definitions travel
by value), so scripts without an `if __name__ == "__main__":` guard, notebooks and `python - <<EOF` all work.
The rank's place in the process group comes from the environment, as torchrun sets it (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a single child has none.
The result is written as one JSON document to the file descriptor RESULT_FD, before the process
group is left (leaving may wait for peers that are being killed).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import sys
import warnings
from typing import Any

from autofit.probe.orphans import exit_process, leave_with_parent
from autofit.probe.payload import job_key, piped, unframed


def main(argv: list[str] | None = None) -> int:
    """Run the job read on standard input, write the result to descriptor `argv[0]`; exit status 0 when reported."""
    result_fd = (argv if argv is not None else sys.argv[1:])[0]
    leave_with_parent()
    quiet_notices()
    try:
        # the launcher's (`autofit.probe.launch.make_job`), through a pipe, signed with its secret
        job, data = unframed(piped(sys.stdin.buffer), job_key())
        check_job(job)
    except ValueError as exc:
        print(f"autofit probe: the job on standard input does not check out: {exc}", file=sys.stderr)
        return 2  # no result: the launcher reports the exit code
    result = run_job(job, data)
    with os.fdopen(int(result_fd), "w") as out:
        out.write(json.dumps(result))
    _leave_group()
    return 0


def quiet_notices() -> None:
    """Leave out notices nobody can act on that a search would print over and over:
    - torch's, that DeepSpeed calls collectives it deprecated (`reduce_scatter_tensor`,
      `all_gather_into_tensor`), printed at nearly every call, as other libraries' `catch_warnings` reset
      the once-per-place registry (3,748 lines on stderr in one two-rank search of 27 probes on the CPU);
    - transformers', that a model whose class names no loss (GPT2LMHeadModel: `loss_type` None) takes the
      causal LM loss: once per process, so once per probe and rank (8 lines in a two-rank search of GPT-2).
    """
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    logging.getLogger("transformers.modeling_utils").addFilter(_unset_loss_type)


def _unset_loss_type(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("`loss_type=None` was set in the config but it is unrecognized")


def check_job(job: dict[str, Any]) -> None:
    """`ValueError` naming the first of `job`'s fields (`autofit.probe.launch.make_job`) that is not what the
    launcher writes."""
    from autofit.config import Config
    from autofit.probe.handover import check_state

    try:
        Config.from_dict(job["config"])
    except (KeyError, TypeError, ValueError) as exc:  # UsageError is a ValueError
        raise ValueError(f"config: {exc}") from None
    limit, timeout = job.get("step_limit"), job.get("timeout")
    if limit is not None and not (type(limit) in (int, float) and limit >= 0):
        raise ValueError(f"step_limit {limit!r} is not a number of seconds")
    if not (type(timeout) in (int, float) and timeout > 0):
        raise ValueError(f"timeout {timeout!r} is not a number of seconds")
    check_state(job.get("state"))


def run_job(job: dict[str, Any], data: bytes) -> dict[str, Any]:
    """The probe's result as a dict (`ProbeResult.to_dict`), whatever happens inside it: `job`'s fields
    (`check_job`) and `data`, the spec and strategies serialised (`autofit.probe.payload`)."""
    from autofit.config import Config
    from autofit.probe.outcome import ProbeResult, ProbeStatus

    config = Config.from_dict(job["config"])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        spec, strategies = pickle.loads(data)  # the user's code (`autofit.probe.payload`), as they passed it
        spec = _placed(spec, job["state"], rank, world)
        result = _probe(spec, config, strategies, job["step_limit"], job["timeout"])
    except Exception as exc:  # noqa: BLE001 - bad input found in a child still comes back as a result
        from autofit.probe.oom import error_site, first_line

        who = f"rank {rank}: " if world > 1 else ""
        result = ProbeResult(config, ProbeStatus.ERROR, who + first_line(exc), error_type=type(exc).__name__,
                             error_site=error_site(exc))
    return result.to_dict()


def _placed(spec: Any, state: dict[str, Any], rank: int, world: int) -> Any:
    """The spec as this rank sees it: the parent's flags and, on CUDA, its own card
    (`autofit.probe.handover.adopt`); on the CPU a share of the host's cores."""
    import torch

    from autofit.probe.handover import adopt

    spec = adopt(state, spec, rank)
    if spec.device.type != "cuda" and "MASTER_PORT" in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return spec


def _probe(spec: Any, config: Any, strategies: list, step_limit: float | None, timeout: float) -> Any:
    import torch.distributed as dist

    from autofit.probe.run import run_probe

    if "MASTER_PORT" in os.environ:
        dist.init_process_group("nccl" if spec.device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout))
    return run_probe(spec, config, strategies, step_limit)


def _leave_group() -> None:
    """Leave the process group while the interpreter lives, after freeing what the probe left in reference
    cycles (left to interpreter exit, a gloo group can abort the process: train_with_prepare.py)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(main())  # the result is written and the group left: the interpreter's teardown is skipped
