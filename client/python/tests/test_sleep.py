"""Sleep and wake from Python (host backend): a Resident keeps its address across sleep
and wake, its contents when saved, releases the tenant's quota while asleep, and a wake is
refused or waits like a lease."""

import threading

import numpy as np
import pytest

import gpubroker
from conftest import wait_for

MIB = 1 << 20


def test_sleep_and_wake_keep_the_address_and_contents(make_broker):
    b = make_broker("--host-capacity", "64MiB")
    token = b.tenant("alice", "16MiB", "--host-limit", "16MiB")
    c = gpubroker.connect(b.address, token)
    with c.session("sleeper") as s:
        r = gpubroker.Resident(s.lease(8 * MIB))
        addr = r.addr
        a = r.as_numpy()
        a[:] = np.arange(a.size, dtype=np.uint64).astype(np.uint8)
        del a
        assert s.usage().held_bytes == 8 * MIB
        r.sleep(save=True)
        assert not r.awake and r.saved and r.lease_id is None
        u = s.usage()
        assert (u.held_bytes, u.host_held_bytes) == (0, 8 * MIB)
        with pytest.raises(gpubroker.FailedPrecondition):
            r.as_numpy()
        # While asleep the tenant's quota is free: another lease of the whole limit fits.
        other = s.lease(16 * MIB)
        with pytest.raises(gpubroker.QuotaExceeded):
            r.wake()
        assert not r.awake and r.saved
        t = threading.Timer(0.3, other.release)
        t.start()
        r.wake(wait=20)
        t.join()
        assert r.awake and r.addr == addr
        a = r.as_numpy()
        assert a.ctypes.data == addr
        assert (a == np.arange(a.size, dtype=np.uint64).astype(np.uint8)).all()
        assert s.usage().held_bytes == 8 * MIB and s.usage().host_held_bytes == 0
        del a
        r.sleep(save=False)
        assert s.usage().host_held_bytes == 0 and s.usage().held_bytes == 0
        r.wake()
        assert r.addr == addr
        r.release()
        assert s.usage().held_bytes == 0
        with pytest.raises(gpubroker.InvalidArgument):
            gpubroker.Resident(s.lease(2 * MIB)).wake(wait=-1)



def test_a_resident_sleeps_by_itself_on_a_reclaim_request(make_broker):
    b = make_broker("--host-capacity", "64MiB", "--reclaim-deadline", "20s")
    low = gpubroker.connect(
        b.address, b.tenant("low", "64MiB", "--priority", "0", "--host-limit", "64MiB")
    )
    high = gpubroker.connect(b.address, b.tenant("high", "64MiB", "--priority", "10"))
    with low.session("sleeper") as s:
        r = gpubroker.Resident(s.lease(48 * MIB, reclaimable=True))
        first = r.lease_id
        addr = r.addr
        a = r.as_numpy()
        want = (np.arange(a.size, dtype=np.uint64) * 7 % 251).astype(np.uint8)
        a[:] = want
        del a
        assert r.reclaim_sleeps == 0
        r.sleep_on_reclaim(save=True)
        with high.session("high") as hs:
            # Only the sleeper's lease can make room: the reclaim puts it to sleep, and the
            # waiting request is granted.
            got = hs.lease(32 * MIB, wait=20)
            assert got.nbytes == 32 * MIB
            wait_for(lambda: r.reclaim_sleeps != 0, timeout=10, every=0.01)
            assert r.reclaim_sleeps == 1 and r.take_reclaim_error() is None
            assert not r.awake and r.saved and r.lease_id is None
            u = s.usage()
            assert (u.held_bytes, u.host_held_bytes) == (0, 48 * MIB)
            with pytest.raises(gpubroker.FailedPrecondition):
                r.as_numpy()
            # Waking waits for the memory the other tenant holds.
            t = threading.Timer(0.3, got.release)
            t.start()
            r.wake(wait=20)
            t.join()
        assert r.awake and r.addr == addr and r.lease_id != first
        a = r.as_numpy()
        assert a.ctypes.data == addr and (a == want).all(), "contents restored in place"
        del a
        assert s.usage().held_bytes == 48 * MIB and s.usage().host_held_bytes == 0
        # Released: the watcher stops; nothing is left charged.
        r.release()
        assert s.usage().held_bytes == 0 and s.usage().host_held_bytes == 0
