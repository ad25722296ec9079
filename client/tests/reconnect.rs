//! Reconnection against the real broker: SIGKILL and restart it on the same socket
//! and state directory, shut it down gracefully, revoke the token, delete the tenant.
//! The broker binary is `target/<profile>/gpu-broker`; build it first
//! (`cargo build -p gpu-broker`), or these tests print why and pass without running.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpu_broker_client::{
    AdminClient, Backoff, Client, ClientError, Code, QuotaSpec, Session, SessionEvent,
    SessionEvents,
};

const MIB: u64 = 1 << 20;

/// The broker binary next to this test's directory (`target/debug/deps/..`).
fn broker_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let mut dir = exe.parent()?.to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("gpu-broker");
    bin.is_file().then_some(bin)
}

/// Skips the test (returns) when the broker binary is not built.
macro_rules! broker_or_skip {
    ($($extra:expr),* $(,)?) => {
        match broker_bin() {
            Some(bin) => TestBroker::start(bin, &[$($extra),*]),
            None => {
                eprintln!(
                    "SKIPPED: gpu-broker binary not built next to {:?}; run `cargo build -p gpu-broker`",
                    std::env::current_exe().ok()
                );
                return;
            }
        }
    };
}

/// One broker process (restartable on the same socket and state), host backend.
struct TestBroker {
    bin: PathBuf,
    child: Option<Child>,
    dir: tempfile::TempDir,
    shm_dir: PathBuf,
    args: Vec<String>,
}

impl TestBroker {
    fn start(bin: PathBuf, extra: &[&str]) -> TestBroker {
        let dir = tempfile::Builder::new()
            .prefix("gpb-client-reconnect-")
            .tempdir()
            .unwrap();
        let unique = dir
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        let shm_dir = PathBuf::from("/dev/shm").join(unique);
        let path = |p: &Path| p.display().to_string();
        let mut args = vec![
            "--backend".to_string(),
            "host".into(),
            "--socket".into(),
            path(&dir.path().join("b.sock")),
            "--state-dir".into(),
            path(&dir.path().join("state")),
            "--host-shm-dir".into(),
            path(&shm_dir),
            "--host-capacity".into(),
            "1GiB".into(),
            "--headroom".into(),
            "0%".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut broker = TestBroker {
            bin,
            child: None,
            dir,
            shm_dir,
            args,
        };
        broker.spawn();
        broker
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("b.sock")
    }

    fn uri(&self) -> String {
        format!("unix://{}", self.socket().display())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("broker.log")).unwrap_or_default()
    }

    fn admin_token(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("state/admin.token"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// Starts the process (again) and waits until the socket answers.
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("broker.log"))
            .unwrap();
        let child = Command::new(&self.bin)
            .args(&self.args)
            .env("GPU_BROKER_LOG", "info,gpu_broker=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(self.socket()).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("broker exited early ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "broker did not start:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> libc::pid_t {
        self.child.as_ref().unwrap().id() as libc::pid_t
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// SIGTERM (graceful shutdown); `wait_exit` reaps it.
    fn terminate(&self) {
        // SAFETY: plain syscall on our own child.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
    }

    async fn wait_exit(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut().unwrap();
        while child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "broker did not exit:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.child = None;
    }

    async fn admin(&self) -> AdminClient {
        AdminClient::connect(&self.uri(), self.admin_token())
            .await
            .unwrap()
    }

    /// Creates tenant `name` and returns a token for it.
    async fn tenant(&self, name: &str) -> String {
        let admin = self.admin().await;
        admin
            .set_quota(name, QuotaSpec::new(256 * MIB))
            .await
            .unwrap();
        admin
            .issue_token(name, "reconnect test")
            .await
            .unwrap()
            .token
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.shm_dir);
    }
}

/// Quick retries for tests.
fn fast() -> Backoff {
    Backoff::new(Duration::from_millis(50), Duration::from_millis(400))
}

async fn reconnecting(client: &Client, name: &str) -> Session {
    client
        .session_builder(name)
        .reconnect(fast())
        .open()
        .await
        .unwrap()
}

/// The next event matching `pred` within `within`; other events are kept in the panic
/// message.
async fn wait_for(
    events: &mut SessionEvents,
    what: &str,
    within: Duration,
    pred: impl Fn(&SessionEvent) -> bool,
) -> SessionEvent {
    let deadline = tokio::time::Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(event)) if pred(&event) => {
                eprintln!("event: {event:?}");
                return event;
            }
            Ok(Some(event)) => seen.push(event),
            Ok(None) => panic!("events ended before {what}; saw {seen:?}"),
            Err(_) => panic!("no {what} within {within:?}; saw {seen:?}"),
        }
    }
}

