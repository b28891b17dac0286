"""A competing CPU load for the benchmark: processes that multiply matrices until told to stop.

A tuner's decisions must hold on a machine where other work runs (a shared box, a data loader, a
notebook training next door). `python bench/run.py --competing-load N` starts N of these processes for
the whole run (one torch thread each, at the benchmark's own priority) and stops them at the end.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any


def _spin(stop: Any, parent: int) -> None:
    """Multiply 256x256 matrices (about the working set of a small model's layer) until `stop` is set or
    the benchmark that started this process is gone (killed before it could stop it)."""
    import os

    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    while not stop.is_set() and os.getppid() == parent:
        for _ in range(50):
            a = torch.tanh(a @ b)


class CompetingLoad:
    """Context manager running `processes` busy processes; `processes=0` does nothing. `loads` holds the
    1-minute load average every `every_s` seconds while it runs (with or without processes)."""

    def __init__(self, processes: int, every_s: float = 30.0):
        self.processes = processes
        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()
        self._workers: list[Any] = []
        self.loads: list[float] = []
        self._every_s = every_s
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True, name="bench-load-sampler")

    def _sample(self) -> None:
        while not self._sampling.wait(self._every_s):
            self.loads.append(os.getloadavg()[0])

    def __enter__(self) -> "CompetingLoad":
        self._sampler.start()
        for index in range(self.processes):
            worker = self._context.Process(target=_spin, args=(self._stop, os.getpid()), daemon=True,
                                           name=f"bench-load-{index}")
            worker.start()
            self._workers.append(worker)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sampling.set()
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
                worker.join()
        self._workers.clear()
