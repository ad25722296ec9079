//! The README's operator quick start and its `run` block run verbatim against the README's
//! own demo broker: the test starts the broker the README's "run a broker by hand" block
//! starts (its `/tmp/gpu-broker` directory moved to a private temporary one), then runs the
//! operator block with bash, `gpu-brokerctl` on `PATH`, checks what it left behind, and
//! runs the `run` block with the token it wrote. (The Python block: client/python/tests.)

use gpu_broker_client::Client;
use gpu_broker_tests::*;
use std::time::Duration;

const README: &str = include_str!("../../README.md");

/// The first ```sh block after the line containing `marker`.
fn block_after(marker: &str) -> String {
    let start = README
        .find(marker)
        .unwrap_or_else(|| panic!("README has no {marker:?}"));
    let rest = &README[start..];
    let open = rest.find("```sh\n").expect("a sh block after the marker") + 6;
    let close = rest[open..].find("```").expect("the block ends") + open;
    rest[open..close].to_string()
}

/// The demo broker's flags: the words after `--` of the README's `cargo run` command.
fn demo_broker_args(dir: &str) -> Vec<String> {
    let block = block_after("<!-- demo-broker:").replace("\\\n", " ");
    let words: Vec<&str> = block.split_whitespace().collect();
    assert_eq!(
        &words[..4],
        ["cargo", "run", "-p", "gpu-broker"],
        "the README starts the broker with cargo run: {block}"
    );
    let dash = words
        .iter()
        .position(|w| *w == "--")
        .expect("-- before the flags");
    words[dash + 1..]
        .iter()
        .map(|w| w.replace("/tmp/gpu-broker", dir))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_operator_quick_start_runs_against_the_readme_broker() {
    let tmp = tempfile::Builder::new()
        .prefix("gpb-readme-")
        .tempdir()
        .unwrap();
    // The README's paths, moved under the test broker's private directory.
    let b = Broker::start_raw(|dir| {
        let args = demo_broker_args(&dir.display().to_string());
        assert!(
            args.windows(2).any(|w| w == ["--host-capacity", "8GiB"]),
            "the README's broker is the 8 GiB one its text describes: {args:?}"
        );
        args
    })
    .unwrap();
    let dir = b.dir.path().display().to_string();

    let script = block_after("<!-- operator-quick-start:").replace("/tmp/gpu-broker", &dir);
    let path = format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg("-euo")
        .arg("pipefail")
        .arg("-c")
        .arg(&script)
        .current_dir(tmp.path())
        .env("PATH", &path)
        .env_remove("GPU_BROKER_ADMIN_TOKEN")
        .env_remove("GPU_BROKER_ADDR")
        .env_remove("GPU_BROKER_ADMIN_TOKEN_FILE")
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the quick start finished")
        .expect("bash ran");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the README's operator block failed:\n{script}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    assert!(
        stdout.contains("training") && stdout.contains("inference"),
        "{stdout}"
    );

    // What it left: a private token file that works, and the patched quota.
    use std::os::unix::fs::PermissionsExt;
    assert!(
        !tmp.path().join("training.token").exists(),
        "the token is written under the broker's directory, not where the block runs"
    );
    let token_file = b.dir.path().join("training.token");
    let mode = std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the token file is private");
    let token = std::fs::read_to_string(&token_file).unwrap();
    assert!(!token.trim().is_empty());
    let usage = Client::connect(&b.uri(), token.trim().to_string())
        .await
        .unwrap()
        .usage()
        .await
        .unwrap();
    assert_eq!(
        usage.quota.limit_bytes,
        6 * GIB,
        "the second quota set changed the limit"
    );
    assert_eq!(
        usage.quota.guaranteed_bytes,
        2 * GIB,
        "and left the guarantee"
    );
    assert_eq!(usage.quota.max_leases, 32);
    assert_eq!(usage.quota.priority, 1);

    // The `run` block, with the token the operator block wrote: the program runs under a
    // reservation of the tenant and sees its id.
    let script = block_after("<!-- run-quick-start:").replace("/tmp/gpu-broker", &dir);
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("bash")
            .args(["-euo", "pipefail", "-c", &script])
            .current_dir(tmp.path())
            .env("PATH", &path)
            .env_remove("GPU_BROKER_TOKEN")
            .env_remove("GPU_BROKER_TOKEN_FILE")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the run block finished")
    .expect("bash ran");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the README's run block failed:\n{script}\n--- stdout\n{stdout}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = stdout
        .trim()
        .strip_prefix("reserved ")
        .unwrap_or_else(|| panic!("the program printed its reservation: {stdout}"));
    assert!(!id.is_empty(), "{stdout}");
}
