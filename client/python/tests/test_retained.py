"""Retained blocks from Python (`Session.retain_mappings`) on the host backend: a released
lease's block stays mapped in this process and comes back as the next lease of its size,
at the same address, with no ticket; the broker asks for it back when another tenant
waits and the package lets go by itself; another process never gets it."""

from __future__ import annotations

import mmap
import subprocess
import sys

import numpy as np

import gpubroker

from conftest import MIB, wait_for


def _addr(view) -> int:
    return view.__array_interface__["data"][0]


def _occupy(nbytes: int) -> mmap.mmap:
    """A new anonymous mapping: were a released lease's range unmapped, it would likely
    land there, and the next lease be mapped elsewhere."""
    m = mmap.mmap(-1, nbytes)
    m[0:1] = b"\0"
    return m


def test_a_released_lease_comes_back_mapped_at_its_address_with_no_ticket(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t", "64MiB"))
    with b.session("w") as s:
        assert s.retained_nbytes == 0
        s.retain_mappings(16 * MIB)
        lease = s.lease(4 * MIB)
        assert not lease.retained, "a fresh block comes with a ticket"
        view = lease.as_numpy()
        view[:] = 0x5A
        addr = _addr(view)
        del view
        lease.release()
        assert s.retained_nbytes == 4 * MIB
        u = s.usage()
        assert (u.held_bytes, u.quarantined_bytes) == (0, 4 * MIB), "counted to its tenant"
        other = _occupy(4 * MIB)

        again = s.lease(4 * MIB)
        assert again.retained
        assert s.retained_nbytes == 0
        view = again.as_numpy()
        assert _addr(view) == addr, "the same mapping, not a new one"
        assert (view == 0x5A).all()
        # Another size is another block; a `with` block's release retains too.
        with s.lease(2 * MIB) as small:
            assert not small.retained
        assert s.retained_nbytes == 2 * MIB
        del view
        again.release()
        assert s.retained_nbytes == 6 * MIB
        other.close()

        s.drop_retained()
        assert s.retained_nbytes == 0
        u = s.usage()
        assert (u.held_bytes, u.quarantined_bytes) == (0, 0)
        # Off: a release gives the block back.
        s.retain_mappings(0)
        s.lease(4 * MIB).release()
        assert s.retained_nbytes == 0 and s.usage().quarantined_bytes == 0


def test_a_resident_released_keeps_its_range_for_the_next_lease_of_its_block(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t", "64MiB"))
    with b.session("w") as s:
        s.retain_mappings(8 * MIB)
        r = gpubroker.Resident(s.lease(4 * MIB))
        view = r.as_numpy()
        view[:] = 7
        addr = r.addr
        del view
        r.release()
        assert s.retained_nbytes == 4 * MIB
        other = _occupy(4 * MIB)
        lease = s.lease(4 * MIB)
        assert lease.retained
        r = gpubroker.Resident(lease)
        assert r.addr == addr, "the range it had, mapped already"
        view = r.as_numpy()
        assert (view == 7).all()
        # A sleep gives the memory back: nothing retained, nothing held.
        del view
        r.sleep(save=False)
        assert s.retained_nbytes == 0
        u = s.usage()
        assert (u.held_bytes, u.quarantined_bytes) == (0, 0)
        r.release()
        other.close()


def test_the_package_lets_a_retained_block_go_when_another_tenant_waits(make_broker):
    br = make_broker("--host-capacity", "64MiB")
    a = gpubroker.connect(br.address, br.tenant("a", "64MiB"))
    bob = gpubroker.connect(br.address, br.tenant("b", "64MiB"))
    with a.session("a") as sa, bob.session("b") as sb:
        sa.retain_mappings(64 * MIB)
        sa.lease(48 * MIB).release()
        assert sa.retained_nbytes == 48 * MIB
        # Without the give-back the wait would run out: the card holds only 16 MiB more.
        got = sb.lease(32 * MIB, wait=10)
        assert got.nbytes == 32 * MIB
        assert (got.as_numpy() == 0).all(), "fresh memory, never the other tenant's block"
        assert wait_for(lambda: sa.retained_nbytes == 0, timeout=5)
        assert sa.usage().quarantined_bytes == 0


CHILD = """
import sys, gpubroker
s = gpubroker.connect(sys.argv[1], sys.argv[2]).session("child")
s.retain_mappings(16 << 20)
lease = s.lease(4 << 20)
print(lease.retained, int(lease.as_numpy()[0]))
"""


def test_a_retained_block_goes_back_only_to_the_process_that_retained_it(broker):
    token = broker.tenant("t", "64MiB")
    b = gpubroker.connect(broker.address, token)
    with b.session("w") as s:
        s.retain_mappings(16 * MIB)
        lease = s.lease(4 * MIB)
        view = lease.as_numpy()
        view[:] = 9
        del view
        lease.release()
        assert s.retained_nbytes == 4 * MIB
        # Another process of the same tenant, asking for the same size: another block.
        out = subprocess.run([sys.executable, "-c", CHILD, broker.address, token],
                             check=True, capture_output=True, text=True, timeout=60).stdout
        assert out.split() == ["False", "0"], out
        assert s.retained_nbytes == 4 * MIB
        assert s.lease(4 * MIB).retained
