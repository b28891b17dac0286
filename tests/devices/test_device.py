

def test_a_busy_machine_probes_at_the_threads_its_cores_spare(monkeypatch):
    """OpenMP threads wait for each other: on 2 cores at a load of 8, a step ran 4-12 s at 2 threads, ~1 s at 1."""
    import os

    import torch

    from autofit.devices.device import search_threads, spare_threads

    assert spare_threads(2, cores=2, load=8.0) == 1
    assert spare_threads(2, cores=2, load=1.0) == 2  # one runnable process is this one
    assert spare_threads(64, cores=64, load=32.0) == 33
    assert spare_threads(4, cores=8, load=0.2) == 4
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "getloadavg", lambda: (50.0, 50.0, 50.0))
    with search_threads(torch.device("cpu")) as threads:
        assert threads == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with search_threads(torch.device("cuda")) as threads:
        assert threads is None
