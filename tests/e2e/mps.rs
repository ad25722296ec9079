//! Managed MPS through the broker binary, against the fake control binary
//! (`broker/src/mps/fake-control.sh`, which records what it is sent): `--mps` starts the
//! daemon in private directories, `GetDevices` and `gpu-brokerctl status` show it, and
//! stopping the broker sends `quit` and leaves no daemon. And `--turn-slots`: N turn
//! holders per device at once.

use gpu_broker_tests::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn fake_control() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../broker/src/mps/fake-control.sh")
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let exists = unsafe { libc::kill(pid, 0) == 0 };
    exists
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
}

/// Kills the fake daemon named by the pid file in `pipe` when dropped (a failed test must
/// not leave it sleeping).
struct DaemonGuard(PathBuf);

impl Drop for DaemonGuard {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.0.join("nvidia-cuda-mps-control.pid"))
            .ok()
            .and_then(|t| t.trim().parse::<i32>().ok());
        if let Some(pid) = pid.filter(|p| *p > 0) {
            // SAFETY: kills the fake daemon this test's broker started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_runs_its_mps_daemon_shows_it_and_quits_it_at_shutdown() {
    let mps_dir = tempfile::tempdir().unwrap();
    let pipe = mps_dir.path().join("pipe");
    let _guard = DaemonGuard(pipe.clone());
    let mut b = Broker::start_with(BrokerOpts {
        extra: vec![
            "--mps".into(),
            "--mps-control".into(),
            fake_control().display().to_string(),
            "--mps-pipe-dir".into(),
            pipe.display().to_string(),
            "--mps-health-interval".into(),
            "100ms".into(),
        ],
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let devices = admin.get_devices().await.unwrap();
    assert_eq!(devices[0].mps_state, "running", "{:?}", devices[0]);
    assert!(devices[0].mps_detail.contains("pid "), "{:?}", devices[0]);
    let pid: i32 = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(pid));
    let log = mps_dir.path().join("commands.log");
    let text = std::fs::read_to_string(&log).unwrap();
    let default_log_dir = b.state_dir.join("mps-log");
    assert!(
        text.contains(&format!("log={}", default_log_dir.display())),
        "the log directory defaults to the state directory: {text}"
    );
    // gpu-brokerctl status shows the daemon.
    let out = tokio::process::Command::from(b.ctl())
        .arg("status")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("mps: running (pid"), "{stdout}");
    // The daemon dies: the broker restarts it and reports the restart.
    // SAFETY: kills the fake daemon this test's broker started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    assert!(
        eventually(Duration::from_secs(15), || async {
            admin
                .get_devices()
                .await
                .is_ok_and(|d| d[0].mps_state == "running" && d[0].mps_detail.contains("1 restart"))
        })
        .await,
        "restarted"
    );
    let pid: i32 = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(pid));
    let status = b.stop(Duration::from_secs(20)).unwrap();
    assert!(status.success(), "{status}\n{}", b.log_text());
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches(" cmd quit").count(), 1, "{text}");
    assert!(!alive(pid), "no MPS daemon left after the broker stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_under_mps_gets_and_is_charged_the_context_overhead_on_top() {
    let mps_dir = tempfile::tempdir().unwrap();
    let pipe = mps_dir.path().join("pipe");
    let _guard = DaemonGuard(pipe.clone());
    let b = Broker::start_with(BrokerOpts {
        extra: vec![
            "--mps".into(),
            "--mps-control".into(),
            fake_control().display().to_string(),
            "--mps-pipe-dir".into(),
            pipe.display().to_string(),
            "--mps-context-overhead".into(),
            "32MiB".into(),
        ],
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b
        .tenant("alice", gpu_broker_client::QuotaSpec::new(256 * MIB))
        .await
        .unwrap();
    let client = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    let session = client.session("ctx").await.unwrap();
    // 64 MiB for the program: its pinned limit and its charge are 64 + 32 MiB.
    let r = gpu_broker_client::ReservationRequest::new(&session, 64 * MIB)
        .await
        .unwrap();
    assert_eq!(r.info().bytes, 96 * MIB, "{:?}", r.info());
    let env = r.info().mps_env.clone().unwrap_or_default();
    let limit = env
        .iter()
        .find(|(k, _)| k == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        .map(|(_, v)| v.as_str());
    assert_eq!(limit, Some("0=96M"), "{env:?}");
    let u = session.usage().await.unwrap();
    assert_eq!(
        u.usage.process_reserved_bytes,
        96 * MIB,
        "charged with the overhead"
    );
    // 136 MiB more fits the quota without the overhead (64 + 136 <= 256) but not with
    // it (96 + 168 > 256): the overhead is charged, not hidden.
    let other = client.session("ctx2").await.unwrap();
    let e = gpu_broker_client::ReservationRequest::new(&other, 136 * MIB)
        .await
        .unwrap_err();
    assert_eq!(e.code_name(), "RESOURCE_EXHAUSTED", "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_control_binary_the_broker_serves_and_reports_mps_down() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec![
            "--mps".into(),
            "--mps-control".into(),
            "/nonexistent/nvidia-cuda-mps-control".into(),
        ],
        ..BrokerOpts::default()
    })
    .unwrap();
    let d = b.admin().await.unwrap().get_devices().await.unwrap();
    assert_eq!(d[0].mps_state, "down", "{:?}", d[0]);
    assert!(d[0].mps_detail.contains("/nonexistent"), "{:?}", d[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_slots_let_n_holders_run_at_once() {
    // The holders keep their turns while the third waits, for as long as the machine takes
    // to run the test: with the default quantum and grace (100 ms each) a loaded machine
    // had them taken (`TurnRevoked`) before the release, which then found no turn. Here
    // nothing is taken: what is tested is the slots.
    let b = Broker::start_with(BrokerOpts {
        extra: vec![
            "--turn-slots".into(),
            "2".into(),
            "--turn-quantum".into(),
            "10min".into(),
        ],
        ..BrokerOpts::default()
    })
    .unwrap();
    let mut sessions = Vec::new();
    for t in ["a", "b", "c"] {
        let c = b.client(t, 64 * MIB).await.unwrap();
        sessions.push(c.session(t).await.unwrap());
    }
    let ta = sessions[0].turn(0).await.expect("first slot");
    let _tb = sessions[1].turn(0).await.expect("second slot");
    let busy = sessions[2].turn(0).await.unwrap_err();
    assert_eq!(
        busy.code(),
        gpu_broker_client::Code::ResourceExhausted,
        "{busy}"
    );
    let admin = b.admin().await.unwrap();
    let d = &admin.get_devices().await.unwrap()[0];
    assert_eq!((d.turn_holders, d.turns_waiting), (2, 0), "{d:?}");
    let sc = sessions.pop().unwrap();
    let waiter = tokio::spawn(async move {
        let t = sc.turn(0).wait(Duration::from_secs(10)).await;
        (t, sc)
    });
    // Released once the third waits (not after a guessed sleep).
    assert!(
        eventually(Duration::from_secs(10), || async {
            admin
                .get_devices()
                .await
                .is_ok_and(|d| d[0].turns_waiting == 1)
        })
        .await,
        "the third waits"
    );
    ta.release().await.unwrap();
    let (tc, _sc) = waiter.await.unwrap();
    let tc = tc.expect("the third got the freed slot");
    assert_eq!(admin.get_devices().await.unwrap()[0].turn_holders, 2);
    tc.release().await.unwrap();
}