#[tokio::test]
async fn sigkill_and_restart_reconnects_and_old_leases_stay_dead() {
    let mut broker = broker_or_skip!();
    let token = broker.tenant("team").await;
    let client = Client::connect(&broker.uri(), &token).await.unwrap();
    let session = reconnecting(&client, "worker").await;
    let mut events = session.events();
    let plain = client.session("plain").await.unwrap();
    let mut plain_events = plain.events();
    assert!(session.reconnects() && !plain.reconnects());
    let old_id = session.id().to_string();
    let first = session.lease(MIB).await.unwrap();
    let second = session.lease(2 * MIB).await.unwrap();
    let released = session.lease(MIB).await.unwrap();
    released.release().await.unwrap();

    broker.kill();
    let ev = wait_for(&mut events, "Disconnected", Duration::from_secs(5), |e| {
        matches!(e, SessionEvent::Disconnected { .. })
    })
    .await;
    assert!(
        matches!(&ev, SessionEvent::Disconnected { session_id, .. } if *session_id == old_id),
        "{ev:?}"
    );
    assert!(!session.is_connected() && !session.is_closed());
    assert!(first.is_lost());
    // Between sessions, acquiring fails at once.
    let err = session.lease(MIB).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    // A session without reconnection just ends.
    let ev = wait_for(&mut plain_events, "Closed", Duration::from_secs(5), |e| {
        e.is_closed()
    })
    .await;
    assert!(
        matches!(ev, SessionEvent::Closed { reason: Some(_) }),
        "{ev:?}"
    );

    broker.spawn();
    let ev = wait_for(&mut events, "Reconnected", Duration::from_secs(10), |e| {
        matches!(e, SessionEvent::Reconnected { .. })
    })
    .await;
    let SessionEvent::Reconnected {
        old_session_id,
        new_session_id,
        lost_leases,
    } = ev
    else {
        unreachable!()
    };
    assert_eq!(old_session_id, old_id);
    assert_ne!(new_session_id, old_id);
    assert_eq!(session.id(), new_session_id);
    assert_eq!(lost_leases, [first.id(), second.id()]);
    assert!(session.is_connected());
    assert_eq!(first.session_id(), old_id);

    // The session works on the new broker.
    let fresh = session.lease(4 * MIB).await.unwrap();
    assert_eq!(fresh.session_id(), new_session_id);
    assert!(!fresh.is_lost());
    // Old leases are dead: release fails without calling the broker, drop sends nothing.
    let err = first.release().await.unwrap_err();
    assert!(
        matches!(&err, ClientError::LeaseLost { session_id, .. } if *session_id == old_id),
        "{err}"
    );
    assert_eq!(err.code(), Code::NotFound);
    drop(second);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let admin = broker.admin().await;
    let sessions = admin.list_sessions(Some("team")).await.unwrap();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    assert_eq!(sessions[0].session_id, new_session_id);
    assert_eq!(sessions[0].name, "worker");
    assert_eq!(sessions[0].lease_count, 1);
    let leases = admin.list_all_leases(Some("team")).await.unwrap();
    let ids: Vec<_> = leases.iter().map(|l| l.lease_id.as_str()).collect();
    assert_eq!(ids, [fresh.id()]);
    fresh.release().await.unwrap();
    assert!(admin
        .list_all_leases(Some("team"))
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn graceful_shutdown_then_restart_reconnects() {
    let mut broker = broker_or_skip!("--shutdown-grace", "300ms");
    let token = broker.tenant("team").await;
    let client = Client::connect(&broker.uri(), &token).await.unwrap();
    let session = reconnecting(&client, "worker").await;
    let mut events = session.events();
    let old_id = session.id().to_string();
    let lease = session.lease(MIB).await.unwrap();

    broker.terminate();
    wait_for(&mut events, "ShuttingDown", Duration::from_secs(5), |e| {
        matches!(e, SessionEvent::ShuttingDown { .. })
    })
    .await;
    let ev = wait_for(&mut events, "Disconnected", Duration::from_secs(5), |e| {
        matches!(e, SessionEvent::Disconnected { .. })
    })
    .await;
    assert!(
        matches!(&ev, SessionEvent::Disconnected { session_id, reason } if *session_id == old_id && reason.contains("shut down")),
        "{ev:?}"
    );
    broker.wait_exit(Duration::from_secs(10)).await;
    assert!(!session.is_closed(), "a shut-down broker is retried");

    broker.spawn();
    let ev = wait_for(&mut events, "Reconnected", Duration::from_secs(10), |e| {
        matches!(e, SessionEvent::Reconnected { .. })
    })
    .await;
    assert!(
        matches!(&ev, SessionEvent::Reconnected { old_session_id, lost_leases, .. }
            if *old_session_id == old_id && *lost_leases == [lease.id()]),
        "{ev:?}"
    );
    assert!(lease.is_lost());
    assert!(matches!(
        lease.release().await,
        Err(ClientError::LeaseLost { .. })
    ));
    session.lease(MIB).await.unwrap().release().await.unwrap();
}

#[tokio::test]
async fn revoked_token_stops_reconnecting_with_closed() {
    let mut broker = broker_or_skip!();
    let token = broker.tenant("team").await;
    let client = Client::connect(&broker.uri(), &token).await.unwrap();
    let session = reconnecting(&client, "worker").await;
    let mut events = session.events();
    let _lease = session.lease(MIB).await.unwrap();
    broker.admin().await.revoke_token(&token).await.unwrap();

    broker.kill();
    broker.spawn();
    let ev = wait_for(&mut events, "Closed", Duration::from_secs(10), |e| {
        e.is_closed()
    })
    .await;
    assert!(
        matches!(&ev, SessionEvent::Closed { reason: Some(r) } if r.contains("UNAUTHENTICATED")),
        "{ev:?}"
    );
    assert!(events.next().await.is_none());
    assert!(session.is_closed() && !session.is_connected());
}

#[tokio::test]
async fn deleted_tenant_stops_reconnecting_with_closed() {
    let broker = broker_or_skip!();
    let token = broker.tenant("team").await;
    let client = Client::connect(&broker.uri(), &token).await.unwrap();
    let session = reconnecting(&client, "worker").await;
    let mut events = session.events();
    broker.admin().await.delete_tenant("team").await.unwrap();
    wait_for(&mut events, "Disconnected", Duration::from_secs(5), |e| {
        matches!(e, SessionEvent::Disconnected { .. })
    })
    .await;
    let ev = wait_for(&mut events, "Closed", Duration::from_secs(5), |e| {
        e.is_closed()
    })
    .await;
    assert!(
        matches!(&ev, SessionEvent::Closed { reason: Some(r) } if r.contains("UNAUTHENTICATED") || r.contains("NOT_FOUND")),
        "{ev:?}"
    );
    assert!(session.is_closed());
}
