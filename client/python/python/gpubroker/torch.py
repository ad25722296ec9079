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

CUDA graphs (``torch.cuda.graph``, ``make_graphed_callables``,
``torch.compile(mode="reduce-overhead")``) capture into a private pool of their own whose
segments come from the same leases (counted against the quota); a capture's routing is put
in front of the all-streams one, so the graph's memory stays its own for replays. A freed
graph's memory goes back with ``empty_cache()``.

Blocks used on several streams (``record_stream``, NCCL) are returned to PyTorch's pool
by a short pause of the routing that the hook asks the main thread for (a pending call),
so nobody has to call :func:`reuse_stream_blocks`.

CUDA tensors sent through ``torch.multiprocessing`` to another process of the same
tenant travel as a publication of their segment's lease, which the receiver imports
through the broker and maps. See ``docs/python.md``.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

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
    def __init__(self, session: Any, allocator: Any, pools: Dict[int, Any], torch: Any):
        self.session = session
        self.allocator = allocator
        self.pools = pools
        # PyTorch's own routing calls, kept before install() wraps the public names.
        self.begin = torch._C._cuda_beginAllocateToPool
        self.end = torch._C._cuda_endAllocateToPool
        self.release = torch._C._cuda_releasePool
        # CUDA graphs' pools on our allocator, by pool id; ids of graphs freed since.
        self.graph_pools: Dict[Tuple[int, int], Any] = {}
        self.dead_graph_pools: List[Tuple[int, int]] = []
        # Captures under way in this process (no pause of the routing during one).
        self.capturing = 0
        # Per device: routings of others (captures, pools) under way, ours stepped aside.
        self.aside: Dict[int, int] = {}
        # Bytes of tensors recorded on other streams since the last return of such blocks.
        self.recorded_bytes = 0


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
    retain: Optional[int] = None,
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
        oom_reason: ``torch.OutOfMemoryError`` carries the broker's reason (its
            constructor appends it); False leaves PyTorch's own message.
        sleep_on_reclaim: when the broker asks for a segment back (a reclaim request),
            put every segment to sleep by itself, as :func:`sleep` does (contents saved
            when ``save_on_reclaim``), so the reclaim completes without a handler of
            yours; implies ``reclaimable``. Tensors must not be touched while
            :func:`asleep`; :func:`wake` brings them back at the same addresses.
            For jobs that check :func:`asleep` between steps or sit idle between
            requests: a kernel that runs on a tensor after the sleep faults.
        save_on_reclaim: with ``sleep_on_reclaim``, keep the contents (host-tier
            leases) or not.
        retain: bytes of released free segments (:func:`empty_cache`) kept mapped in
            this process, held for it by the broker (``Session.retain_mappings``): the next
            segment of a released size is that block again, one call to the broker and no
            import, at the address it had. They stay counted to the tenant until let go:
            when the broker asks (others wait), when a segment is refused (they are let
            go and it is asked again), on :func:`sleep`, or ``session().drop_retained()``.
            Default ``$GPU_BROKER_TORCH_RETAIN`` or one segment; 0 turns it off.

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
        if retain is None:
            retain = int(_env_number("GPU_BROKER_TORCH_RETAIN", float(segment_size)))
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
            max(0, int(retain)),
        )
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _native.__file__, "gpubroker_torch_alloc", "gpubroker_torch_free"
        )
        state = _State(session, allocator, {}, torch)
        for d in devs:
            with torch.cuda.device(d):
                pool = _new_pool(torch, allocator)
            # Every thread and every stream of device d allocates from the pool.
            state.begin(d, pool.id)
            state.pools[d] = pool
        if oom_reason:
            _attach_oom_reason(torch)
        _refuse_unsupported(torch)
        _route_graphs(torch, state)
        # Least seconds between two automatic returns of multi-stream blocks. 0: one per
        # burst of hook calls (the main thread runs one pending call however many were
        # asked for meanwhile), which keeps a loop that frees a side-stream block per step
        # from growing.
        _native._torch_set_stream_block_flush(
            _reuse_stream_blocks_soon, _env_number("GPU_BROKER_STREAM_FLUSH", 0.0)
        )
        _route_record_stream(
            torch, state, int(_env_number("GPU_BROKER_STREAM_RECORD_FLUSH", float(64 << 20)))
        )
        _state = state
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
            state.end(d, pool.id)
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
    """`torch.OutOfMemoryError`s carry the broker's refusal: PyTorch raises its own error
    when the hook returns null, and the error's constructor (patched here) appends the
    refusal the allocator kept and sets `.reason`, `.cause`, `.code`. Not an
    out-of-memory observer that raises: its exception would not be the C++ out-of-memory
    error that cuDNN catches to retry a smaller workspace, so its probes would fail."""
    cls = torch.OutOfMemoryError
    original_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        last = _native._torch_take_last_error()
        if last is None:
            return  # not a refusal of ours: PyTorch's own error stands
        text = str(args[0]) if args else "CUDA out of memory"
        self.args = (f"{text}\ngpubroker could not lease the memory: {last['error']}",) + tuple(args[1:])
        # The broker's machine-readable reason (e.g. "WAIT_EXPIRED" with cause
        # "CAPACITY_EXHAUSTED"), as on gpubroker's own exceptions; None for local failures.
        self.reason = last.get("reason")
        self.cause = last.get("cause")
        self.code = last.get("code")

    try:
        cls.reason = None
        cls.cause = None
        cls.code = None
        cls.__init__ = __init__
        return
    except (TypeError, AttributeError):
        pass  # an immutable type: raise from an observer instead (cuDNN probes then fail)

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        last = _native._torch_take_last_error()
        if last is None:
            return
        err = torch.OutOfMemoryError(
            f"CUDA out of memory on cuda:{device}: tried to allocate {alloc} bytes and "
            f"gpubroker could not lease them: {last['error']}"
        )
        err.reason = last.get("reason")
        err.cause = last.get("cause")
        err.code = last.get("code")
        raise err

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(observer)


