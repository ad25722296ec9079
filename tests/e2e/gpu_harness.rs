//! The GPU harness (`scripts/gpu-all.sh`) cannot rot unseen: its dry run builds nothing and
//! needs no GPU, yet runs every part's script as on the GPU machine (the real broker on the
//! host backend, started with the part's flags, the CLI calls, the tenants, the steps'
//! order and the verdicts) and checks each GPU step instead of running it (its program is
//! in the folder, a Python script parses).

use gpu_broker_tests::{bin, bin_dir};
use std::path::PathBuf;
use std::process::{Command, Output};

fn dry_run(parts: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    // The binaries the harness's folder is made of (built by the workspace's build).
    for b in [
        "gpu-broker",
        "gpu-brokerctl",
        "gpu-worker",
        "gpu-broker-bench",
        "turn-gate",
    ] {
        bin(b);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("scripts/gpu-all.sh"))
        .arg("dry-run")
        .args(parts)
        .env("GPU_ALL_BIN", bin_dir())
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

#[test]
fn every_part_of_the_gpu_harness_runs_its_logic_without_a_gpu() {
    let (out, text) = dry_run(&[], &[]);
    assert!(out.status.success(), "{text}");
    for part in [
        "fd", "fd-ab", "check", "forge", "shared", "sleep", "python", "serving", "mps", "health",
        "restart", "probe", "host",
    ] {
        assert!(
            text.contains(&format!("################ {part} ################")),
            "part {part} did not run:\n{text}"
        );
    }
    assert!(text.contains("parts failed: none"), "{text}");
    assert!(!text.contains("STEP FAILED"), "{text}");
    // The brokers really served the CLI (a device listing per part) and the steps were
    // checked (the fd part's six, the sleep part's three, ...).
    assert!(text.matches("host-sim-0").count() >= 8, "{text}");
    assert!(text.matches("dry-run: ").count() >= 30, "{text}");
    // The removed legacy flag is still refused at start.
    assert!(text.contains("--legacy-ipc-handles: error:"), "{text}");
}

#[test]
fn a_failed_step_fails_its_part_and_the_run() {
    let (out, text) = dry_run(&["shared,health"], &[("GPU_DRY_FAIL", "shared-check")]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("STEP FAILED: shared-check"), "{text}");
    assert!(text.contains("parts failed: shared ("), "{text}");
    // The other part still ran, and passed.
    assert!(
        text.contains("=== health check: every step passed ==="),
        "{text}"
    );
}

#[test]
fn an_unknown_part_is_refused_before_any_runs() {
    let (out, text) = dry_run(&["fd,bogus"], &[]);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("unknown part bogus"), "{text}");
    assert!(!text.contains("################ fd"), "{text}");
}
