"""A worker of scripts/gpu-restart-check.sh: rides through a broker SIGKILL + restart.

`gpu_restart_check.py hold N`: a reconnecting session holds N leases of 2 MiB (their
descriptors fetched), prints ``HOLDING N``, then waits for the broker to come back: the
first call after it (``FIRST_CALL_MS x``, a fresh lease), ``RESUMED kept=K lost=L``, no
lease lost and the quota's held bytes exact (``USAGE_OK``), then releases everything
(``DONE``).

`gpu_restart_check.py train`: gpubroker.torch on a reconnecting session; an MLP trains
(``STEP i loss``) while the broker is killed and restarted; it prints ``RESUMED`` when
the session came back, keeps stepping, allocates new memory after it, and checks the
tenant's quota is enforced afterwards (``QUOTA_ENFORCED``): ``TRAIN_OK``.
"""

import os
import resource
import sys
import threading
import time

import gpubroker
from gpubroker import events as ev

MIB = 1 << 20


def out(*a):
    print(*a, flush=True)


def wait_resumed(stream, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        e = stream.next(timeout=1)
        if isinstance(e, ev.Resumed):
            return e
        if isinstance(e, (ev.Reconnected, ev.Closed)):
            raise SystemExit(f"the session was not resumed: {e}")
    raise SystemExit("no Resumed event")


def hold(n):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    b = gpubroker.connect(os.environ["GPU_BROKER_ADDR"], os.environ["GPU_BROKER_TOKEN"])
    s = b.session("restart-holder", reconnect=True)
    stream = s.events()
    leases = [s.lease(2 * MIB) for _ in range(n)]
    out(f"HOLDING {len(leases)} held_bytes={s.usage().held_bytes}")
    e = wait_resumed(stream)
    t = time.perf_counter()
    extra = s.lease(2 * MIB)
    out(f"FIRST_CALL_MS {(time.perf_counter() - t) * 1000:.1f}")
    out(f"RESUMED kept={len(e.kept_leases)} lost={len(e.lost_leases)}")
    lost = [l for l in leases if l.lost]
    want = (n + 1) * 2 * MIB
    held = s.usage().held_bytes
    if held != want or lost:
        raise SystemExit(f"usage {held} != {want} or {len(lost)} leases lost")
    out("USAGE_OK")
    for l in leases + [extra]:
        l.release()
    s.close()
    out("DONE")


def train():
    import torch
    import gpubroker.torch as gt

    b = gpubroker.connect(os.environ["GPU_BROKER_ADDR"], os.environ["GPU_BROKER_TOKEN"])
    s = b.session("restart-trainer", reconnect=True)
    gt.install(s, segment_size=256 * MIB)
    stream = s.events()
    resumed = threading.Event()

    def watch():
        e = wait_resumed(stream)
        out(f"RESUMED kept={len(e.kept_leases)} lost={len(e.lost_leases)}")
        resumed.set()

    threading.Thread(target=watch, daemon=True).start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(512, 1024, device="cuda")
    y = torch.randint(0, 10, (512,), device="cuda")
    first = None
    step = 0
    after = 0
    deadline = time.time() + 180
    while time.time() < deadline:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if first is None:
            first = loss.item()
        if step % 10 == 0:
            out(f"STEP {step} {loss.item():.4f}")
        if resumed.is_set():
            after += 1
            # New memory after the restart: the allocator leases again.
            _ = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
            if after >= 100:
                break
        else:
            time.sleep(0.01)
    if after < 100:
        raise SystemExit(f"only {after} steps after the restart")
    last = loss.item()
    if not last < first:
        raise SystemExit(f"loss did not fall: {first} -> {last}")
    limit = s.usage().limit_bytes
    try:
        _ = torch.empty(limit, dtype=torch.uint8, device="cuda")
        raise SystemExit("an allocation beyond the quota succeeded after the restart")
    except torch.OutOfMemoryError:
        out("QUOTA_ENFORCED")
    out(f"TRAIN_OK steps={step} after_restart={after} loss {first:.3f} -> {last:.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(int(sys.argv[2]))
    else:
        train()
