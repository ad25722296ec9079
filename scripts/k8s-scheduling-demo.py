#!/usr/bin/env python3
"""The real Kubernetes scheduler places pods by brokered GPU memory.

Starts etcd, kube-apiserver and kube-scheduler (built into target/k8s-bin/ by
scripts/k8s-control-plane.sh) on loopback, creates two fake Nodes (no kubelet: pods are
bound, never run), applies the shipped DeviceClass (deploy/kubernetes/dra/deviceclass.yaml)
and one ResourceSlice per node in the gpu-broker.io driver's shape (docs/kubernetes.md: one
GPU with allowMultipleAllocations and capacity.memory 125Gi; `--slice-cmd` takes the
driver's own output instead), then creates pods that each claim 40 GiB of GPU memory
(the claim spec of deploy/kubernetes/examples/worker-pod.yaml with 40Gi):

  1. node-b cordoned: three pods fit node-a's 125 GiB device, the fourth stays Pending
     with the scheduler's reason;
  2. node-b uncordoned: the fourth goes there, two more follow, the seventh stays Pending.

Prints one line per fact (PLACED / PENDING / ALLOCATED) and `OK` at the end; exits 1 on a
placement other than that, 2 when the binaries are missing. Run with the venv python that
scripts/test-deps.sh makes (target/k8s-venv/bin/python: PyYAML reads the manifests):

  target/k8s-venv/bin/python scripts/k8s-scheduling-demo.py [--log-dir DIR]
  target/k8s-venv/bin/python scripts/k8s-scheduling-demo.py --print-slice node-a
"""

import argparse
import json
import os
import secrets
import shlex
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BIN = os.path.join(ROOT, "target", "k8s-bin")
DRIVER = "gpu-broker.io"
DEVICE_MEMORY = "125Gi"
CLAIM_MEMORY = "40Gi"
NAMESPACE = "training"
# Consumable capacity: beta and on by default from 1.36, alpha (off) in 1.34-1.35.
FEATURE_GATES = "DRAConsumableCapacity=true"


def say(*words):
    print(*words, flush=True)


def slice_for(node):
    """The node's ResourceSlice, in the shape docs/kubernetes.md gives."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "allowMultipleAllocations": True,
                    "attributes": {
                        "uuid": {"string": f"HOST-{node}-0"},
                        "model": {"string": "NVIDIA H200"},
                        "index": {"int": 0},
                        "brokerVersion": {"version": "0.1.0"},
                    },
                    "capacity": {
                        "memory": {
                            "value": DEVICE_MEMORY,
                            "requestPolicy": {
                                "default": "1Gi",
                                "validRange": {"min": "2Mi", "max": DEVICE_MEMORY, "step": "2Mi"},
                            },
                        }
                    },
                }
            ],
        },
    }


def yaml_docs(path):
    import yaml  # PyYAML, in target/k8s-venv

    with open(os.path.join(ROOT, path)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Api:
    """The API server's REST interface, as the cluster admin (a static bearer token)."""

    def __init__(self, port, token):
        self.base = f"https://127.0.0.1:{port}"
        self.token = token
        self.tls = ssl.create_default_context()
        self.tls.check_hostname = False
        self.tls.verify_mode = ssl.CERT_NONE

    def call(self, method, path, body=None, content_type="application/json"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.tls, timeout=30) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: {e.code} {e.read().decode()[:2000]}") from None
        return json.loads(text) if text.startswith("{") else text

    def create(self, path, obj):
        return self.call("POST", path, obj)

    def patch(self, path, patch):
        return self.call("PATCH", path, patch, "application/merge-patch+json")


def wait_for(what, check, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
        except Exception as e:  # not up yet
            got, last = None, e
        else:
            last = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}" + (f": {last}" if last else ""))
        time.sleep(0.5)


