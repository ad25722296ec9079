//! One identity for a fleet of nodes: tokens declared once in the config file that every
//! node's broker reads (a ConfigMap) work on every node (a worker token, and the read
//! token Prometheus uses for `/metrics`), follow the file's changes, and cannot be revoked
//! by RPC; an admin token file holding the example Secret's placeholder, or a short token,
//! stops the broker at start with a clear error.

use crate::prometheus::http_get;
use gpu_broker_client::{Client, Code};
use gpu_broker_tests::*;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// A fresh random token (as an operator makes one: 32 random bytes in hex).
fn random_token() -> String {
    let (token, _) = gpu_broker::auth::generate_token();
    token
}

fn sha256_hex(token: &str) -> String {
    gpu_broker::auth::hash_token(token)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Publishes `text` as `dir/config.toml` the way the kubelet updates a ConfigMap volume
/// (`config.toml -> ..data/config.toml`, `..data` swapped to a new generation).
fn publish(dir: &Path, generation: u32, text: &str) {
    let gen = dir.join(format!("gen-{generation}"));
    std::fs::create_dir_all(&gen).unwrap();
    std::fs::write(gen.join("config.toml"), text).unwrap();
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(format!("gen-{generation}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    if !dir.join("config.toml").exists() {
        symlink("..data/config.toml", dir.join("config.toml")).unwrap();
    }
}

/// A node: a broker of its own (own socket, state and admin token) reading `config`.
fn node(config: &Path) -> Broker {
    Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        extra: vec![
            "--config".into(),
            config.display().to_string(),
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
            "--metrics-require-token".into(),
        ],
        ..BrokerOpts::default()
    })
    .unwrap()
}

/// A worker token and a node-wide read token, declared once, work on two nodes that never
/// saw them minted; a token the file no longer declares is refused there; revoking a
/// declared token by RPC is refused with what to do instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_declared_once_work_on_every_node() {
    let worker = random_token();
    let reader = random_token();
    let declared = |with_worker: bool| {
        let mut text = format!(
            "[tenants.training]\nlimit = \"64MiB\"\n\n[tokens.prometheus]\nscope = \"read\"\nsha256 = \"{}\"\n",
            sha256_hex(&reader)
        );
        if with_worker {
            text.push_str(&format!(
                "\n[tokens.training-workers]\ntenant = \"training\"\nsha256 = \"{}\"\n",
                sha256_hex(&worker)
            ));
        }
        text
    };
    let cm = tempfile::tempdir().unwrap();
    publish(cm.path(), 1, &declared(true));
    let config = cm.path().join("config.toml");
    let nodes = [node(&config), node(&config)];
    assert_ne!(nodes[0].admin_token, nodes[1].admin_token);

    for (i, n) in nodes.iter().enumerate() {
        let c = Client::connect(&n.uri(), worker.clone()).await.unwrap();
        let s = c.session(format!("on-node-{i}")).await.unwrap();
        let lease = s.lease(4 * MIB).await.unwrap();
        let usage = c.usage().await.unwrap();
        assert_eq!(usage.tenant, "training", "node {i}");
        assert_eq!(usage.usage.held_bytes, 4 * MIB, "node {i}");
        lease.release().await.unwrap();

        let addr = n.metrics_addr().await;
        let (status, _, body) = http_get(
            &addr,
            "/metrics",
            &[("Authorization", &format!("Bearer {reader}"))],
        )
        .await;
        assert!(
            status.contains("200") && body.contains("gpu_broker_sessions"),
            "node {i}: the fleet's read token reads /metrics: {status}"
        );
        let (status, _, _) = http_get(
            &addr,
            "/metrics",
            &[("Authorization", &format!("Bearer {worker}"))],
        )
        .await;
        assert!(status.contains("401"), "node {i}: {status}");

        // Listed like the minted ones, but not revocable by RPC.
        let admin = n.admin().await.unwrap();
        let listed = admin.list_tokens(Some("training")).await.unwrap();
        assert!(
            listed.iter().any(|t| t.name == "training-workers"),
            "{listed:?}"
        );
        let e = admin.revoke_token(&worker).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains("[tokens.training-workers]"), "{e}");
    }

    // The token leaves the file: every node refuses it from then on; the rest stays.
    let held = Client::connect(&nodes[0].uri(), worker.clone())
        .await
        .unwrap();
    publish(cm.path(), 2, &declared(false));
    for n in &nodes {
        let uri = n.uri();
        let worker = worker.clone();
        let refused = eventually(Duration::from_secs(15), || {
            let (uri, worker) = (uri.clone(), worker.clone());
            async move {
                match Client::connect(&uri, worker).await {
                    Ok(c) => c
                        .usage()
                        .await
                        .is_err_and(|e| e.code() == Code::Unauthenticated),
                    Err(e) => e.code() == Code::Unauthenticated,
                }
            }
        })
        .await;
        assert!(
            refused,
            "no longer declared, still accepted:\n{}",
            n.log_text()
        );
        let addr = n.metrics_addr().await;
        let (status, _, _) = http_get(
            &addr,
            "/metrics",
            &[("Authorization", &format!("Bearer {reader}"))],
        )
        .await;
        assert!(status.contains("200"), "{status}");
    }
    let e = held.usage().await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
}

