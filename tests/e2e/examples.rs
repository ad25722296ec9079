//! The examples as users run them: `writer` and `reader` as processes against a real
//! broker, and `operator.sh` driving `gpu-brokerctl`.

use gpu_broker_client::QuotaSpec;
use gpu_broker_tests::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn example(b: &Broker, name: &str, token: &str, args: &[&str]) -> Command {
    let mut c = Command::new(bin(name));
    c.args(args)
        .env("GPU_BROKER_ADDR", b.uri())
        .env("GPU_BROKER_TOKEN", token);
    c
}

/// `key=value` from a line of `writer` output.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_and_reader_share_a_lease() {
    let b = Broker::start().unwrap();
    let token = b.tenant("demo", QuotaSpec::new(GIB)).await.unwrap();
    let other = b.tenant("other", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();

    let mut writer = Proc::spawn(example(
        &b,
        "writer",
        &token,
        &[
            "--bytes",
            "6MiB",
            "--pattern",
            "0x5A",
            "--name",
            "demo-writer",
        ],
    ))
    .unwrap();
    let line = writer.line_starting("lease_id=", T).await.unwrap();
    let id = field(&line, "lease_id");
    assert!(field(&line, "block").starts_with("fd:"), "{line}");
    assert_eq!(field(&line, "bytes"), (6 * MIB).to_string());
    let sessions = admin.list_sessions(Some("demo")).await.unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(
        (sessions[0].name.as_str(), sessions[0].peer_pid),
        ("demo-writer", writer.pid)
    );

    // By lease id, with the tenant's token (a ticket of the reader's own).
    let (status, out) = Proc::spawn(example(&b, "reader", &token, &["--lease", id]))
        .unwrap()
        .finish(T)
        .await
        .unwrap();
    assert!(status.success(), "{out}");
    assert!(out.contains("all bytes 0x5a"), "{out}");
    assert!(out.contains(&format!("({} bytes)", 6 * MIB)), "{out}");
    assert!(out.contains("fnv1a64 "), "{out}");
    // Another tenant cannot find it.
    let (status, out) = Proc::spawn(example(&b, "reader", &other, &["--lease", id]))
        .unwrap()
        .finish(T)
        .await
        .unwrap();
    assert!(!status.success(), "{out}");
    assert!(out.contains("not found"), "{out}");

    // Ctrl-C: the writer releases and exits 0.
    writer.signal(libc::SIGINT);
    writer.line_starting("released", T).await.unwrap();
    let status = writer.wait(T).await.unwrap();
    assert!(status.success(), "{status}");
    let t = admin.get_quota("demo").await.unwrap();
    assert_eq!((t.usage.held_bytes, t.usage.quarantined_bytes), (0, 0));
    assert_eq!(admin.get_devices().await.unwrap()[0].cached_bytes, 6 * MIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_exits_when_its_lease_is_revoked() {
    let b = Broker::start().unwrap();
    let token = b.tenant("demo", QuotaSpec::new(GIB)).await.unwrap();
    let mut writer = Proc::spawn(example(&b, "writer", &token, &["--bytes", "2MiB"])).unwrap();
    let line = writer.line_starting("lease_id=", T).await.unwrap();
    let id = field(&line, "lease_id").to_string();
    b.admin()
        .await
        .unwrap()
        .revoke_lease(&id, "demo")
        .await
        .unwrap();
    let (status, out) = writer.finish(T).await.unwrap();
    assert!(status.success(), "{out}");
    assert!(out.contains("lease revoked: demo"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_script_runs_against_a_real_broker() {
    // The script's quotas are for a real node: give the simulated device room for them.
    let b = Broker::start_with(BrokerOpts {
        capacity: "64GiB",
        ..Default::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    admin
        .set_quota("training", QuotaSpec::new(GIB))
        .await
        .unwrap();
    let worker_token = admin.issue_token("training", "worker").await.unwrap().token;
    let mut w = hold(&b, &worker_token, &["--bytes", "4MiB"]).await.unwrap();
    let lease_id = w.leases[0].id.clone();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/operator.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .arg(&lease_id)
        .env("GPU_BROKER_ADDR", b.uri())
        .env(
            "GPU_BROKER_ADMIN_TOKEN_FILE",
            b.state_dir.join("admin.token"),
        )
        .env("GPU_BROKERCTL", bin("gpu-brokerctl"));
    let (status, out) = Proc::spawn(cmd)
        .unwrap()
        .finish(Duration::from_secs(60))
        .await
        .unwrap();
    assert!(status.success(), "{out}");
    for expected in [
        "TENANT",
        "training",
        "inference",
        "DEVICE",
        "host-sim-0",
        &lease_id,
    ] {
        assert!(out.contains(expected), "{expected:?} missing from:\n{out}");
    }
    // The script revoked the worker's lease and its own token, and deleted `batch`.
    w.proc
        .line_starting(&format!("EVENT revoked {lease_id}"), T)
        .await
        .unwrap();
    let tenants = tenant_names(&admin).await;
    assert_eq!(tenants, ["inference", "training"]);
    let training = admin.get_quota("training").await.unwrap();
    assert_eq!(training.quota.limit_bytes, 48 * GIB);
    assert_eq!(training.quota.guaranteed_bytes, 8 * GIB);
    assert_eq!(training.token_count, 1, "only the worker's token is left");
}

/// `turn-gate` as `examples/turn_step_worker.py` drives it: `a` waits for the turn and
/// answers `g`, `r` gives it back; a second gate waiting on the same device gets the turn
/// when the first gives it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_gate_takes_and_hands_over_turns_on_stdin() {
    // A quantum longer than the test: the first turn is not taken away meanwhile.
    let b = Broker::start_with(BrokerOpts {
        extra: vec!["--turn-quantum".into(), "30s".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let t1 = b.tenant("one", QuotaSpec::new(GIB)).await.unwrap();
    let t2 = b.tenant("two", QuotaSpec::new(GIB)).await.unwrap();
    let gate = |token: &str| Proc::spawn(example(&b, "turn-gate", token, &[])).unwrap();
    let mut g1 = gate(&t1);
    let mut g2 = gate(&t2);
    g1.send("a").await.unwrap();
    assert_eq!(g1.line_starting("g", T).await.unwrap(), "g");
    g2.send("a").await.unwrap();
    assert!(
        g2.line_starting("g", Duration::from_millis(300))
            .await
            .is_err(),
        "the second waits while the first holds the turn"
    );
    g1.send("r").await.unwrap();
    assert!(g1.line_starting("r ", T).await.is_ok());
    assert_eq!(g2.line_starting("g", T).await.unwrap(), "g");
    g1.send("x").await.unwrap();
    assert!(g1.line_starting("e unknown command", T).await.is_ok());
    g1.send("r").await.unwrap();
    assert!(g1.line_starting("e no turn held", T).await.is_ok());
}
