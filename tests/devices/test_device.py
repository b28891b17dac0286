import pytest


def test_a_busy_machine_probes_at_the_threads_its_cores_spare(monkeypatch):
    """OpenMP threads wait for each other: on 2 cores at a load of 8, a step ran 4-12 s at 2 threads, ~1 s at 1.
    The CPUs are sampled (a test double of the operating system's counters here), not read from the load average,
    which still counts a run that ended a minute ago."""
    import os

    import psutil
    import torch

    from autofit.devices import device
    from autofit.devices.device import search_threads, spare_threads

    assert spare_threads(2, idle=0) == 1
    assert spare_threads(2, idle=2) == 2
    assert spare_threads(64, idle=33) == 33
    assert spare_threads(4, idle=8) == 4
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: pytest.fail("sampled for one thread"))
    assert spare_threads(1) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: [3.0, 97.0, 1.0, 0.0])
    assert device.idle_cpus() == 1  # cpus 2 and 3 are not this process's

    def unreadable(interval, percpu):
        raise PermissionError("/proc/stat")

    monkeypatch.setattr(psutil, "cpu_percent", unreadable)
    assert device.idle_cpus() == 2  # as if idle: the threads torch would take anyway
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 8.0, 8.0))  # what a search that just ended leaves
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: [2.0, 4.0])
        with search_threads(torch.device("cpu")) as threads:
            assert threads == torch.get_num_threads() == 2  # quiet now: the lagging load average is not read
        monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: [100.0, 99.0])
        with search_threads(torch.device("cpu")) as threads:
            assert threads == torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with search_threads(torch.device("cuda")) as threads:
        assert threads is None
