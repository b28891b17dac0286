"""The probe process: `python -m autofit.probe.child RESULT_FD`, started by `autofit.probe.launch`.

An autofit entry point, not a re-run of the user's `__main__`: the job comes on standard input, never
through a file, the spec and the strategies serialised with cloudpickle (lambdas, closures, notebook and
standard-input definitions travel by value), so scripts without an `if __name__ == "__main__":` guard,
notebooks and `python - <<EOF` all work. The rank's place in the process group comes from the environment, as
torchrun sets it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a single child has none.
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

from autofit.probe.orphans import leave_with_parent


def main(argv: list[str] | None = None) -> int:
    """Run the job read on standard input, write the result to descriptor `argv[0]`; exit status 0 when reported."""
    result_fd = (argv if argv is not None else sys.argv[1:])[0]
    leave_with_parent()
    quiet_notices()
    job = pickle.loads(sys.stdin.buffer.read())  # the launcher's (`autofit.probe.launch.make_job`), through a pipe
    # The parent's import path first: modules its objects were pickled by reference from (a test's
    # helpers, the user's package) import here as they did there.
    sys.path[:0] = [p for p in job["sys_path"] if p not in sys.path]
    result = run_job(job)
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


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """The probe's result as a dict (`ProbeResult.to_dict`), whatever happens inside it."""
    from autofit.config import Config
    from autofit.probe.outcome import ProbeResult, ProbeStatus

    config = Config.from_dict(job["config"])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        spec, strategies = pickle.loads(job["payload"])
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
    sys.exit(main())
