//! The supervisor against a fake control binary (`fake-control.sh`, which records what
//! it is sent): start, health checks, servers and clients, crash and restart with
//! backoff, refusal while down, adoption, quit.

use super::*;
use std::time::Instant;

struct Fixture {
    dir: tempfile::TempDir,
    log: PathBuf,
}

impl Drop for Fixture {
    /// A failed test must not leave its fake daemon sleeping.
    fn drop(&mut self) {
        if let Some(pid) = self.control().daemon_pid() {
            // SAFETY: kills the fake daemon this test started (its pid file is ours).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("commands.log");
        Fixture { dir, log }
    }

    fn control(&self) -> control::Control {
        control::Control {
            binary: Path::new(env!("CARGO_MANIFEST_DIR")).join("src/mps/fake-control.sh"),
            pipe_dir: self.dir.path().join("pipe"),
            log_dir: self.dir.path().join("log"),
            visible_devices: Some("0,1".into()),
            timeout: Duration::from_secs(5),
            external: false,
        }
    }

    fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Times of the `-d` invocations, in seconds.
    fn starts(&self) -> Vec<f64> {
        self.lines()
            .iter()
            .filter(|l| l.split_whitespace().nth(1) == Some("-d"))
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect()
    }

    fn commands(&self, cmd: &str) -> usize {
        self.lines()
            .iter()
            .filter(|l| l.split_once(" cmd ").is_some_and(|(_, c)| c == cmd))
            .count()
    }

    async fn start(&self, t: Timings) -> Arc<Mps> {
        Mps::start(self.control(), t, 2, vec!["Default".into(); 2]).await
    }
}

fn fast() -> Timings {
    Timings {
        health_interval: Duration::from_millis(50),
        backoff_initial: Duration::from_millis(100),
        backoff_max: Duration::from_millis(400),
        start_timeout: Duration::from_secs(3),
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

use crate::process::process_alive as alive;

#[tokio::test]
async fn starts_the_daemon_checks_it_and_quits_at_shutdown() {
    let fx = Fixture::new();
    let mps = fx.start(fast()).await;
    let s = mps.status();
    assert_eq!(s.state, MpsState::Running, "{s:?}");
    let pid = s.daemon_pid.expect("pid from the pid file");
    assert!(alive(pid));
    let starts: Vec<String> = fx
        .lines()
        .into_iter()
        .filter(|l| l.contains(" -d "))
        .collect();
    assert_eq!(starts.len(), 1, "{starts:?}");
    let pipe = fx.dir.path().join("pipe");
    assert!(
        starts[0].contains(&format!("pipe={}", pipe.display())),
        "{}",
        starts[0]
    );
    assert!(starts[0].contains("visible=0,1"), "{}", starts[0]);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&pipe).unwrap().permissions().mode() & 0o7777;
    assert_eq!(
        mode, 0o1770,
        "the pipe directory is private to the broker's user and group, and sticky"
    );
    // Health checks keep coming.
    until("health checks", || fx.commands("get_server_list") >= 3).await;
    let env = mps
        .client_env(1, 4 << 30, 25)
        .expect("admitted while running");
    assert_eq!(env.get(env::PIPE_DIRECTORY), Some(pipe.to_str().unwrap()));
    assert_eq!(env.get(env::PINNED_DEVICE_MEM_LIMIT), Some("0=4096M"));
    assert_eq!(env.get(env::ACTIVE_THREAD_PERCENTAGE), Some("25"));
    assert!(matches!(
        mps.client_env(2, 1 << 30, 100),
        Err(BrokerError::UnknownDevice {
            device: 2,
            mps: true,
            ..
        })
    ));
    mps.shutdown().await;
    assert_eq!(fx.commands("quit"), 1);
    assert!(!alive(pid), "the daemon is gone after shutdown");
    assert_eq!(mps.status().state, MpsState::Stopped);
    assert!(matches!(
        mps.client_env(0, 1 << 30, 100),
        Err(BrokerError::MpsNotRunning { .. })
    ));
    mps.shutdown().await; // idempotent
    assert_eq!(fx.commands("quit"), 1);
}

#[tokio::test]
async fn a_crashed_daemon_is_restarted_and_reservations_are_refused_meanwhile() {
    let fx = Fixture::new();
    // A long first backoff leaves time to see the refusal.
    let t = Timings {
        backoff_initial: Duration::from_millis(600),
        backoff_max: Duration::from_secs(2),
        ..fast()
    };
    let mps = fx.start(t).await;
    let pid = mps.status().daemon_pid.unwrap();
    // SAFETY: kills the fake daemon this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    until("down", || mps.status().state == MpsState::Down).await;
    let s = mps.status();
    assert!(s.last_error.contains("stopped answering"), "{s:?}");
    match mps.client_env(0, 1 << 30, 100) {
        Err(e @ BrokerError::MpsNotRunning { state: "down", .. }) => {
            assert!(e.to_string().contains("down"), "{e}")
        }
        other => panic!("refused while down: {other:?}"),
    }
    until("running again", || mps.status().state == MpsState::Running).await;
    let s = mps.status();
    assert_eq!(s.restarts, 1);
    let new_pid = s.daemon_pid.unwrap();
    assert_ne!(new_pid, pid);
    assert!(alive(new_pid));
    let starts = fx.starts();
    assert_eq!(starts.len(), 2);
    assert!(
        starts[1] - starts[0] >= 0.6,
        "restarted only after the backoff: {starts:?}"
    );
    assert!(mps.client_env(0, 1 << 30, 100).is_ok());
    mps.shutdown().await;
    assert!(!alive(new_pid));
}

#[tokio::test]
async fn failed_starts_back_off_exponentially_up_to_the_maximum() {
    let fx = Fixture::new();
    std::fs::write(fx.dir.path().join("fail-start"), "").unwrap();
    let mps = fx.start(fast()).await;
    assert_eq!(mps.status().state, MpsState::Down);
    assert!(mps.status().last_error.contains("failed to start"));
    until("five attempts", || fx.starts().len() >= 5).await;
    let s = fx.starts();
    // Waits of at least 100, 200, 400, 400 ms (lower bounds only: a loaded machine is
    // slower, never faster).
    for (i, want) in [0.1, 0.2, 0.4, 0.4].iter().enumerate() {
        let gap = s[i + 1] - s[i];
        assert!(
            gap >= want * 0.95,
            "gap {i} was {gap:.3}s, want >= {want}s: {s:?}"
        );
    }
    std::fs::remove_file(fx.dir.path().join("fail-start")).unwrap();
    until("running", || mps.status().state == MpsState::Running).await;
    assert!(mps.status().restarts >= 4);
    mps.shutdown().await;
    assert_eq!(fx.commands("quit"), 1);
}

#[tokio::test]
async fn servers_and_clients_are_reported() {
    let fx = Fixture::new();
    let mps = fx.start(fast()).await;
    let pipe = fx.dir.path().join("pipe");
    std::fs::write(pipe.join("servers"), "4242\n").unwrap();
    std::fs::write(pipe.join("clients"), "100\n101\n").unwrap();
    until("clients seen", || mps.status().clients == vec![100, 101]).await;
    let s = mps.status();
    assert_eq!(s.servers, vec![4242]);
    assert!(s.summary().contains("2 client(s)"), "{}", s.summary());
    assert!(fx.commands("get_client_list 4242") >= 1);
    mps.shutdown().await;
    assert!(mps.status().clients.is_empty());
}

#[tokio::test]
async fn a_daemon_of_ours_that_still_answers_is_adopted() {
    let fx = Fixture::new();
    let c = fx.control();
    std::fs::create_dir_all(&c.pipe_dir).unwrap();
    c.start_daemon().await.unwrap();
    let pid = c.daemon_pid().unwrap();
    let mps = fx.start(fast()).await;
    assert_eq!(mps.status().state, MpsState::Running);
    assert_eq!(mps.status().daemon_pid, Some(pid));
    assert_eq!(fx.starts().len(), 1, "no second daemon was started");
    mps.shutdown().await;
    assert!(!alive(pid));
}

#[tokio::test]
async fn a_missing_control_binary_is_down_with_the_reason() {
    let fx = Fixture::new();
    let mut c = fx.control();
    c.binary = fx.dir.path().join("no-such-binary");
    let mps = Mps::start(c, fast(), 1, vec!["unknown".into()]).await;
    let s = mps.status();
    assert_eq!(s.state, MpsState::Down);
    assert!(s.last_error.contains("no-such-binary"), "{s:?}");
    assert!(matches!(
        mps.client_env(0, 1 << 30, 100),
        Err(BrokerError::MpsNotRunning { .. })
    ));
    mps.shutdown().await;
    assert_eq!(mps.status().state, MpsState::Stopped);
}

/// An external daemon (its own unit's, started in the foreground) is adopted, waited for
/// while it does not answer (reservations refused meanwhile), never started by the broker
/// and left running at its shutdown: a broker restart keeps it and its servers.
#[tokio::test]
async fn an_external_daemon_is_adopted_waited_for_and_left_running() {
    let fx = Fixture::new();
    let control = control::Control {
        external: true,
        ..fx.control()
    };
    let t = Timings {
        start_timeout: Duration::from_millis(300),
        ..fast()
    };
    let mps = Mps::start(control.clone(), t, 2, vec!["Default".into(); 2]).await;
    assert_eq!(mps.status().state, MpsState::Down, "none answers yet");
    assert!(
        mps.status().last_error.contains("gpu-broker-mps"),
        "{:?}",
        mps.status()
    );
    assert!(mps.client_env(0, 1 << 30, 100).is_err());
    // Its unit starts it.
    let mut unit = std::process::Command::new(&control.binary)
        .arg("-f")
        .env("CUDA_MPS_PIPE_DIRECTORY", &control.pipe_dir)
        .spawn()
        .unwrap();
    until("running", || mps.status().state == MpsState::Running).await;
    let pid = mps.status().daemon_pid.unwrap();
    assert_eq!(pid, unit.id());
    mps.shutdown().await;
    assert_eq!(fx.commands("quit"), 0, "{:?}", fx.lines());
    assert!(
        fx.starts().is_empty(),
        "the broker started none: {:?}",
        fx.lines()
    );
    assert!(alive(pid), "left running for its clients");
    // The next broker adopts it.
    let next = Mps::start(control, t, 2, vec!["Default".into(); 2]).await;
    assert_eq!(next.status().state, MpsState::Running);
    assert_eq!(next.status().daemon_pid, Some(pid));
    next.shutdown().await;
    assert!(alive(pid));
    unit.kill().unwrap();
    unit.wait().unwrap();
}
