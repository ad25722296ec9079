"""GPU check of sleep/wake from Python (run by scripts/gpu-sleep-check.sh): a PyTorch
tensor in gpubroker.torch's leases keeps its address and contents across
gpubroker.torch.sleep(save=True) / wake(), the tenant's device bytes go to zero while
asleep, a kernel runs on the tensor after the wake; then the same with save=False (the
address stays, the tensor is usable); and a gpubroker.Resident of a VMM lease keeps its
CUDA address and bytes. Prints one line per fact; exits 1 on the first failure.

`gpu_sleep_check.py reclaim HIGH_TOKEN`: gpubroker.torch installed with
sleep_on_reclaim=True; another tenant of higher priority (HIGH_TOKEN) asks for 256 MiB more
than the card has left (read with $GPU_SLEEP_CTL --json devices), which only the segments'
memory can give: the reclaim request puts the allocator to sleep
by itself (contents saved), the other tenant is granted, and after it lets go a wake()
brings the tensor back at the same address with its bytes."""

import os
import sys
import time

import gpubroker
import gpubroker.torch as gt

MIB = 1 << 20


def fail(msg):
    print("FAIL", msg, flush=True)
    sys.exit(1)


def main():
    import torch

    b = gpubroker.connect(os.environ["GPU_BROKER_ADDR"], os.environ["GPU_BROKER_TOKEN"])
    s = b.session("sleep-check")
    gt.install(s, segment_size=512 * MIB)
    x = torch.arange(64 * MIB, device="cuda", dtype=torch.float32)  # 256 MiB
    y = torch.full((1024,), 7.0, device="cuda")
    ptr, yptr = x.data_ptr(), y.data_ptr()
    want = x.cpu()
    held = s.usage().held_bytes
    print("BEFORE held", held, "ptr", hex(ptr), flush=True)
    t = time.perf_counter()
    given = gt.sleep(save=True)
    t_sleep = time.perf_counter() - t
    u = s.usage()
    print("ASLEEP given", given, "held", u.held_bytes, "host_held", u.host_held_bytes, "asleep", gt.asleep(), flush=True)
    if u.held_bytes != 0 or u.host_held_bytes < given or not gt.asleep():
        fail("asleep: device bytes still charged or no saved copy")
    try:
        torch.empty(96 * MIB, device="cuda")  # 384 MiB: more than any cached block
        fail("an allocation while asleep succeeded")
    except torch.OutOfMemoryError:
        print("ALLOC_WHILE_ASLEEP refused (OutOfMemoryError)", flush=True)
    t = time.perf_counter()
    woke = gt.wake(wait=30)
    t_wake = time.perf_counter() - t
    if x.data_ptr() != ptr or y.data_ptr() != yptr:
        fail("the tensor moved")
    if not torch.equal(x.cpu(), want) or not bool((y == 7.0).all()):
        fail("contents not restored")
    z = (x * 2).sum().item()
    print(
        "WOKE woke", woke, "same_ptr", True, "contents", True, "sum2", z,
        "held", s.usage().held_bytes, f"sleep_s {t_sleep:.3f} wake_s {t_wake:.3f}", flush=True,
    )
    gt.sleep(save=False)
    if s.usage().held_bytes != 0 or s.usage().host_held_bytes != 0:
        fail("sleep(save=False) left bytes charged")
    gt.wake(wait=30)
    if x.data_ptr() != ptr:
        fail("moved after sleep(save=False)")
    x.fill_(3.0)
    if float(x[12345].item()) != 3.0:
        fail("tensor unusable after a wake without contents")
    print("NOSAVE same_ptr True usable True", flush=True)

    lease = s.lease(64 * MIB, wait=30)
    r = gpubroker.Resident(lease)
    addr = r.addr
    v = r.as_torch(torch.int32)
    v.fill_(0x1234)
    del v
    r.sleep(save=True)
    r.wake(wait=30)
    v = r.as_torch(torch.int32)
    if r.addr != addr or v.data_ptr() != addr or not bool((v == 0x1234).all()):
        fail("Resident lost its address or contents")
    del v
    r.release()
    print("RESIDENT same_addr True contents True", flush=True)
    print("OK", flush=True)


def left_on_card():
    """(leasable, leased) bytes of device 0, from gpu-brokerctl."""
    import json
    import subprocess

    out = subprocess.run(
        os.environ["GPU_SLEEP_CTL"].split() + ["--json", "devices"], check=True, capture_output=True, text=True
    ).stdout
    d = json.loads(out)
    d = d[0] if isinstance(d, list) else d.get("devices", [d])[0]
    return d["leasable_bytes"], d["leased_bytes"]


def reclaim(high_token):
    import torch

    addr = os.environ["GPU_BROKER_ADDR"]
    leasable0, _ = left_on_card()
    s = gpubroker.connect(addr, os.environ["GPU_BROKER_TOKEN"]).session("reclaim-check")
    gt.install(s, segment_size=512 * MIB, sleep_on_reclaim=True, save_on_reclaim=True)
    x = torch.arange(64 * MIB, device="cuda", dtype=torch.float32)  # 256 MiB
    ptr = x.data_ptr()
    want = x.cpu()
    torch.cuda.synchronize()
    held = s.usage().held_bytes
    print("BEFORE held", held, "ptr", hex(ptr), "reclaimable segments", gt.memory_stats()["segments"], flush=True)
    # The broker shrinks its leasable memory when it sees this process's CUDA context
    # (memory outside the broker) on its next refresh: ask only after that, or the ask
    # may exceed what can ever be leased.
    leasable, leased = left_on_card()
    deadline = time.time() + 15
    while time.time() < deadline and leasable >= leasable0 - 256 * MIB:
        time.sleep(0.5)
        leasable, leased = left_on_card()
    nbytes = leasable - leased + 256 * MIB
    print("CARD leasable", leasable, "leased", leased, "the other tenant asks", nbytes, flush=True)
    hs = gpubroker.connect(addr, high_token).session("high")
    t = time.perf_counter()
    lease = hs.lease(nbytes, wait=60)
    t_grant = time.perf_counter() - t
    st = gt.memory_stats()
    u = s.usage()
    print(
        "GRANTED other tenant", lease.nbytes, f"after {t_grant:.3f} s;", "asleep", gt.asleep(),
        "reclaim_sleeps", st["reclaim_sleeps"], "held", u.held_bytes, "host_held", u.host_held_bytes,
        flush=True,
    )
    if not gt.asleep() or st["reclaim_sleeps"] != 1 or u.held_bytes != 0:
        fail("the reclaim request did not put the allocator to sleep")
    lease.release()
    hs.close()
    t = time.perf_counter()
    gt.wake(wait=30)
    t_wake = time.perf_counter() - t
    if x.data_ptr() != ptr:
        fail("the tensor moved")
    if not torch.equal(x.cpu(), want):
        fail("contents not restored after the reclaim-triggered sleep")
    print(
        "WOKE same_ptr True contents True", f"wake_s {t_wake:.3f}", "held", s.usage().held_bytes,
        "sum", float(x.sum().item()), flush=True,
    )
    print("OK", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "reclaim":
        reclaim(sys.argv[2])
    else:
        main()
