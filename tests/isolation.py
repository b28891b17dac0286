"""Run a test's body in a fresh spawned process: a GPU test that runs out of memory in the backward on
purpose can leave tensors allocated in its process (pytorch/pytorch#82218), and pytest-xdist runs other
test files in the same worker after it; their measured peaks would count what it left. Seen on an H200
(2026-11-27): the activation-offload test's checkpointed probe measured 1,750 MiB after the left-behind
test in one worker, 1,178 MiB in a fresh process (bench/results/probe-residue-cuda-h200-2026-11-27.json)."""

import concurrent.futures
import multiprocessing
from typing import Any, Callable


def in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a new spawned process (a module-level function); its result, or its exception
    raised here (an assertion's message included)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args).result()
