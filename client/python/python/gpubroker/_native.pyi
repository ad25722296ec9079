"""Typing stubs of the native extension (the classes gpubroker re-exports)."""

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

from .events import Event, ReclaimRequested

__version__: str
REQUIRED_API_REVISION: int
#: Every reason the broker sends, with its gRPC code's name (from the Rust list).
REASON_CODES: Dict[str, str]

Shape = Union[int, Sequence[int], None]

def _connect(address: str, token: str) -> Broker: ...

class Broker:
    """A connection to the broker, authenticated as one tenant."""

    @property
    def address(self) -> str: ...
    def session(self, name: str, *, reconnect: bool = False) -> Session:
        """Opens a session (a context manager; leaving it ends the session)."""
    def usage(self) -> Usage:
        """The tenant's quota and live usage."""
    def info(self) -> dict:
        """What the broker says about itself: version, api_revision, backend,
        device_count, features."""

class Session:
    """A worker session: leases are taken through it; events arrive on it."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def connected(self) -> bool: ...
    @property
    def keepalive_timeout(self) -> Optional[float]: ...
    def lease(
        self,
        nbytes: int,
        *,
        device: Optional[int] = None,
        wait: Optional[float] = None,
        label: Optional[str] = None,
        reclaimable: bool = False,
        fallback_host: bool = False,
    ) -> Lease:
        """Acquires memory; ``wait`` seconds in the broker's queue when it is short."""
    def events(self) -> EventStream:
        """A new iterator over the session's events (ends after ``Closed``)."""
    def on_reclaim(self, callback: Callable[[ReclaimRequested], Any]) -> None:
        """Calls ``callback`` on a background thread for every ``ReclaimRequested``."""
    def retain_mappings(self, nbytes: int) -> None:
        """Keeps released leases' blocks mapped in this process, up to ``nbytes`` (0: off)."""
    @property
    def retained_nbytes(self) -> int: ...
    def drop_retained(self) -> None:
        """Lets go of every retained block."""
    def usage(self) -> Usage: ...
    def close(self) -> None:
        """Ends the session; the broker takes back its leases."""
    def __enter__(self) -> Session: ...
    def __exit__(self, *args: Any) -> bool: ...

class Lease:
    """Memory granted by the broker (a context manager; leaving it releases)."""

    @property
    def id(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def requested_nbytes(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def tier(self) -> str:
        """``"device"`` or ``"host"``."""
    @property
    def handle_kind(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def reclaimable(self) -> bool: ...
    @property
    def session_id(self) -> str: ...
    @property
    def released(self) -> bool: ...
    @property
    def lost(self) -> bool: ...
    @property
    def retained(self) -> bool:
        """Granted from a block this process retained (no ticket; mapped already)."""
    def release(self) -> None:
        """Gives the memory back now (raises FailedPrecondition while views live)."""
    def release_when_unused(self) -> bool:
        """Releases now, or once the last view is gone; True when released now."""
    def as_numpy(self, dtype: Any = None, shape: Shape = None) -> Any:
        """Zero-copy numpy view of host (shared) memory."""
    def as_torch(self, dtype: Any = None, shape: Shape = None) -> Any:
        """Zero-copy torch tensor (CUDA for device memory, CPU for host memory)."""
    def as_cupy(self, dtype: Any = None, shape: Shape = None) -> Any:
        """Zero-copy CuPy array."""
    def _memory_kind(self) -> str: ...
    def _host_memory(self) -> Memory: ...
    def _cuda_memory(self) -> Memory: ...
    def __enter__(self) -> Lease: ...
    def __exit__(self, *args: Any) -> bool: ...

class Memory:
    """An address inside a mapped lease; every view holds one."""

    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def device(self) -> int: ...

class Resident:
    """A lease mapped at addresses that survive sleep and wake."""

    def __init__(self, lease: Lease) -> None: ...
    @property
    def addr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def tier(self) -> str: ...
    @property
    def first_lease_id(self) -> str: ...
    @property
    def lease_id(self) -> Optional[str]: ...
    @property
    def awake(self) -> bool: ...
    @property
    def saved(self) -> bool: ...
    def sleep(self, save: bool = True) -> None:
        """Gives the memory back, keeping the addresses (contents to a host-tier lease)."""
    def wake(self, wait: Optional[float] = None) -> None:
        """Memory again at the same addresses, contents restored; refused like a lease."""
    def sleep_on_reclaim(self, save: bool = True) -> None:
        """From now on sleep by itself when the broker asks for the lease back."""
    @property
    def reclaim_sleeps(self) -> int: ...
    def take_reclaim_error(self) -> Optional[str]: ...
    def release(self) -> None: ...
    def as_numpy(self, dtype: Any = None, shape: Any = None) -> Any: ...
    def as_torch(self, dtype: Any = None, shape: Any = None) -> Any: ...
    def as_cupy(self, dtype: Any = None, shape: Any = None) -> Any: ...
    def _memory_kind(self) -> str: ...
    def _host_memory(self) -> Memory: ...
    def _cuda_memory(self) -> Memory: ...
    def __enter__(self) -> Resident: ...
    def __exit__(self, *args: Any) -> bool: ...

class EventStream(Iterator[Event]):
    def __iter__(self) -> EventStream: ...
    def __next__(self) -> Event: ...
    def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event, or None when ``timeout`` seconds pass first."""

class Usage:
    tenant: str
    limit_bytes: int
    held_bytes: int
    lease_count: int
    max_leases: int
    priority: int
    guaranteed_bytes: int
    borrowed_bytes: int
    quarantined_bytes: int
    host_limit_bytes: int
    host_held_bytes: int
    session_count: int
    waiting_requests: int
    available_bytes: int
    device_limit_bytes: Dict[int, int]
    device_committed_bytes: Dict[int, int]
