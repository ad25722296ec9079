//! Resource exhaustion and isolation: what a live peer can make the broker hold (pidfds,
//! connections, streams, queue entries, huge strings), peers the broker cannot see
//! (another PID namespace), and the broker's own output closing under it.

use super::*;
use std::path::PathBuf;

/// Open descriptors of process `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// A live process (this test) that opens and closes sessions leaves no descriptor behind
/// in the broker: each session's pidfd watcher ends with the session.
#[tokio::test]
async fn closed_sessions_of_a_live_process_leave_no_pidfds() {
    let b = broker_64mib(&[]);
    let pid = b.pid().expect("broker pid");
    let token = b.tenant("cycler", QuotaSpec::new(64 * MIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let client = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    // Warm up: the connection and one session's worth of lazily opened descriptors.
    client.session("warm").await.unwrap().close();
    let settled = eventually(Duration::from_secs(5), || async {
        admin.list_sessions(None).await.unwrap().is_empty()
    })
    .await;
    assert!(settled);
    let before = fd_count(pid);
    const CYCLES: usize = 60;
    for i in 0..CYCLES {
        let s = client.session(format!("s{i}")).await.unwrap();
        assert!(s.peer_pid() > 0, "the broker sees this process's pid");
        s.close();
        let closed = eventually(Duration::from_secs(5), || async {
            admin.list_sessions(None).await.unwrap().is_empty()
        })
        .await;
        assert!(closed, "session {i} did not end");
    }
    let after = fd_count(pid);
    eprintln!("broker fds: {before} before, {after} after {CYCLES} session cycles");
    assert!(
        after < before + 5,
        "broker descriptors grew from {before} to {after} over {CYCLES} sessions"
    );
    assert_broker_alive(&b);
}

/// A broker in its own PID namespace sees this process as pid 0: unknown, not dead. The
/// session lives on (calls on it work), and its memory ends like a TCP peer's when it
/// closes. Needs root (unshare); skips with a reason otherwise.
#[tokio::test]
async fn a_peer_in_another_pid_namespace_is_unknown_not_dead() {
    let probe = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .stderr(std::process::Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("SKIP: `unshare --pid --fork --mount-proc` is not available (needs root)");
        return;
    }
    let wrapper = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];
    let b = Broker::start_wrapped(
        wrapper.iter().map(|s| s.to_string()).collect(),
        BrokerOpts {
            capacity: "64MiB",
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    let token = b.tenant("outside", QuotaSpec::new(64 * MIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let client = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    let s = client.session("across").await.unwrap();
    assert_eq!(s.peer_pid(), 0, "the broker cannot see our pid");
    // Give a wrongly started liveness watcher every chance to end the session.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lease = s.lease(8 * MIB).await.expect("the session is still open");
    s.keepalive().await.expect("keepalive on a live session");
    let sessions = admin.list_sessions(None).await.unwrap();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    assert_eq!(tenant(&admin, "outside").await.usage.held_bytes, 8 * MIB);
    drop(lease);
    s.close();
    assert!(wait_all_zero(&admin, Duration::from_secs(5)).await.is_ok());
    assert!(b.log_text().contains("session opened"));
    assert!(
        !b.log_text().contains("peer process exited"),
        "{}",
        b.log_text()
    );
}

/// The broker keeps serving when its stderr pipe closes (`gpu-broker ... 2>&1 | head -2`),
/// and still shuts down cleanly (exit 0, socket removed).
#[tokio::test]
async fn broker_survives_its_stderr_closing() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("b.sock");
    let state = dir.path().join("state");
    let shm = PathBuf::from("/dev/shm").join(dir.path().file_name().unwrap());
    let mut child = std::process::Command::new(bin("gpu-broker"))
        .args(["--backend", "host", "--host-capacity", "64MiB", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(&state)
        .arg("--host-shm-dir")
        .arg(&shm)
        .args(["--shutdown-grace", "1s"])
        .env("GPU_BROKER_LOG", "debug")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    {
        // Read two lines, then close the pipe, as `head -2` does.
        let mut r = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        for _ in 0..2 {
            r.read_line(&mut line).unwrap();
        }
    }
    let up = eventually(Duration::from_secs(20), || async {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    })
    .await;
    assert!(up, "broker did not come up (exit {:?})", child.try_wait());
    let token = std::fs::read_to_string(state.join("admin.token")).unwrap();
    let uri = format!("unix://{}", socket.display());
    let admin = gpu_broker_client::AdminClient::connect(&uri, token.trim().to_string())
        .await
        .unwrap();
    // Every one of these logs a line into the closed pipe.
    for i in 0..20 {
        admin
            .set_quota(&format!("t{i}"), QuotaSpec::new(MIB * 2))
            .await
            .expect("admin works with stderr closed");
    }
    assert!(child.try_wait().unwrap().is_none(), "the broker died");
    // SAFETY: plain syscall on our own child.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("broker did not stop on SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _ = std::fs::remove_dir_all(&shm);
    assert!(status.success(), "broker exit: {status}");
    assert!(!socket.exists(), "stale socket left");
}

/// `gpu-brokerctl --json tenants list | head` : a reader that goes away is not a panic.
#[tokio::test]
async fn brokerctl_survives_a_closed_stdout() {
    let b = broker_64mib(&[]);
    let admin = b.admin().await.unwrap();
    for i in 0..5 {
        admin
            .set_quota(&format!("t{i}"), QuotaSpec::new(MIB))
            .await
            .unwrap();
    }
    for json in [true, false] {
        let mut cmd = b.ctl();
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd
            .args(["tenants", "list"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader is gone before the CLI writes a byte.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "json={json}: {stderr}");
        assert_eq!(out.status.code(), Some(0), "json={json}: {stderr}");
    }
}

/// Asserts `r` is `INVALID_ARGUMENT` whose message names `field` and the limit, short.
fn assert_bounded<T: std::fmt::Debug>(r: Result<T, tonic::Status>, field: &str, what: &str) {
    let s = r.expect_err(what);
    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{what}: {s:?}");
    assert!(
        s.message().contains(field) && s.message().contains("limit"),
        "{what}: {}",
        s.message()
    );
    assert!(
        s.message().len() < 200,
        "{what}: echoed {} bytes",
        s.message().len()
    );
}

/// Every string a client sends is bounded: 1 MB inputs get `INVALID_ARGUMENT` naming the
/// field and the limit (the client sees that status, not its own header limit), and a 1 MB
/// revoke reason is neither stored nor sent.
#[tokio::test]
#[allow(clippy::field_reassign_with_default)] // requests others may extend
async fn huge_strings_are_refused_by_name_not_echoed() {
    use gpu_broker_client::proto::v1 as pb;
    let b = broker_64mib(&[]);
    let token = b.tenant("t", QuotaSpec::new(64 * MIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let big = "x".repeat(1 << 20);
    let mut w = raw::broker(&b.uri(), &token).await;
    let (sid, _events) = raw::open_session(&mut w, "s").await;
    let r = w
        .acquire_lease(pb::AcquireLeaseRequest {
            session_id: big.clone(),
            bytes: MIB,
            ..Default::default()
        })
        .await;
    assert_bounded(r, "session_id", "AcquireLease session_id");
    let r = w
        .release_lease(pb::ReleaseLeaseRequest {
            lease_id: big.clone(),
            ..Default::default()
        })
        .await;
    assert_bounded(r, "lease_id", "ReleaseLease lease_id");
    let r = w
        .keepalive(pb::KeepaliveRequest {
            session_id: big.clone(),
        })
        .await;
    assert_bounded(r, "session_id", "Keepalive");
    let r = w
        .open_session(pb::OpenSessionRequest {
            name: big.clone(),
            ..Default::default()
        })
        .await;
    assert_bounded(r.map(|_| ()), "session name", "OpenSession name");

    let mut a = admin.raw();
    let r = a
        .get_quota(pb::GetQuotaRequest {
            tenant: big.clone(),
        })
        .await;
    assert_bounded(r, "tenant", "GetQuota");
    let r = a
        .delete_tenant(pb::DeleteTenantRequest {
            tenant: big.clone(),
        })
        .await;
    assert_bounded(r, "tenant", "DeleteTenant");
    let mut req = pb::ListAllLeasesRequest::default();
    req.tenant = big.clone();
    let r = a.list_all_leases(req).await;
    assert_bounded(r, "tenant", "ListAllLeases filter");
    let r = a
        .revoke_token(pb::RevokeTokenRequest {
            token: big.clone(),
            ..Default::default()
        })
        .await;
    assert_bounded(r, "token", "RevokeToken");
    let mut req = pb::IssueTokenRequest::default();
    req.tenant = "t".into();
    req.description = big.clone();
    let r = a.issue_token(req).await;
    assert_bounded(r, "description", "IssueToken description");

    // A 1 MB revoke reason: refused, the lease untouched.
    let lease = w
        .acquire_lease(pb::AcquireLeaseRequest {
            session_id: sid.clone(),
            bytes: MIB,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap();
    let r = a
        .revoke_lease(pb::RevokeLeaseRequest {
            lease_id: lease.lease_id.clone(),
            reason: big.clone(),
        })
        .await;
    assert_bounded(r, "reason", "RevokeLease reason");
    let leases = admin.list_all_leases(None).await.unwrap();
    assert_eq!(leases.len(), 1, "the lease is still there");
    assert!(
        !b.log_text().contains(&big[..4096]),
        "the huge input reached the log"
    );
    assert_broker_alive(&b);
}

/// A tenant cannot queue unboundedly many `AcquireTurn` requests: past
/// `--max-waiting-per-tenant` it gets `RESOURCE_EXHAUSTED`, as for leases.
#[tokio::test]
async fn turn_waiters_per_tenant_are_capped() {
    use gpu_broker_client::proto::v1 as pb;
    // A long quantum: the holder keeps its turn while the waiters are counted (with the
    // default 100 ms + grace it would be taken, a waiter served, and the third let in).
    let b = broker_64mib(&["--max-waiting-per-tenant", "2", "--turn-quantum", "10min"]);
    let token = b.tenant("t", QuotaSpec::new(64 * MIB)).await.unwrap();
    let holder_token = b.tenant("h", QuotaSpec::new(64 * MIB)).await.unwrap();
    let mut h = raw::broker(&b.uri(), &holder_token).await;
    let (hs, _he) = raw::open_session(&mut h, "holder").await;
    h.acquire_turn(pb::AcquireTurnRequest {
        session_id: hs,
        device: 0,
        wait_ms: None,
    })
    .await
    .expect("the holder gets the turn");
    let mut w = raw::broker(&b.uri(), &token).await;
    let mut streams = Vec::new();
    let mut waits = Vec::new();
    for i in 0..2 {
        let (sid, ev) = raw::open_session(&mut w, &format!("w{i}")).await;
        streams.push(ev);
        let mut c = w.clone();
        waits.push(tokio::spawn(async move {
            c.acquire_turn(pb::AcquireTurnRequest {
                session_id: sid,
                device: 0,
                wait_ms: Some(30_000),
            })
            .await
        }));
    }
    let queued = eventually(Duration::from_secs(10), || async {
        devices(&b).await.unwrap()[0].turns_waiting == 2
    })
    .await;
    assert!(queued, "two turn requests wait");
    let (sid, _ev) = raw::open_session(&mut w, "w-extra").await;
    let r = w
        .acquire_turn(pb::AcquireTurnRequest {
            session_id: sid,
            device: 0,
            wait_ms: Some(30_000),
        })
        .await;
    let s = r.expect_err("a third waiter is refused");
    assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
    assert!(
        s.message().contains("max-waiting-per-tenant"),
        "{}",
        s.message()
    );
    for t in waits {
        t.abort();
    }
    assert_broker_alive(&b);
}

/// A connection that never sends its HTTP/2 preface (or only part of it) is closed after
/// the handshake deadline; one that does keeps working.
#[tokio::test]
async fn silent_and_half_open_connections_are_closed_after_the_handshake_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let b = broker_64mib(&["--handshake-timeout", "300ms"]);
    let mut silent = tokio::net::UnixStream::connect(&b.socket).await.unwrap();
    let mut half = tokio::net::UnixStream::connect(&b.socket).await.unwrap();
    half.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    for (what, s) in [("silent", &mut silent), ("half preface", &mut half)] {
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => continue, // the server's SETTINGS
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "{what} connection still open after 10 s");
    }
    // A real client is unaffected.
    let admin = b.admin().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    admin
        .list_tenants()
        .await
        .expect("a speaking connection stays");
    assert_broker_alive(&b);
}

/// `--max-unauthenticated-streams`: health watches beyond the cap are RESOURCE_EXHAUSTED;
/// closing one frees its slot. `--max-streams-per-connection`: a connection runs at most
/// that many calls at once (the next waits for a slot).
#[tokio::test]
async fn unauthenticated_streams_and_streams_per_connection_are_bounded() {
    let b = broker_64mib(&[
        "--max-unauthenticated-streams",
        "6",
        "--max-streams-per-connection",
        "4",
    ]);
    let a = gpu_broker_client::connect::connect_channel(&b.uri())
        .await
        .unwrap();
    let c = gpu_broker_client::connect::connect_channel(&b.uri())
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(HealthWatch::open(&a, "").await.expect("within the caps").0);
    }
    // A fifth call on the same connection waits for a stream slot.
    let a2 = a.clone();
    let mut fifth = tokio::spawn(async move { HealthWatch::open(&a2, "").await });
    let waited = tokio::time::timeout(Duration::from_millis(500), &mut fifth).await;
    assert!(
        waited.is_err(),
        "a fifth concurrent stream ran on one connection"
    );
    held.pop();
    let (w, _) = tokio::time::timeout(Duration::from_secs(10), fifth)
        .await
        .expect("the fifth runs once a stream closed")
        .unwrap()
        .unwrap();
    held.push(w);
    // Two more on another connection reach the cap of 6 unauthenticated calls.
    for _ in 0..2 {
        held.push(HealthWatch::open(&c, "").await.expect("within the cap").0);
    }
    let over = HealthWatch::open(&c, "").await.err().expect("over the cap");
    assert_eq!(over.code(), tonic::Code::ResourceExhausted, "{over:?}");
    assert!(over.message().contains("max-unauthenticated-streams"));
    held.pop();
    let freed = eventually(Duration::from_secs(5), || async {
        HealthWatch::open(&c, "").await.is_ok()
    })
    .await;
    assert!(freed, "a closed watch frees its slot");
    // Authenticated calls are not counted against the unauthenticated cap.
    b.admin().await.unwrap().list_tenants().await.unwrap();
    assert_broker_alive(&b);
}

/// Opens `n` idle connections to `socket` as `uid` (a Python child: the caps are per peer
/// uid, and this test runs as root); returns how many the broker kept open after a second,
/// and the child, which holds them until dropped.
async fn idle_connections_as(uid: u32, socket: &std::path::Path, n: usize) -> (usize, Proc) {
    use std::os::unix::process::CommandExt;
    const SCRIPT: &str = r#"
import socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    socks.append(s)
time.sleep(1.0)
alive = 0
for s in socks:
    s.setblocking(False)
    try:
        if s.recv(1, socket.MSG_PEEK):
            alive += 1
    except BlockingIOError:
        alive += 1
    except OSError:
        pass
print("ALIVE", alive, flush=True)
sys.stdin.read()
"#;
    let mut cmd = std::process::Command::new("/usr/bin/python3");
    cmd.arg("-c")
        .arg(SCRIPT)
        .arg(socket)
        .arg(n.to_string())
        .uid(uid)
        .gid(uid);
    let mut p = Proc::spawn(cmd).unwrap();
    let line = p
        .line_starting("ALIVE ", Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("python as uid {uid}: {e:#}\n{}", p.history()));
    let alive = line["ALIVE ".len()..].trim().parse().unwrap();
    (alive, p)
}

/// Lets other users reach the test broker's socket (the tempdir is 0700 root).
fn open_socket_to_everyone(b: &Broker) -> bool {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 || !std::path::Path::new("/usr/bin/python3").exists() {
        eprintln!("SKIP: needs root (to connect as other uids) and /usr/bin/python3");
        return false;
    }
    let dir = b.socket.parent().unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&b.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    true
}

/// Connections are capped per peer uid and in total; the last slots are kept for root and
/// the broker's user, so the operator connects while workers hold every other slot.
#[tokio::test]
async fn connections_are_capped_per_uid_and_in_total_with_an_operator_reserve() {
    let b = broker_64mib(&[
        "--max-connections",
        "40",
        "--max-connections-per-uid",
        "10",
        "--admin-connection-reserve",
        "5",
        "--handshake-timeout",
        "60s",
    ]);
    if !open_socket_to_everyone(&b) {
        return;
    }
    let mut kept = Vec::new();
    let mut holders = Vec::new();
    for uid in [65534, 65533, 65532, 65531] {
        let (alive, p) = idle_connections_as(uid, &b.socket, 25).await;
        kept.push(alive);
        holders.push(p);
    }
    assert_eq!(
        kept,
        vec![10, 10, 10, 5],
        "per-uid cap 10, 35 for non-operators"
    );
    let admin = b
        .admin()
        .await
        .expect("the operator connects through the reserve");
    admin.list_tenants().await.unwrap();
    // Closing a worker's connections gives their places back.
    drop(holders.pop());
    let (alive, _p) = idle_connections_as(65530, &b.socket, 25).await;
    // 30 workers' and the operator's connection are open: 4 of the 35 remain.
    assert_eq!(alive, 4);
    assert_broker_alive(&b);
}

/// Under a descriptor limit of 128 (systemd's soft default is 1024) 300 idle connections do
/// not lock anyone out: the cap follows the limit, the surplus is closed at once, and the
/// operator still connects.
#[tokio::test]
async fn idle_connections_cannot_exhaust_the_descriptor_limit() {
    let b = Broker::start_with_nofile(
        128,
        BrokerOpts {
            capacity: "64MiB",
            extra: vec!["--handshake-timeout".into(), "60s".into()],
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    if !open_socket_to_everyone(&b) {
        return;
    }
    let pid = b.pid().unwrap();
    let (alive, _p) = idle_connections_as(65534, &b.socket, 300).await;
    assert!(
        alive <= 64,
        "{alive} idle connections kept under a limit of 128 fds"
    );
    let fds = fd_count(pid);
    assert!(fds < 128, "broker holds {fds} descriptors");
    let admin = b.admin().await.expect("the operator connects");
    admin.list_tenants().await.unwrap();
    let token = b.tenant("w", QuotaSpec::new(8 * MIB)).await.unwrap();
    let c = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    c.session("still")
        .await
        .expect("root workers get the reserve too");
    assert!(
        b.log_text().contains("connection refused"),
        "refusals are logged"
    );
    assert_broker_alive(&b);
}

/// The metrics listener closes a connection whose request headers do not arrive within the
/// handshake timeout (a half-sent request), and keeps answering whole ones.
#[tokio::test]
async fn the_metrics_listener_drops_half_sent_requests() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let b = broker_64mib(&[
        "--metrics-listen",
        "127.0.0.1:0",
        "--handshake-timeout",
        "300ms",
    ]);
    let addr = b.metrics_addr().await;
    let mut half = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 1024];
        loop {
            match half.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => continue,
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "a half-sent request is held after 10 s");
    let mut whole = tokio::net::TcpStream::connect(&addr).await.unwrap();
    whole
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(10), whole.read_to_string(&mut reply))
        .await
        .expect("a whole request is answered")
        .unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
}

/// `GET path` on a new connection to the metrics listener: the reply, or why none came
/// within 2 s (a probe's patience).
async fn probe(addr: &str, path: &str) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ask = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut reply = String::new();
        s.read_to_string(&mut reply).await?;
        Ok::<_, std::io::Error>(reply)
    };
    match tokio::time::timeout(Duration::from_secs(2), ask).await {
        Ok(Ok(r)) if !r.is_empty() => Ok(r),
        Ok(Ok(_)) => Err("closed without a reply".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no reply within 2 s".into()),
    }
}

/// Anyone who can reach the metrics listener holding every one of its connections idle
/// (none sending a request, or half of one) does not starve the probes: a new connection
/// takes the place of the one that has waited longest for a request, so `/healthz` and
/// `/readyz` keep answering (an orchestrator would otherwise restart the broker).
#[tokio::test]
async fn probes_answer_while_idle_connections_fill_the_metrics_listener() {
    use tokio::io::AsyncWriteExt;
    let b = broker_64mib(&[
        "--metrics-listen",
        "127.0.0.1:0",
        "--handshake-timeout",
        "60s",
    ]);
    let addr = b.metrics_addr().await;
    let cap = gpu_broker::listener::MAX_HTTP_CONNECTIONS;
    let mut held = Vec::new();
    let hold = |n: usize| {
        let addr = addr.clone();
        async move {
            let mut v = Vec::new();
            for i in 0..n {
                let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
                if i % 2 == 1 {
                    s.write_all(b"GET /metrics HTTP/1.1\r\nHo").await.unwrap();
                }
                v.push(s);
            }
            // Accepted (or refused) by now.
            tokio::time::sleep(Duration::from_millis(200)).await;
            v
        }
    };
    held.extend(hold(cap).await);
    for round in 0..10 {
        let path = if round % 2 == 0 {
            "/healthz"
        } else {
            "/readyz"
        };
        let reply = probe(&addr, path).await;
        assert!(
            reply
                .as_deref()
                .is_ok_and(|r| r.starts_with("HTTP/1.1 200")),
            "probe {round} ({path}) with {cap} idle connections held: {reply:?}"
        );
        // The place it took is taken again.
        held.extend(hold(1).await);
    }
    drop(held);
    assert_broker_alive(&b);
}

/// Unmounts a test filesystem when dropped (after the broker using it stopped).
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// With the state directory on a full filesystem admin changes fail (INTERNAL, nothing
/// claimed) and the Admin service reports NOT_SERVING; once space is freed the store
/// reopens by itself: the Admin service serves again and changes commit. Needs root (a
/// small tmpfs); skips with a reason otherwise.
#[tokio::test]
async fn the_store_recovers_after_the_disk_was_full() {
    use std::io::Write;
    let mut mount_failed = None;
    let started = Broker::start_raw(|dir| {
        let state = dir.join("state");
        std::fs::create_dir_all(&state).unwrap();
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=6m", "tmpfs"])
            .arg(&state)
            .stderr(std::process::Stdio::piped())
            .output();
        match st {
            Ok(o) if o.status.success() => {}
            Ok(o) => mount_failed = Some(String::from_utf8_lossy(&o.stderr).into_owned()),
            Err(e) => mount_failed = Some(e.to_string()),
        }
        [
            "--backend",
            "host",
            "--host-capacity",
            "64MiB",
            "--headroom",
            "0%",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    });
    if let Some(why) = mount_failed {
        eprintln!("SKIP: cannot mount a tmpfs for the state directory (needs root): {why}");
        return;
    }
    let mut b = started.unwrap();
    let _mounted = Mounted(b.state_dir.clone());
    let admin = b.admin().await.unwrap();
    admin
        .set_quota("before", QuotaSpec::new(MIB))
        .await
        .unwrap();

    // Fill the filesystem.
    let filler = b.state_dir.join("filler");
    {
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![0xabu8; 64 << 10];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
    }
    let mut failed = None;
    for i in 0..200 {
        match admin.set_quota(&format!("t{i}"), QuotaSpec::new(MIB)).await {
            Ok(_) => continue,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let err = failed.expect("an admin change fails on a full disk");
    assert_eq!(err.code(), Code::Internal, "{err}");
    let not_serving = eventually(Duration::from_secs(10), || async {
        health_check(&b.uri(), "gpubroker.v1.Admin").await.ok() == Some(2)
    })
    .await;
    assert!(not_serving, "Admin health while the store is unwritable");
    assert!(
        admin
            .set_quota("during", QuotaSpec::new(MIB))
            .await
            .is_err(),
        "still full"
    );

    // Free the space: the store recovers without a restart.
    std::fs::remove_file(&filler).unwrap();
    let serving = eventually(Duration::from_secs(15), || async {
        health_check(&b.uri(), "gpubroker.v1.Admin").await.ok() == Some(1)
    })
    .await;
    assert!(
        serving,
        "Admin health after space was freed:\n{}",
        b.log_text()
    );
    admin
        .set_quota("after", QuotaSpec::new(2 * MIB))
        .await
        .expect("admin changes commit again");
    assert_eq!(
        admin.get_quota("after").await.unwrap().quota.limit_bytes,
        2 * MIB
    );
    assert!(
        admin.get_quota("during").await.is_err(),
        "a failed change claimed nothing"
    );
    let log = b.log_text();
    assert!(log.contains("state store unwritable"), "{log}");
    assert!(log.contains("state store writable again"), "{log}");
    // Durable: a restart sees the change made after the recovery.
    b.stop(Duration::from_secs(10)).unwrap();
    b.spawn().unwrap();
    let admin = b.admin().await.unwrap();
    assert_eq!(
        admin.get_quota("after").await.unwrap().quota.limit_bytes,
        2 * MIB
    );
    b.kill().unwrap();
}

/// Listings come in pages (page size, page token) in the API and the client; walking the
/// pages yields every item once, in order; the whole-list calls walk them by themselves.
#[tokio::test]
async fn listings_are_paginated() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    for i in 0..23 {
        admin
            .set_quota(&format!("t{i:02}"), QuotaSpec::new(MIB))
            .await
            .unwrap();
    }
    let token = b.tenant("holder", QuotaSpec::new(256 * MIB)).await.unwrap();
    let client = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    let mut sessions = Vec::new();
    let mut leases = Vec::new();
    for i in 0..12 {
        let s = client.session(format!("s{i}")).await.unwrap();
        for _ in 0..3 {
            leases.push(s.lease(2 * MIB).await.unwrap());
        }
        sessions.push(s);
    }

    // Tenants: pages of 10, by name.
    let mut names = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let (page, next) = admin.list_tenants_page(10, &token).await.unwrap();
        assert!(page.len() <= 10);
        pages += 1;
        names.extend(page.into_iter().map(|t| t.name));
        match next {
            Some(t) => token = t,
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(names.len(), 24);
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted);
    assert_eq!(admin.list_tenants().await.unwrap().len(), 24);

    // Leases: pages of 7, in grant order, each once.
    let mut ids = Vec::new();
    let mut token = String::new();
    loop {
        let (page, next) = admin.list_all_leases_page(None, 7, &token).await.unwrap();
        ids.extend(page.into_iter().map(|l| l.lease_id));
        match next {
            Some(t) => token = t,
            None => break,
        }
    }
    let granted: Vec<String> = leases.iter().map(|l| l.id().to_string()).collect();
    assert_eq!(ids, granted, "every lease once, in grant order");
    let (own, next) = client.list_leases_page(5, "").await.unwrap();
    assert_eq!(own.len(), 5);
    assert!(next.is_some());
    assert_eq!(client.list_leases().await.unwrap().len(), 36);

    // Sessions: pages of 5, oldest first.
    let (first, next) = admin.list_sessions_page(None, 5, "").await.unwrap();
    assert_eq!(first.len(), 5);
    let (rest, _) = admin
        .list_sessions_page(None, 100, &next.unwrap())
        .await
        .unwrap();
    assert_eq!(rest.len(), 7);
    assert_eq!(admin.list_sessions(None).await.unwrap().len(), 12);

    // A token the broker did not give out.
    let bad = admin
        .list_all_leases_page(None, 5, "not-a-token")
        .await
        .expect_err("a bad token is refused");
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad}");
    // The CLI lists everything.
    let out = std::process::Command::new(bin("gpu-brokerctl"))
        .arg("--broker")
        .arg(b.uri())
        .arg("--token-file")
        .arg(b.state_dir.join("admin.token"))
        .args(["--json", "leases", "list"])
        .env_remove("GPU_BROKER_ADMIN_TOKEN")
        .env_remove("GPU_BROKER_ADDR")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v.as_array().map(|a| a.len()), Some(36));
    drop(leases);
}
