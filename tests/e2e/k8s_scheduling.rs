//! The real Kubernetes control plane places pods by the memory the DRA driver publishes:
//! `scripts/k8s-scheduling-demo.py` runs etcd, kube-apiserver and kube-scheduler built by
//! `scripts/k8s-control-plane.sh` (cached in `target/k8s-bin/`) and checks that three
//! 40 GiB claims fit a 125 GiB device, the fourth pod stays Pending with the scheduler's
//! reason, and two nodes fill in turn. Without those binaries the test says so and passes
//! (building them needs the Go module proxy and tens of minutes); the slice it publishes
//! is checked against the Kubernetes schema either way.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn venv_python() -> PathBuf {
    let p = root().join("target/k8s-venv/bin/python");
    assert!(
        p.exists(),
        "{} not found: scripts/test-deps.sh makes it",
        p.display()
    );
    p
}

/// The ResourceSlice the scheduling demo publishes (the shape of `docs/kubernetes.md`)
/// passes `kubernetes-validate --strict`.
#[test]
fn the_demo_slice_has_the_kubernetes_schema() {
    let out = std::process::Command::new(venv_python())
        .arg(root().join("scripts/k8s-scheduling-demo.py"))
        .args(["--print-slice", "node-a"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("slice.json");
    std::fs::write(&file, &out.stdout).unwrap();
    let check = std::process::Command::new(root().join("target/k8s-venv/bin/kubernetes-validate"))
        .arg("--strict")
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && text.contains("resourceslice/node-a-gpu-broker.io"),
        "{text}{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

#[test]
fn the_real_scheduler_places_memory_claims_by_capacity() {
    let bin = root().join("target/k8s-bin");
    let missing: Vec<&str> = ["etcd", "kube-apiserver", "kube-scheduler"]
        .into_iter()
        .filter(|b| !bin.join(b).exists())
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "skipped: {missing:?} not in {}: build them with scripts/k8s-control-plane.sh \
             (needs a Go of 1.21 or newer and the Go module proxy)",
            bin.display()
        );
        return;
    }
    let logs = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(venv_python())
        .arg(root().join("scripts/k8s-scheduling-demo.py"))
        .arg("--log-dir")
        .arg(logs.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let logs_text = || {
        ["etcd", "kube-apiserver", "kube-scheduler"]
            .iter()
            .map(|n| {
                let log = std::fs::read_to_string(logs.path().join(format!("{n}.log")))
                    .unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                format!(
                    "--- {n}\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        out.status.success() && text.lines().last() == Some("OK"),
        "{text}{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs_text()
    );
    for (i, node) in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b"), (6, "b")] {
        assert!(
            text.contains(&format!(
                "PLACED worker-{i} on node-{node}; claim gpu-{i}: node-{node}/gpu-0 consumed 40Gi"
            )),
            "worker-{i}:\n{text}"
        );
    }
    for i in [4, 7] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("PENDING worker-{i}:")))
            .unwrap_or_else(|| panic!("worker-{i} never pending:\n{text}"));
        assert!(line.contains("nodes are available"), "{line}");
    }
}