def _refuse_unsupported(torch: Any) -> None:
    """torch.multiprocessing of CUDA tensors: through the broker instead of CUDA IPC (which
    cannot re-export memory this process imported)."""
    try:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing.reductions as reductions
    except ImportError:
        return
    original = reductions.reduce_tensor
    original_storage = reductions.reduce_storage

    def reduce_tensor(tensor: Any) -> Any:
        if not tensor.is_cuda:
            return original(tensor)
        if tensor.requires_grad and not tensor.is_leaf:
            raise RuntimeError(
                "Cowardly refusing to serialize non-leaf tensor which requires_grad, "
                "since autograd does not support crossing process boundaries.  "
                "If you just want to transfer the data, call detach() on the tensor "
                "before serializing (e.g., putting it on the queue)."
            )
        storage = tensor.untyped_storage()
        tenant, name, offset = _native._torch_share(int(storage.data_ptr()))
        return (
            _rebuild_cuda_tensor,
            (tenant, name, offset, int(storage.nbytes()), str(tensor.dtype).replace("torch.", ""),
             tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset()),
             bool(tensor.requires_grad)),
        )

    def reduce_storage(storage: Any) -> Any:
        if not getattr(storage, "is_cuda", False):
            return original_storage(storage)
        tenant, name, offset = _native._torch_share(int(storage.data_ptr()))
        return (_rebuild_cuda_storage, (tenant, name, offset, int(storage.nbytes())))

    for cls in (torch.Tensor, torch.nn.parameter.Parameter):
        ForkingPickler.register(cls, reduce_tensor)
    ForkingPickler.register(torch.UntypedStorage, reduce_storage)


# Imported segments of this process, by (tenant, name): one import and mapping each,
# kept while a tensor views it (weakly held here).
_imports: "weakref.WeakValueDictionary[Tuple[str, str], Any]" = weakref.WeakValueDictionary()
_import_session: Any = None


