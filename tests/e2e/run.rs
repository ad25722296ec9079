//! `gpu-brokerctl run` against a real broker: the program gets the worker environment
//! (token file only its user reads, the device's UUID), its exit status and signals pass
//! through, the reservation is charged while it runs and freed within a second of the
//! program's exit or of `run` being SIGKILLed (which stops the program too), and a
//! reservation over quota is refused or waits with the statuses of a lease request.

use gpu_broker_client::QuotaSpec;
use gpu_broker_tests::*;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// A broker, a tenant `name` with `limit` bytes, and a token file for it.
async fn setup(name: &str, limit: u64) -> (Broker, PathBuf, String) {
    let b = Broker::start().expect("broker starts");
    let token = b
        .tenant(name, QuotaSpec::new(limit))
        .await
        .expect("tenant created");
    let file = b.dir.path().join(format!("{name}.token"));
    std::fs::write(&file, &token).unwrap();
    (b, file, token)
}

/// `gpu-brokerctl run ARGS -- sh -c SCRIPT` with the tenant's token file.
fn run_cmd(b: &Broker, token_file: &PathBuf, args: &[&str], script: &str) -> Command {
    let mut cmd = Command::new(bin("gpu-brokerctl"));
    cmd.arg("--broker")
        .arg(b.uri())
        .arg("--token-file")
        .arg(token_file)
        .arg("run")
        .args(args)
        .args(["--", "sh", "-c", script])
        .env_remove("GPU_BROKER_TOKEN")
        .env_remove("GPU_BROKER_TOKEN_FILE")
        .env_remove("GPU_BROKER_ADMIN_TOKEN")
        .env_remove("GPU_BROKER_ADDR");
    cmd
}

/// Bytes the tenant has reserved for processes now, and how many reservations.
async fn reserved(b: &Broker, tenant: &str) -> (u64, u32) {
    let t = b
        .admin()
        .await
        .unwrap()
        .get_quota(tenant)
        .await
        .expect("tenant");
    (t.usage.process_reserved_bytes, t.usage.process_reservations)
}

/// The ids of the broker's sessions.
async fn session_ids(b: &Broker) -> Vec<String> {
    let s = b.admin().await.unwrap().list_sessions(None).await.unwrap();
    s.into_iter().map(|s| s.session_id).collect()
}

/// The tenant's process reservations are all gone within a second.
async fn assert_freed_within_a_second(b: &Broker, tenant: &str) {
    assert!(
        eventually(Duration::from_secs(1), || async {
            reserved(b, tenant).await == (0, 0)
        })
        .await,
        "{tenant}'s reservation still held a second later: {:?}",
        reserved(b, tenant).await
    );
}

/// Is `pid` a live (not zombie) process?
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next().map(str::to_string));
            !matches!(state.as_deref(), Some("Z") | Some("X") | None)
        }
        Err(_) => false,
    }
}

#[tokio::test]
async fn run_hands_the_program_its_environment_and_exit_code() {
    let (b, token_file, token) = setup("alice", 512 * MIB).await;
    let dev = devices(&b).await.unwrap().remove(0);
    let script = r#"echo "addr=$GPU_BROKER_ADDR"; echo "cvd=$CUDA_VISIBLE_DEVICES";
        echo "device=$GPU_BROKER_DEVICE"; echo "mode=$(stat -c %a "$GPU_BROKER_TOKEN_FILE")";
        echo "dirmode=$(stat -c %a "$(dirname "$GPU_BROKER_TOKEN_FILE")")";
        echo "token=$(cat "$GPU_BROKER_TOKEN_FILE")"; echo "admin=${GPU_BROKER_ADMIN_TOKEN:-none}";
        echo "file=$GPU_BROKER_TOKEN_FILE"; exit 7"#;
    let mut cmd = run_cmd(&b, &token_file, &["--memory", "256MiB"], script);
    cmd.env("GPU_BROKER_ADMIN_TOKEN", "not-for-the-program");
    let (status, out) = Proc::spawn(cmd)
        .unwrap()
        .finish(Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(status.code(), Some(7), "{out}");
    let line = |k: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")).map(str::to_string))
            .unwrap_or_else(|| panic!("no {k}= in\n{out}"))
    };
    assert_eq!(line("addr"), b.uri());
    assert_eq!(
        line("cvd"),
        dev.uuid,
        "CUDA_VISIBLE_DEVICES is the device's UUID"
    );
    assert_eq!(line("device"), "0");
    assert_eq!(line("mode"), "600", "token file readable by its user only");
    assert_eq!(line("dirmode"), "700");
    assert_eq!(line("token"), token);
    assert_eq!(line("admin"), "none", "no admin token reaches the program");
    assert!(
        !std::path::Path::new(&line("file")).exists(),
        "the token file is removed when run ends"
    );
    assert_freed_within_a_second(&b, "alice").await;
}

