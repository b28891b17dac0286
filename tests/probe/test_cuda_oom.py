"""OOM kinds and sticky CUDA errors in the CUDA test double: the exceptions carry the real message texts
(tests/cuda_double.py names the upstream file of each); the double decides whether the context
still works."""

import pytest
import torch
from cuda_double import (ALLOCATOR_OOM, CUBLAS_CREATE, CUDNN9_DEVICE, CUDNN9_HOST, DEVICE_ASSERT, DRIVER_OOM,
                         ILLEGAL_ADDRESS, NCCL_CALLOC, NCCL_OOM, NCCL_OTHER, PINNED_OOM, FakeCuda, accelerator_error,
                         nccl_error)
from torch import nn

from autofit import Config
from autofit.errors import CudaContextBroken
from autofit.probe.oom import classify_oom
from autofit.probe.run import run_probe
from autofit.job.train_spec import make_spec
from autofit.strategies import MicroBatch


@pytest.mark.parametrize("exc, kind", [
    (torch.OutOfMemoryError(ALLOCATOR_OOM), "cuda-allocator"),
    (RuntimeError(CUDNN9_DEVICE), "cudnn"),
    (RuntimeError(CUDNN9_HOST), "cudnn-host"),
    (nccl_error(NCCL_OOM), "nccl"),
    (nccl_error(NCCL_CALLOC), "nccl"),
    (accelerator_error(PINNED_OOM), "cuda-runtime"),
    (RuntimeError("Caught RuntimeError in pin memory thread for device 0.\nOriginal Traceback (most recent call "
                  f"last):\n...\nRuntimeError: {PINNED_OOM}"), "host-pinned"),
    (RuntimeError(DRIVER_OOM), "cuda-driver"),
])
def test_todays_oom_texts_are_recognised(exc, kind):
    # Defect 5: cuDNN 9, NCCL, pinned host and driver-API allocation failures were errors, not OOMs.
    with FakeCuda():
        assert classify_oom(exc) == kind


def test_nccl_errors_that_name_no_memory_are_not_oom():
    with FakeCuda():
        assert classify_oom(nccl_error(NCCL_OTHER)) is None


def test_cublas_handle_creation_is_an_oom_only_while_the_context_works():
    with FakeCuda():
        assert classify_oom(accelerator_error(CUBLAS_CREATE)) == "cublas"
    with FakeCuda() as cuda:  # the same text after an earlier device-side assert: the context is gone
        cuda.fail("synchronize", accelerator_error(DEVICE_ASSERT), sticky=True)
        assert classify_oom(accelerator_error(CUBLAS_CREATE)) is None


def test_sticky_errors_are_never_oom():
    for text in (DEVICE_ASSERT, ILLEGAL_ADDRESS):
        assert classify_oom(accelerator_error(text)) is None


class OutOfRangeIds(nn.Module):
    """Stands in for an embedding lookup with ids past the vocabulary: on a card, a device-side assert."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x):
        raise accelerator_error(DEVICE_ASSERT)


def _batch(n):
    return torch.randn(n, 4)


def test_a_sticky_error_stops_the_search_naming_the_candidate_and_the_cause():
    # Defect 9: the error surfaced again from synchronize/empty_cache after the probe and escaped raw;
    # every later in-process probe would have failed the same way.
    spec = make_spec(OutOfRangeIds, _batch, device="cpu", global_batch_size=2, loss_fn=lambda out, b: out.sum())
    config = Config(micro_batch_size=2)
    with FakeCuda() as cuda:
        cuda.fail("synchronize", accelerator_error(DEVICE_ASSERT), sticky=True)
        with pytest.raises(CudaContextBroken) as info:
            run_probe(spec, config, [MicroBatch()])
    message = str(info.value)
    assert config.describe() in message and "device-side assert triggered" in message
    assert "token ids" in message  # the likely cause, and how to find it


def test_a_sticky_error_found_only_at_the_next_synchronize_stops_the_search_too():
    spec = make_spec(nn.Linear(4, 1), _batch, device="cpu", global_batch_size=2, loss_fn=lambda out, b: out.sum())
    with FakeCuda() as cuda:
        cuda.fail("synchronize", accelerator_error(ILLEGAL_ADDRESS), sticky=True)
        with pytest.raises(CudaContextBroken, match="illegal memory access"):
            run_probe(spec, Config(micro_batch_size=2), [MicroBatch()])
