//! Resource exhaustion and isolation: what a live peer can make the broker hold (pidfds,
//! connections, streams, queue entries, huge strings), peers the broker cannot see
//! (another PID namespace), and the broker's own output closing under it.

use super::*;

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
    assert!(!b.log_text().contains("peer process exited"), "{}", b.log_text());
}
