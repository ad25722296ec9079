"""Run in a child process: gpubroker.torch_memory_saver plugged into a stand-in of the
torch_memory_saver package (argv[4]: its folder) over the fake torch, against the broker
in argv[1] with token argv[2]; the real native hooks."""

import ctypes
import json
import sys

sys.path.insert(0, sys.argv[3])
sys.path.insert(0, sys.argv[4])
import torch  # the fake  # noqa: E402

import gpubroker  # noqa: E402
import gpubroker.torch as gt  # noqa: E402
import gpubroker.torch_memory_saver as gtms  # noqa: E402
from gpubroker import _native  # noqa: E402

out = {}
session = gpubroker.connect(sys.argv[1], sys.argv[2]).session("memsaver-plumbing")
gt.install(session, segment_size=8 << 20, wait=0.3)
impl = gtms.install()
import torch_memory_saver as package  # noqa: E402

tms = package.torch_memory_saver
out["impl_is_ours"] = tms._impl is impl if not hasattr(package, "register_hook_mode") else None

alloc = ctypes.CDLL(gpubroker._native.__file__).gpubroker_torch_alloc
alloc.restype = ctypes.c_void_p
alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

torch.calls.clear()
outside = _native._region_enter(None)
with tms.region(tag="kv", enable_cpu_backup=True):
    out["inside"] = _native._region_enter("kv", True)  # what was open (and reopen it)
    # An allocation inside a region goes to the tag's allocator: the host backend's lease
    # cannot be mapped as CUDA memory, so it fails there, and the tag now exists.
    out["ptr"] = alloc(2 << 20, 0, None)
    with impl.disable():
        out["disabled"] = _native._region_enter(None)
        _native._region_enter(None)
    out["after_disable"] = _native._region_enter("kv", True)
out["after"] = _native._region_enter(None)
out["outside"] = outside
# Each region's pool routing (use_mem_pool, through torch.cuda.memory's own names): a
# pool per tag, another for disable(); the all-streams routing steps aside before the
# first begins and comes back once the last (nested) one ended.
main_pool = gt._state.pools[0].id
threads = [c[2] for c in torch.calls if c[0] == "begin_thread"]
out["thread_pools"] = len(threads) == 2 and len(set(threads)) == 2 and main_pool not in threads
begun = [i for i, c in enumerate(torch.calls) if c[0] == "begin_thread"]
aside = [i for i, c in enumerate(torch.calls) if c == ("end", 0, main_pool)]
back = [i for i, c in enumerate(torch.calls) if c == ("begin", 0, main_pool)]
others_ended = [i for i, c in enumerate(torch.calls) if c[0] == "end" and c[2] != main_pool]
out["in_front"] = (
    bool(begun) and aside == [begun[0] - 1] and len(back) == 1 and len(others_ended) == 2
    and back[0] > max(others_ended)
)
out["tags"] = sorted(impl.stats())
out["pause_unknown"] = impl.pause("never-used")
out["pause_kv"] = impl.pause("kv")
out["paused"] = impl.stats()["kv"]["paused"]
out["resume_kv"] = impl.resume("kv")
out["resumed"] = impl.stats()["kv"]["paused"]
tms.pause("kv")  # through the package's facade
out["facade_paused"] = impl.stats()["kv"]["paused"]
tms.resume("kv")
print("RESULT " + json.dumps(out))
