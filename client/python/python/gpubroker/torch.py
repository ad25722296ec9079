"""PyTorch on broker leases: ``gpubroker.torch.install()`` before the first CUDA
allocation puts every CUDA allocation of the process into leases of its tenant.

How: the allocator's hooks (``gpubroker_torch_alloc``/``gpubroker_torch_free`` in the
native extension) serve memory from large segments, each one lease of this process's
session, carved by a caching sub-allocator in Rust (split, coalesce, stream-ordered reuse
through CUDA events). PyTorch reaches them through ``CUDAPluggableAllocator`` behind a
``MemPool`` that *every* thread and stream allocates from (``_cuda_beginAllocateToPool``
with a filter that accepts all streams; ``use_mem_pool`` would route only the calling
thread and leave autograd's backward threads outside), so PyTorch's own caching
allocator stays on top: most allocations never leave PyTorch, the rest come from a
segment without a broker call, and a new lease is taken only when the segments are full.

Over the tenant's quota an allocation fails at once; when the card is full, the hook
waits in the broker's queue (``GPU_BROKER_WAIT`` seconds, default 60) on a Rust thread
without the GIL; if no memory comes, PyTorch raises ``torch.OutOfMemoryError`` carrying the broker's reason. Reclaim
requests and revocations of a segment are handled in Rust too: a segment with no live
block is released at once, a busy one is drained (released when its last block is freed).

``memory_stats()`` reports the allocator (allocated, reserved = leased bytes, segments,
broker calls); PyTorch's own ``torch.cuda.memory_stats()`` keeps working (it describes
PyTorch's cache on top). ``empty_cache()`` gives PyTorch's unused cached blocks and then
every free segment back to the broker.

Not supported (refused with a clear error): CUDA graph capture (``torch.cuda.graph``,
``torch.compile(mode="reduce-overhead")``), and sharing CUDA tensors through
``torch.multiprocessing`` (share a lease instead). See ``docs/python.md``.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
from typing import Any, Dict, Iterable, List, Optional

from . import _native
from .errors import FailedPrecondition, InvalidArgument

__all__ = [
    "install",
    "installed",
    "empty_cache",
    "reuse_stream_blocks",
    "memory_stats",
    "session",
    "sleep",
    "wake",
    "asleep",
]

_lock = threading.Lock()
_state: Optional["_State"] = None


class _State:
    def __init__(self, session: Any, allocator: Any, pools: Dict[int, Any]):
        self.session = session
        self.allocator = allocator
        self.pools = pools


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise InvalidArgument(f"{name}={raw!r} is not a number", code="INVALID_ARGUMENT") from None


def installed() -> bool:
    """True once :func:`install` ran in this process."""
    return _state is not None


def session() -> Any:
    """The :class:`gpubroker.Session` the allocator takes its leases on."""
    if _state is None:
        raise FailedPrecondition("gpubroker.torch is not installed", code="FAILED_PRECONDITION")
    return _state.session


def install(
    session: Any = None,
    *,
    segment_size: Optional[int] = None,
    wait: Optional[float] = None,
    reclaimable: bool = False,
    devices: Optional[Iterable[int]] = None,
    oom_reason: bool = True,
    sleep_on_reclaim: bool = False,
    save_on_reclaim: bool = True,
) -> Any:
    """Routes every CUDA allocation of this process through broker leases.

    Call it before the first CUDA allocation (memory allocated earlier stays where it
    is, outside leases). Calling it again returns the same session.

    Args:
        session: the :class:`gpubroker.Session` to lease on; default: a new session of
            ``gpubroker.connect()`` named ``torch-<pid>``.
        segment_size: bytes per segment lease (default ``$GPU_BROKER_TORCH_SEGMENT`` or
            1 GiB); larger allocations get a segment of their own.
        wait: seconds an allocation may wait in the broker's queue when the card is full
            (over the tenant's quota it fails at once) (default ``$GPU_BROKER_WAIT`` or 60).
        reclaimable: take the segments as reclaimable leases (the broker may ask for
            them back; only free segments are given).
        devices: CUDA devices to route (default: all visible).
        oom_reason: raise ``torch.OutOfMemoryError`` with the broker's reason (from an
            out-of-memory observer); False leaves PyTorch's own message.
        sleep_on_reclaim: when the broker asks for a segment back (a reclaim request),
            put every segment to sleep by itself, as :func:`sleep` does (contents saved
            when ``save_on_reclaim``), so the reclaim completes without a handler of
            yours; implies ``reclaimable``. Tensors must not be touched while
            :func:`asleep`; :func:`wake` brings them back at the same addresses.
            For jobs that check :func:`asleep` between steps or sit idle between
            requests: a kernel that runs on a tensor after the sleep faults.
        save_on_reclaim: with ``sleep_on_reclaim``, keep the contents (host-tier
            leases) or not.

    Returns:
        The session.
    """
    global _state
    with _lock:
        if _state is not None:
            return _state.session
        try:
            import torch
        except ImportError:
            raise FailedPrecondition("PyTorch is not installed", code="FAILED_PRECONDITION") from None
        if not torch.cuda.is_available():
            raise FailedPrecondition("CUDA is not available to PyTorch", code="FAILED_PRECONDITION")
        for name in ("_cuda_beginAllocateToPool", "_cuda_endAllocateToPool", "_cuda_releasePool"):
            if not hasattr(torch._C, name):
                raise FailedPrecondition(
                    f"this PyTorch ({torch.__version__}) lacks torch._C.{name}; "
                    "gpubroker.torch needs PyTorch 2.8 or later",
                    code="FAILED_PRECONDITION",
                )
        if wait is None:
            wait = _env_number("GPU_BROKER_WAIT", 60.0)
        if segment_size is None:
            segment_size = int(_env_number("GPU_BROKER_TORCH_SEGMENT", float(1 << 30)))
        devs: List[int] = (
            list(range(torch.cuda.device_count())) if devices is None else [int(d) for d in devices]
        )
        if torch.cuda.is_initialized():
            for d in devs:
                if torch.cuda.memory_allocated(d) > 0:
                    warnings.warn(
                        f"gpubroker.torch.install(): {torch.cuda.memory_allocated(d)} bytes were "
                        f"allocated on cuda:{d} before; they stay outside the broker's leases",
                        stacklevel=2,
                    )
        if session is None:
            from . import connect

            session = connect().session(f"torch-{os.getpid()}")
        _native._torch_install(
            session,
            int(segment_size),
            float(wait),
            bool(reclaimable),
            bool(save_on_reclaim) if sleep_on_reclaim else None,
        )
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _native.__file__, "gpubroker_torch_alloc", "gpubroker_torch_free"
        )
        pools: Dict[int, Any] = {}
        for d in devs:
            with torch.cuda.device(d):
                pool = _new_pool(torch, allocator)
            # Every thread and every stream of device d allocates from the pool.
            torch._C._cuda_beginAllocateToPool(d, pool.id)
            pools[d] = pool
        if oom_reason:
            _attach_oom_reason(torch)
        _refuse_unsupported(torch)
        _state = _State(session, allocator, pools)
        atexit.register(_stop_routing)
        return session


def _stop_routing() -> None:
    """At exit: PyTorch destroys its pools, which it may do only while no routing is
    active (it asserts otherwise), so the routing ends first."""
    state = _state
    if state is None:
        return
    import torch

    for d, pool in state.pools.items():
        try:
            torch._C._cuda_endAllocateToPool(d, pool.id)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _new_pool(torch: Any, allocator: Any) -> Any:
    """A MemPool on the current device whose segments come from our hooks (PyTorch 2.8+
    takes the raw allocator; some releases took the CUDAPluggableAllocator itself)."""
    try:
        return torch.cuda.MemPool(allocator.allocator())
    except TypeError:
        return torch.cuda.MemPool(allocator)


def _attach_oom_reason(torch: Any) -> None:
    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        last = _native._torch_take_last_error()
        if last is None:
            return  # not a refusal of ours: PyTorch raises its own error
        err = torch.OutOfMemoryError(
            f"CUDA out of memory on cuda:{device}: tried to allocate {alloc} bytes and "
            f"the broker refused them: {last['error']}"
        )
        # The broker's machine-readable reason (e.g. "WAIT_EXPIRED" with cause
        # "QUOTA_EXCEEDED"), as on gpubroker's own exceptions; None for local failures.
        err.reason = last.get("reason")
        err.cause = last.get("cause")
        err.code = last.get("code")
        raise err

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(observer)


def _refuse_unsupported(torch: Any) -> None:
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is not None:

        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                "gpubroker.torch: CUDA graph capture is not supported while every CUDA "
                "allocation comes from broker leases (the capture's private pool would be "
                "bypassed and its memory reused). Run without CUDA graphs "
                '(torch.compile: any mode but "reduce-overhead").'
            )

        try:
            graph.capture_begin = capture_begin
        except (AttributeError, TypeError):
            pass
    try:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing.reductions as reductions
    except ImportError:
        return
    original = reductions.reduce_tensor
    original_storage = reductions.reduce_storage
    message = (
        "gpubroker.torch: CUDA tensors on broker leases cannot be shared through "
        "torch.multiprocessing (CUDA IPC of memory this process imported from the broker is "
        "not possible); take a lease in the other process, or send a CPU copy"
    )

    def reduce_tensor(tensor: Any) -> Any:
        if tensor.is_cuda:
            raise RuntimeError(message)
        return original(tensor)

    def reduce_storage(storage: Any) -> Any:
        if getattr(storage, "is_cuda", False):
            raise RuntimeError(message)
        return original_storage(storage)

    for cls in (torch.Tensor, torch.nn.parameter.Parameter):
        ForkingPickler.register(cls, reduce_tensor)
    ForkingPickler.register(torch.UntypedStorage, reduce_storage)


def empty_cache() -> int:
    """Gives memory back to the broker: PyTorch's unused cached blocks, then every
    segment with no live block. Returns the bytes of leases released."""
    state = _state
    if state is None:
        return 0
    import torch

    with _lock:
        old_pools = dict(state.pools)
        for d in old_pools:
            # PyTorch empties a pool (MemPool's destructor does) only while no pool routing
            # is active on the device (it asserts otherwise), so the routing pauses here:
            # allocations other threads make meanwhile go to PyTorch's default pool.
            with torch.cuda.device(d):
                state.pools[d] = _new_pool(torch, state.allocator)
            torch._C._cuda_endAllocateToPool(d, old_pools[d].id)
            torch._C._cuda_releasePool(d, old_pools[d].id)
        try:
            # The old pools become freeable: their cached free blocks go back to the hook.
            old_pools.clear()
            torch.cuda.empty_cache()
        finally:
            for d, pool in state.pools.items():
                torch._C._cuda_beginAllocateToPool(d, pool.id)
    return int(_native._torch_empty_cache())


def sleep(save: bool = True) -> int:
    """Gives every segment's device memory back to the broker while keeping its addresses:
    waits for the GPU (``torch.cuda.synchronize``), copies the contents to host-tier
    leases when ``save`` (charged under the tenant's host limit), unmaps, releases the
    leases. Tensors keep their pointers; do not touch them (or allocate: it fails) until
    :func:`wake`. Returns the device bytes given back."""
    if _state is None:
        raise FailedPrecondition("gpubroker.torch is not installed", code="FAILED_PRECONDITION")
    import torch

    torch.cuda.synchronize()
    return int(_native._torch_sleep(bool(save)))


def wake(wait: Optional[float] = None) -> int:
    """Gets memory again for every sleeping segment at the same addresses (waiting up to
    ``wait`` seconds for each in the broker's queue; ``None``: do not wait) and restores
    saved contents; tensors made before :func:`sleep` work again. Refused like a lease
    (``gpubroker.QuotaExceeded``, ``WaitTimeout``, ...); then what did not wake stays
    asleep and allocations keep failing: call again. Returns the bytes woken."""
    if _state is None:
        raise FailedPrecondition("gpubroker.torch is not installed", code="FAILED_PRECONDITION")
    return int(_native._torch_wake(None if wait is None else float(wait)))


def asleep() -> bool:
    """True between :func:`sleep` and a complete :func:`wake`."""
    return bool(_native._torch_asleep())


def reuse_stream_blocks() -> None:
    """Makes blocks that were used on more than one stream (``Tensor.record_stream``,
    side-stream copies) reusable again. PyTorch defers their end-of-use events while any
    pool routing is active, which under :func:`install` is always: without this call such
    blocks are never reused and PyTorch keeps asking for new segments. The routing pauses
    for the call (as in :func:`empty_cache`; other threads' allocations in that moment go
    to PyTorch's default pool, outside leases) and PyTorch waits for those blocks' streams
    to finish their work; then they are back in the pool. Cheap enough to call once per
    step of a loop that uses side streams; :func:`empty_cache` does it too."""
    state = _state
    if state is None:
        return
    import torch

    with _lock:
        for d, pool in state.pools.items():
            torch._C._cuda_endAllocateToPool(d, pool.id)
        try:
            # With no routing active, PyTorch records the deferred events, waits for them
            # and returns those blocks to their pool (ours stays in use, so its cached
            # blocks are kept); only its default pool's free blocks are released.
            torch.cuda.empty_cache()
        finally:
            for d, pool in state.pools.items():
                torch._C._cuda_beginAllocateToPool(d, pool.id)


def memory_stats() -> Dict[str, int]:
    """The allocator's figures: ``allocated_bytes`` (blocks PyTorch holds from segments),
    ``reserved_bytes`` = ``leased_bytes`` (segments held), peaks, ``segments``,
    ``draining_segments``, block counts, ``allocs``/``frees`` (hook calls),
    ``broker_calls`` (leases acquired and released), ``waits``, ``ooms``,
    ``reclaimed_segments``; plus ``torch_allocated_bytes``/``torch_reserved_bytes`` from
    PyTorch's cache on top (summed over the routed devices)."""
    stats: Dict[str, int] = dict(_native._torch_stats())
    state = _state
    if state is not None:
        import torch

        stats["torch_allocated_bytes"] = sum(torch.cuda.memory_allocated(d) for d in state.pools)
        stats["torch_reserved_bytes"] = sum(torch.cuda.memory_reserved(d) for d in state.pools)
    return stats
