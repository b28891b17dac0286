"""FakeCuda: a named test double of the CUDA runtime, for CPU-only CI.

It replaces the `torch.cuda` functions autofit calls, and NVML (a `pynvml` module), with scripted
readings: cards with a name, a size, a compute capability and a PCI address; the bytes the caching
allocator holds; the memory of this process and of other processes as NVML reports it; the
per-process fraction. It records every call, and raises injected exceptions that carry the real
message texts (below, each with the upstream file that produces it).

It checks control flow and bookkeeping: which device autofit binds, which fraction it sets and
restores, what it recognises as an OOM, when it stops. It measures nothing: every figure in it is
scripted by the test that reads it back. Nothing here has run on a GPU.

    with FakeCuda([FakeGpu(total=80 * GiB)]) as cuda:
        cuda.reserved[0] = 2 * GiB
        ...
        assert ("set_per_process_memory_fraction", 0.25, 0) in cuda.calls
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import uuid
from typing import Any, Callable

import torch

from autofit.devices.memory import forget_baselines

GiB = 2**30

# -- the real message texts -------------------------------------------------------------------------
# c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc (TORCH_CHECK_WITH(OutOfMemoryError, ...))
ALLOCATOR_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                 "1.52 GiB is free. Including non-PyTorch memory, this process has 77.66 GiB memory in use. 20.00 GiB "
                 "allowed; Of the allocated memory 18.50 GiB is allocated by PyTorch, and 1.01 GiB is reserved by "
                 "PyTorch but unallocated.")
# aten/src/ATen/cuda/Exceptions.h AT_CUDNN_CHECK: "cuDNN error: " + cudnnGetErrorString(status); cuDNN 9 codes 4003/4004
CUDNN9_DEVICE = "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"
CUDNN9_HOST = "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"
# aten/src/ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK; CublasHandlePool.cpp createCublasHandle
CUBLAS_CREATE = "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"
# torch/csrc/distributed/c10d/NCCLUtils.hpp C10D_NCCL_CHECK + getNcclErrorDetailStr (NCCLUtils.cpp)
NCCL_OOM = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error "
            "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclUnhandledCudaError: Call to CUDA "
            "function failed.\nLast error:\nCuda failure 2 'out of memory'")
NCCL_CALLOC = ("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
               "\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
               "Failed to CUDA calloc 6291456 bytes")
NCCL_OTHER = ("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
              "\nncclUnhandledCudaError: Call to CUDA function failed.")
# c10/cuda/CUDAException.cpp c10_cuda_check_implementation + CUDAMiscFunctions.cpp get_cuda_async_error_suffix
_ASYNC = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
          "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")
DEVICE_ASSERT = "CUDA error: device-side assert triggered" + _ASYNC
ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered" + _ASYNC
# aten/src/ATen/cuda/CachingHostAllocator.cpp allocate_host_memory: C10_CUDA_CHECK(cudaHostAlloc(...))
PINNED_OOM = "CUDA error: out of memory\nFor more detailed error information, run with CUDA_LOG_FILE=stderr"
# c10/cuda/driver_api.h C10_CUDA_DRIVER_CHECK: cuMemHostAlloc / cuMemCreate failures
DRIVER_OOM = "CUDA driver error: out of memory"


def accelerator_error(message: str) -> RuntimeError:
    """The exception C10_CUDA_CHECK raises: `torch.AcceleratorError` (a RuntimeError) where torch has it."""
    return getattr(torch, "AcceleratorError", RuntimeError)(message)


def nccl_error(message: str) -> RuntimeError:
    """The exception C10D_NCCL_CHECK raises: `torch.distributed.DistBackendError`."""
    return torch.distributed.DistBackendError(message)


@dataclasses.dataclass
class FakeGpu:
    """One scripted card. `foreign` is what other processes hold on it (bytes); `pci` its bus address."""

    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GiB
    capability: tuple[int, int] = (9, 0)
    pci: tuple[int, int, int] = (0, 0x18, 0)
    foreign: int = 0
    context: int = 512 * 2**20  # this process's CUDA context, once it exists

    @property
    def bus_id(self) -> str:
        """NVML's PCI bus id text, NVML_DEVICE_PCI_BUS_ID_FMT = "%08X:%02X:%02X.0" (pynvml.py)."""
        return "%08X:%02X:%02X.0" % self.pci


