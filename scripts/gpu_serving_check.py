#!/usr/bin/env python3
"""The GPU machine's check of serving on broker leases (run by scripts/gpu-serving-check.sh).

Subcommands (each prints one `RESULT {json}` line with an `ok` verdict):
  quota        an allocation over the tenant's quota fails at once (GPU_BROKER_WAIT=30 is
               not waited) with the broker's reason; tensors fill >= 99% of the quota
               (memory-limit accuracy); cuDNN convolutions with benchmark
               mode near the quota cost no wait either
  multistream  blocks used on a side stream (record_stream), nobody calling
               reuse_stream_blocks(): PyTorch's reserved memory stays bounded
  graph        torch.cuda.graph of a decode step under install(): the graph's pool is in
               leases (leased bytes and the tenant's held bytes grow at capture), replays
               match eager and take no new memory, a second graph shares a pool, freeing
               the graphs + empty_cache() gives the leases back; torch.compile
               mode="reduce-overhead" runs and matches eager
  decode       one timing round of a captured decode loop (--mode native|broker): what
               `bench` interleaves
  memsaver     code written for the real torch_memory_saver package, its singleton on
               broker leases (gpubroker.torch_memory_saver.install()): regions with tags,
               pause(tag) drops the tenant's held bytes and another tenant is granted
               them, resume(tag) at the same addresses (contents back with CPU backup),
               its cuda_graph helper's graph paused and replayed
  memsaver-reclaim  the same with pause_on_reclaim: a higher-priority tenant's request
               pauses the region by itself
  mp           torch.multiprocessing (spawn) of CUDA tensors on leases to a process of the
               same tenant: it reads them, writes into one, the sender sees the write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20
GIB = 1 << 30


FAILED = []


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
    if kw.get("ok") is False:
        FAILED.append(kw.get("step"))


def _held():
    import gpubroker.torch as gt

    return gt.session().usage().held_bytes


# ---------------------------------------------------------------- quota
def quota(args):
    import gpubroker.torch as gt

    gt.install()  # GPU_BROKER_WAIT from the environment (the script sets 30 s)
    import torch

    limit = gt.session().usage().limit_bytes
    keep = torch.empty(limit - 512 * MIB, dtype=torch.uint8, device="cuda")
    t0 = time.perf_counter()
    try:
        torch.empty(GIB, dtype=torch.uint8, device="cuda")
        refused = None
    except torch.OutOfMemoryError as e:
        refused = {"reason": getattr(e, "reason", None), "code": getattr(e, "code", None),
                   "text": str(e)[:300]}
    over_s = time.perf_counter() - t0
    # cuDNN near the quota: benchmark mode tries algorithms with large workspaces.
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda().half()
    x = torch.randn(32, 64, 128, 128, device="cuda", dtype=torch.half)
    t0 = time.perf_counter()
    conv_error = None
    try:
        for _ in range(3):
            conv(x)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported: cuDNN must retry smaller itself
        conv_error = f"{type(e).__name__}: {str(e)[:300]}"
    conv_s = time.perf_counter() - t0
    st = gt.memory_stats()
    del conv, x
    gt.empty_cache()
    # GPU-Virt-Bench's memory-limit accuracy for leases: what tensors can really take of
    # the quota (64 MiB, then 2 MiB at a time, until the broker refuses), after cuDNN's cached
    # blocks went back (PyTorch does not empty a private pool by itself on an OOM).
    filled, fill = limit - 512 * MIB, []
    for chunk in (64 * MIB, 2 * MIB):
        while True:
            try:
                fill.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
                filled += chunk
            except torch.OutOfMemoryError:
                break
    accuracy = filled / limit
    del fill
    gt.empty_cache()
    del keep
    ok = (refused is not None and refused["reason"] == "QUOTA_EXCEEDED" and over_s < 2.0
          and conv_error is None and conv_s < 10.0 and st["waits"] == 0 and accuracy >= 0.99)
    result(step="quota", limit=limit, over_quota_s=round(over_s, 3), refused=refused,
           allocatable_bytes=filled, accuracy=round(accuracy, 4),
           cudnn_benchmark_s=round(conv_s, 3), cudnn_error=conv_error, waits=st["waits"],
           ooms=st["ooms"], ok=ok)


# ---------------------------------------------------------------- multistream
def multistream(args):
    import gpubroker.torch as gt

    gt.install()
    import torch

    side = torch.cuda.Stream()
    reserved = []
    for _ in range(args.iters):
        x = torch.empty(64 * MIB // 4, dtype=torch.float32, device="cuda")
        x.fill_(1.0)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul_(2.0)
        x.record_stream(side)
        del x
        reserved.append(torch.cuda.memory_reserved())
    torch.cuda.synchronize()
    st = gt.memory_stats()
    # Without the automatic return, every iteration keeps a fresh 64 MiB block:
    # iters x 64 MiB. Bounded: a few blocks.
    ok = reserved[-1] <= 8 * 64 * MIB
    result(step="multistream", iters=args.iters, reserved_after_5=reserved[4],
           reserved_last=reserved[-1], unbounded_would_be=args.iters * 64 * MIB,
           leased=st["leased_bytes"], flushes=st["stream_block_flushes"], ok=ok)


# ---------------------------------------------------------------- graph
def _decode_model(torch, d=1024, layers=8, vocab=32000):
    """A decode step's shape: embedding, layers of (attention over a static KV cache
    approximated by matmuls + MLP), logits; fixed shapes so it can be captured."""

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, d)
            self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d) for _ in range(layers))
            self.mlp = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                    torch.nn.Linear(4 * d, d)) for _ in range(layers))
            self.head = torch.nn.Linear(d, vocab)

        def forward(self, tok, kv):
            h = self.emb(tok)
            for i in range(layers):
                q, k, v = self.qkv[i](h).chunk(3, dim=-1)
                att = torch.softmax(q @ kv[i].transpose(-1, -2) / d ** 0.5, dim=-1) @ kv[i]
                h = h + att + self.mlp[i](h + att)
            return self.head(h).float()  # logits

    return Step().cuda().half().eval()


def _capture(torch, step, pool=None):
    """Captures `step()` (warmed up on a side stream first, as PyTorch's docs do)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = step()
    return g, out


def _same(torch, a, b):
    """Graph and eager may pick other GEMM algorithms: equal up to half precision."""
    return bool(torch.allclose(a, b, rtol=2e-2, atol=2e-2))


def graph(args):
    import gpubroker.torch as gt

    gt.install()
    import torch

    out = {"step": "graph"}
    with torch.no_grad():
        model = _decode_model(torch)
        batch, ctx = 16, 512
        tok = torch.randint(0, 32000, (batch, 1), device="cuda")
        kv = [torch.randn(batch, ctx, 1024, device="cuda", dtype=torch.half) for _ in range(8)]
        # A large intermediate, so the graph's pool is visibly leases of the tenant.
        big_in = torch.randn(64 * MIB, device="cuda", dtype=torch.half)  # 128 MiB
        s_ = torch.cuda.Stream()
        s_.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s_):
            for _ in range(3):
                model(tok, kv)
                (big_in * 2).sum()
        torch.cuda.current_stream().wait_stream(s_)
        torch.cuda.synchronize()
        before = gt.memory_stats()
        held0 = _held()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out_tok = model(tok, kv)
            out_big = (big_in * 2).sum()
        torch.cuda.synchronize()
        captured = gt.memory_stats()
        out.update(hook_allocs_at_capture=captured["allocs"] - before["allocs"],
                   allocated_before=before["allocated_bytes"],
                   allocated_captured=captured["allocated_bytes"],
                   held_before=held0, held_captured=_held())
        g.replay()
        torch.cuda.synchronize()
        ok_replay = _same(torch, out_tok, model(tok, kv))
        ok_replay &= _same(torch, out_big.float(), (big_in * 2).sum().float())
        # Replays take no new memory: the graph's pool is reused.
        pre = gt.memory_stats()["allocs"]
        for _ in range(50):
            tok.random_(0, 32000)
            g.replay()
        torch.cuda.synchronize()
        out["hook_allocs_during_50_replays"] = gt.memory_stats()["allocs"] - pre
        ok_replay &= _same(torch, out_tok, model(tok, kv))
        # A second graph sharing the first one's pool (as make_graphed_callables does).
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=g.pool()):
            out2 = model(tok, kv)
        g2.replay()
        torch.cuda.synchronize()
        out["shared_pool_matches"] = _same(torch, out2, model(tok, kv))
        out["replay_matches_eager"] = ok_replay
        # Freeing the graphs gives their pool back (with empty_cache).
        pre_free = gt.memory_stats()
        del g, g2, out_tok, out_big, out2
        out["empty_cache_gave_back"] = gt.empty_cache()
        freed = gt.memory_stats()
        out.update(hook_frees_after_free=freed["frees"] - pre_free["frees"],
                   allocated_after_free=freed["allocated_bytes"], held_after_free=_held())
        # torch.compile with CUDA graphs (CUDA-graph trees).
        routings = _count_routings(torch)
        try:
            cm = torch.compile(model, mode="reduce-overhead")
            for _ in range(4):
                got = cm(tok, kv)
            torch.cuda.synchronize()
            out["compiled_matches"] = _same(torch, got, model(tok, kv))
        except Exception as e:  # noqa: BLE001 - reported
            out["compiled_matches"] = False
            out["compile_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            out["compile_diagnosis"] = _diagnose_pools(torch, str(e))
        out["torch"] = torch.__version__
        out["routings_during_compile"] = dict(routings)
    out["ok"] = (out["hook_allocs_at_capture"] > 0
                 and out["allocated_captured"] >= out["allocated_before"] + 128 * MIB
                 and out["replay_matches_eager"] and out["hook_allocs_during_50_replays"] == 0
                 and out["shared_pool_matches"] and out["hook_frees_after_free"] > 0
                 and out["allocated_after_free"] < out["allocated_captured"] - 64 * MIB
                 and out["compiled_matches"])
    result(**out)


# ---------------------------------------------------------------- decode (one bench round)
def decode(args):
    if args.mode == "broker":
        import gpubroker.torch as gt

        gt.install()
    import torch

    with torch.no_grad():
        model = _decode_model(torch)
        batch, ctx = 8, 256
        tok = torch.randint(0, 32000, (batch, 1), device="cuda")
        kv = [torch.randn(batch, ctx, 1024, device="cuda", dtype=torch.half) for _ in range(8)]
        g, out = _capture(torch, lambda: model(tok, kv).argmax(-1))
        steps = args.iters
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                g.replay()
                tok.copy_(out.view(batch, 1))  # the next token feeds the next step
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / steps * 1e6)
    extra = {}
    if args.mode == "broker":
        st = gt.memory_stats()
        extra = {"leased": st["leased_bytes"], "broker_calls": st["broker_calls"]}
    result(step="decode", mode=args.mode, us_per_step=statistics.median(times), **extra)


