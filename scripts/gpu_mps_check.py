#!/usr/bin/env python3
"""Managed MPS and compute turns on the GPU machine (run by scripts/gpu-mps-check.sh).

check: the broker's own MPS daemon (start, status and clients, driver-enforced limits for
       an unmodified PyTorch program, restart after SIGKILL, nothing left after stop).
external: the daemon in a unit of its own (`-f`, --mps-external-daemon, a keeper): a
       program under `gpu-brokerctl run` rides a broker SIGKILL + restart with its
       reservation, bytes and pinned limit; a SIGTERM stop leaves the daemon; quit after.
bench: K = 2, 4, 8 ResNet-18 workers (a) alone one after another, (b) all at once,
       (c) broker turns with 1 slot, (d) managed MPS with K slots; weights 1:2:4.
ordinal: a lease-taking child of `gpu-brokerctl run` (gpu-worker ordinal) maps its lease
       on the CUDA ordinal whose UUID is the lease's device's, with and without --mps.
handoff: (c) alone, the turn hand-off of this build and (--before DIR) of an earlier
       gpu-broker, alternating (--repeat runs each).

Also the programs: with ``--alloc --ready F --go G`` the external step's (hold_main), else
the allocator of the check (``--alloc``): allocates 256 MiB blocks until CUDA says out
of memory or ``--target`` bytes are held, fills each, holds them ``--hold`` seconds, checks
they kept their bytes, and prints one JSON line.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

GIB = 1 << 30
MIB = 1 << 20
WEIGHTS = [1, 2, 4]
PASSED, FAILED = [], []


def verdict(ok, what):
    (PASSED if ok else FAILED).append(what)
    print(("PASS " if ok else "FAIL ") + what, flush=True)


# ---------------------------------------------------------------- the allocator

def alloc_main(a):
    import torch

    blocks, oom, err = [], False, ""
    t0 = time.time()
    torch.zeros(1, device="cuda")  # the context (and PyTorch's first segment)
    torch.cuda.synchronize()
    free_at_start, _ = torch.cuda.mem_get_info()
    # 256 MiB steps, then 16 MiB ones after the first out-of-memory: what the program can
    # really allocate, to 16 MiB.
    for step in (256 * MIB, 16 * MIB):
        while sum(b.numel() for b in blocks) + step <= a.target:
            try:
                b = torch.empty(step, dtype=torch.uint8, device="cuda")
                b.fill_(len(blocks) % 251)
                blocks.append(b)
            except torch.OutOfMemoryError as e:
                oom, err = True, str(e).splitlines()[0][:200]
                break
    torch.cuda.synchronize()
    held = sum(b.numel() for b in blocks)
    time.sleep(a.hold)
    intact = all(int(b[0]) == i % 251 and int(b[-1]) == i % 251 for i, b in enumerate(blocks))
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({
        "allocated": held, "oom": oom, "error": err, "intact": intact,
        "mem_get_info_free": free, "mem_get_info_total": total,
        "free_at_start": free_at_start,
        "seconds": round(time.time() - t0, 2),
        "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""),
        "limit": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""),
    }), flush=True)


# ------------------------------------------------- the program held through a restart

class _Oom(Exception):
    pass


class _CudaMemory:
    """Device memory through PyTorch (the program as a user would write it)."""

    def __init__(self):
        import torch
        self.torch = torch
        torch.zeros(1, device="cuda")  # the context (and PyTorch's first segment)
        torch.cuda.synchronize()

    def alloc(self, n, fill):
        try:
            b = self.torch.empty(n, dtype=self.torch.uint8, device="cuda")
        except self.torch.OutOfMemoryError as e:
            raise _Oom(str(e).splitlines()[0][:200])
        b.fill_(fill)
        return b

    def intact(self, b, fill):
        self.torch.cuda.synchronize()
        return int(b[0]) == fill and int(b[-1]) == fill and bool((b[:: 1 << 20] == fill).all())

    def free(self):
        return self.torch.cuda.mem_get_info()[0]


class _HostMemory:
    """GPU_MPS_BACKEND=host (no GPU): stands in for the driver's pinned limit (512 MiB of
    it for a context), so the step's logic can be tried on any machine."""

    def __init__(self):
        lim = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
        self.limit = int(lim.split("=")[1].rstrip("M")) * MIB if "=" in lim else 1 << 62
        self.used = 512 * MIB

    def alloc(self, n, fill):
        if self.used + n > self.limit:
            raise _Oom("stand-in: out of memory under the pinned limit")
        self.used += n
        return bytearray([fill]) * 4096

    def intact(self, b, fill):
        return b[0] == fill and b[-1] == fill

    def free(self):
        return self.limit - self.used


def hold_main(a):
    """The external step's program: holds --target bytes, says so in --ready, waits for
    --go (the broker was restarted meanwhile), checks its bytes, then allocates until the
    driver refuses (its pinned limit still holds), and prints one JSON line."""
    mem = _HostMemory() if os.environ.get("GPU_MPS_BACKEND") == "host" else _CudaMemory()
    free_at_start = mem.free()
    blocks, oom, err = [], False, ""

    def grow(cap):
        nonlocal oom, err
        for step in (256 * MIB, 16 * MIB):
            while sum(n for n, _ in blocks) + step <= cap:
                try:
                    blocks.append((step, mem.alloc(step, len(blocks) % 251)))
                except _Oom as e:
                    oom, err = True, str(e)
                    return

    def intact():
        return all(mem.intact(b, i % 251) for i, (_, b) in enumerate(blocks))

    grow(a.target)
    held, oom_before = sum(n for n, _ in blocks), oom
    with open(a.ready + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "held": held, "oom": oom_before, "error": err}, f)
    os.rename(a.ready + ".tmp", a.ready)
    t0 = time.time()
    while not os.path.exists(a.go) and time.time() - t0 < a.hold:
        time.sleep(0.05)
    went_on = os.path.exists(a.go)
    intact_after = intact()
    oom, err = False, ""
    grow(64 * GIB)
    print(json.dumps({
        "held_before": held, "oom_before": oom_before, "went_on": went_on,
        "intact_after_restart": intact_after, "allocated": sum(n for n, _ in blocks),
        "oom": oom, "error": err, "intact_at_end": intact(), "free_at_start": free_at_start,
        "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""),
        "limit": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""),
    }), flush=True)