/// A config file declaring a worker token for a tenant it does not declare is refused
/// at start, naming file, line and reason.
#[test]
fn a_token_of_an_undeclared_tenant_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[tenants.training]\nlimit = \"64MiB\"\n\n[tokens.w]\ntenant = \"inference\"\nsha256 = \"{}\"\n",
            sha256_hex("x")
        ),
    )
    .unwrap();
    let (ok, text) = start_and_wait(dir.path(), &["--config", &config.display().to_string()]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("config.toml:5:") && text.contains("\"inference\" is not declared"),
        "{text}"
    );
}

/// Runs the broker on `dir` (its own socket and state) with `extra` flags until it exits
/// (at most 20 s): whether it exited successfully, and what it printed.
fn start_and_wait(dir: &Path, extra: &[&str]) -> (bool, String) {
    let mut child = Command::new(bin("gpu-broker"))
        .args(["--backend", "host", "--host-capacity", "64MiB"])
        .arg("--socket")
        .arg(dir.join("broker.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--host-shm-dir")
        .arg(dir.join("shm"))
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(20) || dir.join("broker.sock").exists() {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            return (
                false,
                format!(
                    "still running (serving: {}): {}",
                    dir.join("broker.sock").exists(),
                    String::from_utf8_lossy(&out.stderr)
                ),
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The example Secret's placeholder, or a short token, in the admin token file: the
/// broker does not start, and says why and what to do.
#[test]
fn a_guessable_admin_token_stops_the_start() {
    for (token, want) in [
        (
            "REPLACE-WITH-A-RANDOM-TOKEN\n",
            "placeholder REPLACE-WITH-A-RANDOM-TOKEN",
        ),
        ("changeme\n", "has 8 characters, fewer than 32"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret/admin.token");
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, token).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o400)).unwrap();
        let (ok, text) = start_and_wait(
            dir.path(),
            &["--admin-token-file", &file.display().to_string()],
        );
        assert!(!ok, "{token}: {text}");
        assert!(
            text.contains(want) && text.contains("/dev/urandom"),
            "{token}: {text}"
        );
        assert!(!dir.path().join("broker.sock").exists());
    }
    // A random token of 64 hex digits is taken.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin.token");
    let good = random_token();
    std::fs::write(&file, &good).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o400)).unwrap();
    let (_, text) = start_and_wait(
        dir.path(),
        &["--admin-token-file", &file.display().to_string()],
    );
    assert!(text.contains("serving: true"), "{text}");
}

/// The broker's socket group is its process's group (a DaemonSet's `runAsGroup`): a
/// non-root worker with that group among its supplementary groups (a pod's
/// `supplementalGroups`) opens a session and takes a descriptor lease through both
/// sockets; the same uid without the group is refused at the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_root_worker_in_the_brokers_group_reaches_it() {
    const GROUP: &str = "2345";
    let b = Broker::start_wrapped(
        ["setpriv", "--regid", GROUP, "--clear-groups", "--"]
            .map(String::from)
            .to_vec(),
        BrokerOpts {
            capacity: "64MiB",
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    // The test's private directory, as /run/gpu-broker is on a node: others may enter it.
    std::fs::set_permissions(b.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&b.socket).unwrap();
    assert_eq!(meta.gid().to_string(), GROUP);
    assert_eq!(meta.mode() & 0o777, 0o660);
    let token = b
        .tenant("t", gpu_broker_client::QuotaSpec::new(16 * MIB))
        .await
        .unwrap();
    let worker = |groups: &[&str]| {
        let mut c = tokio::process::Command::new("setpriv");
        c.args(["--reuid", "1000", "--regid", "1000"]);
        match groups {
            [] => c.arg("--clear-groups"),
            g => c.args(["--groups", &g.join(",")]),
        };
        c.arg("--")
            .arg(bin("e2e-worker"))
            .args(["--broker", &b.uri(), "--token", &token])
            .args(["hold", "--bytes", "2MiB"])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        c
    };
    let out = tokio::time::timeout(Duration::from_secs(20), worker(&[GROUP]).output())
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("LEASE ") && text.contains("READY"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tokio::time::timeout(Duration::from_secs(20), worker(&[]).output())
        .await
        .unwrap()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("READY") && text.to_lowercase().contains("permission denied"),
        "{text}"
    );
}