def bench(args):
    """Interleaved rounds of `decode`: native, broker, native, broker, ..."""
    rounds = {"native": [], "broker": []}
    for _ in range(args.rounds):
        for mode in ("native", "broker"):
            p = subprocess.run([sys.executable, __file__, "decode", "--mode", mode,
                                "--iters", str(args.iters)], capture_output=True, text=True,
                               timeout=300)
            line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                sys.stderr.write(p.stdout[-2000:] + p.stderr[-3000:])
                result(step="bench", ok=False, failed=mode)
                return
            rounds[mode].append(json.loads(line[-1][7:])["us_per_step"])
    n, b = statistics.median(rounds["native"]), statistics.median(rounds["broker"])
    result(step="bench", native_us=rounds["native"], broker_us=rounds["broker"],
           native_median_us=n, broker_median_us=b, ratio=b / n, ok=b / n < 1.05)


# ---------------------------------------------------------------- memsaver
def _card(ctl):
    out = subprocess.run(ctl.split() + ["--json", "devices"], check=True, capture_output=True,
                         text=True).stdout
    d = json.loads(out)
    d = d[0] if isinstance(d, list) else d.get("devices", [d])[0]
    return d["leasable_bytes"], d["leased_bytes"]


def memsaver(args):
    import gpubroker
    import gpubroker.torch as gt
    import gpubroker.torch_memory_saver as gtms

    impl = gtms.install(gtms.BrokerMemorySaver(pause_on_reclaim=args.cmd == "memsaver-reclaim"))
    import torch
    import torch_memory_saver as package
    from torch_memory_saver import torch_memory_saver as tms  # the package's own singleton

    out = {"step": args.cmd, "package": getattr(package, "__version__", None) or "0.0.10?",
           "extension_point": hasattr(package, "register_hook_mode")}
    gt.install()
    s = gt.session()
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.arange(64 * MIB, device="cuda", dtype=torch.int32)  # 256 MiB
    with tms.region(tag="kv_cache"):
        kv = torch.ones(128 * MIB, device="cuda", dtype=torch.int32)  # 512 MiB
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.half)
    g = torch.cuda.CUDAGraph()
    s_ = torch.cuda.Stream()
    s_.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s_):
        (x @ x).relu_()
    torch.cuda.current_stream().wait_stream(s_)
    with tms.cuda_graph(g, tag="graph"):
        y = (x @ x).relu_()
    g.replay()
    torch.cuda.synchronize()
    want_w, want_y = w.cpu(), y.cpu()
    ptrs = (w.data_ptr(), kv.data_ptr(), y.data_ptr())
    out["regions"] = impl.stats()
    held0 = s.usage().held_bytes
    # The broker shrinks its leasable memory once it sees this process's CUDA context
    # (memory outside the broker) on a refresh: measure the card after that.
    leasable0 = _card(os.environ["GPU_SERVING_CTL"])[0]
    deadline = time.time() + 15
    while time.time() < deadline and _card(os.environ["GPU_SERVING_CTL"])[0] >= leasable0 - 256 * MIB:
        time.sleep(0.5)
    leasable, leased = _card(os.environ["GPU_SERVING_CTL"])
    out["card_free_before"] = leasable - leased
    if args.cmd == "memsaver-reclaim":
        nbytes = max(leasable - leased, 0) + 256 * MIB
        hs = gpubroker.connect(os.environ["GPU_BROKER_ADDR"], args.high_token).session("high")
        t0 = time.perf_counter()
        lease = hs.lease(nbytes, wait=60)
        out.update(other_granted=lease.nbytes, grant_s=round(time.perf_counter() - t0, 3))
        out["paused_by_reclaim"] = {t: v["paused"] for t, v in impl.stats().items()}
        held1 = s.usage().held_bytes
        lease.release()
        hs.close()
        tms.resume()
    else:
        tms.pause("kv_cache")
        held_kv = s.usage().held_bytes
        # Another tenant is granted what was given back: more than the card had free.
        other = gpubroker.connect(os.environ["GPU_BROKER_ADDR"], args.high_token).session("other")
        lease = other.lease(max(leasable - leased, 0) + 256 * MIB)
        out["other_granted"] = lease.nbytes
        lease.release()
        other.close()
        tms.pause("weights")
        tms.pause("graph")
        held1 = s.usage().held_bytes
        out["held_after_kv_pause"] = held_kv
        tms.resume("weights")
        tms.resume("kv_cache")
        tms.resume("graph")
    kv.fill_(3)
    g.replay()
    torch.cuda.synchronize()
    same = (w.data_ptr(), kv.data_ptr(), y.data_ptr()) == ptrs
    w_ok = bool(torch.equal(w.cpu(), want_w))
    y_ok = bool(torch.equal(y.cpu(), want_y))
    kv_ok = bool((kv == 3).all().item())
    held2 = s.usage().held_bytes
    out.update(held_before=held0, held_paused=held1, held_resumed=held2, same_addresses=same,
               weights_restored=w_ok, graph_replays=y_ok, kv_usable=kv_ok)
    paused_ok = held1 <= held0 - 512 * MIB
    if args.cmd == "memsaver-reclaim":
        paused_ok = paused_ok and any(out["paused_by_reclaim"].values())
    out["ok"] = paused_ok and same and w_ok and y_ok and kv_ok and held2 >= held0 - 64 * MIB
    result(**out)