# ---------------------------------------------------------------- a broker under test

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    def __init__(self, bin_dir, name, extra, broker_bin=None):
        self.bin = bin_dir
        self.dir = tempfile.mkdtemp(prefix=f"gpb-{name}-")
        self.sock = os.path.join(self.dir, "broker.sock")
        self.state = os.path.join(self.dir, "state")
        self.port = free_port()
        backend = os.environ.get("GPU_MPS_BACKEND", "cuda")  # host: try the harness without a GPU
        args = [broker_bin or os.path.join(bin_dir, "gpu-broker"), "--backend", backend, "--socket", self.sock,
                "--state-dir", self.state, "--metrics-listen", f"127.0.0.1:{self.port}",
                "--shutdown-grace", "1s", "--headroom", "5%"]
        if os.environ.get("GPU_MPS_CONTROL"):
            args += ["--mps-control", os.environ["GPU_MPS_CONTROL"]]
        if os.environ.get("GPU_MPS_DEVICES"):
            args += ["--devices", os.environ["GPU_MPS_DEVICES"]]
        self.log_path = os.path.join(self.dir, "broker.log")
        self.log = open(self.log_path, "w")
        self.args = args + extra
        t0 = time.time()
        self.p = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        token = os.path.join(self.state, "admin.token")
        while not (os.path.exists(self.sock) and os.path.exists(token)):
            if self.p.poll() is not None or time.time() - t0 > 60:
                print(open(self.log_path).read())
                raise RuntimeError(f"broker {name} did not start")
            time.sleep(0.05)
        self.started_s = time.time() - t0
        self.tokens = {}

    def kill_and_restart(self, timeout=60):
        """SIGKILLs the broker and starts it again with the same flags, socket and state;
        returns the seconds from the new process's start to its first answered call."""
        self.p.kill()
        self.p.wait()
        t0 = time.time()
        self.p = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            # The old socket file is still there: only an answer says it serves.
            r = subprocess.run([os.path.join(self.bin, "gpu-brokerctl"), "--broker", f"unix://{self.sock}",
                                "--token-file", os.path.join(self.state, "admin.token"), "devices"],
                               capture_output=True, timeout=30)
            if r.returncode == 0:
                return time.time() - t0
            if self.p.poll() is not None or time.time() - t0 > timeout:
                raise RuntimeError(f"the restarted broker did not serve:\n{self.log_tail(20)}")
            time.sleep(0.01)

    def ctl(self, *args, check=True):
        cmd = [os.path.join(self.bin, "gpu-brokerctl"), "--broker", f"unix://{self.sock}",
               "--token-file", os.path.join(self.state, "admin.token"), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"{args}: {r.stdout}{r.stderr}")
        return r.stdout

    def tenant(self, name, limit="16GiB", weight=1):
        self.ctl("quota", "set", name, "--limit", limit, "--turn-weight", str(weight))
        tok = self.ctl("tokens", "issue", name).strip().splitlines()[-1].strip()
        self.tokens[name] = tok
        return tok

    def devices(self):
        return json.loads(self.ctl("devices", "--json"))

    def tenants(self):
        return json.loads(self.ctl("tenants", "list", "--json"))

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = "killed"
        self.log.close()
        return rc

    def log_tail(self, n=15):
        return "".join(open(self.log_path).readlines()[-n:])


def mps_processes(zombies=False):
    """MPS processes that run (with zombies=True: exited ones nobody reaped, `<defunct>`;
    the machine's init does not reap orphans, so the daemon's exited processes stay as
    zombies: they hold no GPU memory and run nothing)."""
    r = subprocess.run(["ps", "-eo", "pid,user,stat,args"], capture_output=True, text=True)
    out = []
    for l in r.stdout.splitlines():
        if "nvidia-cuda-mps" not in l or "grep" in l:
            continue
        dead = l.split()[2].startswith("Z")
        if dead == zombies:
            out.append(l)
    return out


def device_uuid(b, index=0):
    for d in b.devices():
        if d.get("index") == index:
            return d.get("uuid", "")
    return ""


# ---------------------------------------------------------------- check

