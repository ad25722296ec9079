//! The shipped deployment material: every Kubernetes manifest validates against the
//! Kubernetes schemas (`kubernetes-validate --strict`, PyPI, offline; installed into
//! `target/k8s-venv` by `scripts/test-deps.sh`), the ConfigMap's config file is one the
//! broker accepts, and `scripts/install.sh --dry-run` installs both binaries. Container
//! images cannot be built here: the `Containerfile` is checked for what it copies only.

use gpu_broker_tests::*;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn manifests() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("deploy/kubernetes"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_kubernetes_manifest_validates() {
    let tool = root().join("target/k8s-venv/bin/kubernetes-validate");
    assert!(
        tool.exists(),
        "{} not found: install it with scripts/test-deps.sh (pip install kubernetes-validate \
         into target/k8s-venv), which the README's test command scripts/test.sh runs first",
        tool.display()
    );
    let files = manifests();
    assert!(files.len() >= 4, "{files:?}");
    let out = std::process::Command::new(&tool)
        .arg("--strict")
        .args(&files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy();
        assert!(
            text.lines()
                .any(|l| l.contains(name.as_ref()) && l.contains("passed")),
            "{name} not validated:\n{text}"
        );
    }
}

#[test]
fn the_manifests_keep_their_promises() {
    let read = |f: &str| std::fs::read_to_string(root().join("deploy/kubernetes").join(f)).unwrap();
    let ds = read("daemonset.yaml");
    for want in [
        "kind: DaemonSet",
        "nodeSelector:",
        "path: /run/gpu-broker",
        "path: /var/lib/gpu-broker",
        "configMap:",
        "secretName: gpu-broker-admin-token",
        "livenessProbe:",
        "path: /healthz",
        "readinessProbe:",
        "path: /readyz",
        "resources:",
    ] {
        assert!(ds.contains(want), "daemonset.yaml lacks {want:?}");
    }
    assert!(
        !ds.contains("subPath"),
        "the config is mounted as a directory so that ConfigMap updates (symlink swaps) arrive"
    );
    let pod = read("worker-pod.yaml");
    let spec: String = pod
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        !spec.contains("hostPID") && !spec.contains("hostIPC"),
        "{spec}"
    );
    assert!(pod.contains("secretKeyRef") && pod.contains("path: /run/gpu-broker"));

    // The ConfigMap's config file is one the broker accepts, tenants included.
    let cm = read("configmap.yaml");
    let start = cm.find("config.toml: |\n").expect("a config.toml key") + "config.toml: |\n".len();
    let config: String = cm[start..]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, config).unwrap();
    let out = std::process::Command::new(bin("gpu-broker"))
        .arg("check-config")
        .arg(&file)
        .args(["--broker", "unix:///nonexistent/broker.sock"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("valid (2 tenants declared)"), "{text}");
    assert!(
        text.contains("+ training: new tenant: limit 64.0 GiB"),
        "{text}"
    );

    let containerfile = std::fs::read_to_string(root().join("Containerfile")).unwrap();
    assert!(
        containerfile.contains("target/release/gpu-broker ")
            && containerfile.contains("gpu-brokerctl")
    );
}

#[test]
fn install_script_installs_both_binaries_the_group_and_the_unit() {
    let out = std::process::Command::new(root().join("scripts/install.sh"))
        .arg("--dry-run")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for want in [
        "cargo install --locked --path broker",
        "cargo install --locked --path client/ctl ",
        "/etc/systemd/system/gpu-broker.service",
    ] {
        assert!(text.contains(want), "{want:?} in\n{text}");
    }
}

/// The systemd unit is sandboxed as far as GPU access allows: systemd's own scoring of it
/// (`systemd-analyze security`, offline) is at most 4.5 of 10, and it waits for readiness.
#[test]
fn the_systemd_unit_is_hardened_and_waits_for_readiness() {
    let unit = root().join("deploy/gpu-broker.service");
    let out = std::process::Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--threshold=45", "--no-pager"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze (Debian's systemd package; scripts/test-deps.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    let overall = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("no overall score in:\n{text}"));
    assert!(out.status.success(), "the unit scores above 4.5: {overall}");
    let unit = std::fs::read_to_string(unit).unwrap();
    assert!(unit.contains("Type=notify") && unit.contains("NotifyAccess=main"));
}