def routing(args):
    """Where an allocation lands when a thread routes to a pool of ours (as torch.compile's
    CUDA-graph trees' warm-up does): the pool of the segment holding it."""
    import gpubroker.torch as gt

    gt.install()
    import torch
    from torch._inductor import cudagraph_trees as trees

    def pool_of(t):
        ptr = t.untyped_storage().data_ptr()
        for seg in torch.cuda.memory_snapshot():
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                return list(seg.get("segment_pool_id", ()))
        return None

    out = {"step": "routing", "torch": torch.__version__,
           "begin_thread": getattr(torch._C._cuda_beginAllocateCurrentThreadToPool, "__name__", "?"),
           "main_pools": {d: list(p.id) for d, p in gt._state.pools.items()}}
    pool = torch.cuda.graph_pool_handle()
    out["graph_pool"] = list(pool)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.device(0):
        torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
        big = torch.empty(32 << 20, device="cuda", dtype=torch.uint8)
        small = torch.empty(4096, device="cuda", dtype=torch.uint8)
        torch._C._cuda_endAllocateToPool(0, pool)
        torch._C._cuda_releasePool(0, pool)
    out["thread_big"], out["thread_small"] = pool_of(big), pool_of(small)
    with trees._use_cuda_memory_pool_manager(0, pool, s):
        managed = torch.empty(48 << 20, device="cuda", dtype=torch.uint8)
    out["manager"] = pool_of(managed)
    plain = torch.empty(16 << 20, device="cuda", dtype=torch.uint8)
    out["plain"] = pool_of(plain)
    out["ok"] = out["thread_big"] == out["manager"] == list(pool) and out["plain"] != list(pool)
    result(**out)


