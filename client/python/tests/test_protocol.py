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


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, value) -> bytes:
    """One protobuf field: a string (length-delimited), or an integer / bool (varint)."""
    if isinstance(value, str):
        data = value.encode()
        return _varint(num << 3 | 2) + _varint(len(data)) + data
    return _varint(num << 3) + _varint(int(value))


def _first_string(msg: bytes, num: int) -> bytes:
    """The first length-delimited field `num` of `msg` (a string or a message)."""
    i = 0
    while i < len(msg):
        key, i = _read_varint(msg, i)
        if key & 7 == 0:
            _, i = _read_varint(msg, i)
            continue
        assert key & 7 == 2, f"wire type {key & 7}"
        n, i = _read_varint(msg, i)
        if key >> 3 == num:
            return msg[i : i + n]
        i += n
    raise AssertionError(f"no field {num}")


def _read_varint(b: bytes, i: int):
    n = shift = 0
    while True:
        n |= (b[i] & 0x7F) << shift
        shift += 7
        i += 1
        if not b[i - 1] & 0x80:
            return n, i


def test_a_retained_block_on_a_lease_line_over_plain_python_sockets(broker):
    """docs/protocol.md's lease line from plain sockets: the session's own process (this
    one) opens its session's line with the hello and the session id, leases its retained
    block again with a framed AcquireLeaseRequest (no gRPC call) and releases it retained
    with a framed ReleaseLeaseRequest; another size is "not here"; a frame that is not one
    closes the line."""
    import socket
    import struct
    import uuid

    c = gpubroker.connect(broker.address, broker.tenant("alice"))
    with c.session("line") as s:
        s.retain_mappings(8 * MIB)
        lease = s.lease(2 * MIB)
        path, _ticket = lease._fresh_ticket()
        lease.release()
        assert s.retained_nbytes == 2 * MIB
        sid = s.id

        def frame(kind: int, body: bytes) -> bytes:
            return bytes([kind]) + struct.pack("<I", len(body)) + body

        def read_exact(sock, n: int) -> bytes:
            got = b""
            while len(got) < n:
                chunk = sock.recv(n - len(got))
                if not chunk:
                    return got
                got += chunk
            return got

        def ask(sock, kind: int, body: bytes):
            sock.sendall(frame(kind, body))
            head = read_exact(sock, 5)
            if len(head) < 5:
                return None
            (n,) = struct.unpack("<I", head[1:])
            return head[0], read_exact(sock, n)

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b"gpu-broker retained lease line 1" + uuid.UUID(sid).bytes)
        assert sock.recv(1) == b"\x06"
        acquire = _field(1, sid) + _field(2, 2 * MIB)
        kind, body = ask(sock, 0x01, acquire)
        assert kind == 0x01
        lease_id = _first_string(_first_string(body, 1), 1).decode()
        assert uuid.UUID(lease_id)
        # Another size: nothing done, for gRPC to answer.
        assert ask(sock, 0x01, _field(1, sid) + _field(2, 4 * MIB)) == (0x03, b"")
        release = _field(1, lease_id) + _field(2, True) + _field(3, True)
        kind, body = ask(sock, 0x02, release)
        assert kind == 0x02 and body == _field(1, True), "retained: true"
        assert ask(sock, 0x7F, b"") is None, "an unknown frame closes the line"
        sock.close()
        # The package's own next lease of that size is the block, retained again.
        again = s.lease(2 * MIB)
        assert again.retained
        again.release()