class ControlPlane:
    def __init__(self, log_dir):
        self.dir = tempfile.mkdtemp(prefix="k8s-demo-")
        self.log_dir = log_dir or self.dir
        os.makedirs(self.log_dir, exist_ok=True)
        self.procs = []

    def start(self, name, args):
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        say(f"START {name}: {os.path.join(self.log_dir, name + '.log')}")
        p = subprocess.Popen([os.path.join(BIN, name)] + args, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, p))
        return p

    def alive(self):
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}: see {self.log_dir}/{name}.log")
        return True

    def stop(self):
        for _, p in reversed(self.procs):
            p.terminate()
        for _, p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()

    def up(self):
        d = self.dir
        etcd_port, peer_port, api_port, sched_port = (free_port() for _ in range(4))
        self.start(
            "etcd",
            [
                "--name=default",
                f"--data-dir={d}/etcd",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
            ],
        )
        wait_for(
            "etcd",
            lambda: self.alive()
            and urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=2).status == 200,
            60,
        )
        subprocess.run(["openssl", "genrsa", "-out", f"{d}/sa.key", "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", f"{d}/sa.key", "-pubout", "-out", f"{d}/sa.pub"],
            check=True,
            capture_output=True,
        )
        token = secrets.token_hex(32)
        with open(f"{d}/tokens.csv", "w") as f:
            f.write(f"{token},admin,admin,system:masters\n")
        self.start(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={d}/certs",
                f"--token-auth-file={d}/tokens.csv",
                "--authorization-mode=AlwaysAllow",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={d}/sa.pub",
                f"--service-account-signing-key-file={d}/sa.key",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--endpoint-reconciler-type=none",
                # No controller-manager: it would make ServiceAccounts (pods go without one) and lift
                # the not-ready taint TaintNodesByCondition puts on every new node.
                "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
                f"--feature-gates={FEATURE_GATES}",
            ],
        )
        api = Api(api_port, token)
        wait_for("kube-apiserver /readyz", lambda: self.alive() and api.call("GET", "/readyz") == "ok", 120)
        version = api.call("GET", "/version")
        say(f"APISERVER {version.get('gitVersion')} on 127.0.0.1:{api_port}")
        kubeconfig = f"{d}/kubeconfig"
        with open(kubeconfig, "w") as f:
            json.dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "local",
                            "cluster": {"server": api.base, "insecure-skip-tls-verify": True},
                        }
                    ],
                    "users": [{"name": "admin", "user": {"token": token}}],
                    "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
                    "current-context": "local",
                },
                f,
            )
        self.start(
            "kube-scheduler",
            [
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                f"--feature-gates={FEATURE_GATES}",
            ],
        )
        return api


def node(name, unschedulable):
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {"unschedulable": unschedulable},
    }


NODE_STATUS = {
    "status": {
        "capacity": {"cpu": "16", "memory": "128Gi", "pods": "110"},
        "allocatable": {"cpu": "16", "memory": "128Gi", "pods": "110"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "FakeKubelet", "message": "no kubelet here"}],
    }
}