def _count_routings(torch):
    """Counts the pool routings begun from here on (by PyTorch's function name): what
    torch.compile's CUDA-graph trees call, for a failure's report."""
    counts = {}
    for name in ("_cuda_beginAllocateToPool", "_cuda_beginAllocateCurrentThreadToPool",
                 "_cuda_beginAllocateCurrentStreamToPool", "_cuda_endAllocateToPool",
                 "_cuda_endAllocateCurrentStreamToPool", "_cuda_releasePool"):
        inner = getattr(torch._C, name, None)
        if inner is None:
            continue

        def counted(*a, _inner=inner, _name=name):
            counts[_name] = counts.get(_name, 0) + 1
            return _inner(*a)

        setattr(torch._C, name, counted)
    return counts


def _diagnose_pools(torch, text):
    """For each address the error names: the pool of the segment holding it."""
    import re

    found = {}
    try:
        snapshot = torch.cuda.memory_snapshot()
    except Exception as e:  # noqa: BLE001 - reported
        return f"no snapshot: {e}"
    for ptr in {int(m) for m in re.findall(r"\b(\d{8,})\b", text)}:
        for seg in snapshot:
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                found[ptr] = {"pool": list(seg.get("segment_pool_id", ())),
                              "segment": seg["address"], "size": seg["total_size"]}
    pools = sorted({tuple(seg.get("segment_pool_id", ())) for seg in snapshot})
    return {"ptrs": found, "pools": [list(p) for p in pools]}


