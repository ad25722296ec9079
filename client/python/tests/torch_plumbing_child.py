"""Run in a child process (install() is once per process): gpubroker.torch over the fake
torch in fake_torch/, against the broker in argv, with the real native hooks."""

import ctypes
import json
import sys

sys.path.insert(0, sys.argv[3])
import torch  # the fake  # noqa: E402

import gpubroker  # noqa: E402
import gpubroker.torch as gt  # noqa: E402

out = {}
session = gpubroker.connect(sys.argv[1], sys.argv[2]).session("torch-plumbing")
assert gt.install(session, segment_size=8 << 20, wait=0.3) is session
assert gt.install() is session, "idempotent"
out["installed"] = gt.installed()
out["calls"] = [c[0] for c in torch.calls]
pool = [c for c in torch.calls if c[0] == "pool"][0][1]
out["routed"] = ("begin", 0, pool) in torch.calls
allocator = [c for c in torch.calls if c[0] == "allocator"][0]
out["hooks"] = allocator[2:]

# The hook: on the host backend the lease cannot be mapped as CUDA memory, so the
# allocation fails after the broker granted (and took back) the lease; the reason is kept.
alloc = ctypes.CDLL(gpubroker._native.__file__).gpubroker_torch_alloc
alloc.restype = ctypes.c_void_p
alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
torch.calls.clear()
out["ptr"] = alloc(2 << 20, 0, None)
# The hook asked the main thread (a pending call, run between bytecodes) to return
# multi-stream blocks: the routing paused around PyTorch's empty_cache.
for _ in range(1000):
    pass
out["flush_calls"] = [c[0] for c in torch.calls]
stats = gt.memory_stats()
out["stats"] = {k: stats[k] for k in ("allocs", "ooms", "broker_acquires", "waits", "segments", "leased_bytes", "stream_block_flushes")}
# The error PyTorch raises when the hook returns null carries the broker's refusal (its
# constructor appends it), once: a later error of PyTorch's own stays as it is.
out["observers"] = len(torch._observers)
e = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
out["oom"] = str(e)
out["oom_plain"] = [str(torch.OutOfMemoryError("plain")), torch.OutOfMemoryError("plain").reason]
# More than the tenant's quota: the broker refuses with its reason, which the OOM carries.
out["ptr_over_quota"] = alloc(128 << 20, 0, None)
e = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB.")
out["oom_quota"] = {"text": str(e), "reason": e.reason, "cause": e.cause, "code": e.code}

# Refusals.
from multiprocessing.reduction import ForkingPickler  # noqa: E402

# torch.multiprocessing: a CUDA tensor travels as a publication of its segment's lease;
# an address in no segment is refused, and a receiver's import of a publication that is
# not there gets the broker's refusal.
try:
    ForkingPickler.dumps(torch.Tensor(is_cuda=True))
    out["mp"] = "pickled"
except gpubroker.BrokerError as e:
    out["mp"] = [type(e).__name__, str(e)]
try:
    gt._rebuild_cuda_tensor(session.tenant, "gpubroker.torch/1/none", 0, 4096, "uint8", (4096,), (1,), 0, False)
    out["mp_import"] = "imported"
except gpubroker.BrokerError as e:
    out["mp_import"] = [type(e).__name__, e.reason]
# CUDA graphs: a capture with no pool gets a pool of the broker's allocator, and its
# routing goes in front of the all-streams one (which steps out and back in behind it).
main_pool = pool
torch.calls.clear()
g = torch.cuda.CUDAGraph()
g.capture_begin()
g.capture_end()
out["graph_calls"] = [c[0] for c in torch.calls]
graph_pool = [c for c in torch.calls if c[0] == "pool"][0][1]
out["graph_pool_is_ours"] = ("capture_begin", graph_pool) in torch.calls
reroute = [c for c in torch.calls if c[0] in ("end", "begin")]
out["graph_reroute"] = reroute == [("end", 0, main_pool), ("begin", 0, main_pool)]
# Shared pools (make_graphed_callables, torch.compile's CUDA-graph trees) are ours too,
# and a thread's routing to one also goes in front.
torch.calls.clear()
shared = torch.cuda.graph_pool_handle()
torch._C._cuda_beginAllocateCurrentThreadToPool(0, shared)
out["shared_calls_begun"] = [c[0] for c in torch.calls]
# Its end puts ours back.
torch._C._cuda_endAllocateToPool(0, shared)
out["shared_calls"] = [c[0] for c in torch.calls]
out["memory_module_patched"] = (
    torch.cuda.memory._cuda_beginAllocateCurrentThreadToPool is torch._C._cuda_beginAllocateCurrentThreadToPool
)
out["shared_is_ours"] = shared != (99, 0) and ("pool", shared) in torch.calls
# A freed graph's pool goes with empty_cache(), while the routing pauses.
del g

# empty_cache: a fresh pool routed before the old one stops; PyTorch's cache emptied.
torch.calls.clear()
out["released"] = gt.empty_cache()
out["empty_calls"] = [c[0] for c in torch.calls]
out["graph_pool_deleted"] = ("pool_deleted", graph_pool) in torch.calls
# reuse_stream_blocks: the routing pauses around PyTorch's empty_cache (which then
# processes the deferred multi-stream blocks), on the same pool.
torch.calls.clear()
gt.reuse_stream_blocks()
out["reuse_calls"] = [c[0] for c in torch.calls]
out["reuse_same_pool"] = len({c[2] for c in torch.calls if c[0] in ("end", "begin")}) == 1
# Tensor.record_stream returns multi-stream blocks once enough bytes were recorded
# (GPU_BROKER_STREAM_RECORD_FLUSH, 8 KiB here: two 4 KiB tensors), before a miss grows the pool.
torch.calls.clear()
torch.Tensor(is_cuda=True).record_stream("side")
out["record_first"] = [c[0] for c in torch.calls]
torch.calls.clear()
torch.Tensor(is_cuda=True).record_stream("side")
out["record_second"] = [c[0] for c in torch.calls]
print("RESULT " + json.dumps(out))
