"""GPU check of sleep/wake from Python (run by scripts/gpu-sleep-check.sh): a PyTorch
tensor in gpubroker.torch's leases keeps its address and contents across
gpubroker.torch.sleep(save=True) / wake(), the tenant's device bytes go to zero while
asleep, a kernel runs on the tensor after the wake; then the same with save=False (the
address stays, the tensor is usable); and a gpubroker.Resident of a VMM lease keeps its
CUDA address and bytes. Prints one line per fact; exits 1 on the first failure."""

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


if __name__ == "__main__":
    main()
