//! The `gpu-brokerctl` binary against the client crate's fake broker: what it prints,
//! its JSON, its one-line errors and exit codes.

#[path = "../../tests/fake/mod.rs"]
mod fake;

use fake::{start, ADMIN_TOKEN};

fn ctl(uri: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_gpu-brokerctl"))
        .args(["--broker", uri, "--token", ADMIN_TOKEN])
        .args(args)
        .env_remove("GPU_BROKER_ADDR")
        .env_remove("GPU_BROKER_ADMIN_TOKEN")
        .env_remove("GPU_BROKER_ADMIN_TOKEN_FILE")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_against_the_fake() {
    let h = start(0).await;
    let run = |args: &'static [&'static str]| {
        let uri = h.uri.clone();
        tokio::task::spawn_blocking(move || ctl(&uri, args))
    };
    let out = run(&[
        "quota",
        "set",
        "a",
        "--limit",
        "8GiB",
        "--guaranteed",
        "512MiB",
        "--priority",
        "-1",
    ])
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("TENANT"), "{text}");
    assert!(
        text.contains("8.0 GiB") && text.contains("512.0 MiB"),
        "{text}"
    );

    let out = run(&["tokens", "issue", "a", "--description", "ci"])
        .await
        .unwrap();
    assert!(out.status.success());
    let token = String::from_utf8(out.stdout).unwrap();
    assert!(
        token.starts_with("secret-") && token.ends_with('\n') && token.lines().count() == 1,
        "{token:?}"
    );

    let out = run(&["--json", "tenants", "list"]).await.unwrap();
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json[0]["name"], "a");
    assert_eq!(json[0]["quota"]["limit_bytes"], 8u64 << 30);
    assert_eq!(json[0]["quota"]["priority"], -1);

    for args in [
        &["devices"][..],
        &["leases", "list"],
        &["sessions", "list", "--tenant", "a"],
        &["tokens", "list"],
    ] {
        let out = run(args).await.unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let out = run(&["quota", "get", "nobody"]).await.unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.starts_with("error: NOT_FOUND: "), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn cli_reports_unreachable_broker() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-brokerctl"))
        .args([
            "--broker",
            "unix:///nonexistent/gpu-broker.sock",
            "--token",
            "x",
            "devices",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.starts_with("error: ") && err.contains("/nonexistent/gpu-broker.sock"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}