def _imported(tenant: str, name: str) -> Any:
    """The publication `name` of `tenant`, imported and mapped read-write in this process
    (on gpubroker.torch's session if installed here, else a session of its own:
    GPU_BROKER_ADDR/TOKEN as for connect(); the same tenant)."""
    global _import_session
    with _lock:
        seg = _imports.get((tenant, name))
        if seg is not None:
            return seg
        if _state is not None:
            session = _state.session
        else:
            if _import_session is None:
                from . import connect

                _import_session = connect().session(f"torch-import-{os.getpid()}")
            session = _import_session
        seg = _native._torch_import(session, tenant, name)
        _imports[(tenant, name)] = seg
        return seg


def _segment_bytes(torch: Any, tenant: str, name: str, offset: int, nbytes: int) -> Any:
    """A uint8 CUDA tensor over `nbytes` at `offset` of an imported segment (it keeps
    the import mapped)."""
    from ._arrays import _CudaView

    seg = _imported(tenant, name)

    class _At:  # the array interface wants .ptr/.device on the kept object
        def __init__(self) -> None:
            self.segment = seg
            self.ptr = seg.ptr + offset
            self.device = seg.device

    return torch.as_tensor(_CudaView(_At(), (nbytes,), "|u1"), device=f"cuda:{seg.device}")


def _rebuild_cuda_tensor(tenant: str, name: str, offset: int, nbytes: int, dtype: str,
                         size: Tuple[int, ...], stride: Tuple[int, ...], storage_offset: int,
                         requires_grad: bool) -> Any:
    import torch

    raw = _segment_bytes(torch, tenant, name, offset, nbytes)
    t = torch.empty(0, dtype=getattr(torch, dtype), device=raw.device)
    t.set_(raw.untyped_storage(), storage_offset, size, stride)
    t.requires_grad_(requires_grad)
    return t


def _rebuild_cuda_storage(tenant: str, name: str, offset: int, nbytes: int) -> Any:
    import torch

    return _segment_bytes(torch, tenant, name, offset, nbytes).untyped_storage()


def _in_front(state: _State, device: int, begin: Callable[[], Any]) -> Any:
    """Runs `begin` (a capture's or a pool's routing) with the all-streams routing of
    `device` stepped aside until that routing ends (`_step_back`): which of two routings
    serves an allocation differs between PyTorch releases (2.11: not the newer), and a
    capture's allocations must come from its own pool (else eager tensors reuse blocks
    its replays write). Meanwhile other threads allocate from PyTorch's default pool.
    The caller holds `_lock`."""
    pool = state.pools.get(device)
    if pool is None:
        return begin()
    if state.aside.get(device, 0) == 0:
        state.end(device, pool.id)
    state.aside[device] = state.aside.get(device, 0) + 1
    try:
        return begin()
    except BaseException:
        _step_back(state, device)
        raise


def _step_back(state: _State, device: int) -> None:
    """A routing begun by `_in_front` ended: the last one to end resumes ours. The caller
    holds `_lock`."""
    left = state.aside.get(device, 0) - 1
    if left < 0:
        return
    state.aside[device] = left
    pool = state.pools.get(device)
    if left == 0 and pool is not None:
        _resume_routing(state, device, pool)


def _resume_routing(state: _State, device: int, pool: Any) -> None:
    """Routes `device` to our pool again after a pause. Every routing PyTorch begins
    takes a reference on its pool that only a release gives back (ending does not), so
    the pause's begin is balanced here: else the pool could never be freed."""
    state.begin(device, pool.id)
    state.release(device, pool.id)


