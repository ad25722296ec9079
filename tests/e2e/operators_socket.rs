//! The operators' socket (`--admin-listen`): the Admin service on a socket of its own,
//! served wholly on the operators' runtime, beside the main socket that keeps serving it.

use gpu_broker_client::{AdminClient, Client, Code, QuotaSpec};
use gpu_broker_tests::*;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A host-backend broker with its operators' socket at `dir/admin.sock`, and `extra` flags.
fn broker_with_operators_socket(extra: &[&str]) -> (Broker, PathBuf) {
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let b = Broker::start_raw(move |dir| {
        let mut args: Vec<String> = [
            "--backend",
            "host",
            "--host-capacity",
            "64MiB",
            "--admin-listen",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(dir.join("admin.sock").display().to_string());
        args.extend(extra);
        args
    })
    .unwrap();
    let path = b.socket.with_file_name("admin.sock");
    (b, path)
}

fn uri(path: &Path) -> String {
    format!("unix://{}", path.display())
}

/// Admin calls work over the operators' socket (and still over the main one), with either
/// runtime; Broker calls there are UNIMPLEMENTED, a bad token is refused; the socket is
/// 0660, removed at a clean stop, and replaced when a killed broker left it behind.
#[tokio::test]
async fn operators_socket_serves_admin_only_and_lives_like_the_main_one() {
    for threads in ["1", "0"] {
        let (mut b, path) = broker_with_operators_socket(&["--admin-threads", threads]);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660, "--admin-threads {threads}");

        let ops = AdminClient::connect(&uri(&path), b.admin_token.clone())
            .await
            .unwrap();
        ops.set_quota("t", QuotaSpec::new(8 * MIB)).await.unwrap();
        assert_eq!(ops.get_quota("t").await.unwrap().quota.limit_bytes, 8 * MIB);
        let token = ops.issue_token("t", "test").await.unwrap().token;
        // The main socket serves Admin too, and sees the same state.
        let main = b.admin().await.unwrap();
        assert_eq!(
            main.get_quota("t").await.unwrap().quota.limit_bytes,
            8 * MIB
        );
        let names = tenant_names(&ops).await;
        assert_eq!(names, ["t"]);

        // gpu-brokerctl needs nothing new: --broker points it there.
        let out = tokio::process::Command::from(b.ctl_at(&uri(&path)))
            .args(["tenants", "list", "--json"])
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("\"t\""),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );

        // Broker calls are not served there, even with a good tenant token...
        let worker = Client::connect(&uri(&path), token.clone()).await.unwrap();
        let e = worker.usage().await.expect_err("no Broker service there");
        assert_eq!(e.code(), Code::Unimplemented, "{e}");
        // ... and are on the main socket.
        let worker = Client::connect(&b.uri(), token.clone()).await.unwrap();
        assert_eq!(worker.usage().await.unwrap().quota.limit_bytes, 8 * MIB);

        // A bad token, and a tenant token, are refused on the operators' socket.
        let bad = AdminClient::connect(&uri(&path), "not-the-admin-token")
            .await
            .unwrap();
        let e = bad.list_tenants().await.expect_err("a bad token");
        assert_eq!(e.code(), Code::Unauthenticated, "{e}");
        let tenant = AdminClient::connect(&uri(&path), token.clone())
            .await
            .unwrap();
        let e = tenant.list_tenants().await.expect_err("a tenant token");
        assert_eq!(e.code(), Code::PermissionDenied, "{e}");

        // A clean stop removes the socket; a restart serves it again.
        b.stop(Duration::from_secs(10)).unwrap();
        assert!(
            !path.exists(),
            "the operators' socket is removed at a clean stop"
        );
        b.spawn().unwrap();
        let ops = AdminClient::connect(&uri(&path), b.admin_token.clone())
            .await
            .unwrap();
        assert_eq!(ops.get_quota("t").await.unwrap().quota.limit_bytes, 8 * MIB);
        // A killed broker leaves the file behind; the next one replaces it.
        drop(ops);
        b.kill().unwrap();
        assert!(path.exists(), "a killed broker leaves its socket file");
        b.spawn().unwrap();
        let ops = AdminClient::connect(&uri(&path), b.admin_token.clone())
            .await
            .unwrap();
        assert_eq!(ops.get_quota("t").await.unwrap().quota.limit_bytes, 8 * MIB);
        assert!(
            b.log_text()
                .contains("serving Admin on the operators' socket"),
            "{}",
            b.log_text()
        );
    }
}

/// Whether the broker keeps `c` open: a refused connection is closed at once (EOF), an
/// admitted one waits for its HTTP/2 preface.
fn kept_open(c: &mut UnixStream) -> bool {
    c.set_read_timeout(Some(Duration::from_millis(1500)))
        .unwrap();
    let mut buf = [0u8; 256];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return true
            }
            Err(_) => return false,
        }
    }
}

