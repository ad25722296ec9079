"""The whole Python API against a real broker on the host backend: sessions, leases,
numpy views (also read by a forked child), every exception type, events, reclaim and
reconnection."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import gpubroker
from gpubroker import events as ev

from conftest import MIB, _bin, wait_for


def test_connect_reads_the_environment(broker, monkeypatch, tmp_path):
    token = broker.tenant("envy")
    token_file = tmp_path / "token"
    token_file.write_text(f"  {token}\n")
    monkeypatch.setenv("GPU_BROKER_ADDR", broker.address)
    monkeypatch.delenv("GPU_BROKER_TOKEN", raising=False)
    monkeypatch.setenv("GPU_BROKER_TOKEN_FILE", str(token_file))
    b = gpubroker.connect()
    assert b.address == broker.address
    with b.session("from-env") as s:
        assert s.tenant == "envy"
        assert s.name == "from-env"
        assert s.id and not s.closed
    assert s.closed
    monkeypatch.setenv("GPU_BROKER_TOKEN", token)
    monkeypatch.delenv("GPU_BROKER_TOKEN_FILE")
    assert gpubroker.connect().usage().tenant == "envy"


def test_usage_has_the_attributes_the_stub_declares(broker):
    """Usage reads its attributes from the client's one quota and counters: each the stub
    declares is there, with the value the broker reports, and no other."""
    import pathlib
    import re

    stub = (pathlib.Path(gpubroker.__file__).parent / "_native.pyi").read_text()
    body = stub.split("class Usage:", 1)[1].split("\nclass ", 1)[0]
    declared = set(re.findall(r"^    (\w+): ", body, re.M))
    assert {"tenant", "limit_bytes", "held_bytes", "device_limit_bytes"} <= declared
    b = gpubroker.connect(broker.address, broker.tenant("stub", "64MiB", "--priority", "3"))
    u = b.usage()
    assert {a for a in dir(u) if not a.startswith("_")} == declared
    assert (u.tenant, u.limit_bytes, u.priority, u.held_bytes) == ("stub", 64 * MIB, 3, 0)
    assert u.available_bytes == 64 * MIB and u.device_limit_bytes == {}
    assert "tenant=\"stub\"" in repr(u)


def test_connect_without_a_token_is_unauthenticated(monkeypatch):
    monkeypatch.delenv("GPU_BROKER_TOKEN", raising=False)
    monkeypatch.delenv("GPU_BROKER_TOKEN_FILE", raising=False)
    with pytest.raises(gpubroker.Unauthenticated) as e:
        gpubroker.connect("unix:///nonexistent.sock")
    assert "GPU_BROKER_TOKEN" in str(e.value)


def test_lease_attributes_numpy_views_and_usage(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t", "64MiB", "--max-leases", "4"))
    with b.session("w") as s:
        lease = s.lease(3 * MIB, label="buf", reclaimable=True)
        assert lease.nbytes >= 3 * MIB and lease.nbytes % (2 * MIB) == 0
        assert lease.requested_nbytes == 3 * MIB
        assert (lease.device, lease.tier, lease.handle_kind) == (0, "device", "fd")
        assert lease.label == "buf" and lease.reclaimable and not lease.released
        assert lease.session_id == s.id and len(lease.id) == 36
        u = s.usage()
        assert (u.tenant, u.limit_bytes, u.held_bytes, u.lease_count, u.max_leases) == (
            "t", 64 * MIB, lease.nbytes, 1, 4)
        assert u.available_bytes == 64 * MIB - lease.nbytes

        f = lease.as_numpy("float32", (256, 1024))
        assert f.shape == (256, 1024) and f.dtype == np.float32
        f[:] = 1.5
        raw = lease.as_numpy()  # uint8, every byte of the lease
        assert raw.size == lease.nbytes
        assert raw[:4].tobytes() == np.float32(1.5).tobytes()
        raw[-1] = 7
        assert lease.as_numpy("uint8")[-1] == 7
        with pytest.raises(gpubroker.InvalidArgument):
            lease.as_numpy("float64", (lease.nbytes,))

        with pytest.raises(gpubroker.FailedPrecondition) as e:
            lease.release()
        assert "still viewed" in str(e.value)
        del f, raw
        lease.release()
        assert lease.released
        lease.release()  # twice: nothing
        assert s.usage().held_bytes == 0
        with pytest.raises(gpubroker.FailedPrecondition):
            lease.as_numpy()


def test_with_block_releases_after_the_last_view(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t"))
    with b.session("w") as s:
        with s.lease(2 * MIB) as lease:
            view = lease.as_numpy()
            view[:] = 3
        assert lease.released
        assert s.usage().held_bytes == 2 * MIB, "still viewed: the release waits"
        assert view[0] == 3
        del view
        wait_for(lambda: s.usage().held_bytes == 0, timeout=5, every=0.02)
        assert s.usage().held_bytes == 0


def _child_reads(view, expected, out):
    out.send(bool((view == expected).all()) and int(view.sum(dtype=np.uint64)))
    os._exit(0)


def test_a_forked_child_reads_the_inherited_mapping(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t"))
    with b.session("w") as s:
        lease = s.lease(4 * MIB)
        view = lease.as_numpy("uint32")
        view[:] = np.arange(view.size, dtype=np.uint32)
        ctx = multiprocessing.get_context("fork")
        recv, out = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child_reads, args=(view, np.arange(view.size, dtype=np.uint32), out))
        child.start()
        assert recv.poll(30), "the child answered"
        got = recv.recv()
        child.join(30)
        assert child.exitcode == 0
        assert got == int(np.arange(view.size, dtype=np.uint64).sum())
        del view
        lease.release()


def _child_uses_session(session, out):
    try:
        session.usage()
        out.send("no error")
    except gpubroker.FailedPrecondition as e:
        out.send(f"FailedPrecondition: {e}")
    except BaseException as e:  # noqa: BLE001 - report anything else
        out.send(f"{type(e).__name__}: {e}")
    os._exit(0)


def test_a_forked_child_cannot_use_the_parents_session(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t"))
    with b.session("w") as s:
        ctx = multiprocessing.get_context("fork")
        recv, out = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child_uses_session, args=(s, out))
        child.start()
        assert recv.poll(30), "the child answered"
        msg = recv.recv()
        child.join(30)
        assert msg.startswith("FailedPrecondition") and "forked child" in msg, msg
        assert s.usage().tenant == "t", "the parent is unaffected"


def _check(err, cls, code):
    assert isinstance(err, gpubroker.BrokerError)
    # The code's class, or the class of the broker's reason, which is one of its subclasses.
    assert type(err) is cls or type(err) is gpubroker.errors.REASONS.get(err.reason), type(err)
    assert isinstance(err, cls), type(err)
    assert err.code == code
    assert err.message and str(err) == err.message
    assert hasattr(err, "reason")


def test_every_exception_type(broker):
    token = broker.tenant("t", "32MiB")
    b = gpubroker.connect(broker.address, token)
    with b.session("w") as s:
        with pytest.raises(gpubroker.QuotaExceeded) as e:
            s.lease(64 * MIB)
        _check(e.value, gpubroker.QuotaExceeded, "RESOURCE_EXHAUSTED")
        assert "32" in str(e.value), "the message carries the numbers"

        held = s.lease(24 * MIB)
        t0 = time.time()
        with pytest.raises(gpubroker.WaitTimeout) as e:
            s.lease(16 * MIB, wait=0.3)
        assert time.time() - t0 >= 0.25
        _check(e.value, gpubroker.WaitTimeout, "DEADLINE_EXCEEDED")

        with pytest.raises(gpubroker.InvalidArgument) as e:
            s.lease(0)
        _check(e.value, gpubroker.InvalidArgument, "INVALID_ARGUMENT")
        with pytest.raises(gpubroker.InvalidArgument):
            s.lease(MIB, device=7)
        with pytest.raises(gpubroker.InvalidArgument):
            s.lease(MIB, wait=-1)

        broker.ctl("leases", "revoke", held.id, "--reason", "test")
        with pytest.raises(gpubroker.NotFound) as e:
            held.release()
        _check(e.value, gpubroker.NotFound, "NOT_FOUND")
        assert type(e.value) is gpubroker.LeaseNotFound and e.value.reason == "LEASE_NOT_FOUND"

        with s.lease(2 * MIB) as viewed:
            keep = viewed.as_numpy()
            with pytest.raises(gpubroker.FailedPrecondition) as e:
                viewed.release()
            _check(e.value, gpubroker.FailedPrecondition, "FAILED_PRECONDITION")
            del keep

    with pytest.raises(gpubroker.Unauthenticated) as e:
        gpubroker.connect(broker.address, "not-a-token").session("x")
    _check(e.value, gpubroker.Unauthenticated, "UNAUTHENTICATED")

    with pytest.raises(gpubroker.PermissionDenied) as e:
        gpubroker.connect(broker.address, broker.admin_token).session("admin-as-worker")
    _check(e.value, gpubroker.PermissionDenied, "PERMISSION_DENIED")

    with pytest.raises(gpubroker.Unavailable) as e:
        gpubroker.connect(f"unix://{broker.dir.name}/nobody.sock", token)
    _check(e.value, gpubroker.Unavailable, "UNAVAILABLE")

    with pytest.raises(gpubroker.InvalidArgument):
        gpubroker.connect("ftp://nowhere", token)


def test_revocation_and_shutdown_events(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t"))
    s = b.session("w")
    stream = s.events()
    assert stream.next(timeout=0.2) is None, "nothing happened yet"
    lease = s.lease(2 * MIB)
    broker.ctl("leases", "revoke", lease.id, "--reason", "maintenance")
    got = stream.next(timeout=10)
    assert isinstance(got, ev.LeaseRevoked) and got.lease_id == lease.id
    assert "maintenance" in got.reason
    broker.stop(signal.SIGTERM)
    seen = list(stream)
    kinds = [type(e) for e in seen]
    assert ev.ShuttingDown in kinds, seen
    assert isinstance(seen[-1], ev.Closed), seen
    assert s.closed
    assert stream.next(timeout=0.1) is None, "the stream ended"
    with pytest.raises(gpubroker.BrokerError):
        s.lease(MIB)


def test_reclaim_callback_gives_memory_back(make_broker):
    b = make_broker("--host-capacity", "64MiB", "--reclaim-deadline", "10s")
    low = gpubroker.connect(b.address, b.tenant("low", "64MiB", "--priority", "0"))
    high = gpubroker.connect(b.address, b.tenant("high", "64MiB", "--priority", "10"))
    ls = low.session("low")
    held = {}
    asked = []
    done = threading.Event()

    def give_back(event):
        asked.append(event)
        lease = held.pop(event.lease_id, None)
        if lease is not None:
            lease.release()
        done.set()

    ls.on_reclaim(give_back)
    for _ in range(2):
        lease = ls.lease(32 * MIB, reclaimable=True)
        held[lease.id] = lease
    with high.session("high") as hs:
        got = hs.lease(32 * MIB, wait=10)
        assert got.nbytes == 32 * MIB
        assert done.wait(5)
        req = asked[0]
        assert isinstance(req, ev.ReclaimRequested)
        assert req.nbytes == 32 * MIB and req.deadline > time.time() - 1 and req.reason
        assert len(held) == 1, "only as much as needed was asked back"
    ls.close()


def test_a_broker_restart_with_a_keeper_resumes_the_session_and_keeps_its_leases(make_broker):
    keeper_dir = tempfile.TemporaryDirectory(prefix="gpb-py-keeper-")
    sock = Path(keeper_dir.name) / "keeper.sock"
    keeper = subprocess.Popen(
        [_bin("gpu-broker"), "keeper", "--socket", str(sock)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(sock.exists)
        broker = make_broker("--host-capacity", "256MiB", "--keeper", str(sock))
        b = gpubroker.connect(broker.address, broker.tenant("t"))
        s = b.session("survivor", reconnect=True)
        stream = s.events()
        lease = s.lease(2 * MIB)
        view = lease.as_numpy()
        view[:5] = 7
        broker.stop(signal.SIGKILL)
        broker.start()
        seen = []
        deadline = time.time() + 20
        while time.time() < deadline:
            e = stream.next(timeout=1)
            if e is not None:
                seen.append(e)
                if isinstance(e, (ev.Resumed, ev.Reconnected)):
                    break
        assert isinstance(seen[-1], ev.Resumed), seen
        assert seen[-1].kept_leases == [lease.id] and seen[-1].session_id == s.id
        assert not lease.lost and s.connected
        assert (view[:5] == 7).all(), "the mapping outlived the broker"
        view[5] = 8
        del view
        assert (lease.as_numpy()[:6] == [7, 7, 7, 7, 7, 8]).all()
        lease.release()
        wait_for(lambda: s.usage().held_bytes == 0, timeout=5, every=0.02)
        s.close()
    finally:
        keeper.kill()
        keeper.wait()
        keeper_dir.cleanup()


def test_reconnect_after_a_broker_restart(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t"))
    s = b.session("survivor", reconnect=True)
    old_id = s.id
    stream = s.events()
    lease = s.lease(2 * MIB)
    broker.restart()
    seen = []
    deadline = time.time() + 20
    while time.time() < deadline:
        e = stream.next(timeout=1)
        if e is not None:
            seen.append(e)
            if isinstance(e, ev.Reconnected):
                break
    kinds = [type(e) for e in seen]
    assert ev.Disconnected in kinds and isinstance(seen[-1], ev.Reconnected), seen
    rec = seen[-1]
    assert rec.old_session_id == old_id and rec.new_session_id == s.id != old_id
    assert rec.lost_leases == [lease.id]
    assert lease.lost and s.connected
    with pytest.raises(gpubroker.NotFound):
        lease.release()
    again = s.lease(2 * MIB)
    assert again.session_id == s.id
    again.release()
    s.close()


def test_host_fallback_lease(make_broker):
    b = make_broker("--host-capacity", "8MiB", "--host-fallback-capacity", "64MiB")
    w = gpubroker.connect(b.address, b.tenant("t", "64MiB", "--host-limit", "32MiB"))
    with w.session("w") as s:
        full = s.lease(8 * MIB)
        with s.lease(4 * MIB, fallback_host=True) as lease:
            assert lease.tier == "host"
            a = lease.as_numpy("int16")
            a[:] = -2
            assert int(a.sum()) == -2 * a.size
            assert s.usage().host_held_bytes == lease.nbytes
            del a
        full.release()


def test_device_views_need_their_libraries(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t"))
    with b.session("w") as s, s.lease(2 * MIB) as lease:
        try:
            import cupy  # noqa: F401
        except ImportError:
            with pytest.raises(gpubroker.FailedPrecondition) as e:
                lease.as_cupy()
            assert "cupy" in str(e.value)
        try:
            import torch
        except ImportError:
            with pytest.raises(gpubroker.FailedPrecondition):
                lease.as_torch()
        else:
            t = lease.as_torch(torch.int32, (4,))
            t[:] = 9
            assert lease.as_numpy("int32")[:4].tolist() == [9, 9, 9, 9]
            del t


def test_help_and_typing_stubs():
    doc = gpubroker.__doc__
    assert "connect" in doc and "lease" in doc
    assert gpubroker.Session.lease.__doc__ and "wait" in gpubroker.Session.lease.__doc__
    pkg = os.path.dirname(gpubroker.__file__)
    assert os.path.exists(os.path.join(pkg, "_native.pyi"))
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    for name in ("QuotaExceeded", "WaitTimeout", "Unauthenticated", "PermissionDenied",
                 "NotFound", "InvalidArgument", "FailedPrecondition", "Unavailable"):
        assert issubclass(getattr(gpubroker, name), gpubroker.BrokerError)


def test_torch_allocator_hooks_are_exported_and_inert_before_install():
    import ctypes

    import gpubroker.torch as gt

    lib = ctypes.CDLL(gpubroker._native.__file__)
    alloc = lib.gpubroker_torch_alloc
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free = lib.gpubroker_torch_free
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    assert alloc(1 << 20, 0, None) is None, "no allocator installed: null, no crash"
    assert alloc(-5, 0, None) is None
    free(None, 0, 0, None)
    free(0x1234, 16, 0, None)
    assert not gt.installed()
    assert gt.empty_cache() == 0
    with pytest.raises(gpubroker.FailedPrecondition):
        gt.session()
    with pytest.raises(gpubroker.FailedPrecondition):
        gt.memory_stats()
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(gpubroker.FailedPrecondition) as e:
            gt.install()
        assert "PyTorch" in str(e.value)


def test_waits_past_what_a_duration_holds_are_refused_not_a_panic():
    # Finite but past ~584 billion years: InvalidArgument, not a Rust panic.
    with pytest.raises(gpubroker.InvalidArgument) as e:
        gpubroker._native._regions_resume(None, 1e20)
    assert "wait" in str(e.value)


def test_imported_segments_can_be_weakly_referenced():
    # torch.multiprocessing's receiving side keeps imports in a WeakValueDictionary: a
    # type without a weak-reference slot fails there (TypeError) on the GPU.
    assert gpubroker._native.ImportedSegment.__weakrefoffset__ != 0


def test_torch_install_plumbing_with_a_stand_in_torch(broker):
    """gpubroker.torch's Python half against a recording stand-in for PyTorch (the real
    hooks; the host backend's leases cannot be mapped as CUDA memory, which exercises the
    refusal path): routing, hooks, OOM reason, refusals, empty_cache's pool switch."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    token = broker.tenant("t", "64MiB")
    child = subprocess.run(
        [sys.executable, os.path.join(here, "torch_plumbing_child.py"), broker.address, token,
         os.path.join(here, "fake_torch")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "GPU_BROKER_STREAM_RECORD_FLUSH": "8192"},
    )
    lines = [l for l in child.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, child.stdout + child.stderr
    out = json.loads(lines[-1][7:])
    assert out["installed"] and out["routed"]
    assert out["hooks"] == ["gpubroker_torch_alloc", "gpubroker_torch_free"]
    assert out["calls"][:3] == ["allocator", "pool", "begin"], out["calls"]
    assert out["ptr"] is None
    s = out["stats"]
    assert (s["allocs"], s["ooms"], s["waits"], s["segments"], s["leased_bytes"]) == (0, 1, 0, 0, 0), s
    assert s["broker_acquires"] == 2, "a segment, then the exact size, neither waiting (not a full card)"
    assert s["stream_block_flushes"] == 1, s
    assert out["flush_calls"] == ["end", "torch_empty_cache", "begin", "release"], out["flush_calls"]
    assert out["observers"] == 0, "no raising observer (cuDNN must see PyTorch's own error)"
    assert out["oom"].startswith("CUDA out of memory. Tried to allocate 2.00 MiB.\ngpubroker"), out["oom"]
    assert "FAILED_PRECONDITION" in out["oom"], out["oom"]
    assert out["oom_plain"] == ["plain", None], "taken once"
    assert out["ptr_over_quota"] is None
    q = out["oom_quota"]
    assert q and q["reason"] == "QUOTA_EXCEEDED" and q["code"] == "RESOURCE_EXHAUSTED", q
    assert "RESOURCE_EXHAUSTED (QUOTA_EXCEEDED)" in q["text"] and str(64 << 20) in q["text"], q
    assert out["mp"][0] == "InvalidArgument" and "not in a segment" in out["mp"][1], out["mp"]
    assert out["mp_import"] == ["NotFound", "SHARED_LEASE_NOT_FOUND"], out["mp_import"]
    # Each pause's begin is balanced by a release (PyTorch takes a pool reference per begin).
    # Ours steps aside for the capture (which routing wins differs between PyTorch
    # releases) and comes back when it ends.
    assert out["graph_calls"] == ["pool", "end", "capture_begin", "capture_end", "begin", "release"], out["graph_calls"]
    assert out["graph_pool_is_ours"] and out["graph_reroute"]
    assert out["shared_calls_begun"] == ["pool", "end", "begin_thread"], out["shared_calls_begun"]
    assert out["shared_calls"] == ["pool", "end", "begin_thread", "end", "begin", "release"], out["shared_calls"]
    assert out["shared_is_ours"]
    assert out["memory_module_patched"], "use_mem_pool looks the name up in torch.cuda.memory"
    assert out["graph_pool_deleted"], "the freed graph's pool went with empty_cache()"
    # A fresh pool; the routing pauses while the old pool is destroyed and PyTorch's cache
    # emptied (PyTorch asserts no routing is active then), and resumes on the new pool.
    assert out["empty_calls"] == [
        "pool", "end", "release", "pool_deleted", "pool_deleted", "torch_empty_cache", "begin"], out["empty_calls"]
    assert out["reuse_calls"] == ["end", "torch_empty_cache", "begin", "release"], out["reuse_calls"]
    assert out["reuse_same_pool"]
    # A record_stream under the threshold only records; the one that reaches it also
    # returns the multi-stream blocks (the routing pauses around PyTorch's empty_cache).
    assert out["record_first"] == ["record_stream"], out["record_first"]
    assert out["record_second"] == ["record_stream", "end", "torch_empty_cache", "begin", "release"], out["record_second"]
    assert out["released"] == 0


def test_device_unhealthy_event(broker):
    b = gpubroker.connect(broker.address, broker.tenant("t"))
    with b.session("w") as s:
        stream = s.events()
        lease = s.lease(2 * MIB)
        broker.ctl("mark-unhealthy", "0", "--reason", "test fault")
        got = None
        deadline = time.time() + 10
        while time.time() < deadline and not isinstance(got, ev.DeviceUnhealthy):
            got = stream.next(timeout=1)
        assert isinstance(got, ev.DeviceUnhealthy), got
        assert got.device == 0 and "test fault" in got.reason and got.uuid
        with pytest.raises(gpubroker.BrokerError):
            s.lease(2 * MIB)
        lease.release()


def test_per_device_caps_show_in_usage_and_refuse_past_the_cap(make_broker):
    b = make_broker("--host-capacity", "64MiB", "--host-devices", "2")
    token = b.tenant("capped", "48MiB", "--device-limit", "0=4MiB")
    with gpubroker.connect(b.address, token).session("w") as s:
        first = s.lease(4 * MIB, device=0)
        with pytest.raises(gpubroker.QuotaExceeded) as e:
            s.lease(2 * MIB, device=0)
        assert e.value.reason == "DEVICE_QUOTA_EXCEEDED"
        assert e.value.details["device"] == "0"
        other = s.lease(2 * MIB)
        assert other.device == 1, "an unpinned lease goes where the cap leaves room"
        u = s.usage()
        assert u.device_limit_bytes == {0: 4 * MIB}
        assert u.device_committed_bytes == {0: 4 * MIB, 1: 2 * MIB}
        first.release()
        other.release()


@pytest.mark.parametrize("package", ["old", "new"])
def test_memory_saver_plugs_into_torch_memory_saver(broker, package):
    """gpubroker.torch_memory_saver runs code written for torch_memory_saver: through
    `register_hook_mode` where the package has it (new), else as the implementation its
    singleton delegates to (0.0.10, old); regions set the tag the hooks allocate under
    (restored on leaving, also around disable()), each region in a MemPool of its own,
    pause/resume by tag (an unused tag pauses nothing)."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    token = broker.tenant("t", "64MiB")
    child = subprocess.run(
        [sys.executable, os.path.join(here, "memsaver_plumbing_child.py"), broker.address, token,
         os.path.join(here, "fake_torch"), os.path.join(here, "fake_memory_saver", package)],
        capture_output=True, text=True, timeout=120,
    )
    lines = [l for l in child.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, child.stdout + child.stderr
    out = json.loads(lines[-1][7:])
    if package == "old":
        assert out["impl_is_ours"] is True
    assert out["outside"] is None
    assert out["inside"] == ["kv", True]
    assert out["ptr"] is None, "the host backend's lease is not CUDA memory"
    assert out["disabled"] is None and out["after_disable"] == ["kv", True]
    assert out["after"] is None, "leaving the region closed it"
    assert out["thread_pools"] and out["in_front"], out
    assert out["tags"] == ["kv"]
    assert out["pause_unknown"] == 0
    assert out["pause_kv"] == 0 and out["paused"] == 1
    assert out["resume_kv"] == 0 and out["resumed"] == 0
    assert out["facade_paused"] == 1
