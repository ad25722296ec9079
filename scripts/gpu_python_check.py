#!/usr/bin/env python3
"""The GPU machine's check of the `gpubroker` package (run by scripts/gpu-python-check.sh).

Subcommands (each prints one `RESULT {json}` line; `all` runs them and checks):
  roundtrip   as_torch in one process, as_cupy in another, as_torch again: bytes written
              by each are seen by the next (same tenant, the block comes back pooled); and
              what NVML attributes to a process that maps a lease, per handle kind
  train       a small transformer trained on random data, unmodified, under
              `gpubroker.torch.install()` (--mode broker) or PyTorch's own allocator
              (--mode native): steps/s, peak reserved, broker calls per step after warm-up,
              whether every CUDA allocation went to leases, refusals of unsupported uses
  hog         a second tenant's job that wants more than the card has left: it must wait
              GPU_BROKER_WAIT and then get torch.OutOfMemoryError with the broker's reason
  latency     pooled lease() + release() latency from Python (--retained: of a block the
              session retains, on its lease line unless GPU_BROKER_CLIENT_LEASE_LINE=off)
  multistream blocks used on a side stream (record_stream): reserved memory with and
              without gpubroker.torch.reuse_stream_blocks()
  retain      gpubroker.torch with retained segments (install(retain=...), --retain 0:
              off): a tensor of a segment's size made, freed and empty_cache()d in a loop;
              with retain each new segment is the released one (same address, bytes kept,
              memory_stats()["retained_acquires"]), and letting go leaves nothing counted;
              --mode native: the same loop under PyTorch's own allocator (its baseline)

`train --mode pool-native` runs the broker mode's pool routing over PyTorch's own
cudaMalloc, to tell the routing's cost from the leases' (scripts/gpu-python-bench.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

MIB = 1 << 20
GIB = 1 << 30


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def nvml_used(pid: int):
    """MiB NVML attributes to `pid` (None when nvidia-smi does not list it)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return None


# ---------------------------------------------------------------- roundtrip
def roundtrip(args):
    import gpubroker
    import torch

    b = gpubroker.connect()
    n = 256 * MIB
    with b.session("rt-torch") as s:
        lease = s.lease(n)
        kind = lease.handle_kind
        t = lease.as_torch(torch.int32)
        t.copy_(torch.arange(t.numel(), dtype=torch.int32, device=t.device))
        torch.cuda.synchronize()
        first = lease.id
        del t
        lease.release()
        # Another process maps the same (pooled) block with CuPy, checks, doubles it.
        child = subprocess.run([sys.executable, __file__, "roundtrip-cupy", "--nbytes", str(n)],
                               capture_output=True, text=True, timeout=300)
        sys.stderr.write(child.stderr)
        line = [l for l in child.stdout.splitlines() if l.startswith("RESULT ")]
        cp = json.loads(line[-1][7:]) if line else {"error": child.stdout[-2000:]}
        lease = s.lease(n)
        t = lease.as_torch(torch.int32)
        expect = torch.arange(t.numel(), dtype=torch.int32, device=t.device) * 2
        back_ok = bool(torch.equal(t, expect))
        third = lease.id
        del t, expect
        lease.release()
    result(step="roundtrip", handle_kind=kind, leases=[first, cp.get("lease"), third],
           cupy_saw_torch=cp.get("saw_torch"), torch_saw_cupy=back_ok,
           nvml=cp.get("nvml"), ok=bool(cp.get("saw_torch")) and back_ok)


def roundtrip_cupy(args):
    import cupy
    import gpubroker

    b = gpubroker.connect()
    with b.session("rt-cupy") as s:
        lease = s.lease(args.nbytes)
        cupy.cuda.runtime.setDevice(lease.device)
        cupy.zeros(1)  # the context, before measuring
        before = nvml_used(os.getpid())
        a = lease.as_cupy("int32")
        cupy.cuda.runtime.deviceSynchronize()
        mapped = nvml_used(os.getpid())
        saw = bool((a == cupy.arange(a.size, dtype=cupy.int32)).all())
        a *= 2
        cupy.cuda.runtime.deviceSynchronize()
        del a
        lease_id = lease.id
        # A fresh 1 GiB lease, mapped: how much of it NVML puts on this process.
        big = s.lease(GIB)
        pre = nvml_used(os.getpid())
        v = big.as_cupy("uint8")
        v[:1] = 1
        cupy.cuda.runtime.deviceSynchronize()
        post = nvml_used(os.getpid())
        del v
        big.release()
        lease.release()
    result(lease=lease_id, saw_torch=saw, nvml={
        "handle_kind": big.handle_kind, "context_mib": before, "with_256mib_mapped": mapped,
        "before_1gib_map": pre, "after_1gib_map": post,
        "attributed_mib_per_gib": None if pre is None or post is None else post - pre})


