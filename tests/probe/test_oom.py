import gc
import weakref

import torch

from autofit.devices.memory import CpuBudget
from autofit.probe.oom import classify_oom, collecting_new_objects, release_memory


def test_cpu_budget_oom_is_classified():
    try:
        with CpuBudget(1000):
            torch.zeros(1000)
    except torch.OutOfMemoryError as exc:
        assert classify_oom(exc) == "cpu-budget"
    else:
        raise AssertionError("the budget did not raise")


def test_runtime_error_kinds():
    assert classify_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) == "cuda-allocator"
    assert classify_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors ...")) == "cuda-runtime"
    assert classify_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")) == "cublas"
    assert classify_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")) == "cudnn"
    assert classify_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
                                     ": you tried to allocate 8 bytes")) == "cpu-allocator"
    assert classify_oom(MemoryError()) == "host"


def test_wrapped_oom_is_found_through_the_cause():
    try:
        try:
            raise RuntimeError("CUDA error: out of memory")
        except RuntimeError as inner:
            raise ValueError("while stepping") from inner
    except ValueError as outer:
        assert classify_oom(outer) == "cuda-runtime"


def test_other_errors_are_not_oom():
    assert classify_oom(ValueError("shapes do not match")) is None
    assert classify_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


class _Node:
    pass


def test_a_probes_cycles_are_collected_and_the_collector_is_left_as_it_was():
    assert gc.get_freeze_count() == 0
    with collecting_new_objects():
        assert gc.get_freeze_count() > 0  # what lived before is not looked at again
        node = _Node()
        node.itself, node.tensor = node, torch.zeros(4)  # a cycle, as a traceback's frames make one
        alive = weakref.ref(node)
        del node
        release_memory()
        assert alive() is None
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own frozen objects stay frozen
    try:
        frozen = gc.get_freeze_count()
        with collecting_new_objects():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
