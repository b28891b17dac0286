"""CudaBudget in the CUDA test double (tests/cuda_double.py): which fraction it sets, what it
charges to this process, and what it restores. The double scripts every reading; nothing is measured."""

import pytest
import torch
from cuda_double import GiB, FakeCuda, FakeGpu

from autofit.devices.memory import CudaBudget, accounting, foreign_memory, note_baseline, outside_allocator
from autofit.probe.oom import release_memory

CUDA0 = torch.device("cuda", 0)


def _fraction_set(cuda):
    return [c for c in cuda.calls if c[0] == "set_per_process_memory_fraction"]


def test_other_processes_on_a_shared_card_do_not_shrink_the_budget():
    # Defect 1: 60 GiB held by another job, a 20 GiB budget on an 80 GiB card. Device-wide accounting
    # (mem_get_info) left the allocator nothing; this process's own use (NVML) leaves 20 GiB - context.
    with FakeCuda([FakeGpu(total=80 * GiB, foreign=60 * GiB, context=GiB // 2)]) as cuda:
        cuda.reserved[0] = 0
        with CudaBudget(20 * GiB, CUDA0):
            pass
        assert _fraction_set(cuda)[0] == ("set_per_process_memory_fraction", round(19.5 / 80, 6), 0)
        assert outside_allocator(CUDA0) == GiB // 2  # the context, nothing of the other job
        assert foreign_memory(CUDA0) == 60 * GiB
        assert accounting(CUDA0) == "this process's own memory (NVML)"


def test_a_child_charges_its_own_context_not_its_parents_when_nvml_cannot_see_its_pid():
    # Defect 1, containers: NVML lists host PIDs only. The child took the device-wide reading before its
    # context existed (the launcher does, `note_baseline`), so what it adds is its own, context included.
    gpu = FakeGpu(total=80 * GiB, foreign=3 * GiB, context=GiB // 2)  # 3 GiB: the parent's context and tensors
    with FakeCuda([gpu], nvml_sees_pid=False) as cuda:
        cuda.context_made = False
        note_baseline(CUDA0, cuda.device_used(0))
        cuda.context_made = True
        cuda.reserved[0] = 4 * GiB
        cuda.outside[0] = GiB
        assert outside_allocator(CUDA0) == GiB + GiB // 2
        assert "before this process's CUDA context" in accounting(CUDA0)
        assert foreign_memory(CUDA0) is None  # NVML cannot tell this pid from the others


def test_without_nvml_only_growth_after_the_first_reading_is_charged_and_the_summary_says_so():
    with FakeCuda([FakeGpu(foreign=10 * GiB)], nvml=False) as cuda:
        cuda.reserved[0] = GiB
        assert outside_allocator(CUDA0) == 0  # the first reading is the baseline: the other job is not charged
        cuda.outside[0] = 256 * 2**20  # e.g. NCCL buffers made by this process since
        assert outside_allocator(CUDA0) == 256 * 2**20
        assert "pip install 'autofit[gpu]'" in accounting(CUDA0)


def test_the_fraction_in_force_before_is_restored():
    # Defect 18: a user's own cap (0.5) came back as 1.0.
    with FakeCuda() as cuda:
        cuda.fraction[0] = 0.5
        with CudaBudget(10 * GiB, CUDA0):
            assert cuda.fraction[0] < 0.5
        assert cuda.fraction[0] == 0.5
        with CudaBudget(None, CUDA0):  # no limit: the fraction is not touched at all
            pass
        assert cuda.fraction[0] == 0.5 and len(_fraction_set(cuda)) == 2


def test_the_fraction_is_restored_when_the_probe_fails():
    with FakeCuda() as cuda:
        with pytest.raises(torch.OutOfMemoryError):
            with CudaBudget(10 * GiB, CUDA0):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        assert cuda.fraction[0] == 1.0


def test_peak_is_the_allocator_peak_plus_this_process_outside_it():
    with FakeCuda([FakeGpu(foreign=5 * GiB, context=GiB // 2)]) as cuda:
        with CudaBudget(20 * GiB, CUDA0) as budget:
            cuda.max_reserved[0] = 8 * GiB
        assert budget.peak == 8 * GiB + GiB // 2


def test_a_context_grown_in_the_first_step_brings_the_share_down_and_the_peak_counts_again():
    # Seen on an H200 (bench/results/fit-threshold-cuda-h200-2026-11-27-share-on-entry.json): in fresh child processes the
    # context grew during the first step, the share set on entry stayed, and allocator + context passed
    # every budget below the roomy peak: 6,276 MiB measured under budgets of 6,147 to 6,243 MiB.
    with FakeCuda([FakeGpu(total=80 * GiB, context=GiB // 2)]) as cuda:
        with CudaBudget(10 * GiB, CUDA0) as budget:
            assert _fraction_set(cuda)[-1] == ("set_per_process_memory_fraction", round(9.5 / 80, 6), 0)
            cuda.allocated[0], cuda.max_allocated[0], cuda.max_reserved[0] = 5 * GiB, 8 * GiB, 9.4 * GiB
            cuda.outside[0] = GiB // 4  # cuBLAS handles, kernels loaded at first use
            before = len(cuda.calls)
            budget.after_step()
            assert _fraction_set(cuda)[-1] == ("set_per_process_memory_fraction", round(9.25 / 80, 6), 0)
            names = [c[0] for c in cuda.calls[before:]]
            assert names[-2:] == ["empty_cache", "reset_peak_memory_stats"]
            cuda.max_reserved[0] = 7 * GiB  # the steady steps under the new share
            budget.after_step()  # nothing grew: nothing changes
            assert len(_fraction_set(cuda)) == 2
        # the steady steps' reservation is under the allocated peak before the reset: that is the floor
        assert budget.peak == 8 * GiB + GiB // 2 + GiB // 4


def test_a_grown_context_that_leaves_the_reservation_under_the_share_keeps_the_peak():
    with FakeCuda([FakeGpu(total=80 * GiB, context=GiB // 2)]) as cuda:
        with CudaBudget(10 * GiB, CUDA0) as budget:
            cuda.max_reserved[0] = 6 * GiB
            cuda.outside[0] = GiB // 4
            before = len(cuda.calls)
            budget.after_step()
            assert cuda.fraction[0] == 9.25 * GiB / (80 * GiB)
            assert not {"empty_cache", "reset_peak_memory_stats"} & {c[0] for c in cuda.calls[before:]}
        assert budget.peak == 6 * GiB + GiB // 2 + GiB // 4


def test_release_memory_clears_the_cublas_workspaces_too():
    # Defect 8: cuBLAS workspaces come from the caching allocator (CublasHandlePool.cpp getNewWorkspace)
    # and stay allocated until cleared, so memory never returned to its baseline after a probe.
    with FakeCuda() as cuda:
        release_memory()
        names = [c[0] for c in cuda.calls]
        assert names.index("clear_cublas_workspaces") < names.index("empty_cache")


def test_a_budget_on_a_bare_cuda_device_uses_the_current_index():
    # Seen on an H100 (torch 2.11): `get_per_process_memory_fraction(torch.device("cuda"))` raises, so the
    # OOM guard's `CudaBudget(limit, torch.device("cuda"))` failed on entry. The double refuses it as torch does.
    with FakeCuda([FakeGpu(total=80 * GiB), FakeGpu(total=80 * GiB)]) as cuda:
        cuda.current = 1
        with CudaBudget(20 * GiB, torch.device("cuda")) as budget:
            assert budget.device == torch.device("cuda", 1)
        assert ("get_per_process_memory_fraction", 1) in cuda.calls and _fraction_set(cuda)[-1][2] == 1
