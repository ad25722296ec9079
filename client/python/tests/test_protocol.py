"""The fd lease wire protocol from plain Python (no client library on the socket)."""

import gpubroker

MIB = 1 << 20


def test_a_lease_fd_over_plain_python_sockets(broker):
    """docs/protocol.md: connect, send the ticket, receive one byte with one descriptor in
    SCM_RIGHTS (socket.recv_fds); a used ticket gets nothing."""
    import mmap
    import os
    import socket

    c = gpubroker.connect(broker.address, broker.tenant("alice"))
    with c.session("plain") as s:
        lease = s.lease(2 * MIB)
        lease.as_numpy()[:4] = [1, 2, 3, 4]
        path, ticket = lease._fresh_ticket()
        assert len(ticket) == 32

        def redeem(t):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(t)
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
            sock.close()
            return msg, fds

        msg, fds = redeem(ticket)
        assert msg == b"\x01" and len(fds) == 1
        fd = fds[0]
        assert os.fstat(fd).st_size >= 2 * MIB
        mem = mmap.mmap(fd, 2 * MIB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        assert mem[:4] == bytes([1, 2, 3, 4])
        mem[4] = 9
        assert lease.as_numpy()[4] == 9
        mem.close()
        # The same ticket again: the connection closes with nothing sent.
        msg, fds = redeem(ticket)
        assert (msg, fds) == (b"", [])
        # So does a forged one.
        assert redeem(bytes(32)) == (b"", [])
        # A ticket whose lease ended before it was redeemed: one byte 0x02, no descriptor,
        # for its rightful holder, once; then the bare close.
        gone = s.lease(2 * MIB)
        _path, late = gone._fresh_ticket()
        gone.release()
        assert redeem(late) == (b"\x02", [])
        assert redeem(late) == (b"", [])
