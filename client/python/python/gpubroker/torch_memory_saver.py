"""Serving engines' pause and resume on broker leases: the API of ``torch_memory_saver``
(``region(tag=..., enable_cpu_backup=...)``, ``pause(tag)``, ``resume(tag)``,
``cuda_graph(...)``, ``disable()``), implemented over ``gpubroker.torch``.

Tensors made inside ``region(tag)`` come from leases of the tenant that belong to that
tag alone (a sub-allocator per tag; PyTorch caches them in a MemPool per tag, as
torch_memory_saver does). ``pause(tag)`` gives their device memory back to the broker
(the tenant's held bytes drop; another tenant can be granted it), keeping every virtual
address; ``resume(tag)`` takes leases again at the same addresses, with the contents back
where the region asked for ``enable_cpu_backup`` (saved to host-tier leases, charged
under the tenant's host limit). ``cuda_graph(...)`` is ``torch.cuda.graph(...)`` with the
capture's memory in a region, so a captured graph's memory pauses too.

Code written for the real package keeps importing it: :func:`install` makes
``torch_memory_saver.torch_memory_saver`` use this implementation, through the package's
``register_hook_mode`` where it has one (releases after 0.0.10), else by handing the
singleton this implementation before its first use (0.0.10 has no extension point: its
native core creates the physical memory itself). The module's own
``torch_memory_saver`` singleton is the same API without the package.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple

from . import _native
from .errors import FailedPrecondition

__all__ = ["BrokerMemorySaver", "torch_memory_saver", "install"]

_TAG_DEFAULT = "default"
HOOK_MODE = "gpubroker"


class BrokerMemorySaver:
    """torch_memory_saver's API over broker leases (see the module's doc)."""

    def __init__(self, pause_on_reclaim: bool = False, segment_size: int = 64 << 20):
        self._pause_on_reclaim = pause_on_reclaim
        self._segment_size = segment_size
        self._pools: Dict[Tuple[str, bool, int], Any] = {}
        self._ready = False

    # -- torch_memory_saver's facade ------------------------------------------------
    @property
    def enabled(self) -> bool:
        return True

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ) -> Iterator[None]:
        """Tensors allocated inside are paused and resumed with ``tag``."""
        if enable_disk_backup:
            raise NotImplementedError("gpubroker: regions back up to host-tier leases, not disk")
        torch = self._ensure_ready()
        device = torch.cuda.current_device()
        key = (tag, bool(enable_cpu_backup), device)
        pool = self._pools.get(key)
        if pool is None:
            from .torch import _new_pool, _state

            pool = _new_pool(torch, _state.allocator)  # kept: PyTorch may not drop it while routed
            self._pools[key] = pool
        with torch.cuda.use_mem_pool(pool):
            with self._config(tag, bool(enable_cpu_backup)):
                yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ) -> Iterator[None]:
        """``torch.cuda.graph(...)`` whose captured memory belongs to region ``tag``."""
        torch = self._ensure_ready()
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with self._config(tag, bool(enable_cpu_backup)):
                yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Inside a region: allocations that do not pause (the process-wide leases)."""
        torch = self._ensure_ready()
        key = ("", False, torch.cuda.current_device())
        pool = self._pools.get(key)
        if pool is None:
            from .torch import _new_pool, _state

            pool = _new_pool(torch, _state.allocator)
            self._pools[key] = pool
        previous = _native._region_enter(None)
        try:
            with torch.cuda.use_mem_pool(pool):
                yield
        finally:
            _restore(previous)

    def pause(self, tag: Optional[str] = None) -> int:
        """Gives the device memory of ``tag``'s regions (``None``: all) back to the broker;
        returns the bytes. Their tensors must not be touched until :meth:`resume`."""
        torch = self._ensure_ready()
        torch.cuda.synchronize()
        return int(_native._regions_pause(tag))

    def resume(self, tag: Optional[str] = None, wait: Optional[float] = None) -> int:
        """Takes leases again for ``tag``'s regions at the same addresses (waiting up to
        ``wait`` seconds for each; refused like a lease); returns the bytes."""
        self._ensure_ready()
        return int(_native._regions_resume(tag, None if wait is None else float(wait)))

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        raise NotImplementedError("gpubroker: the backup is a host-tier lease, not readable here")

    # -- gpubroker's own ------------------------------------------------------------
    def stats(self) -> Dict[str, Dict[str, int]]:
        """Per tag: ``leased_bytes`` (segments, paused or not), ``allocated_bytes``,
        ``segments``, ``paused`` (0/1)."""
        return {t: dict(v) for t, v in _native._regions_stats().items()}

    @contextlib.contextmanager
    def _config(self, tag: str, backup: bool) -> Iterator[None]:
        previous = _native._region_enter(tag, backup)
        try:
            yield
        finally:
            _restore(previous)

    def _ensure_ready(self) -> Any:
        from . import torch as gt

        if not gt.installed():
            gt.install()
        import torch

        if not self._ready:
            _native._regions_configure(int(self._segment_size), bool(self._pause_on_reclaim))
            self._ready = True
        return torch


def _restore(previous: Optional[Tuple[str, bool]]) -> None:
    """Reopens the region that was open before (or none)."""
    if previous is None:
        _native._region_enter(None)
    else:
        _native._region_enter(*previous)


# The module's singleton, as torch_memory_saver's.
torch_memory_saver = BrokerMemorySaver()


def install(saver: Optional[BrokerMemorySaver] = None) -> BrokerMemorySaver:
    """Makes the ``torch_memory_saver`` package's singleton run on broker leases (call it
    before that singleton's first use; ``gpubroker.torch.install()`` runs on first use
    if it has not). Returns the implementation."""
    saver = saver or torch_memory_saver
    try:
        import torch_memory_saver as package
    except ImportError:
        raise FailedPrecondition(
            "the torch_memory_saver package is not installed; use "
            "gpubroker.torch_memory_saver.torch_memory_saver directly",
            code="FAILED_PRECONDITION",
        ) from None
    facade = package.torch_memory_saver
    register = getattr(package, "register_hook_mode", None)
    if register is not None:
        # The package's extension point: a named hook mode with a lazy factory.
        try:
            register(HOOK_MODE, lambda: saver, uses_preload=False)
        except TypeError:
            register(HOOK_MODE, lambda: saver)
        facade.hook_mode = HOOK_MODE
        return saver
    if getattr(facade, "_impl", None) is not None:
        raise FailedPrecondition(
            "torch_memory_saver was used before gpubroker.torch_memory_saver.install()",
            code="FAILED_PRECONDITION",
        )
    # No extension point (0.0.10): the facade delegates to its implementation object.
    facade._impl = saver
    return saver
