"""`gpu-brokerctl run --torch`: a Python program has `gpubroker.torch.install()` done for it
before its own first line (a sitecustomize put first on PYTHONPATH), on a session of its
own tenant opened from the token file `run` hands it (the fake torch of fake_torch/ stands
in for PyTorch: the routing calls are recorded)."""

import json
import os
import subprocess
import sys

from conftest import _bin

HERE = os.path.dirname(os.path.abspath(__file__))

PROGRAM = """
import json, os, torch
import gpubroker.torch as gt
print("RESULT " + json.dumps({
    "installed": gt.installed(),
    "calls": [c[0] for c in torch.calls][:3],
    "tenant": gt.session().tenant if gt.installed() else None,
    "token_env": "GPU_BROKER_TOKEN" in os.environ,
}))
"""


def run(broker, token_file, *args, env=None):
    cmd = [_bin("gpu-brokerctl"), "--broker", broker.address, "--token-file", str(token_file),
           "run", "--memory", "64MiB", *args, "--", sys.executable, "-c", PROGRAM]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_run_torch_installs_the_allocator_before_the_program(broker, tmp_path):
    token_file = tmp_path / "t.token"
    token_file.write_text(broker.tenant("t", "256MiB"))
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "fake_torch"), GPU_BROKER_TOKEN="stale")
    child = run(broker, token_file, "--torch", env=env)
    assert child.returncode == 0, child.stdout + child.stderr
    lines = [l for l in child.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, child.stdout + child.stderr
    out = json.loads(lines[-1][7:])
    assert out["installed"], out
    assert out["calls"] == ["allocator", "pool", "begin"], out
    assert out["tenant"] == "t"
    assert not out["token_env"], "the program reads the token file run made, not a stale variable"

    # Without --torch nothing is installed.
    child = run(broker, token_file, env=env)
    assert child.returncode == 0, child.stdout + child.stderr
    out = json.loads([l for l in child.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    assert not out["installed"] and out["calls"] == [], out
