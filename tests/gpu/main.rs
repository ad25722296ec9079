//! End-to-end tests on a real GPU (`--backend cuda`). Where no CUDA driver or GPU is
//! present (CI), each test prints why it is skipped and passes; `scripts/gpu-fd-check.sh`
//! runs them for real on the GPU machine.

use gpu_broker_client::{AdminClient, QuotaSpec};
use gpu_broker_tests::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

fn gpu_or_skip(test: &str) -> bool {
    if gpu_broker_client::cuda::is_available() {
        true
    } else {
        eprintln!("skipped {test}: no CUDA driver or GPU on this machine");
        false
    }
}

struct Worker {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Worker {
    fn spawn(b: &Broker, token: &str, args: &[&str]) -> Worker {
        let mut child = Command::new(bin("gpu-worker"))
            .args(["--broker", &b.uri(), "--token", token])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn gpu-worker");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        Worker { child, out }
    }

    /// Next stdout line, split in words.
    fn line(&mut self) -> Vec<String> {
        let mut s = String::new();
        self.out.read_line(&mut s).expect("read worker output");
        assert!(!s.is_empty(), "worker ended without output");
        s.split_whitespace().map(str::to_string).collect()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn finish(mut self) -> std::process::ExitStatus {
        self.child.wait().expect("wait worker")
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

fn run(b: &Broker, token: &str, args: &[&str]) -> Vec<String> {
    let mut w = Worker::spawn(b, token, args);
    let l = w.line();
    assert!(w.finish().success(), "gpu-worker {args:?} failed");
    l
}

async fn setup(extra: &[&str]) -> (Broker, AdminClient, String) {
    let b =
        Broker::start_cuda(extra.iter().map(|s| s.to_string()).collect()).expect("start broker");
    let admin = b.admin().await.unwrap();
    admin
        .set_quota("a", QuotaSpec::new(64 * GIB))
        .await
        .unwrap();
    let token = admin.issue_token("a", "gpu").await.unwrap().token;
    (b, admin, token)
}

#[tokio::test]
async fn two_processes_exchange_data_through_a_lease() {
    if !gpu_or_skip("two_processes_exchange_data_through_a_lease") {
        return;
    }
    let (b, _admin, token) = setup(&[]).await;
    let mut holder = Worker::spawn(
        &b,
        &token,
        &["hold", "--bytes", "67108864", "--pattern", "ab"],
    );
    let ready = holder.line();
    assert_eq!(ready[0], "READY", "{ready:?}");
    let (lease, device, bytes, handle) = (&ready[1], &ready[2], &ready[3], &ready[4]);
    assert!(
        handle.starts_with("fd:"),
        "default leases are fd leases: {ready:?}"
    );
    let ok = run(
        &b,
        &token,
        &[
            "open", "--handle", handle, "--lease", lease, "--device", device, "--bytes", bytes,
            "--expect", "ab", "--write", "cd",
        ],
    );
    assert_eq!(ok, vec!["OK"]);
    // The holder sees the other process's write.
    assert_eq!(holder.line(), vec!["CHANGED", "0xcd"]);
}

/// Tenant a fills a block and releases it; tenant b's lease of that size is zero, and a
/// fresh memory object (a's process may still map the old one).
#[tokio::test]
async fn another_tenant_reads_only_zeros_from_fresh_memory() {
    if !gpu_or_skip("another_tenant_reads_only_zeros_from_fresh_memory") {
        return;
    }
    let (b, admin, token_a) = setup(&[]).await;
    admin
        .set_quota("b", QuotaSpec::new(64 * GIB))
        .await
        .unwrap();
    let token_b = admin.issue_token("b", "gpu").await.unwrap().token;
    let done = run(
        &b,
        &token_a,
        &["fill-release", "--bytes", "134217728", "--pattern", "ee"],
    );
    assert_eq!(done[0], "DONE");
    assert!(done[1].starts_with("fd:"), "{done:?}");
    let devices = admin.get_devices().await.unwrap();
    assert_eq!(
        devices[0].cached_bytes,
        128 << 20,
        "block went back to the pool"
    );
    let read = run(&b, &token_b, &["read-zeros", "--bytes", "134217728"]);
    assert_eq!(read[0], "READ");
    assert_ne!(read[1], done[1], "another tenant gets a fresh object");
    assert_eq!(read[2], "0", "nonzero bytes seen by the next tenant");
}

/// A worker whose session ends while it still maps its lease keeps the memory: the block is
/// quarantined (counted to the device and the tenant, given to nobody) until the process
/// exits, then comes back to the pool.
#[tokio::test]
async fn a_still_mapped_block_is_quarantined_until_its_holder_exits() {
    if !gpu_or_skip("a_still_mapped_block_is_quarantined_until_its_holder_exits") {
        return;
    }
    let (b, admin, token) = setup(&[]).await;
    let mut w = Worker::spawn(
        &b,
        &token,
        &["abandon", "--bytes", "67108864", "--pattern", "3c"],
    );
    let l = w.line();
    assert_eq!(l[0], "ABANDONED", "{l:?}");
    assert_eq!(
        w.line(),
        vec!["STILL", "0"],
        "the mapping outlives the session"
    );
    let quarantined = eventually(Duration::from_secs(5), || async {
        let d = &admin.get_devices().await.unwrap()[0];
        d.leased_bytes == 0 && d.quarantined_bytes == 64 << 20
    })
    .await;
    let d = &admin.get_devices().await.unwrap()[0];
    assert!(quarantined, "not quarantined: {d:?}");
    assert_eq!(d.cached_bytes, 0, "a mapped block is not in the pool");
    let usage = admin.get_quota("a").await.unwrap().usage;
    assert_eq!(
        (usage.quarantined_bytes, usage.lease_count),
        (64 << 20, 0),
        "charged to its tenant as quarantine: {usage:?}"
    );
    w.kill();
    let back = eventually(Duration::from_secs(10), || async {
        let d = &admin.get_devices().await.unwrap()[0];
        d.quarantined_bytes == 0 && d.cached_bytes == 64 << 20
    })
    .await;
    let d = &admin.get_devices().await.unwrap()[0];
    assert!(
        back,
        "the holder exited but the block did not come back: {d:?}"
    );
    let usage = admin.get_quota("a").await.unwrap().usage;
    assert_eq!(usage.quarantined_bytes, 0, "{usage:?}");
}

/// A worker that releases its lease but keeps its import (CUDA VMM memory cannot be
/// revoked) keeps the memory after the broker frees the block for another tenant: the
/// driver's free memory does not rise, and the bytes stay charged to the worker's tenant
/// (not to "outside the broker") until it exits. A worker that unmapped before its
/// release is charged nothing when its block goes.
#[tokio::test]
async fn memory_kept_after_release_stays_charged_until_its_holder_exits() {
    if !gpu_or_skip("memory_kept_after_release_stays_charged_until_its_holder_exits") {
        return;
    }
    const BYTES: u64 = 256 << 20;
    let bytes = BYTES.to_string();
    let (b, admin, token_a) = setup(&[]).await;
    admin
        .set_quota("b", QuotaSpec::new(64 * GIB))
        .await
        .unwrap();
    let token_b = admin.issue_token("b", "gpu").await.unwrap().token;
    let charged_to_a = || async { admin.get_quota("a").await.unwrap().usage.quarantined_bytes };
    // b asks for the same size: a's cached block is freed, b gets fresh memory.
    let evict_for_b = || {
        let read = run(&b, &token_b, &["read-zeros", "--bytes", &bytes]);
        assert_eq!(read[0], "READ", "{read:?}");
    };
    let cached = || async { admin.get_devices().await.unwrap()[0].cached_bytes };

    // The control: unmapped before the release, alive when its block is freed.
    let mut clean = Worker::spawn(
        &b,
        &token_a,
        &["release-and-stay", "--bytes", &bytes, "--pattern", "5a"],
    );
    assert_eq!(clean.line()[0], "RELEASED");
    assert_eq!(cached().await, BYTES, "the released block is cached");
    evict_for_b();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        charged_to_a().await,
        0,
        "memory that came back is charged to nobody"
    );
    clean.kill();

    // Kept past the release.
    let mut keeper = Worker::spawn(
        &b,
        &token_a,
        &[
            "release-and-stay",
            "--bytes",
            &bytes,
            "--pattern",
            "a5",
            "--keep",
        ],
    );
    assert_eq!(keeper.line()[0], "RELEASED");
    assert_eq!(
        keeper.line(),
        vec!["STILL", "0"],
        "the import outlives the release"
    );
    assert_eq!(cached().await, BYTES);
    // Let the leasable refresh settle with the worker's context in place.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let before = admin.get_devices().await.unwrap()[0].clone();
    evict_for_b();
    let held = eventually(Duration::from_secs(5), || async {
        charged_to_a().await == BYTES
    })
    .await;
    assert!(
        held,
        "the kept memory is charged to a: {}",
        charged_to_a().await
    );
    let listed = admin.list_quarantined().await.unwrap();
    assert!(
        listed
            .iter()
            .any(|q| q.reason == gpu_broker_client::HoldReason::KeptAfterFree
                && q.bytes == BYTES
                && q.holder_pids == vec![keeper.child.id()]),
        "listed as kept after its free by the worker: {listed:?}"
    );
    // Counted once: as a's, not also as memory used outside the broker (the leasable
    // refresh runs every second).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let after = admin.get_devices().await.unwrap()[0].clone();
    assert_eq!(after.quarantined_bytes, BYTES, "{after:?}");
    assert!(
        after.external_used_bytes < before.external_used_bytes + (64 << 20),
        "counted as outside too: before {before:?}, after {after:?}"
    );
    assert!(
        after.leasable_bytes + (64 << 20) > before.leasable_bytes,
        "leasable shrank by the kept memory: before {before:?}, after {after:?}"
    );
    keeper.kill();
    let gone = eventually(Duration::from_secs(10), || async {
        charged_to_a().await == 0
    })
    .await;
    assert!(
        gone,
        "let go once the holder exited: {}",
        charged_to_a().await
    );
    assert_eq!(admin.get_devices().await.unwrap()[0].quarantined_bytes, 0);
}

fn card_free(device: u32) -> u64 {
    // nvidia-smi reports MiB; the driver's own view is what matters for OOM.
    let out = Command::new("nvidia-smi")
        .args([
            "--query-gpu=memory.free",
            "--format=csv,noheader,nounits",
            "-i",
            &device.to_string(),
        ])
        .output()
        .expect("nvidia-smi");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse::<u64>()
        .expect("MiB")
        << 20
}

#[tokio::test]
async fn killed_worker_gives_its_memory_back() {
    if !gpu_or_skip("killed_worker_gives_its_memory_back") {
        return;
    }
    let (b, admin, token) = setup(&[]).await;
    let before = card_free(0);
    let mut w = Worker::spawn(
        &b,
        &token,
        &["hold", "--bytes", "4294967296", "--pattern", "11"],
    );
    assert_eq!(w.line()[0], "READY");
    let during = card_free(0);
    assert!(
        before - during >= 4 << 30,
        "4 GiB lease not visible on the card"
    );
    w.kill();
    let back = eventually(Duration::from_secs(5), || async {
        let d = &admin.get_devices().await.unwrap()[0];
        d.leased_bytes == 0 && d.quarantined_bytes == 0
    })
    .await;
    assert!(back, "broker did not get the memory back");
    let d = &admin.get_devices().await.unwrap()[0];
    assert_eq!(d.cached_bytes, 4 << 30, "block is back in the pool");
    // The worker's own context memory is gone too: everything not in the pool is free again.
    let settled = eventually(Duration::from_secs(5), || async {
        card_free(0) + d.cached_bytes + (64 << 20) >= before
    })
    .await;
    assert!(
        settled,
        "card free {} + cached {} < before {before}",
        card_free(0),
        d.cached_bytes
    );
}

#[tokio::test]
async fn more_than_the_card_is_refused_and_95_percent_is_leasable() {
    if !gpu_or_skip("more_than_the_card_is_refused_and_95_percent_is_leasable") {
        return;
    }
    let (b, admin, token) = setup(&[]).await;
    admin.set_quota("a", QuotaSpec::new(1 << 50)).await.unwrap();
    let client = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    let s = client.session("fill").await.unwrap();
    let devices = admin.get_devices().await.unwrap();
    let biggest = devices.iter().map(|d| d.total_bytes).max().unwrap_or(0);
    let err = s.lease(biggest + (2 << 20)).await.expect_err("refused");
    assert_eq!(
        err.code(),
        gpu_broker_client::Code::ResourceExhausted,
        "{err}"
    );
    // Fill with leases of 2 MiB .. 1 GiB until refused.
    let mut held = Vec::new();
    let mut size: u64 = 1 << 30;
    let mut total = 0u64;
    let mut k = 0u64;
    loop {
        match s.lease(size).await {
            Ok(l) => {
                total += l.bytes();
                held.push(l);
                k += 1;
                // Mix sizes: 1 GiB, 256 MiB, 64 MiB, 2 MiB.
                size = [1u64 << 30, 256 << 20, 64 << 20, 2 << 20][(k % 4) as usize];
            }
            Err(e) => {
                assert_eq!(e.code(), gpu_broker_client::Code::ResourceExhausted, "{e}");
                if size == 2 << 20 {
                    break;
                }
                size = 2 << 20;
            }
        }
    }
    let leasable: u64 = devices
        .iter()
        .map(|d| d.total_bytes - d.headroom_bytes)
        .sum();
    eprintln!(
        "leased {total} of total-headroom {leasable} ({:.2}%) in {} leases on {} GPU(s)",
        100.0 * total as f64 / leasable as f64,
        held.len(),
        devices.len()
    );
    assert!(
        total as f64 >= 0.95 * leasable as f64,
        "only {total} of {leasable}"
    );
    assert!(
        !b.log_text().contains("OUT_OF_MEMORY"),
        "a CUDA OOM happened"
    );
}

#[tokio::test]
async fn every_gpu_of_the_node_is_used() {
    if !gpu_or_skip("every_gpu_of_the_node_is_used") {
        return;
    }
    let (b, admin, token) = setup(&[]).await;
    let devices = admin.get_devices().await.unwrap();
    eprintln!(
        "{} GPU(s): {:?}",
        devices.len(),
        devices.iter().map(|d| &d.name).collect::<Vec<_>>()
    );
    let client = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    let s = client.session("spread").await.unwrap();
    let mut seen = std::collections::BTreeSet::new();
    let mut held = Vec::new();
    for d in 0..devices.len() as u32 {
        let l = s.lease_request(1 << 30).device(d).send().await.unwrap();
        assert_eq!(l.device(), d);
        held.push(l);
    }
    for _ in 0..devices.len() * 2 {
        let l = s.lease(1 << 30).await.unwrap();
        seen.insert(l.device());
        held.push(l);
    }
    assert_eq!(
        seen.len(),
        devices.len(),
        "unpinned leases should spread over all GPUs"
    );
}

#[tokio::test]
async fn worker_allocating_behind_the_brokers_back_is_reported() {
    if !gpu_or_skip("worker_allocating_behind_the_brokers_back_is_reported") {
        return;
    }
    let (b, admin, token) = setup(&["--own-alloc-allowance", "1GiB"]).await;
    let mut w = Worker::spawn(
        &b,
        &token,
        &["hog", "--bytes", "1073741824", "--own", "4294967296"],
    );
    assert_eq!(w.line()[0], "READY");
    let mut sessions = Vec::new();
    let mut seen = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        sessions = admin.list_sessions(None).await.unwrap();
        if sessions.iter().any(|s| s.over_allowance) {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "NVML view: {:?}",
        sessions
            .iter()
            .map(|s| (
                s.peer_pid,
                s.held_bytes,
                s.gpu_used_bytes,
                s.own_alloc_bytes,
                s.over_allowance
            ))
            .collect::<Vec<_>>()
    );
    if sessions.iter().all(|s| s.gpu_used_bytes == 0) {
        eprintln!("skipped the check: NVML reports no per-process memory on this machine");
        return;
    }
    assert!(
        seen,
        "a worker with 4 GiB of its own allocations was not reported"
    );
    let s = sessions.iter().find(|s| s.over_allowance).unwrap();
    assert!(
        s.own_alloc_bytes >= 4 << 30,
        "own {} < 4 GiB",
        s.own_alloc_bytes
    );
}

#[tokio::test]
async fn host_fallback_lease_is_registered_for_zero_copy_gpu_access() {
    if !gpu_or_skip("host_fallback_lease_is_registered_for_zero_copy_gpu_access") {
        return;
    }
    let (b, admin, _) = setup(&[]).await;
    // Device quota too small for the request: it falls back to host memory.
    let q = QuotaSpec {
        limit_bytes: 2 << 20,
        host_limit_bytes: 1 << 30,
        ..QuotaSpec::default()
    };
    admin.set_quota("h", q).await.unwrap();
    let token = admin.issue_token("h", "gpu").await.unwrap().token;
    let out = run(&b, &token, &["host-fallback", "--bytes", "67108864"]);
    assert_eq!(
        out,
        vec!["HOSTREG", "Host", "0"],
        "the GPU's writes must land in the host lease"
    );
}

#[tokio::test]
async fn memory_taken_outside_the_broker_shrinks_what_it_leases() {
    if !gpu_or_skip("memory_taken_outside_the_broker_shrinks_what_it_leases") {
        return;
    }
    let (b, admin, token) = setup(&[]).await;
    // Let the broker's first refresh (1 s) settle what "outside" means at this moment.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = admin.get_devices().await.unwrap()[0].clone();
    let mut w = Worker::spawn(&b, &token, &["outside", "--own", "21474836480"]);
    assert_eq!(w.line(), vec!["READY"]);
    let mut during = before.clone();
    let mut shrunk = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        during = admin.get_devices().await.unwrap()[0].clone();
        if during.leasable_bytes + (20u64 << 30) <= before.leasable_bytes + (1 << 30) {
            shrunk = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "leasable {} -> {}, external {} -> {}",
        before.leasable_bytes,
        during.leasable_bytes,
        before.external_used_bytes,
        during.external_used_bytes
    );
    assert!(
        shrunk,
        "leasable did not shrink by the 20 GiB another process took"
    );
    assert!(during.external_used_bytes >= before.external_used_bytes + (20 << 30));
    w.kill();
    let mut last = during.leasable_bytes;
    let mut back = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        last = admin.get_devices().await.unwrap()[0].leasable_bytes;
        if last + (64 << 20) >= before.leasable_bytes {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "leasable after the other process exited: {last} (before: {})",
        before.leasable_bytes
    );
    assert!(
        back,
        "leasable did not come back after the other process exited:\n{}",
        b.log_text()
    );
}