#[tokio::test]
async fn run_frees_the_reservation_within_a_second_of_the_program_exiting() {
    let (b, token_file, _) = setup("alice", 512 * MIB).await;
    // The program runs until its stdin (run's stdin) closes.
    let script = "echo started; cat >/dev/null; echo done";
    let mut p = Proc::spawn(run_cmd(&b, &token_file, &["--memory", "300MiB"], script)).unwrap();
    p.line_starting("started", Duration::from_secs(20))
        .await
        .unwrap();
    let (bytes, count) = reserved(&b, "alice").await;
    assert_eq!((bytes, count), (300 * MIB, 1), "charged while it runs");
    let sessions = b.admin().await.unwrap().list_sessions(None).await.unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].peer_pid, p.pid, "the session is run's");
    let (status, out) = p.finish(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "{out}");
    assert_freed_within_a_second(&b, "alice").await;
}

#[tokio::test]
async fn killing_run_stops_the_program_and_frees_the_reservation() {
    let (b, token_file, _) = setup("alice", 512 * MIB).await;
    let script = "echo pid=$$; exec sleep 300";
    let mut p = Proc::spawn(run_cmd(&b, &token_file, &["--memory", "128MiB"], script)).unwrap();
    let line = p
        .line_starting("pid=", Duration::from_secs(20))
        .await
        .unwrap();
    let child: u32 = line.trim_start_matches("pid=").parse().unwrap();
    assert!(alive(child));
    assert_eq!(reserved(&b, "alice").await, (128 * MIB, 1));
    p.signal(libc::SIGKILL);
    assert!(
        eventually(Duration::from_secs(1), || async {
            reserved(&b, "alice").await == (0, 0) && !alive(child)
        })
        .await,
        "within 1 s of run's SIGKILL the program is gone and the reservation freed (reserved {:?}, program alive {})",
        reserved(&b, "alice").await,
        alive(child)
    );
    let _ = p.wait(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn run_forwards_signals_and_passes_the_programs_status() {
    let (b, token_file, _) = setup("alice", 512 * MIB).await;
    // A program that handles SIGTERM exits with its own code...
    let script = r#"trap 'echo got-term; exit 42' TERM; echo ready; while :; do sleep 0.05; done"#;
    let mut p = Proc::spawn(run_cmd(&b, &token_file, &["--memory", "64MiB"], script)).unwrap();
    p.line_starting("ready", Duration::from_secs(20))
        .await
        .unwrap();
    p.signal(libc::SIGTERM);
    let (status, out) = p.finish(Duration::from_secs(10)).await.unwrap();
    assert_eq!(status.code(), Some(42), "{out}");
    assert!(out.contains("got-term"), "{out}");
    // ... and one that dies of a signal makes run die of the same signal.
    use std::os::unix::process::ExitStatusExt;
    let script = "echo ready; exec sleep 300";
    let mut p = Proc::spawn(run_cmd(&b, &token_file, &["--memory", "64MiB"], script)).unwrap();
    p.line_starting("ready", Duration::from_secs(20))
        .await
        .unwrap();
    p.signal(libc::SIGUSR1);
    let (status, out) = p.finish(Duration::from_secs(10)).await.unwrap();
    assert_eq!(status.signal(), Some(libc::SIGUSR1), "{out}");
    assert_freed_within_a_second(&b, "alice").await;
}

#[tokio::test]
async fn run_over_quota_is_refused_or_waits() {
    let (b, token_file, _) = setup("alice", 256 * MIB).await;
    // Above the limit: refused at once, even with a wait; the program never starts.
    let (status, out) = Proc::spawn(run_cmd(
        &b,
        &token_file,
        &["--memory", "512MiB", "--wait", "5s"],
        "echo started",
    ))
    .unwrap()
    .finish(Duration::from_secs(20))
    .await
    .unwrap();
    assert_eq!(status.code(), Some(125), "{out}");
    assert!(out.contains("RESOURCE_EXHAUSTED"), "{out}");
    assert!(!out.contains("started"), "{out}");

    // A first run holds 200 MiB of the 256.
    let mut first = Proc::spawn(run_cmd(
        &b,
        &token_file,
        &["--memory", "200MiB"],
        "echo started; cat >/dev/null",
    ))
    .unwrap();
    first
        .line_starting("started", Duration::from_secs(20))
        .await
        .unwrap();
    // No wait: RESOURCE_EXHAUSTED; a wait that runs out: DEADLINE_EXCEEDED.
    for (wait, code) in [("0s", "RESOURCE_EXHAUSTED"), ("300ms", "DEADLINE_EXCEEDED")] {
        let (status, out) = Proc::spawn(run_cmd(
            &b,
            &token_file,
            &["--memory", "100MiB", "--wait", wait],
            "echo started",
        ))
        .unwrap()
        .finish(Duration::from_secs(20))
        .await
        .unwrap();
        assert_eq!(status.code(), Some(125), "{out}");
        assert!(out.contains(code), "wait {wait}: {out}");
        assert!(!out.contains("started"), "{out}");
    }
    // A long enough wait is granted once the first run ends.
    let mut second = Proc::spawn(run_cmd(
        &b,
        &token_file,
        &["--memory", "100MiB", "--wait", "20s"],
        "echo started; exit 3",
    ))
    .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            b.admin()
                .await
                .unwrap()
                .get_quota("alice")
                .await
                .is_ok_and(|t| t.usage.waiting_requests == 1)
        })
        .await,
        "the second run waits in the queue"
    );
    let listed = b.admin().await.unwrap().list_tenants().await.unwrap();
    let alice = listed.iter().find(|t| t.name == "alice").unwrap();
    assert_eq!(
        alice.usage.queue_position, 1,
        "the tenants listing says where its waiter stands"
    );
    let said = second
        .line_starting("stderr: gpu-brokerctl run: waiting", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        said.contains("for 100.0 MiB on any device; next in the node's queue")
            && said
                .contains("blocked by tenant \"alice\"'s quota: it holds 200.0 MiB of 256.0 MiB"),
        "a queued run says what it waits for and what blocks it: {said}"
    );
    let (status, _) = first.finish(Duration::from_secs(10)).await.unwrap();
    assert!(status.success());
    second
        .line_starting("started", Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(
        second.wait(Duration::from_secs(10)).await.unwrap().code(),
        Some(3)
    );
}

