#!/usr/bin/env python3
"""The "other language" fd importer on the GPU machine: a Python worker that speaks the
lease protocol with nothing but grpcio, the standard library's socket.recv_fds and
cuda-python (docs/protocol.md). It acquires a lease accepting only fd handles, redeems the
ticket at the broker's ticket socket, imports the CUDA VMM memory
(cuMemImportFromShareableHandle, reserve, map, set access), fills it, has a Rust worker of
the same tenant open the same lease in its own process (with a ticket of its own), sees the
Rust worker's write, then unmaps and releases in the right order. It also checks that the
ticket, once used, is refused.

Usage: gpu_python_fd_worker.py SOCKET TOKEN DESCRIPTOR_SET GPU_WORKER_BINARY
"""
import socket
import subprocess
import sys
import time

import grpc
from cuda.bindings import driver as cu
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

sock, token, fds_path, rust_worker = sys.argv[1:5]

fds = descriptor_pb2.FileDescriptorSet.FromString(open(fds_path, "rb").read())
pool = descriptor_pool.DescriptorPool()
for f in fds.file:
    pool.Add(f)


def msg(name):
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("gpubroker.v1." + name))


def enum(name, value):
    return pool.FindEnumTypeByName("gpubroker.v1." + name).values_by_name[value].number


ch = grpc.insecure_channel("unix://" + sock, options=[("grpc.default_authority", "localhost")])
md = [("authorization", "Bearer " + token)]


def unary(method, req, resp):
    return ch.unary_unary("/gpubroker.v1.Broker/" + method,
                          request_serializer=msg(req).SerializeToString,
                          response_deserializer=msg(resp).FromString)


def ok(r, what):
    err = r[0] if isinstance(r, tuple) else r
    assert err == cu.CUresult.CUDA_SUCCESS, (what, err)
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r[1:] if isinstance(r, tuple) else None


def redeem(path, ticket):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(ticket)
    data, fds, _flags, _addr = socket.recv_fds(s, 1, 1)
    s.close()
    return data, fds


open_session = ch.unary_stream("/gpubroker.v1.Broker/OpenSession",
                               request_serializer=msg("OpenSessionRequest").SerializeToString,
                               response_deserializer=msg("SessionEvent").FromString)
events = open_session(msg("OpenSessionRequest")(name="py-fd-worker"), metadata=md)
session_id = next(events).opened.session_id

size = 256 << 20
t0 = time.perf_counter()
lease = unary("AcquireLease", "AcquireLeaseRequest", "AcquireLeaseResponse")(
    msg("AcquireLeaseRequest")(session_id=session_id, bytes=size,
                               accept_handles=[enum("HandleKind", "HANDLE_KIND_FD")]),
    metadata=md).lease
assert lease.WhichOneof("handle") == "fd", lease
h = lease.fd
assert h.memory_kind == enum("MemoryKind", "MEMORY_KIND_CUDA_VMM"), h
assert len(h.ticket) == 32
data, got = redeem(h.socket_path, h.ticket)
assert data == b"\x01" and len(got) == 1, (data, got)
fd = got[0]
# The ticket is single use.
data2, got2 = redeem(h.socket_path, h.ticket)
assert data2 == b"" and not got2, "a used ticket must get nothing"

ok(cu.cuInit(0), "cuInit")
dev = ok(cu.cuDeviceGet(lease.device), "cuDeviceGet")
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
handle = ok(cu.cuMemImportFromShareableHandle(
    fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
    "cuMemImportFromShareableHandle")
import os
os.close(fd)  # the import holds the memory
ptr = ok(cu.cuMemAddressReserve(h.size, 0, 0, 0), "cuMemAddressReserve")
ok(cu.cuMemMap(ptr, h.size, 0, handle, 0), "cuMemMap")
acc = cu.CUmemAccessDesc()
acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
acc.location.id = lease.device
acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
ok(cu.cuMemSetAccess(ptr, h.size, [acc], 1), "cuMemSetAccess")
mapped_ms = (time.perf_counter() - t0) * 1e3
ok(cu.cuMemsetD8(ptr, 0x5A, lease.bytes), "cuMemsetD8")
ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")

# A Rust worker of the same tenant opens the same lease in its own process.
out = subprocess.run([rust_worker, "--broker", "unix://" + sock, "--token", token,
                      "open", "--handle", "fd:%d" % h.block_id, "--lease", lease.lease_id,
                      "--device", str(lease.device), "--bytes", str(lease.bytes),
                      "--expect", "5a", "--write", "77"],
                     capture_output=True, text=True, timeout=120)
assert out.returncode == 0 and out.stdout.strip() == "OK", (out.stdout, out.stderr)

buf = bytearray(8192)
ok(cu.cuMemcpyDtoH(buf, ptr, len(buf)), "cuMemcpyDtoH")
assert buf[0] == 0x77 and buf[4095] == 0x77 and buf[4096] == 0x5A, (buf[0], buf[4095], buf[4096])

# Unmap and release our import, then give the lease back.
ok(cu.cuMemUnmap(ptr, h.size), "cuMemUnmap")
ok(cu.cuMemRelease(handle), "cuMemRelease")
ok(cu.cuMemAddressFree(ptr, h.size), "cuMemAddressFree")
unary("ReleaseLease", "ReleaseLeaseRequest", "ReleaseLeaseResponse")(
    msg("ReleaseLeaseRequest")(lease_id=lease.lease_id), metadata=md)
events.cancel()
print("PYTHON-FD-OK lease=%s device=%d bytes=%d block=%d: acquire+ticket+import+map %.2f ms; "
      "Python wrote 0x5a, a Rust process (own ticket) saw it and wrote 0x77, Python saw that; "
      "the used ticket was refused" % (lease.lease_id, lease.device, lease.bytes, h.block_id,
                                         mapped_ms))