class FakeCuda:
    """The double: a context manager that patches `torch.cuda` and installs a fake `pynvml`.

    Scripted state (read and written by tests): `reserved[i]`, `max_reserved[i]`, `allocated[i]`,
    `max_allocated[i]`, `outside[i]` (this process's memory outside the allocator, context excluded), `fraction[i]`,
    `current`, `nvml_sees_pid` (False: a container whose PIDs NVML does not translate), `nvml`
    (False: nvidia-ml-py not installed), `context_made` (whether this process has a context),
    `allocator_settings` (what `torch._C._accelerator_setAllocatorSettings` was last given, as
    PYTORCH_CUDA_ALLOC_CONF would say it).
    `calls` records (name, *args). `fail(name, exc, sticky=False)` makes the next call (every call,
    when sticky) of `name` raise `exc`.
    """

    def __init__(self, gpus: list[FakeGpu] | None = None, *, nvml: bool = True, nvml_sees_pid: bool = True):
        self.gpus = gpus or [FakeGpu()]
        n = len(self.gpus)
        self.reserved, self.max_reserved, self.allocated, self.outside = [0] * n, [0] * n, [0] * n, [0] * n
        self.max_allocated = [0] * n
        self.fraction = [1.0] * n
        self.current = 0
        self.nvml, self.nvml_sees_pid = nvml, nvml_sees_pid
        self.context_made = True
        self.allocator_settings = ""
        self.calls: list[tuple] = []
        self._failures: dict[str, tuple[BaseException, bool]] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    # -- scripting ---------------------------------------------------------------------------------
    def fail(self, name: str, exc: BaseException, sticky: bool = False) -> None:
        """The next call of `name` raises `exc`; every later call too when `sticky` (a poisoned context)."""
        self._failures[name] = (exc, sticky)

    def used_by_this_process(self, index: int) -> int:
        """What NVML reports for this pid on card `index`: context + allocator + outside it."""
        if not self.context_made:
            return 0
        return self.gpus[index].context + self.reserved[index] + self.outside[index]

    def device_used(self, index: int) -> int:
        """Device-wide used bytes (every process), as cudaMemGetInfo and nvmlDeviceGetMemoryInfo see them."""
        return self.gpus[index].foreign + self.used_by_this_process(index)

    def physical(self, index: int) -> int:
        """The card `cuda:index` is in this process, through CUDA_VISIBLE_DEVICES as it is now."""
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        return int(listed.split(",")[index]) if listed else index

    # -- the patched functions -----------------------------------------------------------------------
    def _index(self, device: Any = None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.current if device.index is None else device.index

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        failure = self._failures.get(name)
        if failure is not None:
            exc, sticky = failure
            if not sticky:
                del self._failures[name]
            raise exc

    def _functions(self) -> dict[str, Callable]:
        def props(device=None):
            self._call("get_device_properties", self._index(device))
            gpu = self.gpus[self._index(device)]
            return types.SimpleNamespace(name=gpu.name, total_memory=gpu.total, major=gpu.capability[0],
                                         minor=gpu.capability[1], pci_domain_id=gpu.pci[0], pci_bus_id=gpu.pci[1],
                                         pci_device_id=gpu.pci[2], uuid=uuid.UUID(int=self._index(device)))

        def set_fraction(fraction, device=None):
            if not isinstance(fraction, float):  # torch/cuda/memory.py set_per_process_memory_fraction
                raise TypeError("Invalid type for fraction argument, must be `float`")
            if not 0 <= fraction <= 1:
                raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
            self._call("set_per_process_memory_fraction", round(fraction, 6), self._index(device))
            self.fraction[self._index(device)] = fraction

        def mem_get_info(device=None):
            i = self._index(device)
            self._call("mem_get_info", i)
            self.context_made = True  # cudaMemGetInfo makes a context (torch/csrc/cuda/shared/cudart.cpp)
            return self.gpus[i].total - self.device_used(i), self.gpus[i].total

        def get_fraction(device=None):  # torch/cuda/memory.py: `_get_device_index(device)`, not optional
            if device is None or (not isinstance(device, int) and torch.device(device).index is None):
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            self._call("get_per_process_memory_fraction", self._index(device))
            return self.fraction[self._index(device)]

        def recorded(name, value):
            def function(device=None):
                self._call(name, self._index(device))
                return value(self._index(device))
            return function

        def set_device(device):
            self._call("set_device", self._index(device), self.physical(self._index(device)))
            self.current = self._index(device)
            self.context_made = True  # cudaSetDevice makes the primary context (CUDA 12)

        def reset_peak(device=None):
            self._call("reset_peak_memory_stats", self._index(device))
            self.max_reserved[self._index(device)] = self.reserved[self._index(device)]
            self.max_allocated[self._index(device)] = self.allocated[self._index(device)]

        return {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: len(self.gpus),
            "current_device": lambda: self.current,
            "set_device": set_device,
            "get_device_capability": lambda device=None: self.gpus[self._index(device)].capability,
            "get_device_properties": props,
            "get_device_name": lambda device=None: self.gpus[self._index(device)].name,
            "mem_get_info": mem_get_info,
            "memory_reserved": recorded("memory_reserved", lambda i: self.reserved[i]),
            "max_memory_reserved": recorded("max_memory_reserved",
                                            lambda i: max(self.max_reserved[i], self.reserved[i])),
            "memory_allocated": recorded("memory_allocated", lambda i: self.allocated[i]),
            "max_memory_allocated": recorded("max_memory_allocated",
                                             lambda i: max(self.max_allocated[i], self.allocated[i])),
            "memory_stats": recorded("memory_stats", lambda i: {"reserved_bytes.all.current": self.reserved[i],
                                                                "allocated_bytes.all.current": self.allocated[i]}),
            "set_per_process_memory_fraction": set_fraction,
            "get_per_process_memory_fraction": get_fraction,
            "synchronize": recorded("synchronize", lambda i: None),
            "empty_cache": lambda: self._call("empty_cache"),
            "reset_peak_memory_stats": reset_peak,
        }

    def _set_allocator_settings(self, settings: str) -> None:
        self._call("set_allocator_settings", settings)
        self.allocator_settings = settings

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def __enter__(self) -> "FakeCuda":
        forget_baselines()
        for name, function in self._functions().items():
            self._patch(torch.cuda, name, function)
        self._patch(torch._C, "_cuda_clearCublasWorkspaces", lambda: self._call("clear_cublas_workspaces"))
        self._patch(torch._C, "_accelerator_setAllocatorSettings", self._set_allocator_settings)
        self._saved.append((sys.modules, "pynvml", sys.modules.get("pynvml", _MISSING)))
        if self.nvml:
            sys.modules["pynvml"] = _fake_nvml(self)
        else:
            sys.modules["pynvml"] = None  # type: ignore[assignment]  # import raises ImportError
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for owner, name, value in reversed(self._saved):
            if owner is sys.modules:
                if value is _MISSING:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = value
            elif value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
        forget_baselines()


_MISSING = object()


def _fake_nvml(cuda: FakeCuda) -> types.ModuleType:
    """A `pynvml` module answering from `cuda`'s script (the calls nvidia-ml-py 13 offers, pynvml.py)."""
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def handle(bus_id: str) -> int:
        cuda.calls.append(("nvmlDeviceGetHandleByPciBusId", bus_id))
        for index, gpu in enumerate(cuda.gpus):
            if gpu.bus_id == bus_id:
                return index
        raise NVMLError("Not Found")

    def processes(index: int) -> list:
        cuda.calls.append(("nvmlDeviceGetComputeRunningProcesses", index))
        found = []
        if cuda.gpus[index].foreign:
            found.append(types.SimpleNamespace(pid=1, usedGpuMemory=cuda.gpus[index].foreign))
        if cuda.context_made:
            # In a container NVML reports host PIDs (NVIDIA/nvidia-docker#1483): this pid is not among them.
            pid = os.getpid() if cuda.nvml_sees_pid else 4_000_000
            found.append(types.SimpleNamespace(pid=pid, usedGpuMemory=cuda.used_by_this_process(index)))
        return found

    def memory(index: int) -> Any:
        cuda.calls.append(("nvmlDeviceGetMemoryInfo", index))
        used = cuda.device_used(index)
        return types.SimpleNamespace(total=cuda.gpus[index].total, used=used, free=cuda.gpus[index].total - used)

    module.NVMLError = NVMLError
    module.nvmlInit = lambda: cuda.calls.append(("nvmlInit",))
    module.nvmlDeviceGetHandleByPciBusId = handle
    module.nvmlDeviceGetComputeRunningProcesses = processes
    module.nvmlDeviceGetMemoryInfo = memory
    return module


class OnFakeCuda(torch.Tensor):
    """A CPU tensor that reports `cuda:0`: stands in for a user's tensor already on the card. Every op
    runs on the CPU data and stays "on the card", except a copy to the CPU, which is a plain tensor."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        tensor = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=torch.device("cuda", 0),
                                                     requires_grad=requires_grad)
        tensor.payload = data
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map_only

        kwargs = kwargs or {}
        plain_args, plain_kwargs = tree_map_only(OnFakeCuda, lambda t: t.payload, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return out
        return tree_map_only(torch.Tensor, OnFakeCuda, out)


def on_fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every parameter and buffer an `OnFakeCuda` tensor (tied weights stay tied)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                if id(param) not in seen:
                    seen[id(param)] = torch.nn.Parameter(OnFakeCuda(param.detach()), param.requires_grad)
                sub._parameters[name] = seen[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = OnFakeCuda(buffer)
    return module