#[tokio::test]
async fn run_without_a_tenant_token_or_program_fails_clearly() {
    let (b, _token_file, _) = setup("alice", 256 * MIB).await;
    let mut cmd = Command::new(bin("gpu-brokerctl"));
    cmd.arg("--broker")
        .arg(b.uri())
        .args(["run", "--memory", "64MiB", "--", "true"])
        .env_remove("GPU_BROKER_TOKEN")
        .env_remove("GPU_BROKER_TOKEN_FILE");
    let (status, out) = Proc::spawn(cmd)
        .unwrap()
        .finish(Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(status.code(), Some(125), "{out}");
    assert!(out.contains("tenant's token"), "{out}");

    let mut cmd = Command::new(bin("gpu-brokerctl"));
    cmd.arg("--broker")
        .arg(b.uri())
        .args(["run", "--memory", "64MiB", "--", "/nonexistent/program"])
        .env("GPU_BROKER_TOKEN_FILE", _token_file.as_os_str());
    let (status, out) = Proc::spawn(cmd)
        .unwrap()
        .finish(Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(status.code(), Some(127), "{out}");
    assert_freed_within_a_second(&b, "alice").await;
}

/// `gpu-brokerctl run ARGS` of a program that says "stopping" and exits 5 on SIGTERM,
/// once it is running.
async fn started_stoppable(b: &Broker, token_file: &PathBuf, args: &[&str]) -> Proc {
    let script = r#"trap 'echo stopping; exit 5' TERM; echo ready; while :; do sleep 0.05; done"#;
    let mut p = Proc::spawn(run_cmd(b, token_file, args, script)).unwrap();
    p.line_starting("ready", Duration::from_secs(20))
        .await
        .unwrap();
    p
}

#[tokio::test]
async fn run_stops_the_program_when_the_broker_ends_its_session() {
    let (mut b, token_file, _) = setup("alice", 512 * MIB).await;
    let p = started_stoppable(&b, &token_file, &["--memory", "64MiB"]).await;
    // The broker dies: the reservation is gone, so the program must not run on.
    b.kill().unwrap();
    let (status, out) = p.finish(Duration::from_secs(15)).await.unwrap();
    assert_eq!(status.code(), Some(5), "{out}");
    assert!(out.contains("stopping"), "{out}");
    assert!(out.contains("ended the session"), "{out}");
}

/// A broker with a keeper (sessions and reservations kept across its restart) and tenant
/// alice's token in a file; the keeper lives as long as the first value.
async fn kept_broker_with_alice() -> (Keeper, Broker, std::path::PathBuf) {
    let keeper = Keeper::start().await.unwrap();
    let b = Broker::start_with(BrokerOpts {
        extra: keeper.flags(),
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("alice", QuotaSpec::new(512 * MIB)).await.unwrap();
    let token_file = b.dir.path().join("alice.token");
    std::fs::write(&token_file, &token).unwrap();
    (keeper, b, token_file)
}

/// With a keeper the broker keeps `run`'s session and its reservation across its SIGKILL
/// and restart: `run` resumes the session and its program runs on, still charged, and
/// the reservation ends when the program exits (the setup of a daemon in its own unit,
/// docs/mps.md).
#[tokio::test]
async fn run_keeps_its_program_and_reservation_through_a_broker_restart_with_a_keeper() {
    let (_keeper, mut b, token_file) = kept_broker_with_alice().await;
    let go = b.dir.path().join("go");
    let script = format!(
        r#"trap 'echo stopping; exit 5' TERM; echo pid=$$; while [ ! -e {} ]; do sleep 0.05; done; echo done"#,
        go.display()
    );
    let mut p = Proc::spawn(run_cmd(&b, &token_file, &["--memory", "256MiB"], &script)).unwrap();
    let line = p
        .line_starting("pid=", Duration::from_secs(20))
        .await
        .unwrap();
    let child: u32 = line.trim_start_matches("pid=").parse().unwrap();
    assert_eq!(reserved(&b, "alice").await, (256 * MIB, 1));
    let before = session_ids(&b).await;
    b.kill().unwrap();
    b.spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            session_ids(&b).await == before && reserved(&b, "alice").await == (256 * MIB, 1)
        })
        .await,
        "the session {before:?} and its reservation are kept: {:?} {:?}",
        session_ids(&b).await,
        reserved(&b, "alice").await
    );
    // `run` saw the session resumed, and did not stop the program for it.
    p.line_starting(
        "stderr: gpu-brokerctl run: the broker is back",
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(alive(child), "the program runs on: {}", p.history());
    assert_eq!(reserved(&b, "alice").await, (256 * MIB, 1));
    std::fs::write(&go, "").unwrap();
    let (status, out) = p.finish(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "{out}");
    assert!(out.contains("done") && !out.contains("stopping"), "{out}");
    assert_freed_within_a_second(&b, "alice").await;
}

/// A broker that keeps sessions but does not come back within `--resume-wait`: `run`
/// stops its program then, however long the reconnect attempts take.
#[tokio::test]
async fn run_stops_the_program_when_the_broker_is_not_back_within_its_resume_wait() {
    let (_keeper, mut b, token_file) = kept_broker_with_alice().await;
    let args = ["--memory", "64MiB", "--resume-wait", "1s"];
    let mut p = started_stoppable(&b, &token_file, &args).await;
    // `run` names the program's group to the broker after starting it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.kill().unwrap();
    let gone = std::time::Instant::now();
    p.line_starting(
        "stderr: gpu-brokerctl run: the broker went away",
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let (status, out) = p.finish(Duration::from_secs(15)).await.unwrap();
    assert_eq!(status.code(), Some(5), "{out}");
    assert!(out.contains("did not come back in time"), "{out}");
    assert!(
        gone.elapsed() < Duration::from_secs(8),
        "stopped {:?} after the broker went, with a 1 s wait: {out}",
        gone.elapsed()
    );
}

/// A broker that comes back without the session (restarted without its keeper) has
/// lost the reservation: `run` stops its program then.
#[tokio::test]
async fn run_stops_the_program_when_the_restarted_broker_did_not_keep_its_session() {
    let (_keeper, mut b, token_file) = kept_broker_with_alice().await;
    let p = started_stoppable(&b, &token_file, &["--memory", "64MiB"]).await;
    b.kill().unwrap();
    let keeper_at = b.args_mut().iter().position(|a| a == "--keeper").unwrap();
    b.args_mut().drain(keeper_at..keeper_at + 2);
    b.spawn().unwrap();
    let (status, out) = p.finish(Duration::from_secs(20)).await.unwrap();
    assert_eq!(status.code(), Some(5), "{out}");
    assert!(
        out.contains("stopping") && out.contains("ended the session"),
        "{out}"
    );
    assert_freed_within_a_second(&b, "alice").await;
}

/// A program under `run` that takes leases itself (here `e2e-worker`) draws them from its
/// reservation: the tenant's total stays what `run` reserved, a lease beyond it is refused
/// with RESERVATION_EXCEEDED, and everything is freed when `run` is killed.
#[tokio::test]
async fn leases_of_the_program_are_drawn_from_its_reservation() {
    let (b, token_file, _) = setup("alice", 512 * MIB).await;
    let worker = bin("e2e-worker");
    let script = format!(
        r#"export GPU_BROKER_TOKEN="$(cat "$GPU_BROKER_TOKEN_FILE")"; exec {} hold --bytes 64MiB --count 2"#,
        worker.display()
    );
    let mut p = Proc::spawn(run_cmd(&b, &token_file, &["--memory", "200MiB"], &script)).unwrap();
    p.line_starting("READY", Duration::from_secs(20))
        .await
        .unwrap();
    let t = b.admin().await.unwrap().get_quota("alice").await.unwrap();
    assert_eq!(t.usage.held_bytes, 128 * MIB, "the program's two leases");
    assert_eq!(
        t.usage.process_reserved_bytes,
        72 * MIB,
        "drawn from the reservation"
    );
    assert_eq!(t.usage.process_reservations, 1);
    // A lease beyond what is left of the reservation, though within the quota.
    let script = format!(
        r#"export GPU_BROKER_TOKEN="$(cat "$GPU_BROKER_TOKEN_FILE")"; exec {} hold --bytes 128MiB"#,
        worker.display()
    );
    let (status, out) = Proc::spawn(run_cmd(&b, &token_file, &["--memory", "100MiB"], &script))
        .unwrap()
        .finish(Duration::from_secs(20))
        .await
        .unwrap();
    assert!(!status.success(), "{out}");
    assert!(out.contains("RESOURCE_EXHAUSTED"), "{out}");
    assert!(out.contains("process reservation"), "{out}");
    p.signal(libc::SIGKILL);
    assert!(
        eventually(Duration::from_secs(1), || async {
            let t = b.admin().await.unwrap().get_quota("alice").await.unwrap();
            t.usage.held_bytes == 0 && t.usage.process_reserved_bytes == 0
        })
        .await,
        "the program's leases and the reservation end with run"
    );
}

/// While a program runs under `run`, operators see its reservation: the tenant and device
/// gauges, and the PROC_RESERVED columns of `tenants list`, `sessions` and `devices`.
#[tokio::test]
async fn a_running_reservation_shows_in_metrics_and_the_cli() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("alice", QuotaSpec::new(512 * MIB)).await.unwrap();
    let token_file = b.dir.path().join("alice.token");
    std::fs::write(&token_file, &token).unwrap();
    let addr = b.metrics_addr().await;
    let mut p = Proc::spawn(run_cmd(
        &b,
        &token_file,
        &["--memory", "300MiB"],
        "echo started; cat >/dev/null",
    ))
    .unwrap();
    p.line_starting("started", Duration::from_secs(20))
        .await
        .unwrap();
    let text = crate::observability::get(&addr, "/metrics").await;
    use crate::observability::gauge;
    assert_eq!(
        gauge(
            &text,
            "gpu_broker_tenant_process_reserved_bytes{tenant=\"alice\"}"
        ),
        Some((300 * MIB) as f64),
        "{text}"
    );
    assert_eq!(
        gauge(&text, "gpu_broker_device_process_reserved_bytes{gpu=\"0\","),
        Some((300 * MIB) as f64),
        "{text}"
    );
    for view in [
        &["tenants", "list"][..],
        &["sessions", "list"][..],
        &["devices"][..],
    ] {
        let out = b.ctl().args(view).arg("--wide").output().unwrap();
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{view:?}: {table}");
        let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
        let col = header
            .iter()
            .position(|h| *h == "PROC_RESERVED")
            .unwrap_or_else(|| panic!("{view:?}: no PROC_RESERVED in\n{table}"));
        // Values may hold a space ("300 MiB"): read the column by its start offset.
        let head = table.lines().next().unwrap();
        let start = head.find("PROC_RESERVED").unwrap();
        let row = table.lines().nth(1).unwrap();
        let end = (start + "PROC_RESERVED".len() + 2).min(row.len());
        let cell = row.get(start.saturating_sub(4)..end).unwrap_or("");
        assert!(
            cell.contains("300"),
            "{view:?} column {col}: {cell:?} in\n{table}"
        );
    }
    let (status, _) = p.finish(Duration::from_secs(10)).await.unwrap();
    assert!(status.success());
}

#[tokio::test]
async fn killing_run_stops_the_programs_whole_process_group() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--process-stop-grace".into(), "500ms".into()],
        ..BrokerOpts::default()
    })
    .expect("broker starts");
    let token = b.tenant("alice", QuotaSpec::new(512 * MIB)).await.unwrap();
    let token_file = b.dir.path().join("alice.token");
    std::fs::write(&token_file, &token).unwrap();
    // The program forks a grandchild that dies of SIGTERM and one that ignores it.
    let script = r#"sleep 300 & echo gc=$!; (trap '' TERM; exec sleep 300) & echo stubborn=$!;
        sleep 0.2; echo pid=$$; wait"#;
    let mut p = Proc::spawn(run_cmd(&b, &token_file, &["--memory", "128MiB"], script)).unwrap();
    let pid_of = |l: String, k: &str| -> u32 { l.trim_start_matches(k).trim().parse().unwrap() };
    let gc = pid_of(
        p.line_starting("gc=", Duration::from_secs(20))
            .await
            .unwrap(),
        "gc=",
    );
    let stubborn = pid_of(
        p.line_starting("stubborn=", Duration::from_secs(5))
            .await
            .unwrap(),
        "stubborn=",
    );
    let child = pid_of(
        p.line_starting("pid=", Duration::from_secs(5))
            .await
            .unwrap(),
        "pid=",
    );
    assert!(alive(child) && alive(gc) && alive(stubborn));
    assert_eq!(reserved(&b, "alice").await, (128 * MIB, 1));
    p.signal(libc::SIGKILL);
    assert!(
        eventually(Duration::from_secs(1), || async {
            reserved(&b, "alice").await == (0, 0) && !alive(child) && !alive(gc)
        })
        .await,
        "within 1 s of run's SIGKILL: program {} grandchild {} reserved {:?}",
        alive(child),
        alive(gc),
        reserved(&b, "alice").await
    );
    assert!(
        eventually(Duration::from_millis(1500), || async { !alive(stubborn) }).await,
        "the grandchild that ignores SIGTERM is killed after the grace"
    );
    let _ = p.wait(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn only_a_child_group_of_the_sessions_process_is_accepted_and_stopped_at_release() {
    use std::os::unix::process::CommandExt;
    let (b, _, token) = setup("alice", 512 * MIB).await;
    let client = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    let session = client.session("groups").await.unwrap();
    let r = gpu_broker_client::ReservationRequest::new(&session, 64 * MIB)
        .await
        .unwrap();
    let code = |e: gpu_broker_client::ClientError| e.code_name();
    assert_eq!(
        code(r.set_process_group(1).await.unwrap_err()),
        "INVALID_ARGUMENT"
    );
    // This process is the session's peer, not a child of it.
    let e = r.set_process_group(std::process::id()).await.unwrap_err();
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::ProcessGroupRefused),
        "{e}"
    );
    let me = std::process::id().to_string();
    assert_eq!(e.detail("pgid"), Some(me.as_str()), "{e}");
    assert_eq!(code(e), "PERMISSION_DENIED");
    // A child in this process's own group is not a group leader.
    let mut same = std::process::Command::new("sleep")
        .arg("300")
        .spawn()
        .unwrap();
    assert_eq!(
        code(r.set_process_group(same.id()).await.unwrap_err()),
        "PERMISSION_DENIED"
    );
    let mut leader = std::process::Command::new("sh")
        .args(["-c", "sleep 300 & wait"])
        .process_group(0)
        .spawn()
        .unwrap();
    r.set_process_group(leader.id()).await.unwrap();
    assert!(alive(leader.id()));
    r.release().await.unwrap();
    let gone = tokio::task::spawn_blocking(move || {
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < end {
            if let Ok(Some(s)) = leader.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = leader.kill();
        let _ = leader.wait();
        None
    })
    .await
    .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        gone.and_then(|s| s.signal()),
        Some(libc::SIGTERM),
        "releasing the reservation stopped its group"
    );
    assert!(alive(same.id()), "a process outside the group is untouched");
    let _ = same.kill();
    let _ = same.wait();
}

