"""Session events, as :meth:`gpubroker.Session.events` yields them.

The broker pushes :class:`ReclaimRequested`, :class:`LeaseRevoked`, :class:`ShuttingDown`,
:class:`YieldRequested`, :class:`TurnRevoked` and :class:`DeviceUnhealthy`; the client adds :class:`Disconnected` and
:class:`Reconnected` or :class:`Resumed` (sessions opened with ``reconnect=True``) and ends every stream with
:class:`Closed`. Times are seconds since the Unix epoch (``time.time()`` scale).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

__all__ = [
    "Event",
    "ReclaimRequested",
    "LeaseRevoked",
    "ShuttingDown",
    "YieldRequested",
    "TurnRevoked",
    "DeviceUnhealthy",
    "Disconnected",
    "Reconnected",
    "Resumed",
    "Closed",
    "Unknown",
]


class Event:
    """Base class of every session event."""


@dataclass(frozen=True)
class ReclaimRequested(Event):
    """The broker asks for ``lease_id`` back: release it before ``deadline`` or it is
    revoked (and its memory stays counted against the tenant until this process lets go)."""

    lease_id: str
    nbytes: int
    deadline: float
    reason: str

    def time_left(self) -> float:
        """Seconds until the deadline (0 once it passed)."""
        return max(0.0, self.deadline - time.time())


@dataclass(frozen=True)
class LeaseRevoked(Event):
    """The lease was taken away (operator, or a missed reclaim deadline)."""

    lease_id: str
    reason: str


@dataclass(frozen=True)
class ShuttingDown(Event):
    """The broker is shutting down; sessions end after ``grace`` seconds."""

    reason: str
    grace: float


@dataclass(frozen=True)
class YieldRequested(Event):
    """A compute turn is past its quantum while others wait: release it before ``deadline``."""

    turn_id: str
    device: int
    deadline: float


@dataclass(frozen=True)
class TurnRevoked(Event):
    """A compute turn was taken away."""

    turn_id: str
    device: int
    reason: str


@dataclass(frozen=True)
class DeviceUnhealthy(Event):
    """A device this session holds memory on was found unhealthy (or marked so by an
    operator): it takes no new leases; move work elsewhere."""

    device: int
    uuid: str
    reason: str


@dataclass(frozen=True)
class Disconnected(Event):
    """(``reconnect=True``) The broker session was lost with every lease it held; the
    client is re-opening one."""

    session_id: str
    reason: str


@dataclass(frozen=True)
class Reconnected(Event):
    """(``reconnect=True``) A new broker session replaces the lost one; the leases in
    ``lost_leases`` are gone (their ``release()`` raises :class:`~gpubroker.NotFound`)."""

    old_session_id: str
    new_session_id: str
    lost_leases: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class Resumed(Event):
    """(``reconnect=True``) The broker restarted with a keeper and kept this session: the
    same session and its leases (``kept_leases``) live on, mappings stay valid, and calls
    made meanwhile waited; the leases in ``lost_leases`` are gone."""

    session_id: str
    kept_leases: List[str] = field(default_factory=list)
    lost_leases: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class Closed(Event):
    """The session is over for good; always the last event."""

    reason: Optional[str] = None


@dataclass(frozen=True)
class Unknown(Event):
    """An event this version of the package does not know."""

    description: str
