"""gpubroker: Python workers for gpu-broker.

A node's broker owns its GPUs; a worker asks it for **leases** of device memory under
its tenant's quota, maps them, and gives them back. The package is a native extension
over the Rust ``gpu-broker-client`` crate (sessions, keepalive, events, reconnection and
the CUDA handle cache live there). numpy, PyTorch and CuPy are optional.

Quick start (the host backend needs no GPU)::

    import gpubroker

    broker = gpubroker.connect()          # GPU_BROKER_ADDR, GPU_BROKER_TOKEN(_FILE)
    with broker.session("worker-1") as session:
        with session.lease(64 << 20, wait=5, label="buffers") as lease:
            a = lease.as_numpy("float32")  # zero-copy view (host memory)
            a[:] = 1.0
            del a                          # views first, then the lease is released
        print(session.usage())

On a GPU node, ``lease.as_torch(torch.float16, (1024, 1024))`` and ``lease.as_cupy(...)``
give zero-copy device arrays, and ``gpubroker.torch.install()`` puts every CUDA allocation
of a PyTorch program into broker leases.

Errors are :class:`BrokerError` subclasses named after the broker's gRPC status:
:class:`QuotaExceeded`, :class:`WaitTimeout`, :class:`Unauthenticated`,
:class:`PermissionDenied`, :class:`NotFound`, :class:`InvalidArgument`,
:class:`FailedPrecondition`, :class:`Unavailable`; where the broker names its reason, a
subclass says which (:class:`CapacityExhausted`, :class:`LeaseLimitReached`,
:class:`QueueFull`, :class:`LeaseNotFound`, :class:`DeviceDraining`, ... — see
:mod:`gpubroker.errors`), with ``err.reason`` and the broker's numbers in ``err.details``.
"""

from __future__ import annotations

import os
from typing import Optional

from . import compat, events
from .compat import BrokerVersionWarning
from ._native import Broker, EventStream, Lease, Memory, Resident, Session, Usage
from ._native import __version__
from ._native import _connect
from .errors import (
    BrokerError,
    BrokerRestarted,
    CapacityExhausted,
    DeviceClosed,
    DeviceQuotaExceeded,
    DeviceDraining,
    DeviceUnhealthy,
    FailedPrecondition,
    HostFallbackFailed,
    InvalidArgument,
    LeaseLimitReached,
    LeaseNotFound,
    NoDeviceOpen,
    NotFound,
    PermissionDenied,
    QueueFull,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    SessionLimitReached,
    SessionNotFound,
    ShuttingDown,
    TenantInUse,
    TenantNotFound,
    TokenExpired,
    TurnBusy,
    Unauthenticated,
    Unavailable,
    WaitTimeout,
)

__all__ = [
    "connect",
    "Broker",
    "Session",
    "Lease",
    "Resident",
    "Usage",
    "Memory",
    "EventStream",
    "events",
    "BrokerError",
    "QuotaExceeded",
    "WaitTimeout",
    "Unauthenticated",
    "PermissionDenied",
    "NotFound",
    "InvalidArgument",
    "FailedPrecondition",
    "Unavailable",
    "DeviceQuotaExceeded",
    "LeaseLimitReached",
    "RequestTooLarge",
    "CapacityExhausted",
    "QueueFull",
    "SessionLimitReached",
    "TurnBusy",
    "HostFallbackFailed",
    "RateLimited",
    "TenantNotFound",
    "SessionNotFound",
    "LeaseNotFound",
    "ShuttingDown",
    "BrokerRestarted",
    "NoDeviceOpen",
    "DeviceClosed",
    "DeviceDraining",
    "DeviceUnhealthy",
    "TenantInUse",
    "TokenExpired",
    "BrokerVersionWarning",
    "compat",
    "DEFAULT_ADDRESS",
    "__version__",
]

#: Where a node's broker listens unless told otherwise.
DEFAULT_ADDRESS = "unix:///run/gpu-broker/broker.sock"


def _token_from_env() -> Optional[str]:
    token = os.environ.get("GPU_BROKER_TOKEN")
    if token and token.strip():
        return token.strip()
    path = os.environ.get("GPU_BROKER_TOKEN_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise Unauthenticated(
                f"cannot read GPU_BROKER_TOKEN_FILE {path!r}: {e}", code="UNAUTHENTICATED"
            ) from None
        if token:
            return token
        raise Unauthenticated(f"token file {path!r} is empty", code="UNAUTHENTICATED")
    return None


def connect(address: Optional[str] = None, token: Optional[str] = None) -> Broker:
    """Connects to the broker and returns a :class:`Broker`.

    Args:
        address: ``unix:///path/broker.sock``, a socket path, or ``host:port``. Default:
            ``$GPU_BROKER_ADDR``, else ``unix:///run/gpu-broker/broker.sock``.
        token: the tenant's token. Default: ``$GPU_BROKER_TOKEN``, else the contents of
            ``$GPU_BROKER_TOKEN_FILE``; surrounding whitespace is stripped.

    Raises:
        Unauthenticated: no token was given or found.
        Unavailable: nothing answers at the address.
        InvalidArgument: a malformed address or token.

    Warns:
        BrokerVersionWarning: the broker is older than this package needs, naming the
            rule (:mod:`gpubroker.compat`).
    """
    if address is None:
        address = os.environ.get("GPU_BROKER_ADDR") or DEFAULT_ADDRESS
    if token is None:
        token = _token_from_env()
    if token is None or not token.strip():
        raise Unauthenticated(
            "no broker token: pass token=..., or set GPU_BROKER_TOKEN or GPU_BROKER_TOKEN_FILE",
            code="UNAUTHENTICATED",
        )
    broker = _connect(address, token.strip())
    compat.check(broker)
    return broker