/// A process of another uid holding the same tenant token can neither reserve on a
/// session, name a group of the session's process's children for its reservation, nor
/// release it: the broker (root) would stop the session user's processes on its word.
#[tokio::test]
async fn another_uid_cannot_reserve_name_a_group_or_release_on_a_session() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // SAFETY: plain getter.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: needs root to run a child as nobody");
        return;
    }
    let (b, _, token) = setup("alice", 512 * MIB).await;
    // Let nobody reach the broker's socket (the test directory is private otherwise).
    let dir = b.socket.parent().unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(&b.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let client = gpu_broker_client::Client::connect(&b.uri(), token.clone())
        .await
        .unwrap();
    let bare = client.session("bare").await.unwrap();
    let held = client.session("held").await.unwrap();
    let r = gpu_broker_client::ReservationRequest::new(&held, 64 * MIB)
        .await
        .unwrap();
    // A root program of the session's process, leading its own group.
    let mut leader = Command::new("sh")
        .args(["-c", "sleep 300 & wait"])
        .process_group(0)
        .spawn()
        .unwrap();
    let (bare_id, pgid) = (bare.id().to_string(), leader.id().to_string());
    let args = [
        "--as-uid",
        "65534",
        "meddle",
        "--session",
        &bare_id,
        "--reservation",
        &r.info().reservation_id,
        "--pgid",
        &pgid,
    ];
    let out = Proc::spawn(worker_cmd(&b, &token, &args))
        .unwrap()
        .finish(Duration::from_secs(30))
        .await
        .unwrap()
        .1;
    for call in ["RESERVE", "GROUP", "RELEASE"] {
        let refused = format!("{call} PERMISSION_DENIED SESSION_OF_ANOTHER_USER");
        assert!(out.contains(&refused), "{call}: {out}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(alive(leader.id()), "the session user's program still runs");
    assert_eq!(reserved(&b, "alice").await, (64 * MIB, 1));
    // The session's own user still names its group and releases.
    r.set_process_group(leader.id()).await.unwrap();
    r.release().await.unwrap();
    assert_eq!(reserved(&b, "alice").await, (0, 0));
    let _ = leader.kill();
    let _ = leader.wait();
}

/// State letter of a process (`R`, `S`, `T`, `Z`, ...), `None` when gone.
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// A new pseudo-terminal: (master, path of the slave).
fn open_pty() -> (std::fs::File, String) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain libc calls; the master descriptor is owned by the File.
    unsafe {
        let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
        assert!(m >= 0, "posix_openpt: {}", std::io::Error::last_os_error());
        assert_eq!(libc::grantpt(m), 0);
        assert_eq!(libc::unlockpt(m), 0);
        let mut buf = [0 as libc::c_char; 128];
        assert_eq!(libc::ptsname_r(m, buf.as_mut_ptr(), buf.len()), 0);
        let path = std::ffi::CStr::from_ptr(buf.as_ptr())
            .to_string_lossy()
            .into_owned();
        let flags = libc::fcntl(m, libc::F_GETFL);
        libc::fcntl(m, libc::F_SETFL, flags | libc::O_NONBLOCK);
        (std::fs::File::from_raw_fd(m), path)
    }
}

#[tokio::test]
async fn on_a_terminal_ctrl_z_stops_run_with_its_program_and_continuing_run_continues_both() {
    use std::io::{Read, Write};
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let (b, token_file, _) = setup("alice", 512 * MIB).await;
    let (mut master, slave_path) = open_pty();
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&slave_path)
        .unwrap();
    // The program is one process (the shell execs `sleep`): a shell that forks in a loop can
    // be stopped between its vfork and the child's exec, and then sits in 'D' until the
    // child runs again, so it never shows as stopped.
    let script = "echo pid=$$; exec sleep 600";
    let mut cmd = run_cmd(&b, &token_file, &["--memory", "64MiB"], script);
    cmd.stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave);
    // `run` leads a session whose controlling terminal is the pty (as a shell's job).
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut run = cmd.spawn().unwrap();
    let run_pid = run.id();
    let mut seen = String::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let program: u32 = loop {
        let mut buf = [0u8; 4096];
        if let Ok(n) = master.read(&mut buf) {
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        if let Some(p) = seen
            .lines()
            .find_map(|l| l.trim().strip_prefix("pid=").map(str::to_string))
            .and_then(|p| p.parse().ok())
        {
            break p;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no pid line: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let stopped = |pid: u32| state(pid) == Some('T');
    // Ctrl-Z stops the program (the terminal's foreground group) and then run.
    master.write_all(b"\x1a").unwrap();
    assert!(
        eventually(Duration::from_secs(3), || async {
            stopped(program) && stopped(run_pid)
        })
        .await,
        "program {:?}, run {:?}",
        state(program),
        state(run_pid)
    );
    // Continuing run (what a shell's `fg` does) continues the program too.
    // SAFETY: plain syscall on our child.
    unsafe { libc::kill(run_pid as libc::pid_t, libc::SIGCONT) };
    assert!(
        eventually(Duration::from_secs(3), || async {
            !stopped(program) && !stopped(run_pid) && alive(program)
        })
        .await,
        "program {:?}, run {:?}",
        state(program),
        state(run_pid)
    );
    // Ctrl-C reaches the program in the foreground again; run dies of its signal.
    master.write_all(b"\x03").unwrap();
    let status = tokio::task::spawn_blocking(move || {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = run.try_wait().unwrap() {
                return Some(s);
            }
            if std::time::Instant::now() > end {
                let _ = run.kill();
                let _ = run.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
    assert_eq!(status.and_then(|s| s.signal()), Some(libc::SIGINT));
    assert!(
        eventually(Duration::from_secs(1), || async {
            reserved(&b, "alice").await == (0, 0) && !alive(program)
        })
        .await
    );
}
