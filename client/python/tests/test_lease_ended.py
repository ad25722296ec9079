"""A lease that ends between its grant and the fetch of its memory (the fd redeemed at the
ticket socket): `Session.lease` raises the package's NotFound, says why, and leaves
nothing held."""

import json
import select
import socket
import threading

import gpubroker
from conftest import wait_for

MIB = 1 << 20
BUSY = b"\x00"


def _leases(broker, tenant):
    return json.loads(broker.ctl("leases", "list", "--tenant", tenant, "--json"))


def _take_every_ticket_connection(path, batch=16, most=1024):
    """Connects to the ticket socket at `path`, `batch` at a time, until the broker answers
    one "busy" (the connections this uid may hold are all taken); the connections it
    holds (each waits, sending nothing, for the broker's read timeout)."""
    held = []
    while len(held) < most:
        new = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(batch)]
        for k in new:
            k.connect(path)
        # One told busy is answered at once; one held hears nothing until its timeout.
        answered, _, _ = select.select(new, [], [], 0.2)
        for k in answered:
            k.close()
        held += [k for k in new if k not in answered]
        if answered:
            return held
    raise AssertionError(f"{most} ticket connections and none told busy")


def test_a_lease_ended_before_its_memory_is_fetched_raises_not_found(broker):
    c = gpubroker.connect(broker.address, broker.tenant("late", "64MiB"))
    tickets = str(broker.tickets)
    with c.session("late") as s:
        # Every ticket connection this uid may hold is taken (each waits, sending nothing,
        # for up to the broker's 5 s read timeout): the client's presentation of its
        # ticket is answered "busy" and presented again after a pause, so the lease is
        # granted and its memory not fetched while the operator revokes it.
        held = _take_every_ticket_connection(tickets)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(10)
        probe.connect(tickets)
        assert probe.recv(1) == BUSY, "the ticket socket is full"
        probe.close()

        result = {}

        def ask():
            try:
                result["lease"] = s.lease(2 * MIB)
            except Exception as e:  # the outcome is checked below
                result["error"] = e

        t = threading.Thread(target=ask)
        t.start()
        try:
            granted = wait_for(lambda: _leases(broker, "late"))
            assert len(granted) == 1, granted
            broker.ctl("leases", "revoke", granted[0]["lease_id"], "--reason", "test")
        finally:
            for k in held:
                k.close()
        t.join(30)
        assert not t.is_alive()
        err = result.get("error")
        assert isinstance(err, gpubroker.NotFound), result
        assert err.code == "NOT_FOUND"
        assert "before its memory was fetched" in str(err), str(err)
        # Nothing of it is left, and the session goes on.
        assert _leases(broker, "late") == []
        again = s.lease(2 * MIB)
        again.as_numpy()[:2] = [7, 8]
        assert list(again.as_numpy()[:2]) == [7, 8]
        again.release()
