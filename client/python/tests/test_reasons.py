"""The broker's machine-readable reasons as exception classes: each refusal, made to
happen against a real broker on the host backend, raises the class of its reason (a
subclass of its code's class), with ``.reason`` and the broker's numbers in ``.details``."""

from __future__ import annotations

import signal
import threading
import time

import pytest

import gpubroker
from gpubroker import _native, errors
from gpubroker import events as ev

from conftest import wait_for

MIB = 1 << 20


def _refusal(exc_info, cls, code, reason):
    err = exc_info.value
    assert type(err) is cls, f"{type(err).__name__}: {err!r}"
    assert err.code == code and err.reason == reason, repr(err)
    return err


def test_every_reason_has_a_class_that_is_a_subclass_of_its_codes_class():
    by_code = {
        "RESOURCE_EXHAUSTED": gpubroker.QuotaExceeded,
        "DEADLINE_EXCEEDED": gpubroker.WaitTimeout,
        "NOT_FOUND": gpubroker.NotFound,
        "UNAVAILABLE": gpubroker.Unavailable,
        "FAILED_PRECONDITION": gpubroker.FailedPrecondition,
        "INVALID_ARGUMENT": gpubroker.InvalidArgument,
        "UNAUTHENTICATED": gpubroker.Unauthenticated,
        "PERMISSION_DENIED": gpubroker.PermissionDenied,
    }
    # The reasons are defined once, in Rust (the proto crate's `Reason`): the package
    # knows exactly those, each under its own code.
    known = _native.REASON_CODES
    assert "QUOTA_EXCEEDED" in known and known["TOKEN_EXPIRED"] == "UNAUTHENTICATED"
    assert set(errors.REASONS) == set(known), set(errors.REASONS) ^ set(known)
    for reason, cls in errors.REASONS.items():
        assert issubclass(cls, by_code[known[reason]]), (reason, cls, known[reason])
    # An unknown reason (a newer broker's) keeps the code's class and the reason.
    e = errors._make(gpubroker.QuotaExceeded, "m", "RESOURCE_EXHAUSTED", "SOMETHING_NEW", {"a": "1"})
    assert type(e) is gpubroker.QuotaExceeded and e.reason == "SOMETHING_NEW" and e.details == {"a": "1"}
    # A reason under the wrong code never changes the code's class.
    e = errors._make(gpubroker.NotFound, "m", "NOT_FOUND", "CAPACITY_EXHAUSTED", None)
    assert type(e) is gpubroker.NotFound
    for name in set(errors.__all__) - {"REASONS"}:
        assert hasattr(gpubroker, name), f"gpubroker.{name} is not exported"


def test_quota_capacity_size_and_wait_refusals(make_broker):
    b = make_broker("--host-capacity", "64MiB")
    alice = gpubroker.connect(b.address, b.tenant("alice", "32MiB"))
    bob = gpubroker.connect(b.address, b.tenant("bob", "1GiB"))
    with alice.session("a") as sa, bob.session("b") as sb:
        with pytest.raises(gpubroker.QuotaExceeded) as e:
            sa.lease(40 * MIB)
        err = _refusal(e, gpubroker.QuotaExceeded, "RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED")
        assert err.details["tenant"] == "alice" and err.details["tier"] == "device"
        assert (err.requested_bytes, err.limit_bytes, err.held_bytes) == (40 * MIB, 32 * MIB, 0)

        with pytest.raises(gpubroker.RequestTooLarge) as e:
            sb.lease(128 * MIB)
        err = _refusal(e, gpubroker.RequestTooLarge, "RESOURCE_EXHAUSTED", "REQUEST_TOO_LARGE")
        assert err.details["leasable_bytes"] == str(64 * MIB)
        assert isinstance(err, gpubroker.QuotaExceeded), "still caught as QuotaExceeded"

        held = sb.lease(48 * MIB)
        with pytest.raises(gpubroker.CapacityExhausted) as e:
            sa.lease(24 * MIB)
        err = _refusal(e, gpubroker.CapacityExhausted, "RESOURCE_EXHAUSTED", "CAPACITY_EXHAUSTED")
        assert err.details["free_bytes"] == str(16 * MIB)
        assert err.requested_bytes == 24 * MIB

        with pytest.raises(gpubroker.WaitTimeout) as e:
            sa.lease(24 * MIB, wait=0.3)
        err = _refusal(e, gpubroker.WaitTimeout, "DEADLINE_EXCEEDED", "WAIT_EXPIRED")
        assert err.cause == "CAPACITY_EXHAUSTED" and err.details["waited_ms"] == "300"
        held.release()


def test_lease_count_and_session_caps(make_broker):
    b = make_broker("--host-capacity", "64MiB", "--max-sessions-per-tenant", "1")
    w = gpubroker.connect(b.address, b.tenant("t", "32MiB", "--max-leases", "1"))
    with w.session("one") as s:
        with s.lease(2 * MIB):
            with pytest.raises(gpubroker.LeaseLimitReached) as e:
                s.lease(2 * MIB)
            err = _refusal(e, gpubroker.LeaseLimitReached, "RESOURCE_EXHAUSTED", "LEASE_COUNT_LIMIT")
            assert (err.details["lease_count"], err.details["max_leases"]) == ("1", "1")
        with pytest.raises(gpubroker.SessionLimitReached) as e:
            w.session("two")
        err = _refusal(e, gpubroker.SessionLimitReached, "RESOURCE_EXHAUSTED", "SESSION_LIMIT")
        assert err.details["open_sessions"] == "1"