/// The operators' socket is under the same connection caps as the main one (one count for
/// both): the broker's own user gets its per-uid cap plus the operator reserve, the rest
/// is closed at once, and a place given back lets the next connection in.
#[tokio::test]
async fn operators_socket_shares_the_connection_caps() {
    let (b, path) = broker_with_operators_socket(&[
        "--max-connections-per-uid",
        "2",
        "--admin-connection-reserve",
        "1",
        "--handshake-timeout",
        "60s",
    ]);
    // The start-up probe's connection holds a place until the broker sees it closed.
    let mut held = Vec::new();
    for _ in 0..20 {
        held = (0..3)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        if held.iter_mut().all(kept_open) {
            break;
        }
        held.clear();
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(held.len(), 3, "2 per uid + 1 reserved are admitted");
    let mut over = UnixStream::connect(&path).unwrap();
    assert!(!kept_open(&mut over), "a 4th connection is over the cap");
    let mut main = UnixStream::connect(&b.socket).unwrap();
    assert!(
        !kept_open(&mut main),
        "the main socket counts the same connections"
    );
    held.pop();
    // The place is given back once the broker sees the close.
    let mut admitted = false;
    for _ in 0..50 {
        let ops = AdminClient::connect(&uri(&path), b.admin_token.clone()).await;
        if let Ok(ops) = ops {
            if ops.list_tenants().await.is_ok() {
                admitted = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(admitted, "a place given back admits an operator again");
}

/// Open calls that need no token (health watches) are capped per socket: a tenant that
/// holds every slot of the main socket does not block an operator's health check on the
/// operators' socket, whose own cap still holds.
#[tokio::test]
async fn calls_without_a_token_are_capped_per_socket() {
    let (b, path) = broker_with_operators_socket(&["--max-unauthenticated-streams", "1"]);
    let main = gpu_broker_client::connect::connect_channel(&b.uri())
        .await
        .unwrap();
    let ops = gpu_broker_client::connect::connect_channel(&uri(&path))
        .await
        .unwrap();
    let held = HealthWatch::open(&main, "")
        .await
        .expect("within the cap")
        .0;
    let over = HealthWatch::open(&main, "")
        .await
        .err()
        .expect("the main socket's cap is full");
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");
    // The main socket's slots are all held: the operators' socket still answers.
    assert_eq!(
        health_check(&uri(&path), "").await.unwrap(),
        1,
        "SERVING on the operators' socket"
    );
    let ops_held = HealthWatch::open(&ops, "")
        .await
        .expect("the operators' socket has slots of its own")
        .0;
    let over = HealthWatch::open(&ops, "")
        .await
        .err()
        .expect("the operators' socket is capped too");
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");
    drop(held);
    let freed = eventually(Duration::from_secs(5), || async {
        HealthWatch::open(&main, "").await.is_ok()
    })
    .await;
    assert!(freed, "a closed watch frees its socket's slot");
    drop(ops_held);
}

/// `--admin-listen` naming the main socket (in another spelling too) stops the broker at
/// start with a clear message, before it binds anything; `check-config` refuses the same
/// setting in a file.
#[test]
fn an_operators_socket_that_is_the_main_socket_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("b.sock");
    let same = dir.path().join(".").join("b.sock");
    let out = std::process::Command::new(bin("gpu-broker"))
        .args(["--backend", "host", "--host-capacity", "16MiB"])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--socket")
        .arg(&socket)
        .arg("--admin-listen")
        .arg(&same)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--admin-listen") && err.contains("--socket") && err.contains("of its own"),
        "{err}"
    );
    assert!(!socket.exists(), "nothing was bound");
    let file = dir.path().join("config.toml");
    std::fs::write(
        &file,
        format!(
            "socket = \"{0}\"\nadmin-listen = \"{0}\"\n",
            socket.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(bin("gpu-broker"))
        .arg("check-config")
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("of its own"), "{err}");
}

/// `--admin-listen-only`: the Admin service is on the operators' socket alone; on the
/// workers' socket an Admin call, even with the admin token, is UNIMPLEMENTED while the
/// Broker service works as before. Without `--admin-listen` the flag is refused.
#[tokio::test]
async fn admin_listen_only_leaves_admin_off_the_workers_socket() {
    let (b, path) = broker_with_operators_socket(&["--admin-listen-only"]);
    let ops = AdminClient::connect(&uri(&path), b.admin_token.clone())
        .await
        .unwrap();
    ops.set_quota("t", QuotaSpec::new(8 * MIB)).await.unwrap();
    let token = ops.issue_token("t", "test").await.unwrap().token;
    let on_workers_socket = b.admin().await.unwrap();
    let e = on_workers_socket
        .list_tenants()
        .await
        .expect_err("no Admin service on the workers' socket");
    assert_eq!(e.code(), Code::Unimplemented, "{e}");
    let worker = Client::connect(&b.uri(), token).await.unwrap();
    assert_eq!(worker.usage().await.unwrap().quota.limit_bytes, 8 * MIB);

    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(bin("gpu-broker"))
        .args(["--backend", "host", "--admin-listen-only", "--socket"])
        .arg(dir.path().join("b.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("--admin-listen"),
        "{text}"
    );
}