# ---------------------------------------------------------------- torch.multiprocessing
def _mp_child(q_in, q_out):
    import torch

    t, view = q_in.get()
    got = {"sum": float(t.double().sum().item()), "ptr_differs": True,
           "view_ok": bool(torch.equal(view, t[10:20]))}
    t.mul_(2)  # the sender sees this
    torch.cuda.synchronize()
    q_out.put(got)
    q_in.get()  # hold the tensors until the sender has checked


def mp(args):
    import gpubroker.torch as gt

    gt.install()
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    want = float(t.double().sum().item())
    held0 = gt.session().usage().held_bytes
    p = ctx.Process(target=_mp_child, args=(q_in, q_out))
    p.start()
    t0 = time.perf_counter()
    q_in.put((t, t[10:20]))
    got = q_out.get(timeout=120)
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    doubled = bool(torch.equal(t, torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2))
    held1 = gt.session().usage().held_bytes
    q_in.put("done")
    p.join(60)
    ok = got["sum"] == want and got["view_ok"] and doubled and held1 == held0 and p.exitcode == 0
    result(step="mp", child_sum=got["sum"], want=want, view_ok=got["view_ok"],
           sender_sees_write=doubled, held_before=held0, held_while_shared=held1,
           roundtrip_s=round(dt, 3), child_exit=p.exitcode, ok=ok)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd")
    p.add_argument("--mode", default="broker")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--high-token")
    args = p.parse_args()
    {"quota": quota, "multistream": multistream, "graph": graph, "decode": decode,
     "bench": bench, "memsaver": memsaver, "memsaver-reclaim": memsaver, "mp": mp,
     "routing": routing}[args.cmd](args)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
