//! The CLI's terminal UI stays the CLI's: neither the broker daemon (`gpu-broker`) nor the
//! Python wheel's crate (`gpubroker-python`) reaches `ratatui` or `crossterm` through its
//! normal or build dependencies, as `cargo metadata` resolves them (offline, from the lock
//! file); only this crate does.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// Every package `package` links or builds with (dev-dependencies left out), by name.
fn reached(metadata: &Value, package: &str) -> BTreeSet<String> {
    let name_of: BTreeMap<&str, &str> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    let nodes: BTreeMap<&str, &Value> = metadata["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["id"].as_str().unwrap(), n))
        .collect();
    let root = name_of
        .iter()
        .find(|(_, name)| **name == package)
        .map(|(id, _)| *id)
        .unwrap_or_else(|| panic!("no package {package} in the workspace"));
    let mut seen = BTreeSet::new();
    let mut todo = vec![root];
    while let Some(id) = todo.pop() {
        if !seen.insert(id) {
            continue;
        }
        for dep in nodes[id]["deps"].as_array().unwrap() {
            let not_dev = dep["dep_kinds"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k["kind"].as_str() != Some("dev"));
            if not_dev {
                todo.push(dep["pkg"].as_str().unwrap());
            }
        }
    }
    seen.into_iter().map(|id| name_of[id].to_string()).collect()
}

/// The host's target triple, as `rustc -vV` says.
fn host_triple() -> String {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("run rustc -vV");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names the host")
        .to_string()
}

#[test]
fn the_daemon_and_the_wheel_do_not_link_the_terminal_ui() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Only this platform's graph: a fresh checkout has downloaded no other platform's
    // crates, and `--offline` would fail on them.
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline", "--locked"])
        .args(["--filter-platform", &host_triple()])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: Value = serde_json::from_slice(&out.stdout).unwrap();
    for package in ["gpu-broker", "gpubroker-python"] {
        let deps = reached(&metadata, package);
        // The walk sees the real graph (the client crate and tonic are there).
        assert!(
            deps.contains("gpu-broker-client") && deps.contains("tonic"),
            "{package}: {deps:?}"
        );
        let tui: Vec<_> = deps
            .iter()
            .filter(|d| d.starts_with("ratatui") || d.starts_with("crossterm"))
            .collect();
        assert!(tui.is_empty(), "{package} depends on {tui:?}");
    }
    // The CLI does (the check would see it).
    assert!(reached(&metadata, "gpu-brokerctl").contains("ratatui"));
}