def check(bin_dir):
    print("=== check: managed MPS under the broker ===", flush=True)
    before = mps_processes()
    verdict(not before, f"no MPS process before the broker starts ({len(before)})")
    b = Broker(bin_dir, "mps", ["--mps", "--mps-health-interval", "500ms"])
    print(f"broker started in {b.started_s:.2f} s; log:\n{b.log_tail(8)}")
    d = b.devices()[0]
    print("GetDevices:", {k: d.get(k) for k in ("mps_state", "mps_detail", "mps_clients", "compute_mode")})
    verdict(d.get("mps_state") == "running", f"MPS daemon running: {d.get('mps_detail')}")
    verdict(d.get("compute_mode") != "", f"compute mode reported: {d.get('compute_mode')}")
    pipe = os.path.join(b.dir, "mps")
    print("pipe directory:", pipe, sorted(os.listdir(pipe)))
    procs = mps_processes()
    print("MPS processes:\n  " + "\n  ".join(procs))
    verdict(any("nvidia-cuda-mps-control" in p for p in procs), "the control daemon runs")
    tok_small = b.tenant("small", "6GiB")
    tok_big = b.tenant("big", "12GiB")
    have_run = subprocess.run([os.path.join(bin_dir, "gpu-brokerctl"), "run", "--help"],
                              capture_output=True).returncode == 0
    me = os.path.abspath(__file__)
    uuid = device_uuid(b)

    def launch(name, token, limit, target):
        alloc = [sys.executable, me, "--alloc", "--target", str(target), "--hold", "8"]
        env = dict(os.environ)
        if have_run:
            tf = os.path.join(b.dir, f"{name}.token")
            with open(os.open(tf, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(token)
            cmd = [os.path.join(bin_dir, "gpu-brokerctl"), "--broker", f"unix://{b.sock}", "run",
                   "--token-file", tf, "--memory", f"{limit // GIB}GiB", "--name", name, "--", *alloc]
        else:
            # Stand-in for `gpu-brokerctl run`: the environment the broker's MPS hook gives.
            env.update({
                "CUDA_VISIBLE_DEVICES": uuid,
                "CUDA_MPS_PIPE_DIRECTORY": pipe,
                "CUDA_MPS_LOG_DIRECTORY": os.path.join(b.state, "mps-log"),
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit // MIB}M",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
            })
            cmd = alloc
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    print(f"launching with {'gpu-brokerctl run' if have_run else 'the MPS environment set by hand (no gpu-brokerctl run yet)'}")
    small = launch("small", tok_small, 4 * GIB, 64 * GIB)
    big = launch("big", tok_big, 8 * GIB, 7 * GIB)
    t0 = time.time()
    mid = {}
    while time.time() - t0 < 20 and small.poll() is None and big.poll() is None:
        mid = b.devices()[0]
        if mid.get("mps_clients", 0) >= 2:
            break
        time.sleep(0.2)
    status = b.ctl("status")
    print(f"gpu-brokerctl status while both run ({time.time() - t0:.1f} s after the start):\n" + status)
    verdict(mid.get("mps_clients", 0) >= 2, f"status shows the MPS clients: {mid.get('mps_detail')}")
    outs = {}
    for name, p in (("small", small), ("big", big)):
        o, e = p.communicate(timeout=120)
        print(f"{name}: rc={p.returncode} {o.strip()}")
        if p.returncode != 0 or not o.strip():
            print(e[-2000:])
        try:
            outs[name] = json.loads(o.strip().splitlines()[-1])
        except (ValueError, IndexError):
            outs[name] = {}
    s, g = outs.get("small", {}), outs.get("big", {})
    # The reservation adds the context's share (--mps-context-overhead) to the pinned limit:
    # the program gets what it asked for (GPU-Virt-Bench's memory-limit accuracy >= 99%),
    # and the limit still holds (no more than the limit).
    limit_mib = int((s.get("limit") or "0=0M").split("=")[1].rstrip("M") or 0)
    accuracy = s.get("allocated", 0) / (4 * GIB)
    context = limit_mib * MIB - s.get("free_at_start", 0) if limit_mib else None
    print(f"4 GiB program: pinned limit {limit_mib} MiB, context and libraries took "
          f"{(context or 0) / MIB:.0f} MiB of it at start, allocatable/asked {accuracy:.4f}")
    verdict(s.get("oom") and accuracy >= 0.99 and s.get("allocated", 0) <= limit_mib * MIB,
            f"4 GiB program: torch.OutOfMemoryError after {s.get('allocated', 0) / GIB:.3f} GiB = {accuracy:.1%} of what it asked for, under its {limit_mib} MiB pinned limit ({s.get('error', '')[:90]})")
    verdict(not g.get("oom") and g.get("allocated") == 7 * GIB and g.get("intact"),
            f"8 GiB neighbour: allocated {g.get('allocated', 0) / GIB:.2f} GiB, bytes intact {g.get('intact')}")
    # The control daemon dies: the broker restarts it.
    pid = int(open(os.path.join(pipe, "nvidia-cuda-mps-control.pid")).read().strip())
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    saw_down, restarted = False, None
    while time.time() - t0 < 30:
        dd = b.devices()[0]
        saw_down |= dd.get("mps_state") != "running"
        if dd.get("mps_state") == "running" and "1 restart" in dd.get("mps_detail", ""):
            restarted = dd
            break
        time.sleep(0.1)
    verdict(restarted is not None,
            f"SIGKILLed control daemon (pid {pid}) restarted in {time.time() - t0:.2f} s (down seen: {saw_down}): {restarted and restarted.get('mps_detail')}")
    print("broker log:\n" + b.log_tail(12))
    rc = b.stop()
    time.sleep(1.0)
    left = mps_processes()
    verdict(rc == 0, f"broker stopped (rc {rc})")
    verdict(not left, "nothing of MPS left running after the broker stopped" + (f": {left}" if left else ""))
    print("exited MPS processes not reaped by the machine's init (zombies):", mps_processes(zombies=True))
    return {"small": s, "big": g, "restart": restarted and restarted.get("mps_detail"), "used_run": have_run}


# ---------------------------------------------------------------- external

def mps_send(ctl, env, line):
    """One command to a control daemon (as `echo LINE | nvidia-cuda-mps-control`)."""
    try:
        r = subprocess.run([ctl], input=line + "\n", env=env, capture_output=True, text=True, timeout=15)
        return r.returncode, (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, repr(e)


def reported_pid(d):
    """The daemon pid in a device's `mps_detail` (`running (pid 123, ...)`), or None."""
    detail = d.get("mps_detail", "")
    if "(pid " not in detail:
        return None
    pid = detail.split("(pid ", 1)[1].split(",", 1)[0]
    return int(pid) if pid.isdigit() else None


def run_session(b, name):
    """The broker's session of `gpu-brokerctl run --name NAME` ({} when there is none)."""
    return next((x for x in json.loads(b.ctl("sessions", "list", "--json")) if x.get("name") == name), {})


def external(bin_dir):
    """deploy/gpu-broker-mps.service's setup: the daemon started apart (`-f`, as the unit
    does), the broker with --mps-external-daemon and a keeper; a program reserved with
    `gpu-brokerctl run` rides a broker SIGKILL + restart; a SIGTERM stop leaves the daemon."""
    print("=== external: the MPS daemon in a unit of its own, through broker restarts ===", flush=True)
    ctl = os.environ.get("GPU_MPS_CONTROL") or shutil.which("nvidia-cuda-mps-control")
    if not ctl:
        verdict(False, "external: no nvidia-cuda-mps-control on this machine")
        return {}
    before = mps_processes()
    verdict(not before, f"external: no MPS process before the daemon starts ({len(before)})")
    root = tempfile.mkdtemp(prefix="gpb-mpsext-")
    pipe, logd = os.path.join(root, "mps-pipe"), os.path.join(root, "mps-log")
    for d, mode in ((pipe, 0o1770), (logd, 0o750)):  # the unit's RuntimeDirectoryMode, LogsDirectoryMode
        os.mkdir(d)
        os.chmod(d, mode)
    denv = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logd)
    if os.environ.get("GPU_MPS_DEVICES"):
        denv["CUDA_VISIBLE_DEVICES"] = os.environ["GPU_MPS_DEVICES"]
    res = {}
    keeper = b = prog = daemon = None
    try:
        # The unit: `nvidia-cuda-mps-control -f` in a session of its own (not the broker's group).
        dlog = open(os.path.join(root, "daemon.log"), "w")
        daemon = subprocess.Popen([ctl, "-f"], env=denv, stdin=subprocess.DEVNULL, stdout=dlog,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.time()
        while mps_send(ctl, denv, "get_server_list")[0] != 0 and daemon.poll() is None and time.time() - t0 < 20:
            time.sleep(0.1)
        rc, _ = mps_send(ctl, denv, "get_server_list")
        verdict(rc == 0 and daemon.poll() is None,
                f"external: `{os.path.basename(ctl)} -f` (pid {daemon.pid}) answers in {time.time() - t0:.2f} s")
        res["daemon_pid"] = daemon.pid
        # The broker reads the daemon's pid from its pid file here.
        print("pipe directory:", pipe, sorted(os.listdir(pipe)), flush=True)
        keeper_sock = os.path.join(root, "keeper.sock")
        keeper = subprocess.Popen([os.path.join(bin_dir, "gpu-broker"), "keeper", "--socket", keeper_sock],
                                  stdout=subprocess.DEVNULL, stderr=open(os.path.join(root, "keeper.log"), "w"))
        t0 = time.time()
        while not os.path.exists(keeper_sock):
            if keeper.poll() is not None or time.time() - t0 > 10:
                raise RuntimeError("the keeper did not start: " + open(os.path.join(root, "keeper.log")).read())
            time.sleep(0.05)
        b = Broker(bin_dir, "ext", ["--mps", "--mps-external-daemon", "--mps-pipe-dir", pipe, "--mps-log-dir", logd,
                                    "--mps-health-interval", "500ms", "--keeper", keeper_sock])
        d = b.devices()[0]
        print(f"broker started in {b.started_s:.2f} s: mps {d.get('mps_detail')}", flush=True)
        verdict(d.get("mps_state") == "running" and reported_pid(d) == daemon.pid,
                f"external: the broker adopted the daemon: {d.get('mps_detail')} (started as pid {daemon.pid})")
        token = b.tenant("ext", "8GiB")
        tf = os.path.join(b.dir, "ext.token")
        with open(os.open(tf, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(token)
        ready, go = os.path.join(root, "ready"), os.path.join(root, "go")
        prog = subprocess.Popen(
            [os.path.join(bin_dir, "gpu-brokerctl"), "--broker", f"unix://{b.sock}", "run", "--token-file", tf,
             "--memory", "4GiB", "--name", "ext", "--",
             sys.executable, os.path.abspath(__file__), "--alloc", "--target", str(3 * GIB),
             "--ready", ready, "--go", go, "--hold", "300"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.time()
        while not os.path.exists(ready) and prog.poll() is None and time.time() - t0 < 120:
            time.sleep(0.05)
        if not os.path.exists(ready):
            o, e = prog.communicate(timeout=30)
            raise RuntimeError(f"the reserved program did not get ready (rc {prog.returncode}): {o[-1000:]} {e[-2000:]}")
        r = json.load(open(ready))
        s1 = run_session(b, "ext")
        u1 = {t["name"]: t for t in b.tenants()}["ext"]["usage"]
        d1 = b.devices()[0]
        print(f"program pid {r['pid']} holds {r['held'] / GIB:.2f} GiB; session {s1.get('session_id')} reserved "
              f"{s1.get('process_reserved_bytes', 0) / GIB:.3f} GiB; tenant charged {u1.get('process_reserved_bytes', 0) / GIB:.3f} GiB "
              f"in {u1.get('process_reservations')} reservation(s); mps {d1.get('mps_detail')}", flush=True)
        verdict(r["held"] == 3 * GIB and not r["oom"] and u1.get("process_reservations") == 1
                and s1.get("process_reserved_bytes", 0) >= 4 * GIB,
                f"external: the reserved program holds {r['held'] / GIB:.2f} GiB under its 4 GiB reservation "
                f"(charged {u1.get('process_reserved_bytes', 0) / GIB:.3f} GiB)")
        # The broker SIGKILLed and started again: the keeper keeps the session, the unit's daemon runs on.
        serving = b.kill_and_restart()
        t0 = time.time()
        d2 = b.devices()[0]
        while d2.get("mps_state") != "running" and time.time() - t0 < 30:
            time.sleep(0.1)
            d2 = b.devices()[0]
        print(f"restart to serving {serving * 1000:.0f} ms; mps {d2.get('mps_detail')} "
              f"{time.time() - t0 + serving:.2f} s after the restart", flush=True)
        print("gpu-brokerctl status after the restart:\n" + b.ctl("status"), flush=True)
        verdict(daemon.poll() is None and d2.get("mps_state") == "running" and reported_pid(d2) == daemon.pid,
                f"external: the daemon outlived the broker's SIGKILL and was adopted again: pid {daemon.pid} before, "
                f"{reported_pid(d2)} after ({d2.get('mps_detail')}); restart to serving {serving * 1000:.0f} ms")
        time.sleep(2)  # the program would be stopped by now if `run` had given up its reservation
        s2 = run_session(b, "ext")
        u2 = {t["name"]: t for t in b.tenants()}["ext"]["usage"]
        alive = prog.poll() is None and os.path.exists(f"/proc/{r['pid']}")
        verdict(alive and s2.get("session_id") == s1.get("session_id")
                and s2.get("process_reserved_bytes") == s1.get("process_reserved_bytes")
                and u2.get("process_reserved_bytes") == u1.get("process_reserved_bytes"),
                f"external: the program (pid {r['pid']}) runs on after the restart (alive {alive}), its reservation kept: "
                f"session {s2.get('session_id')} reserved {s2.get('process_reserved_bytes', 0) / GIB:.3f} GiB, "
                f"tenant charged {u2.get('process_reserved_bytes', 0) / GIB:.3f} GiB (before: {s1.get('session_id')}, "
                f"{u1.get('process_reserved_bytes', 0) / GIB:.3f} GiB)")
        open(go, "w").close()
        o, e = prog.communicate(timeout=180)
        try:
            out = json.loads(o.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out = {}
            print(f"program rc {prog.returncode}:\n{o[-1000:]}\n{e[-2000:]}")
        print(f"program: rc={prog.returncode} {json.dumps(out)}", flush=True)
        res["program"] = out
        verdict(prog.returncode == 0 and out.get("went_on") and out.get("intact_after_restart") and out.get("intact_at_end"),
                f"external: {r['held'] / GIB:.2f} GiB kept their bytes through the restart "
                f"({out.get('intact_after_restart')}, and after growing to the limit: {out.get('intact_at_end')})")
        limit_mib = int((out.get("limit") or "0=0M").split("=")[1].rstrip("M") or 0)
        got = out.get("allocated", 0)
        verdict(out.get("oom") and got <= limit_mib * MIB and got >= 0.99 * 4 * GIB and out.get("mps_pipe") == pipe,
                f"external: after the restart the pinned limit still holds: out of memory after {got / GIB:.3f} GiB "
                f"= {got / (4 * GIB):.1%} of the 4 GiB asked for, under its {limit_mib} MiB limit ({out.get('error', '')[:90]})")
        t0 = time.time()
        u3 = {}
        while time.time() - t0 < 15:
            u3 = {t["name"]: t for t in b.tenants()}["ext"]["usage"]
            if not u3.get("process_reservations") and not u3.get("process_reserved_bytes"):
                break
            time.sleep(0.1)
        verdict(not u3.get("process_reservations") and not u3.get("process_reserved_bytes"),
                f"external: the reservation ended with the program ({u3.get('process_reservations')} left, "
                f"{u3.get('process_reserved_bytes', 0)} bytes charged, {time.time() - t0:.2f} s after it exited)")
        # A SIGTERM stop (the unit's stop) leaves the daemon to its clients.
        rc = b.stop()
        b = None
        time.sleep(1.0)
        rc2, _ = mps_send(ctl, denv, "get_server_list")
        verdict(rc == 0 and daemon.poll() is None and rc2 == 0,
                f"external: a SIGTERM stop of the broker (rc {rc}) left the daemon running (pid {daemon.pid}, answers: {rc2 == 0})")
    except Exception as ex:
        verdict(False, f"external raised {ex!r}")
    finally:
        for p in (prog, b and b.p, keeper):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if daemon is not None:
            # What the unit's ExecStop does.
            rc, answer = mps_send(ctl, denv, "quit")
            try:
                daemon.wait(timeout=30)
                quit_ok = True
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
                quit_ok = False
            t0 = time.time()
            left = mps_processes()
            while left and time.time() - t0 < 10:  # its servers go after it
                time.sleep(0.2)
                left = mps_processes()
            verdict(rc == 0 and quit_ok, f"external: `echo quit | {os.path.basename(ctl)}` stopped the daemon (rc {rc} {answer[:80]})")
            verdict(not left, "external: nothing of MPS left running after the quit" + (f": {left}" if left else ""))
    return res


# ---------------------------------------------------------------- bench

def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs else float("nan")


def hist_quantiles(text, name, qs):
    """Quantiles of a Prometheus histogram, interpolated within buckets."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return [float("nan")] * len(qs), 0
    total = buckets[-1][1]
    out = []
    for q in qs:
        want = q * total
        prev_le, prev_c = 0.0, 0.0
        for le, c in buckets:
            if c >= want:
                if le == float("inf"):
                    out.append(prev_le)
                else:
                    frac = (want - prev_c) / (c - prev_c) if c > prev_c else 1.0
                    out.append(prev_le + (le - prev_le) * frac)
                break
            prev_le, prev_c = le, c
    return out, int(total)


def run_workers(bin_dir, k, duration, envs, gate, tag):
    """Starts k workers, waits until all are warm, lets them run one window; reports."""
    work = tempfile.mkdtemp(prefix=f"w-{tag}-")
    go = os.path.join(work, "go")
    procs = []
    for i in range(k):
        cmd = [sys.executable, os.path.join(bin_dir, "turn_step_worker.py"), "--duration", str(duration),
               "--model", os.environ.get("GPU_MPS_MODEL", "resnet18"),
               "--ready", os.path.join(work, f"ready{i}"), "--go", go, "--out", os.path.join(work, f"out{i}.json")]
        if gate:
            cmd += ["--gate", os.path.join(bin_dir, "turn-gate")]
        procs.append(subprocess.Popen(cmd, env=envs[i], stderr=subprocess.PIPE, text=True))
    t0 = time.time()
    while not all(os.path.exists(os.path.join(work, f"ready{i}")) for i in range(k)):
        if any(p.poll() not in (None, 0) for p in procs) or time.time() - t0 > 180:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{tag}: workers failed: " + " | ".join((p.stderr.read() or "")[-800:] for p in procs))
        time.sleep(0.02)
    with open(go + ".tmp", "w") as f:
        f.write(str(time.time() + 0.3))
    os.rename(go + ".tmp", go)
    reports = []
    for i, p in enumerate(procs):
        err = p.communicate(timeout=duration + 120)[1]
        if p.returncode != 0:
            raise RuntimeError(f"{tag}: worker {i} rc {p.returncode}: {err[-1500:]}")
        reports.append(json.load(open(os.path.join(work, f"out{i}.json"))))
    return reports


def summarize(reports, duration, weights=None, broker_compute=None):
    steps = [len(r["steps"]) for r in reports]
    lat = [[(t2 - t0) / 1e6 for (t0, tg, t1, t2) in r["steps"]] for r in reports]
    s = {
        "model": reports[0]["model"],
        "workers": len(reports),
        "steps_per_s": sum(steps) / duration,
        "per_worker_steps": steps,
        "p50_ms": statistics.median(pct(l, 0.5) for l in lat),
        "p99_ms": max(pct(l, 0.99) for l in lat),
    }
    if weights:
        target = [w / sum(weights) for w in weights]
        held = [sum(t2 - tg for (t0, tg, t1, t2) in r["steps"]) for r in reports]
        shares = [h / sum(held) for h in held]
        sshares = [n / sum(steps) for n in steps]
        s["weights"] = weights
        s["held_share"] = [round(x, 4) for x in shares]
        s["steps_share"] = [round(x, 4) for x in sshares]
        s["held_share_err_max"] = max(abs(a - t) / t for a, t in zip(shares, target))
        s["steps_share_err_max"] = max(abs(a - t) / t for a, t in zip(sshares, target))
        s["jain_held"] = jain([a / t for a, t in zip(shares, target)])
        s["jain_steps"] = jain([a / t for a, t in zip(sshares, target)])
        if broker_compute:
            bshare = [c / sum(broker_compute) for c in broker_compute]
            s["broker_share"] = [round(x, 4) for x in bshare]
            s["broker_share_err_max"] = max(abs(a - t) / t for a, t in zip(bshare, target))
            s["jain_broker"] = jain([a / t for a, t in zip(bshare, target)])
    return s


def e2e_handoffs(reports):
    """Release sent by one worker -> grant seen by another that was already waiting."""
    rel = sorted((t1, i) for i, r in enumerate(reports) for (t0, tg, t1, t2) in r["steps"])
    grants = sorted((tg, t0, i) for i, r in enumerate(reports) for (t0, tg, t1, t2) in r["steps"])
    import bisect
    times = [t for t, _ in rel]
    out = []
    for tg, t0, j in grants:
        k = bisect.bisect_left(times, tg) - 1
        while k >= 0 and rel[k][1] == j:
            k -= 1
        if k < 0:
            continue
        t_rel = rel[k][0]
        if t0 < t_rel:  # it was waiting when the turn was given back
            out.append((tg - t_rel) / 1e3)
    return out


def bench(bin_dir, duration, ks):
    print("=== bench: ResNet-18 workers, modes (a)-(d) ===", flush=True)
    base = dict(os.environ)
    results = {"duration_s": duration}
    solo = run_workers(bin_dir, 1, duration, [base], False, "solo")
    results["a"] = summarize(solo, duration)
    print("(a) alone:", json.dumps(results["a"]), flush=True)
    for k in ks:
        weights = [WEIGHTS[i % 3] for i in range(k)]
        row = {}
        rb = run_workers(bin_dir, k, duration, [base] * k, False, f"b{k}")
        row["b"] = summarize(rb, duration)
        print(f"K={k} (b) uncoordinated:", json.dumps(row["b"]), flush=True)

        b = Broker(bin_dir, f"c{k}", ["--turn-slots", "1", "--turn-anticipation", "1ms"])
        envs = []
        for i, w in enumerate(weights):
            e = dict(base, GPU_BROKER_ADDR=f"unix://{b.sock}", GPU_BROKER_TOKEN=b.tenant(f"t{i}", "16GiB", w))
            envs.append(e)
        rc = run_workers(bin_dir, k, duration, envs, True, f"c{k}")
        tenants = {t["name"]: t for t in b.tenants()}
        comp = [tenants[f"t{i}"].get("usage", {}).get("compute_ms", 0) for i in range(k)]
        (h50, h99), n = hist_quantiles(b.metrics(), "gpu_broker_turn_handoff_seconds", [0.5, 0.99])
        b.stop()
        row["c"] = summarize(rc, duration, weights, comp if all(comp) else None)
        e2e = e2e_handoffs(rc)
        row["c"]["handoff_broker_us"] = {"p50": h50 * 1e6, "p99": h99 * 1e6, "count": n}
        row["c"]["handoff_e2e_us"] = {"p50": pct(e2e, 0.5), "p99": pct(e2e, 0.99), "count": len(e2e)}
        print(f"K={k} (c) turns, 1 slot:", json.dumps(row["c"]), flush=True)

        b = Broker(bin_dir, f"d{k}", ["--mps", "--turn-slots", str(k)])
        pipe = os.path.join(b.dir, "mps")
        uuid = device_uuid(b)
        envs = []
        for i, w in enumerate(weights):
            e = dict(base, GPU_BROKER_ADDR=f"unix://{b.sock}", GPU_BROKER_TOKEN=b.tenant(f"t{i}", "16GiB", w))
            # The environment of an MPS reservation (3 GiB; share by weight: 1:2:4 -> 25/50/100 %).
            e.update({
                "CUDA_VISIBLE_DEVICES": uuid,
                "CUDA_MPS_PIPE_DIRECTORY": pipe,
                "CUDA_MPS_LOG_DIRECTORY": os.path.join(b.state, "mps-log"),
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, -(-100 * w // max(weights)))),
            })
            envs.append(e)
        rd = run_workers(bin_dir, k, duration, envs, True, f"d{k}")
        mid = b.devices()[0]
        b.stop()
        row["d"] = summarize(rd, duration, weights)
        row["d"]["mps"] = mid.get("mps_detail")
        print(f"K={k} (d) MPS, {k} slots:", json.dumps(row["d"]), flush=True)
        row["d_over_a"] = row["d"]["steps_per_s"] / results["a"]["steps_per_s"]
        row["b_over_a"] = row["b"]["steps_per_s"] / results["a"]["steps_per_s"]
        row["c_over_a"] = row["c"]["steps_per_s"] / results["a"]["steps_per_s"]
        results[f"K{k}"] = row
    left = mps_processes()
    verdict(not left, "nothing of MPS left after the bench" + (f": {left}" if left else ""))
    return results


def turns_c(bin_dir, k, duration, tag, broker_bin=None):
    """(c) alone: K workers taking broker turns with 1 slot; shares and hand-offs."""
    weights = [WEIGHTS[i % 3] for i in range(k)]
    base = dict(os.environ)
    b = Broker(bin_dir, tag, ["--turn-slots", "1", "--turn-anticipation", "1ms"], broker_bin)
    envs = [dict(base, GPU_BROKER_ADDR=f"unix://{b.sock}", GPU_BROKER_TOKEN=b.tenant(f"t{i}", "16GiB", w))
            for i, w in enumerate(weights)]
    rc = run_workers(bin_dir, k, duration, envs, True, tag)
    (h50, h99), n = hist_quantiles(b.metrics(), "gpu_broker_turn_handoff_seconds", [0.5, 0.99])
    b.stop()
    s = summarize(rc, duration, weights)
    e2e = e2e_handoffs(rc)
    s["handoff_broker_us"] = {"p50": h50 * 1e6, "p99": h99 * 1e6, "count": n}
    s["handoff_e2e_us"] = {"p50": pct(e2e, 0.5), "p99": pct(e2e, 0.99), "count": len(e2e)}
    return s


def handoff(bin_dir, duration, ks, before, repeat):
    """The turn hand-off in (c): this build and, with --before DIR, an earlier gpu-broker,
    alternating, `repeat` runs each."""
    print("=== handoff: (c) broker turns, 1 slot ===", flush=True)
    brokers = [("this", None)] + ([("before", os.path.join(before, "gpu-broker"))] if before else [])
    out = {}
    for k in ks:
        for rep in range(repeat):
            for name, bb in brokers:
                s = turns_c(bin_dir, k, duration, f"h{k}{name}{rep}", bb)
                out.setdefault(f"K{k}", {}).setdefault(name, []).append(s)
                print(f"K={k} {name} run {rep}: steps/s {s['steps_per_s']:.0f}, shares {s['held_share']}"
                      f" (max err {100 * s['held_share_err_max']:.1f}%), hand-off broker p50/p99"
                      f" {s['handoff_broker_us']['p50']:.1f}/{s['handoff_broker_us']['p99']:.1f} us (n={s['handoff_broker_us']['count']}),"
                      f" end to end p50/p99 {s['handoff_e2e_us']['p50']:.0f}/{s['handoff_e2e_us']['p99']:.0f} us", flush=True)
    lines = ["| K | broker | runs | steps/s | max share err | broker p50 us | broker p99 us | end to end p50 us | end to end p99 us |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, per in out.items():
        for name, runs in per.items():
            med = lambda f: statistics.median(f(r) for r in runs)
            lines.append(f"| {key[1:]} | {name} | {len(runs)} | {med(lambda r: r['steps_per_s']):.0f} | "
                         f"{100 * med(lambda r: r['held_share_err_max']):.1f}% | "
                         f"{med(lambda r: r['handoff_broker_us']['p50']):.1f} | {med(lambda r: r['handoff_broker_us']['p99']):.1f} | "
                         f"{med(lambda r: r['handoff_e2e_us']['p50']):.0f} | {med(lambda r: r['handoff_e2e_us']['p99']):.0f} |")
    print("\n".join(lines), flush=True)
    verdict(all(statistics.median(r["handoff_broker_us"]["p99"] for r in per["this"]) < 100 for per in out.values()),
            "hand-off p99 (broker side) < 100 us for this build")
    return out


def ordinal(bin_dir):
    """A lease-taking child of `gpu-brokerctl run` maps its lease on the local CUDA ordinal
    whose UUID is the lease's device's (run narrows CUDA_VISIBLE_DEVICES to that UUID)."""
    print("=== ordinal: broker device -> the child's CUDA ordinal, by UUID ===", flush=True)
    out = {}
    for mode, extra in (("plain", []), ("mps", ["--mps"])):
        b = Broker(bin_dir, f"o-{mode}", extra)
        try:
            tok = b.tenant("alice", "8GiB")
            tf = os.path.join(b.dir, "alice.token")
            with open(tf, "w") as f:
                f.write(tok)
            uuid = device_uuid(b)
            cmd = [os.path.join(bin_dir, "gpu-brokerctl"), "--broker", f"unix://{b.sock}", "--token-file", tf,
                   "run", "--memory", "2GiB", "--", os.path.join(bin_dir, "gpu-worker"), "ordinal", "--bytes", str(64 * MIB)]
            env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_BROKER_")}
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
            line = next((l for l in r.stdout.splitlines() if l.startswith("{")), "")
            print(f"{mode}: rc={r.returncode} {line} {r.stderr.strip()[-400:]}", flush=True)
            j = json.loads(line) if line else {}
            out[mode] = j
            verdict(r.returncode == 0 and j.get("cuda_visible_devices") == uuid and j.get("local_uuids") == [uuid]
                    and j.get("lease_uuid") == uuid and j.get("broker_uuids", [None])[0] == uuid
                    and j.get("ordinal") == 0 and j.get("mapped_on") == 0 and j.get("bad_bytes") == 0,
                    f"{mode}: cuDeviceGetUuid's UUID is the broker's (NVML) UUID; the lease mapped on ordinal 0 and kept its bytes")
        finally:
            b.stop()
    return out


def table(r):
    lines = ["| K | mode | steps/s | vs (a) | p50 ms | p99 ms | shares (held) vs weights | Jain | hand-off p50/p99 us (broker / end to end) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    a = r["a"]
    for key in sorted(k for k in r if k.startswith("K")):
        k = int(key[1:])
        row = r[key]
        lines.append(f"| {k} | (a) one after another | {a['steps_per_s']:.0f} | 1.00 | {a['p50_ms']:.2f} | {a['p99_ms']:.2f} | | | |")
        for m, name in (("b", "(b) all at once"), ("c", "(c) turns, 1 slot"), ("d", f"(d) MPS, {k} slots")):
            s = row[m]
            share = ""
            jn = ""
            if "held_share" in s:
                sh = s["held_share"] if m == "c" else s["steps_share"]
                share = "/".join(f"{x:.3f}" for x in sh) + f" (max err {100 * (s['held_share_err_max'] if m == 'c' else s['steps_share_err_max']):.1f}%)"
                jn = f"{s['jain_held'] if m == 'c' else s['jain_steps']:.4f}"
            ho = ""
            if m == "c":
                hb, he = s["handoff_broker_us"], s["handoff_e2e_us"]
                ho = f"{hb['p50']:.0f}/{hb['p99']:.0f} / {he['p50']:.0f}/{he['p99']:.0f}"
            lines.append(f"| {k} | {name} | {s['steps_per_s']:.0f} | {s['steps_per_s'] / a['steps_per_s']:.2f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {share} | {jn} | {ho} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--alloc", action="store_true")
    ap.add_argument("--target", type=int, default=0)
    ap.add_argument("--hold", type=float, default=0)
    ap.add_argument("--ready", default="", help="with --alloc: the external step's program (hold_main)")
    ap.add_argument("--go", default="")
    ap.add_argument("--bin", default=".gpu/all")
    ap.add_argument("--parts", default="check,bench")
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--before", default="", help="handoff: a directory with an earlier gpu-broker")
    ap.add_argument("--repeat", type=int, default=1, help="handoff: runs per broker")
    a = ap.parse_args()
    if a.alloc:
        return hold_main(a) if a.ready else alloc_main(a)
    out = os.environ.get("OUT", "")
    res = {}
    t0 = time.time()
    if "check" in a.parts:
        try:
            res["check"] = check(a.bin)
        except Exception as e:  # report and go on to the bench
            verdict(False, f"check raised {e!r}")
    if "external" in a.parts:
        res["external"] = external(a.bin)
    if "bench" in a.parts:
        try:
            res["bench"] = bench(a.bin, a.duration, [int(k) for k in a.ks.split(",")])
            print(table(res["bench"]))
        except Exception as e:
            verdict(False, f"bench raised {e!r}")
    if "ordinal" in a.parts:
        try:
            res["ordinal"] = ordinal(a.bin)
        except Exception as e:
            verdict(False, f"ordinal raised {e!r}")
    if "handoff" in a.parts:
        try:
            res["handoff"] = handoff(a.bin, a.duration, [int(k) for k in a.ks.split(",")], a.before, a.repeat)
        except Exception as e:
            verdict(False, f"handoff raised {e!r}")
    print(f"=== {len(PASSED)} passed, {len(FAILED)} failed, {time.time() - t0:.0f} s ===")
    for f in FAILED:
        print("FAILED:", f)
    if out:
        with open(os.path.join(out, "mps-results.json"), "w") as f:
            json.dump(res, f, indent=1)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
