"""Exceptions raised by :mod:`gpubroker`.

Every error is a :class:`BrokerError`; the subclass names the gRPC status the broker
answered with (or the closest one for a local failure). ``str(err)`` is the broker's
message (it carries the numbers, e.g. how much the tenant holds of its limit),
``err.code`` the gRPC code's name and ``err.reason`` the broker's machine-readable reason
where it sends one (``None`` otherwise).
"""

from __future__ import annotations

from typing import Optional

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
]


class BrokerError(Exception):
    """Base class of every gpubroker error.

    Attributes:
        message: the broker's message (or the local failure's description).
        code: the gRPC status code's name, e.g. ``"RESOURCE_EXHAUSTED"``.
        reason: the broker's machine-readable reason, or ``None``.
    """

    def __init__(self, message: str, *, code: Optional[str] = None, reason: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r}, reason={self.reason!r})"


class QuotaExceeded(BrokerError):
    """RESOURCE_EXHAUSTED: the tenant's quota, the device's capacity or a cap (leases,
    sessions, waiting requests) does not allow the request now."""


class WaitTimeout(BrokerError):
    """DEADLINE_EXCEEDED: the request waited in the broker's queue for ``wait`` seconds
    and did not get memory."""


class Unauthenticated(BrokerError):
    """UNAUTHENTICATED: no token, or an unknown or revoked one."""


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
