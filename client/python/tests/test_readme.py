"""The README's Python quick start runs verbatim (its /tmp/gpb directory moved to a
private temporary one) from the repository's root: it builds the wheel with
scripts/build-wheel.sh, installs it into a fresh virtual environment with numpy, starts a
broker, takes a lease from Python and is refused one over the quota."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile

from conftest import ROOT

MARKER = "<!-- python-quick-start:"


def readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(marker)
    opened = text.index("```sh\n", start) + len("```sh\n")
    return text[opened:text.index("```", opened)]


def test_the_readme_python_quick_start_runs_as_written():
    block = readme_block(MARKER)
    assert "pip install target/wheels/gpubroker-" in block, "installs the built wheel"
    with tempfile.TemporaryDirectory(prefix="gpb-readme-") as d:
        script = block.replace("/tmp/gpb", d)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("GPU_BROKER_") and k != "VIRTUAL_ENV"}
        proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        try:
            out, err = proc.communicate(timeout=900)
        finally:
            # The block's broker, if the block stopped before its last line.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert proc.returncode == 0, f"--- stdout\n{out}\n--- stderr\n{err}"
        lines = out.splitlines()
        lease = [l for l in lines if " 67108864 device [1. 1. 1. 1.]" in l]
        assert lease, f"the lease line (id, bytes, tier, values):\n{out}"
        refused = [l for l in lines if l.startswith("refused:")]
        assert refused and "quota" in refused[0].lower(), out
