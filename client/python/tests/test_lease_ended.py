"""A lease that ends between its grant and the fetch of its memory (the fd redeemed at the
ticket socket): `Session.lease` raises the package's NotFound, says why, and leaves
nothing held."""

import json
import socket
import threading
import time

import gpubroker

MIB = 1 << 20
BUSY = b"\x00"


def _leases(broker, tenant):
    return json.loads(broker.ctl("leases", "list", "--tenant", tenant, "--json"))


def test_a_lease_ended_before_its_memory_is_fetched_raises_not_found(broker):
    c = gpubroker.connect(broker.address, broker.tenant("late", "64MiB"))
    tickets = str(broker.socket.with_name("broker.tickets.sock"))
    with c.session("late") as s:
        # Every ticket connection this uid may hold is taken (each waits, sending nothing,
        # for up to the broker's 5 s read timeout): the client's presentation of its
        # ticket is answered "busy" and presented again after a pause, so the lease is
        # granted and its memory not fetched while the operator revokes it.
        held = []
        for _ in range(64):
            k = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            k.connect(tickets)
            held.append(k)
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
            deadline = time.time() + 20
            granted = []
            while not granted and time.time() < deadline:
                granted = _leases(broker, "late")
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