def claim(name, template_spec):
    spec = json.loads(json.dumps(template_spec))
    spec["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = CLAIM_MEMORY
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": spec}


def pod(name, claim_name):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            "containers": [
                {
                    "name": "worker",
                    "image": "registry.invalid/worker:1",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


class Demo:
    def __init__(self, api, slice_cmd):
        self.api = api
        self.slice_cmd = slice_cmd
        self.failures = []
        self.ns = f"/api/v1/namespaces/{NAMESPACE}"
        self.claims = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"

    def expect(self, ok, what):
        if not ok:
            self.failures.append(what)
            say(f"UNEXPECTED {what}")

    def slice(self, node_name):
        if not self.slice_cmd:
            return slice_for(node_name)
        cmd = self.slice_cmd.format(node=shlex.quote(node_name))
        return json.loads(subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True).stdout)

    def setup(self):
        api = self.api
        for name, cordoned in (("node-a", False), ("node-b", True)):
            api.create("/api/v1/nodes", node(name, cordoned))
            api.patch(f"/api/v1/nodes/{name}/status", NODE_STATUS)
        (device_class,) = yaml_docs("deploy/kubernetes/dra/deviceclass.yaml")
        api.create("/apis/resource.k8s.io/v1/deviceclasses", device_class)
        for name in ("node-a", "node-b"):
            s = api.create("/apis/resource.k8s.io/v1/resourceslices", self.slice(name))
            dev = s["spec"]["devices"][0]
            self.expect(
                dev.get("allowMultipleAllocations") is True and "requestPolicy" in dev["capacity"]["memory"],
                f"the API server kept the slice's consumable capacity fields: {json.dumps(dev)}",
            )
            say(f"SLICE {s['metadata']['name']} {dev['name']} memory {dev['capacity']['memory']['value']}")
        api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        docs = yaml_docs("deploy/kubernetes/examples/worker-pod.yaml")
        self.template_spec = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")["spec"]["spec"]

    def submit(self, i):
        self.api.create(self.claims, claim(f"gpu-{i}", self.template_spec))
        self.api.create(f"{self.ns}/pods", pod(f"worker-{i}", f"gpu-{i}"))

    def scheduled(self, i):
        p = self.api.call("GET", f"{self.ns}/pods/worker-{i}")
        return p["spec"].get("nodeName")

    def unschedulable(self, i):
        p = self.api.call("GET", f"{self.ns}/pods/worker-{i}")
        for c in p.get("status", {}).get("conditions", []):
            if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable":
                return c.get("message", "")
        return None

    def expect_placed(self, i, on, timeout=120):
        got = wait_for(f"worker-{i} scheduled", lambda: self.scheduled(i), timeout)
        c = self.api.call("GET", f"{self.claims}/gpu-{i}")
        results = c.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
        r = results[0] if results else {}
        say(
            f"PLACED worker-{i} on {got}; claim gpu-{i}: {r.get('pool')}/{r.get('device')} "
            f"consumed {r.get('consumedCapacity', {}).get('memory')} shareID {r.get('shareID')}"
        )
        self.expect(got == on, f"worker-{i} on {got}, not {on}")
        self.expect(
            r.get("pool") == on and r.get("consumedCapacity", {}).get("memory") == CLAIM_MEMORY and r.get("shareID"),
            f"claim gpu-{i} allocated {json.dumps(r)}",
        )

    def expect_pending(self, i, timeout=60):
        message = wait_for(f"worker-{i} unschedulable", lambda: self.unschedulable(i), timeout)
        say(f"PENDING worker-{i}: {message}")
        time.sleep(2)
        self.expect(self.scheduled(i) is None, f"worker-{i} was placed after all")

    def run(self):
        self.setup()
        say("PHASE node-b cordoned: node-a's 125Gi device takes three 40Gi claims")
        for i in (1, 2, 3):
            self.submit(i)
            self.expect_placed(i, "node-a")
        self.submit(4)
        self.expect_pending(4)
        say("PHASE node-b uncordoned: the pending pod goes there, then node-b fills")
        self.api.patch("/api/v1/nodes/node-b", {"spec": {"unschedulable": False}})
        # Unschedulable pods are retried on a node's update (or after 5 minutes at most).
        self.expect_placed(4, "node-b", timeout=330)
        for i in (5, 6):
            self.submit(i)
            self.expect_placed(i, "node-b")
        self.submit(7)
        self.expect_pending(7)
        return not self.failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log-dir", help="where the control plane's logs go (default: a temporary directory)")
    ap.add_argument("--slice-cmd", help="a command printing a node's ResourceSlice as JSON ({node}: its name)")
    ap.add_argument("--print-slice", metavar="NODE", help="print the fixture slice of NODE and exit")
    args = ap.parse_args()
    if args.print_slice:
        print(json.dumps(slice_for(args.print_slice), indent=2))
        return 0
    missing = [b for b in ("etcd", "kube-apiserver", "kube-scheduler") if not os.access(os.path.join(BIN, b), os.X_OK)]
    if missing:
        say(f"SKIP {', '.join(missing)} not in {BIN}: build them with scripts/k8s-control-plane.sh")
        return 2
    cp = ControlPlane(args.log_dir)
    try:
        api = cp.up()
        ok = Demo(api, args.slice_cmd).run()
    finally:
        cp.stop()
    say("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
