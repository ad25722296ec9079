#!/usr/bin/env python3
"""A Python worker on the GPU machine: takes a lease from the broker over gRPC, opens its
CUDA IPC handle with CuPy, wraps it as a PyTorch tensor (zero-copy), and checks that a Rust
worker process sees what Python wrote (and the reverse).

Usage: gpu_python_worker.py SOCKET TOKEN DESCRIPTOR_SET GPU_WORKER_BINARY

The messages are built from the API's FileDescriptorSet (written by the proto crate's
build), so no generated code or grpcio-tools is needed. The README shows the usual
generated-code way.
"""
import subprocess
import sys

import cupy
import grpc
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

sock, token, fds_path, rust_worker = sys.argv[1:5]

fds = descriptor_pb2.FileDescriptorSet.FromString(open(fds_path, "rb").read())
pool = descriptor_pool.DescriptorPool()
for f in fds.file:
    pool.Add(f)


def msg(name):
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("gpubroker.v1." + name))


# tonic (h2) refuses the socket path as :authority, so name one.
ch = grpc.insecure_channel("unix://" + sock, options=[("grpc.default_authority", "localhost")])
md = [("authorization", "Bearer " + token)]


def unary(method, req, resp):
    return ch.unary_unary("/gpubroker.v1.Broker/" + method,
                          request_serializer=msg(req).SerializeToString,
                          response_deserializer=msg(resp).FromString)


open_session = ch.unary_stream("/gpubroker.v1.Broker/OpenSession",
                               request_serializer=msg("OpenSessionRequest").SerializeToString,
                               response_deserializer=msg("SessionEvent").FromString)
events = open_session(msg("OpenSessionRequest")(name="py-worker"), metadata=md)
session_id = next(events).opened.session_id

size = 256 << 20
lease = unary("AcquireLease", "AcquireLeaseRequest", "AcquireLeaseResponse")(
    msg("AcquireLeaseRequest")(session_id=session_id, bytes=size), metadata=md).lease
assert lease.WhichOneof("handle") == "cuda_ipc", lease
assert len(lease.cuda_ipc) == 64

with cupy.cuda.Device(lease.device):
    ptr = cupy.cuda.runtime.ipcOpenMemHandle(lease.cuda_ipc)
    mem = cupy.cuda.UnownedMemory(ptr, lease.bytes, owner=None)
    arr = cupy.ndarray((lease.bytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    t = torch.as_tensor(arr, device="cuda:%d" % lease.device)
    assert t.data_ptr() == ptr, "tensor is not zero-copy"
    t.fill_(0x5A)
    torch.cuda.synchronize()
    # A Rust worker opens the same handle in its own process, checks and writes.
    out = subprocess.run([rust_worker, "open", "--handle", lease.cuda_ipc.hex(),
                          "--device", str(lease.device), "--bytes", str(lease.bytes),
                          "--expect", "5a", "--write", "77"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "OK", (out.stdout, out.stderr)
    torch.cuda.synchronize()
    first = int(t[0].item())
    rest_ok = bool((t[4096:] == 0x5A).all().item())
    assert first == 0x77, "python did not see the rust write: %#x" % first
    assert rest_ok
    del t, arr, mem
    cupy.cuda.runtime.ipcCloseMemHandle(ptr)

unary("ReleaseLease", "ReleaseLeaseRequest", "ReleaseLeaseResponse")(
    msg("ReleaseLeaseRequest")(lease_id=lease.lease_id), metadata=md)
events.cancel()
print("PYTHON-OK lease=%s device=%d bytes=%d: CuPy+PyTorch wrote 0x5a, Rust saw it and wrote 0x77, Python saw that"
      % (lease.lease_id, lease.device, lease.bytes))
