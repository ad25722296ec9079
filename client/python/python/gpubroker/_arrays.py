"""Zero-copy views of mapped leases: numpy arrays over host memory
(``__array_interface__``), torch tensors and CuPy arrays over device memory
(``__cuda_array_interface__``). Each view keeps a :class:`gpubroker.Memory` alive, which
keeps the lease mapped and unreleased until the view is gone."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

from .errors import FailedPrecondition, InvalidArgument

Shape = Union[int, Sequence[int], None]


def _shape(nbytes: int, itemsize: int, shape: Shape) -> Tuple[int, ...]:
    if shape is None:
        return (nbytes // itemsize,)
    if isinstance(shape, int):
        shape = (shape,)
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"negative dimension in shape {dims}", code="INVALID_ARGUMENT")
    need = math.prod(dims) * itemsize
    if need > nbytes:
        raise InvalidArgument(
            f"shape {dims} of {itemsize}-byte elements needs {need} bytes; the lease has {nbytes}",
            code="INVALID_ARGUMENT",
        )
    return dims


def _missing(module: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"{module} is not installed in this environment (pip install {module})",
        code="FAILED_PRECONDITION",
    )


class _HostView:
    """Exposes host memory through the numpy array interface."""

    def __init__(self, memory: Any, shape: Tuple[int, ...], typestr: str):
        self._memory = memory
        self.__array_interface__ = {
            "version": 3,
            "data": (memory.ptr, False),
            "shape": shape,
            "typestr": typestr,
        }


class _CudaView:
    """Exposes device memory through the CUDA array interface (no stream to wait on)."""

    def __init__(self, memory: Any, shape: Tuple[int, ...], typestr: str):
        self._memory = memory
        self.__cuda_array_interface__ = {
            "version": 3,
            "data": (memory.ptr, False),
            "shape": shape,
            "typestr": typestr,
            "strides": None,
            "stream": None,
        }


def as_numpy(lease: Any, dtype: Any = None, shape: Shape = None) -> Any:
    try:
        import numpy as np
    except ImportError:
        raise _missing("numpy") from None
    dt = np.dtype("uint8" if dtype is None else dtype)
    memory = lease._host_memory()
    dims = _shape(memory.nbytes, dt.itemsize, shape)
    return np.asarray(_HostView(memory, dims, dt.str))


def _torch_dtype(torch: Any, dtype: Any) -> Any:
    if dtype is None:
        return torch.uint8
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise InvalidArgument(f"not a torch dtype: {dtype!r}", code="INVALID_ARGUMENT")


def as_torch(lease: Any, dtype: Any = None, shape: Shape = None) -> Any:
    try:
        import torch
    except ImportError:
        raise _missing("torch") from None
    dt = _torch_dtype(torch, dtype)
    itemsize = torch.empty((), dtype=dt).element_size()
    dims = _shape(lease.nbytes, itemsize, shape)
    count = math.prod(dims)
    if lease._memory_kind() == "host":
        if lease.tier == "host" and torch.cuda.is_available():
            lease._cuda_memory()  # page-locked and mapped for the GPU while the lease is mapped
        raw = torch.from_numpy(as_numpy(lease, "uint8", (count * itemsize,)))
    else:
        memory = lease._cuda_memory()
        raw = torch.as_tensor(
            _CudaView(memory, (count * itemsize,), "|u1"), device=f"cuda:{memory.device}"
        )
    return raw.view(dt).view(dims)


def as_cupy(lease: Any, dtype: Any = None, shape: Shape = None) -> Any:
    try:
        import cupy
    except ImportError:
        raise _missing("cupy") from None
    dt = cupy.dtype("uint8" if dtype is None else dtype)
    memory = lease._cuda_memory()
    dims = _shape(memory.nbytes, dt.itemsize, shape)
    with cupy.cuda.Device(memory.device):
        return cupy.asarray(_CudaView(memory, dims, dt.str))
