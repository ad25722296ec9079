#!/usr/bin/env python3
"""A small model's step loop that takes one gpu-broker compute turn per step.

Each step runs ResNet-18 inference at batch 8 (or, without torchvision, a chain of GEMMs)
and waits for the GPU to finish it. With ``--gate PATH`` (the ``turn-gate`` example
binary; it needs GPU_BROKER_ADDR and GPU_BROKER_TOKEN) every step asks for the turn
first and gives it back after; without it the steps run uncoordinated. The program is
otherwise unmodified PyTorch: under ``gpu-brokerctl run`` (or a broker's MPS environment)
the driver holds it to its reservation.

    GPU_BROKER_TOKEN=gpb_... python3 turn_step_worker.py --gate ./turn-gate --duration 5

It warms up, waits until ``--start-at`` (Unix time) or, with ``--go FILE``, until that
file holds a Unix start time (after creating ``--ready FILE``), so that several workers
measure the same window; then it runs steps for ``--duration`` seconds and writes one JSON object: the model,
the step count and, per step, CLOCK_MONOTONIC nanoseconds of ask, grant, done and
release (``--out``, default stdout).
"""

import argparse
import json
import subprocess
import sys
import time


def build(kind, batch):
    if kind == "sleep":  # no GPU: 2 ms of waiting per step (to try the harness)
        return "sleep", lambda: time.sleep(0.002)
    import torch

    if kind == "resnet18":
        try:
            import torchvision

            model = torchvision.models.resnet18().cuda().eval()
            x = torch.randn(batch, 3, 224, 224, device="cuda")
            return "resnet18", lambda: model(x)
        except ImportError:
            pass
    a = torch.randn(batch * 128, 1024, device="cuda")
    ws = [torch.randn(1024, 1024, device="cuda") / 32 for _ in range(8)]

    def chain():
        y = a
        for w in ws:
            y = torch.relu(y @ w)
        return y

    return "gemm-chain", chain


class Gate:
    """The turn-gate child: one line in, one line out."""

    def __init__(self, path, device):
        self.p = subprocess.Popen(
            [path, "--device", str(device)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def call(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line or line.startswith("e"):
            raise RuntimeError(f"turn-gate: {line.strip() or 'exited'}")
        return line

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet18", choices=["resnet18", "gemm", "sleep"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gate", help="turn-gate binary: take one turn per step")
    ap.add_argument("--device", type=int, default=0, help="broker device of the turns")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--start-at", type=float, default=0.0, help="Unix time to start at")
    ap.add_argument("--ready", help="file created once warmed up")
    ap.add_argument("--go", help="file to wait for: it holds the Unix start time")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--out")
    a = ap.parse_args()

    if a.model == "sleep":
        import contextlib

        sync, no_grad = (lambda: None), contextlib.nullcontext
    else:
        import torch

        torch.backends.cudnn.benchmark = True
        sync, no_grad = torch.cuda.synchronize, torch.no_grad
    name, step = build(a.model, a.batch)
    with no_grad():
        for _ in range(a.warmup):
            step()
        sync()
        gate = Gate(a.gate, a.device) if a.gate else None
        start_at = a.start_at
        if a.ready:
            open(a.ready, "w").close()
        if a.go:
            while True:
                try:
                    with open(a.go) as f:
                        start_at = float(f.read().strip())
                    break
                except (OSError, ValueError):
                    time.sleep(0.002)
        while time.time() < start_at:
            time.sleep(0.0005)
        end = time.monotonic_ns() + int(a.duration * 1e9)
        steps = []
        while True:
            t0 = time.monotonic_ns()
            if t0 >= end:
                break
            if gate:
                gate.call("a")
            tg = time.monotonic_ns()
            step()
            sync()
            t1 = time.monotonic_ns()
            if gate:
                gate.call("r")
            t2 = time.monotonic_ns()
            steps.append((t0, tg, t1, t2))
        if gate:
            gate.close()
    report = {"model": name, "batch": a.batch, "steps": steps}
    text = json.dumps(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
