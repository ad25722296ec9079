"""Fixtures: a real `gpu-broker` on the host backend (simulated device, shared-memory
files) on a private Unix socket, and `gpu-brokerctl` for the operator's side. The
binaries come from `GPU_BROKER_BIN_DIR` (default: the workspace's target/debug)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN_DIR = Path(os.environ.get("GPU_BROKER_BIN_DIR", ROOT / "target" / "debug"))
MIB = 1 << 20


def _bin(name: str) -> str:
    path = BIN_DIR / name
    if not path.exists():
        pytest.fail(f"{path} not built: run scripts/test-python.sh (or cargo build --workspace --bins)")
    return str(path)


def wait_for(what, timeout: float = 20, every: float = 0.05):
    """Calls `what` until it returns something true, sleeping `every` seconds between
    calls, for at most `timeout` seconds; its last answer (false if time ran out)."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(every)


class BrokerProc:
    """A broker process with its own socket, state and shared-memory directories."""

    def __init__(self, args: List[str]):
        self.dir = tempfile.TemporaryDirectory(prefix="gpb-py-")
        d = Path(self.dir.name)
        self.socket = d / "broker.sock"
        # Where workers fetch their leases' descriptors (named here, not left to the
        # broker's default, so tests can reach it).
        self.tickets = d / "broker.tickets.sock"
        self.state = d / "state"
        self.shm = Path("/dev/shm") / d.name
        self.log = d / "broker.log"
        self.address = f"unix://{self.socket}"
        self.args = [
            _bin("gpu-broker"),
            "--backend", "host",
            "--headroom", "0%",
            "--socket", str(self.socket),
            "--ticket-socket", str(self.tickets),
            "--state-dir", str(self.state),
            "--host-shm-dir", str(self.shm),
            "--shutdown-grace", "1s",
            *args,
        ]
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        if self.socket.exists():
            self.socket.unlink()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.socket.exists() and (self.state / "admin.token").exists():
                try:
                    self.ctl("devices")
                    return
                except subprocess.CalledProcessError:
                    pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"broker did not start:\n{self.log.read_text()}")

    @property
    def admin_token(self) -> str:
        return (self.state / "admin.token").read_text().strip()

    def ctl(self, *args: str) -> str:
        cmd = [_bin("gpu-brokerctl"), "--broker", self.address,
               "--token-file", str(self.state / "admin.token"), *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout

    def tenant(self, name: str, limit: str = "256MiB", *extra: str) -> str:
        """Creates (or replaces) a tenant's quota and returns a new token for it."""
        self.ctl("quota", "set", name, "--limit", limit, *extra)
        return self.ctl("tokens", "issue", name).strip()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        self.dir.cleanup()


@pytest.fixture
def broker():
    b = BrokerProc(["--host-capacity", "256MiB"])
    yield b
    b.close()


@pytest.fixture
def make_broker():
    made: List[BrokerProc] = []

    def make(*args: str) -> BrokerProc:
        b = BrokerProc(list(args))
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()