def _route_graphs(torch: Any, state: _State) -> None:
    """CUDA graphs on leases: a capture with no pool given gets a MemPool of our
    allocator (PyTorch's would cudaMalloc), shared pools (`graph_pool_handle()`, which
    `make_graphed_callables` and torch.compile's CUDA-graph trees use) are such MemPools
    too, and every capture's (or pool's) routing goes in front of ours."""
    graph_cls = getattr(torch.cuda, "CUDAGraph", None)
    if graph_cls is not None:
        original_begin = graph_cls.capture_begin
        original_end = graph_cls.capture_end

        def capture_begin(self: Any, pool: Any = None, capture_error_mode: str = "global") -> None:
            device = torch.cuda.current_device()
            if pool is None or tuple(pool) == (0, 0):
                mp = _new_pool(torch, state.allocator)
                pool = mp.id
                state.graph_pools[tuple(pool)] = mp
                # The graph's MemPool may go only after the graph (and only while the
                # routing pauses, in empty_cache()): PyTorch asserts otherwise.
                try:
                    weakref.finalize(self, state.dead_graph_pools.append, tuple(pool))
                except TypeError:
                    pass  # no weak references: the pool stays for the process's life
            elif tuple(pool) not in state.graph_pools:
                warnings.warn(
                    "gpubroker.torch: a CUDA graph captures into a pool that is not the "
                    "broker's (made before install()?); its memory is outside leases",
                    stacklevel=2,
                )
            with _lock:
                _in_front(
                    state,
                    device,
                    lambda: original_begin(self, pool, capture_error_mode=capture_error_mode),
                )
                state.capturing += 1

        def capture_end(self: Any) -> None:
            try:
                original_end(self)
            finally:
                with _lock:
                    state.capturing -= 1
                    _step_back(state, torch.cuda.current_device())

        graph_cls.capture_begin = capture_begin
        graph_cls.capture_end = capture_end

    def graph_pool_handle() -> Tuple[int, int]:
        mp = _new_pool(torch, state.allocator)
        # Shared by any number of graphs: kept for the process's life.
        state.graph_pools[tuple(mp.id)] = mp
        return mp.id

    torch.cuda.graph_pool_handle = graph_pool_handle
    graphs = getattr(torch.cuda, "graphs", None)
    if graphs is not None and hasattr(graphs, "graph_pool_handle"):
        graphs.graph_pool_handle = graph_pool_handle
    for name in (
        "_cuda_beginAllocateToPool",
        "_cuda_beginAllocateCurrentThreadToPool",
        "_cuda_beginAllocateCurrentStreamToPool",
    ):
        original = getattr(torch._C, name, None)
        if original is None:
            continue

        def begin_in_front(device: Any, pool: Any, *rest: Any, _original: Any = original) -> Any:
            index = getattr(device, "index", device)
            if index is None:
                index = torch.cuda.current_device()
            with _lock:
                return _in_front(state, int(index), lambda: _original(device, pool, *rest))

        setattr(torch._C, name, begin_in_front)
        # Modules that imported the name from torch._C before install() (use_mem_pool's
        # torch.cuda.memory) look it up in their own globals.
        for module in (getattr(torch.cuda, "memory", None), graphs):
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, begin_in_front)
    # Their ends put ours back (once the last routing of others on the device ended).
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        original = getattr(torch._C, name, None)
        if original is None:
            continue

        def end_and_step_back(device: Any, *rest: Any, _original: Any = original) -> Any:
            index = getattr(device, "index", device)
            if index is None:
                index = torch.cuda.current_device()
            with _lock:
                try:
                    return _original(device, *rest)
                finally:
                    _step_back(state, int(index))

        setattr(torch._C, name, end_and_step_back)
        for module in (getattr(torch.cuda, "memory", None), graphs):
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, end_and_step_back)


def _release_dead_graph_pools(torch: Any, state: _State) -> None:
    """Drops the MemPools of freed graphs that no other graph shares any more (their
    destructors hand the blocks back to the allocator). The routing must be paused."""
    keep = []
    gone = []
    for pid in state.dead_graph_pools:
        mp = state.graph_pools.get(pid)
        if mp is None:
            continue
        users = getattr(mp, "use_count", None)
        if callable(users) and users() > 1:
            keep.append(pid)  # another graph captured into it (`pool=g.pool()`)
            continue
        gone.append(state.graph_pools.pop(pid))
    state.dead_graph_pools[:] = keep
    gone.clear()