# ---------------------------------------------------------------- train
def build(torch, d_model=512, layers=6, vocab=8192):
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d_model)
            layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, batch_first=True,
                                               norm_first=True, dropout=0.1)
            self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, x):
            return self.head(self.enc(self.emb(x)))

    return Net()


def train(args):
    if args.mode == "broker":
        import gpubroker.torch as gt

        gt.install(wait=args.wait)
    import torch
    import torch.nn.functional as F

    if args.mode == "pool-native":
        # The broker mode's routing (every thread and stream to one MemPool) over
        # PyTorch's own cudaMalloc: separates the routing's cost from the leases'.
        native_pool = torch.cuda.MemPool()
        torch._C._cuda_beginAllocateToPool(0, native_pool.id)

    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    model = build(torch).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab, batch, seq = 8192, args.batch, 256

    def step():
        x = torch.randint(0, vocab, (batch, seq), device=dev)
        y = torch.randint(0, vocab, (batch, seq), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().view(-1, vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    oom = None
    try:
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        s0 = gt.memory_stats() if args.mode == "broker" else None
        if args.ready_file:
            open(args.ready_file, "w").close()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        while args.hold_until and not os.path.exists(args.hold_until):
            step()
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        oom = str(e)
        dt = float("nan")
    out = {"step": "train", "mode": args.mode, "steps": args.steps,
           "steps_per_s": args.steps / dt if dt == dt else None, "oom": oom,
           "peak_torch_reserved": torch.cuda.max_memory_reserved(dev),
           "peak_torch_allocated": torch.cuda.max_memory_allocated(dev),
           "torch_reserved": torch.cuda.memory_reserved(dev),
           "nvml_mib": nvml_used(os.getpid()), "pid": os.getpid(),
}
    if args.mode == "pool-native":
        torch._C._cuda_endAllocateToPool(0, native_pool.id)
    if args.mode == "broker":
        s1 = gt.memory_stats()
        out.update(
            broker_calls_per_step=(s1["broker_calls"] - s0["broker_calls"]) / args.steps if s0 else None,
            hook_allocs_per_step=(s1["allocs"] - s0["allocs"]) / args.steps if s0 else None,
            leased=s1["leased_bytes"], peak_leased=s1["peak_reserved_bytes"],
            segments=s1["segments"], hook_allocated=s1["allocated_bytes"],
            all_in_leases=s1["allocated_bytes"] == torch.cuda.memory_reserved(dev),
            usage=_usage(gt.session().usage()), stats=s1)
    result(**out)
    if args.mode != "broker":
        return
    extra = {"step": "train-extra"}
    try:
        # Allocations of autograd's backward thread: a backward pass on a fresh graph
        # (the engine's device thread allocates the gradients).
        # (If PyTorch's cache has room no new segment is needed; what counts is that every
        # byte PyTorch reserved came through the hook.)
        w = torch.randn(4096, 4096, device=dev, requires_grad=True)
        (w * 2).sum().backward()
        torch.cuda.synchronize()
        extra["backward_all_in_leases"] = (
            gt.memory_stats()["allocated_bytes"] == torch.cuda.memory_reserved(dev))
        del w
    except Exception as e:  # noqa: BLE001 - report and go on
        extra["backward_error"] = repr(e)[:300]
    extra["refusals"] = _refusals(torch)
    try:
        del model, opt
        torch.cuda.synchronize()
        before = gt.memory_stats()["leased_bytes"]
        released = gt.empty_cache()
        after = gt.memory_stats()
        extra["empty_cache"] = {"leased_before": before, "released": released,
                                "leased_after": after["leased_bytes"],
                                "segments_after": after["segments"],
                                "torch_reserved_after": torch.cuda.memory_reserved(dev)}
        # Training goes on after empty_cache (the routing is back on the new pool).
        x = torch.randn(1024, 1024, device=dev)
        extra["after_empty_cache_in_leases"] = (
            gt.memory_stats()["allocated_bytes"] == torch.cuda.memory_reserved(dev))
        del x
    except Exception as e:  # noqa: BLE001
        extra["empty_cache_error"] = repr(e)[:300]
    result(**extra)


def _usage(u):
    return {"tenant": u.tenant, "limit": u.limit_bytes, "held": u.held_bytes, "leases": u.lease_count}


def _refusals(torch):
    got = {}
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.zeros(1, device="cuda")
        got["cuda_graph"] = "captured (not refused)"
    except RuntimeError as e:
        got["cuda_graph"] = str(e)[:120]
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())
    try:
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler.dumps(torch.zeros(4, device="cuda"))
        got["torch_multiprocessing"] = "pickled (not refused)"
    except RuntimeError as e:
        got["torch_multiprocessing"] = str(e)[:120]
    return got


# ---------------------------------------------------------------- multistream
def multistream(args):
    """Blocks used on a second stream (record_stream): does memory stay bounded? Each
    iteration allocates 64 MiB on the default stream, uses it on a side stream and marks
    it (record_stream), then drops it. PyTorch defers such blocks' reuse while pool
    routing is active; under the broker, reuse_stream_blocks() every --every iterations
    (0: never) makes them reusable."""
    if args.mode == "broker":
        import gpubroker.torch as gt

        gt.install(wait=args.wait)
    import torch

    dev = torch.device("cuda:0")
    side = torch.cuda.Stream()
    reserved = []
    t0 = time.perf_counter()
    for i in range(args.iters):
        x = torch.empty(64 * MIB // 4, dtype=torch.float32, device=dev)
        x.fill_(1.0)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul_(2.0)
        x.record_stream(side)
        del x
        if args.mode == "broker" and args.every and (i + 1) % args.every == 0:
            gt.reuse_stream_blocks()
        reserved.append(torch.cuda.memory_reserved(dev))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {"step": "multistream", "mode": args.mode, "every": args.every, "iters": args.iters,
           "reserved_first": reserved[0], "reserved_last": reserved[-1],
           "reserved_max": max(reserved), "iters_per_s": args.iters / dt}
    if args.mode == "broker":
        st = gt.memory_stats()
        out.update(leased=st["leased_bytes"], segments=st["segments"],
                   broker_calls=st["broker_calls"])
    result(**out)


# ---------------------------------------------------------------- hog
def hog(args):
    import gpubroker.torch as gt

    gt.install(wait=args.wait)
    import torch

    t0 = time.perf_counter()
    try:
        x = torch.empty(args.nbytes, dtype=torch.uint8, device="cuda:0")
        x.fill_(1)
        torch.cuda.synchronize()
        result(step="hog", got_memory=True, waited_s=time.perf_counter() - t0)
    except torch.OutOfMemoryError as e:
        result(step="hog", got_memory=False, exception=type(e).__name__,
               waited_s=time.perf_counter() - t0, message=str(e)[:600],
               stats=gt.memory_stats())


# ---------------------------------------------------------------- latency
def latency(args):
    import gpubroker

    b = gpubroker.connect()
    with b.session("py-latency") as s:
        if args.retained:
            # Each lease after the first is the block the last release retained.
            s.retain_mappings(args.nbytes)
        acquire, release = [], []
        for _ in range(args.iters + 1):
            t0 = time.perf_counter()
            lease = s.lease(args.nbytes)
            t1 = time.perf_counter()
            lease.release()
            t2 = time.perf_counter()
            acquire.append((t1 - t0) * 1e6)
            release.append((t2 - t1) * 1e6)
    result(step="latency", nbytes=args.nbytes, retained=args.retained,
           lease_line=os.environ.get("GPU_BROKER_CLIENT_LEASE_LINE", "on"), fresh_us=acquire[0],
           pooled_acquire_median_us=statistics.median(acquire[1:]),
           pooled_acquire_p90_us=sorted(acquire[1:])[int(0.9 * args.iters)],
           release_median_us=statistics.median(release))


# ---------------------------------------------------------------- retain
def torch_segment_bytes(n):
    """The segment PyTorch's caching allocator asks its allocator for, for one tensor of n
    bytes: its small pool's 2 MiB up to 1 MiB, 20 MiB below 10 MiB, else n in 2 MiB steps."""
    if n <= MIB:
        return 2 * MIB
    if n < 10 * MIB:
        return 20 * MIB
    return -(-n // (2 * MIB)) * 2 * MIB


def retain(args):
    import torch

    if args.mode == "native":
        return retain_native(args)
    import gpubroker
    import gpubroker.torch as gt

    s = gpubroker.connect().session("py-retain")
    segment = torch_segment_bytes(args.nbytes)
    gt.install(s, segment_size=segment, retain=args.retain)
    dev = torch.device("cuda")
    took, ptrs, kept = [], [], True
    for i in range(args.iters + 1):
        t0 = time.perf_counter()
        x = torch.empty(args.nbytes, dtype=torch.uint8, device=dev)
        took.append((time.perf_counter() - t0) * 1e6)
        ptrs.append(x.data_ptr())
        if i > 0 and args.retain:
            kept = kept and int(x[-1].item()) == (i - 1) % 256
        x[-1] = i % 256
        torch.cuda.synchronize()
        del x
        gt.empty_cache()
    st = gt.memory_stats()
    retained_before = s.retained_nbytes
    s.drop_retained()
    u = s.usage()
    on = args.retain > 0
    ok = (u.held_bytes == 0 and u.quarantined_bytes == 0 and s.retained_nbytes == 0
          and (not on or (st["retained_acquires"] == args.iters and len(set(ptrs)) == 1
                          and kept and retained_before == segment)))
    result(step="retain", retain=args.retain, nbytes=args.nbytes, segment=segment, ok=ok,
           lease_line=os.environ.get("GPU_BROKER_CLIENT_LEASE_LINE", "on"),
           first_us=round(took[0], 1), again_median_us=round(statistics.median(took[1:]), 1),
           again_p90_us=round(sorted(took[1:])[int(0.9 * args.iters)], 1),
           retained_acquires=st["retained_acquires"], broker_acquires=st["broker_acquires"],
           distinct_addresses=len(set(ptrs)), bytes_kept=kept,
           left_held=u.held_bytes, left_quarantined=u.quarantined_bytes)
    sys.exit(0 if ok else 1)


def retain_native(args):
    """The retain loop under PyTorch's own allocator, the baseline of a retained segment's
    lease + map: each tensor a cudaMalloc of its own (run with
    PYTORCH_NO_CUDA_MEMORY_CACHING=1, so of the tensor's size: the caching allocator would
    ask the driver for 20 MiB for a tensor between 1 and 10 MiB)."""
    import torch

    dev = torch.device("cuda")
    took = []
    for i in range(args.iters + 1):
        t0 = time.perf_counter()
        x = torch.empty(args.nbytes, dtype=torch.uint8, device=dev)
        took.append((time.perf_counter() - t0) * 1e6)
        x[-1] = i % 256
        torch.cuda.synchronize()
        del x
        torch.cuda.empty_cache()
    result(step="retain", mode="native", nbytes=args.nbytes, ok=True,
           caching=os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1",
           first_us=round(took[0], 1), again_median_us=round(statistics.median(took[1:]), 1),
           again_p90_us=round(sorted(took[1:])[int(0.9 * args.iters)], 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd")
    p.add_argument("--mode", default="broker")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--wait", type=float, default=60.0)
    p.add_argument("--nbytes", type=int, default=64 * MIB)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--ready-file")
    p.add_argument("--hold-until")
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--retain", type=int, default=64 * MIB)
    p.add_argument("--retained", action="store_true")
    args = p.parse_args()
    {"roundtrip": roundtrip, "roundtrip-cupy": roundtrip_cupy, "train": train, "hog": hog,
     "latency": latency, "multistream": multistream, "retain": retain}[args.cmd](args)


if __name__ == "__main__":
    main()