/// `Type=notify`: the broker sends READY=1 once its sockets answer, and STOPPING=1 when a
/// stop signal arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_tells_systemd_when_it_is_ready_and_when_it_stops() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let b = Broker::start_wrapped(
        vec!["env".into(), format!("NOTIFY_SOCKET={}", path.display())],
        BrokerOpts::default(),
    )
    .unwrap();
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).unwrap();
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap(), "READY=1\n");
    b.admin().await.unwrap().list_tenants().await.unwrap();
    b.signal(libc::SIGTERM);
    let n = sock.recv(&mut buf).unwrap();
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap(), "STOPPING=1\n");
}

/// The example PodMonitor selects the DaemonSet's pods by their label and scrapes the
/// port the DaemonSet names `metrics`.
#[test]
fn the_pod_monitor_scrapes_the_daemonsets_metrics_port() {
    let monitor =
        std::fs::read_to_string(root().join("deploy/prometheus/podmonitor.yaml")).unwrap();
    let daemonset =
        std::fs::read_to_string(root().join("deploy/kubernetes/daemonset.yaml")).unwrap();
    assert!(monitor.contains("kind: PodMonitor") && monitor.contains("- port: metrics"));
    assert!(daemonset.contains("- name: metrics\n              containerPort: 7478"));
    let label = "app.kubernetes.io/name: gpu-broker";
    assert!(monitor.contains(label) && daemonset.contains(label));
    assert!(
        daemonset.contains("fieldPath: spec.nodeName"),
        "NODE_NAME for Hostname"
    );
}

/// The build context of the image leaves out the build tree and the history.
#[test]
fn the_container_context_leaves_out_target_and_git() {
    let ignore = std::fs::read_to_string(root().join(".containerignore")).unwrap();
    let lines: Vec<&str> = ignore.lines().map(str::trim).collect();
    for want in ["target/", ".git/"] {
        assert!(lines.contains(&want), "{want} in .containerignore");
    }
}

/// `gpu-brokerctl completions SHELL` prints a script its shell accepts, naming the
/// subcommands; the installer installs them.
#[test]
fn shell_completions_come_from_the_cli_and_are_installed() {
    let out = std::process::Command::new(bin("gpu-brokerctl"))
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let script = String::from_utf8(out.stdout).unwrap();
    assert!(script.contains("quota") && script.contains("leases") && script.contains("run"));
    let checked = std::process::Command::new("bash")
        .arg("-n")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(script.as_bytes())?;
            c.wait()
        })
        .unwrap();
    assert!(checked.success(), "bash parses the completion script");
    let dry = std::process::Command::new(root().join("scripts/install.sh"))
        .arg("--dry-run")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&dry.stdout);
    assert!(
        text.contains("completions bash > /usr/share/bash-completion/completions/gpu-brokerctl"),
        "{text}"
    );
}

/// Every file the docs name in backticks (`broker/src/x.rs`, `deploy/config.toml`) exists in
/// the repository (by path, or by name somewhere in it).
#[test]
fn the_docs_cite_only_files_that_exist() {
    let root = root();
    let mut all = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with('.') || name == "target" || name == "node_modules" {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(rel) = p.strip_prefix(&root) {
                all.push(rel.to_string_lossy().to_string());
            }
        }
    }
    let exists = |cited: &str| {
        all.iter().any(|f| {
            f == cited
                || f.ends_with(&format!("/{cited}"))
                || f.rsplit('/').next() == Some(cited.rsplit('/').next().unwrap_or(cited))
        })
    };
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.push(root.join("README.md"));
    let exts = [
        ".rs", ".md", ".sh", ".toml", ".yml", ".yaml", ".json", ".service", ".py",
    ];
    let mut missing = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        for (i, part) in text.split('`').enumerate() {
            let cited = part.trim();
            let is_path = i % 2 == 1
                && !cited.is_empty()
                && cited
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c))
                && exts.iter().any(|e| cited.ends_with(e));
            if is_path && !exists(cited) {
                missing.push(format!("{}: {cited}", doc.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs cite files that do not exist: {missing:#?}"
    );
}

/// The systemd unit raises the descriptor limit (systemd's soft default of 1024 is what
/// idle connections exhausted) far enough that the broker's own connection cap (half the
/// limit, at most 4096) binds first.
#[test]
fn the_systemd_unit_raises_the_descriptor_limit_above_the_connection_cap() {
    let unit = std::fs::read_to_string(root().join("deploy/gpu-broker.service")).unwrap();
    let limit: u64 = unit
        .lines()
        .find_map(|l| l.trim().strip_prefix("LimitNOFILE="))
        .expect("deploy/gpu-broker.service sets LimitNOFILE")
        .trim()
        .parse()
        .expect("a number");
    assert!(limit >= 2 * 4096, "LimitNOFILE={limit}");
}