def test_a_full_queue(make_broker):
    b = make_broker("--host-capacity", "8MiB", "--max-waiting-per-tenant", "1")
    w = gpubroker.connect(b.address, b.tenant("t", "64MiB"))
    with w.session("s") as s:
        full = s.lease(8 * MIB)
        waited = []

        def wait_for_memory():
            try:
                waited.append(s.lease(2 * MIB, wait=10))
            except gpubroker.BrokerError as err:  # noqa: PERF203
                waited.append(err)

        t = threading.Thread(target=wait_for_memory)
        t.start()
        wait_for(lambda: s.usage().waiting_requests >= 1, timeout=10, every=0.02)
        with pytest.raises(gpubroker.QueueFull) as e:
            s.lease(2 * MIB, wait=10)
        err = _refusal(e, gpubroker.QueueFull, "RESOURCE_EXHAUSTED", "QUEUE_FULL")
        assert err.details["queue"] == "lease" and err.details["waiting_requests"] == "1"
        full.release()
        t.join(15)
        assert isinstance(waited[0], gpubroker.Lease), waited
        waited[0].release()


def test_rate_limits(make_broker):
    b = make_broker("--host-capacity", "8MiB", "--tenant-rpc-rate", "1", "--tenant-rpc-burst", "5")
    w = gpubroker.connect(b.address, b.tenant("t", "8MiB"))
    with w.session("s") as s:
        with pytest.raises(gpubroker.RateLimited) as e:
            for _ in range(30):
                s.usage()
        err = _refusal(e, gpubroker.RateLimited, "RESOURCE_EXHAUSTED", "RATE_LIMITED")
        assert err.retry_after is not None and 0 < err.retry_after <= 1.0, err.details


def test_not_found_draining_and_no_device(make_broker):
    b = make_broker("--host-capacity", "64MiB")
    w = gpubroker.connect(b.address, b.tenant("t", "32MiB"))
    with w.session("s") as s:
        lease = s.lease(2 * MIB)
        b.ctl("leases", "revoke", lease.id, "--reason", "test")
        with pytest.raises(gpubroker.LeaseNotFound) as e:
            lease.release()
        err = _refusal(e, gpubroker.LeaseNotFound, "NOT_FOUND", "LEASE_NOT_FOUND")
        assert err.details["lease_id"] == lease.id

        b.ctl("drain", "--device", "0", "--reason", "firmware", "--no-wait")
        with pytest.raises(gpubroker.DeviceDraining) as e:
            s.lease(2 * MIB, device=0)
        err = _refusal(e, gpubroker.DeviceDraining, "FAILED_PRECONDITION", "DEVICE_DRAINING")
        assert err.details["device"] == "0" and "firmware" in str(err)
        assert isinstance(err, gpubroker.DeviceClosed)
        with pytest.raises(gpubroker.NoDeviceOpen) as e:
            s.lease(2 * MIB)
        _refusal(e, gpubroker.NoDeviceOpen, "UNAVAILABLE", "NO_DEVICE_OPEN")
        b.ctl("undrain", "--device", "0")
        b.ctl("mark-unhealthy", "0", "--reason", "test fault")
        with pytest.raises(gpubroker.DeviceUnhealthy) as e:
            s.lease(2 * MIB, device=0)
        _refusal(e, gpubroker.DeviceUnhealthy, "FAILED_PRECONDITION", "DEVICE_UNHEALTHY")


def test_unknown_device_and_too_long_a_wait(make_broker):
    b = make_broker("--host-capacity", "64MiB")
    w = gpubroker.connect(b.address, b.tenant("t", "32MiB"))
    with w.session("s") as s:
        with pytest.raises(gpubroker.InvalidArgument) as e:
            s.lease(2 * MIB, device=7)
        err = _refusal(e, gpubroker.InvalidArgument, "INVALID_ARGUMENT", "UNKNOWN_DEVICE")
        assert err.details["device"] == "7" and err.details["devices_of"] == "broker", err.details
        assert int(err.details["device_count"]) < 7, err.details
        with pytest.raises(gpubroker.InvalidArgument) as e:
            s.lease(2 * MIB, wait=7200.0)
        err = _refusal(e, gpubroker.InvalidArgument, "INVALID_ARGUMENT", "WAIT_TOO_LONG")
        assert err.details["wait_ms"] == "7200000", err.details
        assert err.details["max_wait_ms"] == "3600000", err.details


def test_an_unknown_token_is_told_from_an_expired_one(make_broker):
    b = make_broker("--host-capacity", "64MiB")
    with pytest.raises(gpubroker.Unauthenticated) as e:
        w = gpubroker.connect(b.address, "gpb_0000000000000000")
        w.session("s")
    err = _refusal(e, gpubroker.Unauthenticated, "UNAUTHENTICATED", "TOKEN_UNKNOWN")
    assert not isinstance(err, gpubroker.TokenExpired)
    expired = errors._make(
        gpubroker.Unauthenticated, "m", "UNAUTHENTICATED", "TOKEN_EXPIRED", {"token_id": "t1"}
    )
    assert type(expired) is gpubroker.TokenExpired and expired.details["token_id"] == "t1"


def test_shutting_down(make_broker):
    b = make_broker("--host-capacity", "64MiB", "--shutdown-grace", "10s")
    w = gpubroker.connect(b.address, b.tenant("t", "32MiB"))
    s = w.session("s")
    stream = s.events()
    held = s.lease(2 * MIB)  # keeps the broker in its grace period
    b.proc.send_signal(signal.SIGTERM)
    got = None
    deadline = time.time() + 10
    while time.time() < deadline and not isinstance(got, ev.ShuttingDown):
        got = stream.next(timeout=1)
    assert isinstance(got, ev.ShuttingDown), got
    with pytest.raises(gpubroker.ShuttingDown) as e:
        s.lease(2 * MIB)
    _refusal(e, gpubroker.ShuttingDown, "UNAVAILABLE", "SHUTTING_DOWN")
    held.release()
    s.close()
