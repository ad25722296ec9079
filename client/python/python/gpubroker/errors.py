"""Exceptions raised by :mod:`gpubroker`.

Every error is a :class:`BrokerError`; its class names the gRPC status the broker
answered with (or the closest one for a local failure), and where the broker sent a
machine-readable reason, a subclass of that names the reason (``CapacityExhausted`` is a
``QuotaExceeded``, ``LeaseNotFound`` a ``NotFound``, ...). ``str(err)`` is the broker's
message (for people: it carries the numbers too), ``err.code`` the gRPC code's name,
``err.reason`` the broker's reason (e.g. ``"CAPACITY_EXHAUSTED"``, ``None`` where it sent
none) and ``err.details`` the values behind it (``{"requested_bytes": "8388608", ...}``:
byte counts in bytes, as strings). Programs match on the class or on ``err.reason``,
never on the message. The table of reasons is in the project's ``docs/protocol.md``.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

__all__ = [
    "BrokerError",
    "QuotaExceeded",
    "WaitTimeout",
    "Unauthenticated",
    "PermissionDenied",
    "NotFound",
    "InvalidArgument",
    "FailedPrecondition",
    "Unavailable",
    # by reason
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
    "REASONS",
]


class BrokerError(Exception):
    """Base class of every gpubroker error.

    Attributes:
        message: the broker's message (or the local failure's description).
        code: the gRPC status code's name, e.g. ``"RESOURCE_EXHAUSTED"``.
        reason: the broker's machine-readable reason, or ``None``.
        details: the values behind the reason (``ErrorInfo.metadata``), ``{}`` without one.
    """

    def __init__(
        self,
        message: str,
        *,
        code: Optional[str] = None,
        reason: Optional[str] = None,
        details: Optional[Dict[str, str]] = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.details: Dict[str, str] = dict(details or {})

    def _bytes(self, key: str) -> Optional[int]:
        value = self.details.get(key)
        return int(value) if value is not None and value.isdigit() else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r}, reason={self.reason!r})"


class QuotaExceeded(BrokerError):
    """RESOURCE_EXHAUSTED: the tenant's quota, the device's capacity or a cap (leases,
    sessions, waiting requests) does not allow the request now. Raised as this class for
    the reason ``QUOTA_EXCEEDED`` (the tenant's byte limit) and as a subclass for the
    others (:class:`CapacityExhausted`, :class:`LeaseLimitReached`, ...).

    ``requested_bytes``, ``held_bytes`` and ``limit_bytes`` are the broker's numbers where
    it sent them (else ``None``)."""

    @property
    def requested_bytes(self) -> Optional[int]:
        return self._bytes("requested_bytes")

    @property
    def held_bytes(self) -> Optional[int]:
        return self._bytes("held_bytes")

    @property
    def limit_bytes(self) -> Optional[int]:
        return self._bytes("limit_bytes")


class WaitTimeout(BrokerError):
    """DEADLINE_EXCEEDED: the request waited in the broker's queue for ``wait`` seconds
    and did not get memory (reason ``WAIT_EXPIRED``). ``cause`` is the reason it would
    have been refused with had it not waited (e.g. ``"CAPACITY_EXHAUSTED"``)."""

    @property
    def cause(self) -> Optional[str]:
        return self.details.get("cause")


class Unauthenticated(BrokerError):
    """UNAUTHENTICATED: no token, or an unknown or revoked one."""


class TokenExpired(Unauthenticated):
    """TOKEN_EXPIRED: the token is past its expiry (``details["token_id"]``,
    ``["expired_at_ms"]``): issue a new one. An unknown or revoked token is
    ``TOKEN_UNKNOWN``, a plain :class:`Unauthenticated`."""


class PermissionDenied(BrokerError):
    """PERMISSION_DENIED: the token may not do this (e.g. a tenant calling the admin API)."""


class NotFound(BrokerError):
    """NOT_FOUND: no such lease or session for this tenant (also a lease that was revoked,
    or lost with its session when the broker restarted)."""


class InvalidArgument(BrokerError):
    """INVALID_ARGUMENT: zero or absurd sizes, an unknown device, a bad address or token."""


class FailedPrecondition(BrokerError):
    """FAILED_PRECONDITION: not possible in the current state (e.g. releasing a lease that
    arrays still view, mapping device memory as numpy)."""


class Unavailable(BrokerError):
    """UNAVAILABLE: the broker cannot be reached, or it is shutting down."""


# ---- one class per reason, each a subclass of its code's class


class DeviceQuotaExceeded(QuotaExceeded):
    """DEVICE_QUOTA_EXCEEDED: the tenant's cap on a device does not fit the request on any
    device it may use (``details["device"]``)."""


class LeaseLimitReached(QuotaExceeded):
    """LEASE_COUNT_LIMIT: the tenant holds as many leases as its quota's ``max_leases``."""


class RequestTooLarge(QuotaExceeded):
    """REQUEST_TOO_LARGE: larger than any device could ever lease; waiting does not help."""


class CapacityExhausted(QuotaExceeded):
    """CAPACITY_EXHAUSTED: within the quota, but the devices have not that much free now
    (``details["free_bytes"]`` is the most any candidate device has). Wait, or retry."""


class QueueFull(QuotaExceeded):
    """QUEUE_FULL: the tenant already has the most waiting requests allowed."""


class SessionLimitReached(QuotaExceeded):
    """SESSION_LIMIT: the tenant already has the most open sessions allowed."""


class TurnBusy(QuotaExceeded):
    """TURN_BUSY: another session holds the compute turn."""


class HostFallbackFailed(QuotaExceeded):
    """HOST_FALLBACK_FAILED: host memory asked for as a fallback could not be made."""


class RateLimited(QuotaExceeded):
    """RATE_LIMITED: over the tenant's call rate; ``retry_after`` seconds until a call
    would pass."""

    @property
    def retry_after(self) -> Optional[float]:
        ms = self.details.get("retry_after_ms")
        return int(ms) / 1000.0 if ms is not None and ms.isdigit() else None


class TenantNotFound(NotFound):
    """TENANT_NOT_FOUND: the tenant does not exist (any more)."""


class SessionNotFound(NotFound):
    """SESSION_NOT_FOUND: no such session for this tenant."""


class LeaseNotFound(NotFound):
    """LEASE_NOT_FOUND: no such lease for this tenant (released, revoked, or never yours)."""


class ShuttingDown(Unavailable):
    """SHUTTING_DOWN: the broker is stopping; reconnect to its successor."""


class BrokerRestarted(Unavailable):
    """BROKER_RESTARTED: the session belongs to an earlier run of the broker; open a new one."""


class NoDeviceOpen(Unavailable):
    """NO_DEVICE_OPEN: no device on the node takes new leases (drained or unhealthy)."""


class DeviceClosed(FailedPrecondition):
    """The pinned device takes no new leases (:class:`DeviceDraining`,
    :class:`DeviceUnhealthy`); ``details["device"]`` names it."""


class DeviceDraining(DeviceClosed):
    """DEVICE_DRAINING: the pinned device is drained for maintenance."""


class DeviceUnhealthy(DeviceClosed):
    """DEVICE_UNHEALTHY: the pinned device is unhealthy."""


class TenantInUse(FailedPrecondition):
    """TENANT_IN_USE: the tenant still holds leases."""


#: The class raised for each reason the broker sends. A reason not listed here (a newer
#: broker's) raises its code's class with ``.reason`` set.
REASONS: Dict[str, Type[BrokerError]] = {
    "QUOTA_EXCEEDED": QuotaExceeded,
    "DEVICE_QUOTA_EXCEEDED": DeviceQuotaExceeded,
    "LEASE_COUNT_LIMIT": LeaseLimitReached,
    "REQUEST_TOO_LARGE": RequestTooLarge,
    "CAPACITY_EXHAUSTED": CapacityExhausted,
    "QUEUE_FULL": QueueFull,
    "SESSION_LIMIT": SessionLimitReached,
    "TURN_BUSY": TurnBusy,
    "HOST_FALLBACK_FAILED": HostFallbackFailed,
    "RATE_LIMITED": RateLimited,
    "STREAM_LIMIT": QuotaExceeded,
    "WAIT_EXPIRED": WaitTimeout,
    "TENANT_NOT_FOUND": TenantNotFound,
    "SESSION_NOT_FOUND": SessionNotFound,
    "LEASE_NOT_FOUND": LeaseNotFound,
    "TOKEN_NOT_FOUND": NotFound,
    "TURN_NOT_FOUND": NotFound,
    "SHARED_LEASE_NOT_FOUND": NotFound,
    "IMPORT_NOT_FOUND": NotFound,
    "SHARING_LIMIT": QuotaExceeded,
    "OUT_OF_DESCRIPTORS": QuotaExceeded,
    "RESERVATION_NOT_FOUND": NotFound,
    # A lease of a process reserved with `gpu-brokerctl run` beyond its reservation.
    "RESERVATION_EXCEEDED": QuotaExceeded,
    "SHUTTING_DOWN": ShuttingDown,
    "BROKER_RESTARTED": BrokerRestarted,
    "NO_DEVICE_OPEN": NoDeviceOpen,
    "DEVICE_DRAINING": DeviceDraining,
    "DEVICE_UNHEALTHY": DeviceUnhealthy,
    "TENANT_IN_USE": TenantInUse,
    "TURN_ALREADY_HELD": FailedPrecondition,
    # A request that accepts only legacy CUDA IPC handles (no longer served).
    "LEGACY_HANDLES_REMOVED": FailedPrecondition,
    # A session that already holds its process reservation.
    "RESERVATION_HELD": FailedPrecondition,
    # A publish under a name the tenant already uses, or of a lease already published.
    "SHARED_NAME_TAKEN": FailedPrecondition,
    "ALREADY_PUBLISHED": FailedPrecondition,
    # A quota change whose guarantees would exceed the node's leasable memory.
    "GUARANTEES_EXCEED_CAPACITY": InvalidArgument,
    # An MPS reservation while the broker's MPS daemon is not running.
    "MPS_NOT_RUNNING": Unavailable,
    # What the broker cannot do for this request or caller: publish a host-fallback lease,
    # seal a lease's memory for importers, lease host memory without a host tier, deliver
    # fd handles (no ticket server, a caller not on the Unix socket, a request that does
    # not accept them), rotate an admin token it reads from no file.
    "HOST_LEASE_NOT_SHAREABLE": FailedPrecondition,
    "SEAL_FAILED": FailedPrecondition,
    "NO_HOST_TIER": FailedPrecondition,
    "NO_TICKET_SERVER": FailedPrecondition,
    "FD_NEEDS_UNIX_SOCKET": FailedPrecondition,
    "FD_HANDLES_NOT_ACCEPTED": FailedPrecondition,
    "NO_ADMIN_TOKEN_FILE": FailedPrecondition,
    # A ResourceClaim's token leasing while its claim has no reservation at the broker
    # (retry shortly), or asking for a process reservation (it leases from its claim).
    "CLAIM_NOT_RESERVED": FailedPrecondition,
    "CLAIM_TOKEN_CANNOT_RESERVE": FailedPrecondition,
    # A device index past the last, a wait past --max-wait, too many reader tenants.
    "UNKNOWN_DEVICE": InvalidArgument,
    "WAIT_TOO_LONG": InvalidArgument,
    "TOO_MANY_READERS": InvalidArgument,
    # A token name starting with claim/ (ReserveClaim's alone).
    "TOKEN_NAME_RESERVED": InvalidArgument,
    # Tokens: none sent, not `Bearer <token>`, unknown or revoked, expired; a scope that
    # does not reach the call.
    "TOKEN_MISSING": Unauthenticated,
    "TOKEN_MALFORMED": Unauthenticated,
    "TOKEN_UNKNOWN": Unauthenticated,
    "TOKEN_EXPIRED": TokenExpired,
    # Kubernetes ServiceAccount tokens: refused by the API server's TokenReview, of a
    # namespace no tenant lists; the API server not answering (retry).
    "SERVICE_ACCOUNT_REFUSED": Unauthenticated,
    "NAMESPACE_HAS_NO_TENANT": Unauthenticated,
    "TOKEN_REVIEW_UNAVAILABLE": Unavailable,
    "SCOPE_DENIED": PermissionDenied,
    # A session of another user named; a process group not the reserved process's.
    "SESSION_OF_ANOTHER_USER": PermissionDenied,
    "PROCESS_GROUP_REFUSED": PermissionDenied,
}


def _make(
    base: Type[BrokerError],
    message: str,
    code: str,
    reason: Optional[str],
    details: Optional[Dict[str, str]],
) -> BrokerError:
    """The exception for a broker status: the reason's class where it is one of `base`'s
    (a reason always belongs to one code; a mismatch keeps `base`), else `base`."""
    cls = REASONS.get(reason or "", base)
    if not issubclass(cls, base):
        cls = base
    return cls(message, code=code, reason=reason, details=details)
