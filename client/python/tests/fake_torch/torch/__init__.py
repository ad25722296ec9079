"""A stand-in for PyTorch with only what gpubroker.torch touches, recording the calls:
lets the tests drive install(), the pool routing, the OOM observer, empty_cache() and the
refusals on a machine without CUDA. The hooks themselves are the real native ones."""

import contextlib
import types

calls = []


class OutOfMemoryError(RuntimeError):
    pass


class dtype:  # noqa: N801 - mirrors torch.dtype
    pass


class Tensor:
    def __init__(self, is_cuda=False):
        self.is_cuda = is_cuda


class UntypedStorage:
    def __init__(self, is_cuda=False):
        self.is_cuda = is_cuda


__version__ = "0.0-fake"
_observers = []
_pools = {}


def _begin(device, pool_id):
    calls.append(("begin", device, pool_id))


def _end(device, pool_id):
    calls.append(("end", device, pool_id))


def _release(device, pool_id):
    calls.append(("release", device, pool_id))


_C = types.SimpleNamespace(
    _cuda_beginAllocateToPool=_begin,
    _cuda_endAllocateToPool=_end,
    _cuda_releasePool=_release,
    _cuda_attach_out_of_memory_observer=_observers.append,
)


class _PluggableAllocator:
    def __init__(self, path, alloc_name, free_name):
        import ctypes

        lib = ctypes.CDLL(path)
        self.alloc = getattr(lib, alloc_name)
        self.free = getattr(lib, free_name)
        self.alloc.restype = ctypes.c_void_p
        self.alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        calls.append(("allocator", path, alloc_name, free_name))

    def allocator(self):
        return self


class _MemPool:
    _next = 1

    def __init__(self, allocator=None):
        assert isinstance(allocator, _PluggableAllocator)
        self.id = (0, _MemPool._next)
        _MemPool._next += 1
        calls.append(("pool", self.id))

    def __del__(self):
        calls.append(("pool_deleted", self.id))


class _CUDAGraph:
    def capture_begin(self, *args, **kwargs):
        calls.append(("captured",))


@contextlib.contextmanager
def _device(d):
    yield


def _empty_cache():
    calls.append(("torch_empty_cache",))


cuda = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    is_initialized=lambda: False,
    memory_allocated=lambda d=0: 0,
    memory_reserved=lambda d=0: 0,
    device=_device,
    MemPool=_MemPool,
    CUDAGraph=_CUDAGraph,
    empty_cache=_empty_cache,
    memory=types.SimpleNamespace(CUDAPluggableAllocator=_PluggableAllocator),
)

nn = types.SimpleNamespace(parameter=types.SimpleNamespace(Parameter=type("Parameter", (Tensor,), {})))
