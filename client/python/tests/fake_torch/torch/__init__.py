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
        self.requires_grad = False
        self.is_leaf = True

    def untyped_storage(self):
        return UntypedStorage(self.is_cuda)

    def record_stream(self, stream):
        calls.append(("record_stream", stream))


class UntypedStorage:
    def __init__(self, is_cuda=False):
        self.is_cuda = is_cuda

    def data_ptr(self):
        return 0x7000_0000

    def nbytes(self):
        return 4096


__version__ = "0.0-fake"
_observers = []
_pools = {}


def _begin(device, pool_id):
    calls.append(("begin", device, pool_id))


def _end(device, pool_id):
    calls.append(("end", device, pool_id))


def _release(device, pool_id):
    calls.append(("release", device, pool_id))


def _graph_pool_handle():
    return (99, 0)


def _begin_thread(device, pool_id):
    calls.append(("begin_thread", device, pool_id))


_C = types.SimpleNamespace(
    _cuda_beginAllocateToPool=_begin,
    _cuda_beginAllocateCurrentThreadToPool=_begin_thread,
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
    def capture_begin(self, pool=None, capture_error_mode="global"):
        calls.append(("capture_begin", pool))

    def capture_end(self):
        calls.append(("capture_end",))



@contextlib.contextmanager
def _device(d):
    yield


def _empty_cache():
    calls.append(("torch_empty_cache",))


@contextlib.contextmanager
def _use_mem_pool(pool):
    # As PyTorch's: the begin function from torch.cuda.memory's own globals.
    cuda.memory._cuda_beginAllocateCurrentThreadToPool(0, pool.id)
    try:
        yield
    finally:
        cuda.memory._cuda_endAllocateToPool(0, pool.id)
        _release(0, pool.id)


cuda = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    is_initialized=lambda: False,
    memory_allocated=lambda d=0: 0,
    memory_reserved=lambda d=0: 0,
    device=_device,
    MemPool=_MemPool,
    CUDAGraph=_CUDAGraph,
    graph_pool_handle=_graph_pool_handle,
    graphs=types.SimpleNamespace(graph_pool_handle=_graph_pool_handle),
    current_device=lambda: 0,
    is_current_stream_capturing=lambda: False,
    empty_cache=_empty_cache,
    use_mem_pool=_use_mem_pool,
    synchronize=lambda device=None: calls.append(("synchronize",)),
    memory=types.SimpleNamespace(
        CUDAPluggableAllocator=_PluggableAllocator,
        _cuda_beginAllocateCurrentThreadToPool=_begin_thread,
        _cuda_endAllocateToPool=_end,
    ),
)

nn = types.SimpleNamespace(parameter=types.SimpleNamespace(Parameter=type("Parameter", (Tensor,), {})))