def _route_record_stream(torch: Any, state: _State, every: int) -> None:
    """`Tensor.record_stream` also returns multi-stream blocks once `every` bytes were
    recorded since the last return (0: never). The hook's flush alone comes after a
    miss, when PyTorch has already grown its pool by a segment: a loop that frees a
    side-stream block per step then grows it by one segment per flush, without bound.
    Recording from C++ (NCCL) does not pass here: the hook's flush covers it."""
    original = getattr(torch.Tensor, "record_stream", None)
    if original is None or every <= 0:
        return

    def record_stream(self: Any, stream: Any) -> Any:
        result = original(self, stream)
        try:
            state.recorded_bytes += int(self.untyped_storage().nbytes())
        except Exception:  # noqa: BLE001 - a tensor without storage: nothing to count
            return result
        if state.recorded_bytes >= every:
            state.recorded_bytes = 0
            _reuse_stream_blocks_soon()
        return result

    torch.Tensor.record_stream = record_stream


def _reuse_stream_blocks_soon() -> None:
    """The hook's pending call (main thread, between bytecodes): returns multi-stream
    blocks to PyTorch's pool unless a capture is under way or the routing is busy."""
    state = _state
    if state is None or state.capturing or any(state.aside.values()):
        return
    if not _lock.acquire(blocking=False):
        return
    try:
        import torch

        if state.capturing or torch.cuda.is_current_stream_capturing():
            return
        _flush_stream_blocks(torch, state)
    except Exception:  # noqa: BLE001 - never raise into the code it interrupted
        pass
    finally:
        _lock.release()


def _flush_stream_blocks(torch: Any, state: _State) -> None:
    """With `_lock` held: pauses the routing so PyTorch records the deferred end-of-use
    events of multi-stream blocks, waits for them and puts the blocks back (not while a
    routing of others is under way: ours is aside until it ends)."""
    if any(state.aside.values()):
        return
    for d, pool in state.pools.items():
        state.end(d, pool.id)
    try:
        torch.cuda.empty_cache()
    finally:
        for d, pool in state.pools.items():
            _resume_routing(state, d, pool)


def empty_cache() -> int:
    """Gives memory back to the broker: PyTorch's unused cached blocks, then every
    segment with no live block. Returns the bytes of leases released."""
    state = _state
    if state is None:
        return 0
    import torch

    with _lock:
        if any(state.aside.values()):
            # A capture or another pool's routing is under way: ours is aside until it
            # ends, and PyTorch empties no pool meanwhile.
            return 0
        old_pools = dict(state.pools)
        for d in old_pools:
            # PyTorch empties a pool (MemPool's destructor does) only while no pool routing
            # is active on the device (it asserts otherwise), so the routing pauses here:
            # allocations other threads make meanwhile go to PyTorch's default pool.
            with torch.cuda.device(d):
                state.pools[d] = _new_pool(torch, state.allocator)
            state.end(d, old_pools[d].id)
            state.release(d, old_pools[d].id)
        try:
            # The old pools become freeable: their cached free blocks go back to the hook;
            # so do freed graphs' pools.
            old_pools.clear()
            _release_dead_graph_pools(torch, state)
            torch.cuda.empty_cache()
        finally:
            for d, pool in state.pools.items():
                state.begin(d, pool.id)
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
    side-stream copies, NCCL) reusable again now. PyTorch defers their end-of-use events
    while any pool routing is active, which under :func:`install` is always; the
    allocator's hook therefore asks the main thread to do this by itself (after PyTorch
    missed its cache, once per burst of misses), so calling it is optional. The routing pauses
    for the call (as in :func:`empty_cache`; other threads' allocations in that moment go
    to PyTorch's default pool, outside leases) and PyTorch waits for those blocks'
    streams to finish their work; then they are back in the pool."""
    state = _state
    if state is None:
        return
    import torch

    with _lock:
        _flush_stream_blocks(torch, state)


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
