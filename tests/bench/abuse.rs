//! `abuse`: what hostile or careless clients cost the broker, measured.
//!
//! 1. Session cycles: the broker's open descriptors and resident memory before and after
//!    `cycles` sessions opened and closed by one live process (a pidfd per session must not
//!    stay behind).
//! 2. Held connections: `idle` connections that never send a byte and `streams`
//!    unauthenticated `Health/Watch` streams are held open (the broker keeps only what its
//!    caps allow); admin calls are timed meanwhile (p50/p99).
//! 3. Admin and metrics reads at scale (`admin_reads.rs`): with `tenants` tenants and
//!    `leases` live leases, a worker's pooled acquire+release timed with no reads and
//!    while each kind of read (listings, usage, `/metrics`, `/status`) loops, arms
//!    interleaved over `rounds` rounds.
//! 4. A big waiter (`big_waiter.rs`, another broker, 1 GiB): a tenant holding nothing
//!    waits for 768 MiB while 512 MiB are held for 1.2 s; twelve tenants of the same
//!    priority keep asking for 64 MiB (no wait). Reported: their grants and refusals, the
//!    device's utilization while the big request waits, and the big request's time to
//!    grant after the memory came back (`oversub --big-waiter` compares brokers).

use anyhow::{Context, Result};
use clap::Args;
use gpu_broker_client::{Client, QuotaSpec};
use serde_json::json;
use std::time::{Duration, Instant};

use crate::report::{bytes, count, json_line, note, us, Table};
use crate::stats::Histogram;
use crate::Common;

#[derive(Debug, Clone, Args)]
pub struct AbuseArgs {
    /// Sessions opened and closed in phase 1.
    #[arg(long, default_value_t = 1000)]
    pub cycles: u32,
    /// Idle connections held in phase 2.
    #[arg(long, default_value_t = 1000)]
    pub idle: u32,
    /// Unauthenticated Health/Watch streams attempted in phase 2.
    #[arg(long, default_value_t = 5000)]
    pub streams: u32,
    /// Tenants in phase 3.
    #[arg(long, default_value_t = 3000)]
    pub tenants: u32,
    /// Live leases in phase 3.
    #[arg(long, default_value_t = 10_000)]
    pub leases: u32,
    /// How long each acquire measurement of phase 3 runs (per arm and round).
    #[arg(long, value_parser = crate::parse_duration, default_value = "3s")]
    pub duration: Duration,
    /// Rounds of phase 3 (every arm once per round, interleaved).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// The phases to run (1-4).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    pub phases: Vec<u32>,
    /// Where phase 3's read loops run: a child process (decoding their answers takes
    /// nothing from the timed worker's process) or a thread of this process.
    #[arg(long, value_enum, default_value = "process")]
    pub readers: crate::admin_reads::ReadersIn,
    /// Phase 3: another broker measured side by side with the first, `"BIN [FLAGS...]"`
    /// (repeatable; every arm of every broker in each round).
    #[arg(long)]
    pub also: Vec<String>,
    /// Phase 3: the read arms to run, by number (1 ListTenants, 2 ListAllLeases, 3
    /// ListLeases, 4 GetUsage, 5 /metrics, 6 /status, 7 all at once); the quiet arm
    /// always runs. Default: all.
    #[arg(long, value_delimiter = ',')]
    pub arms: Vec<usize>,
}

fn fds(pid: Option<u32>) -> Option<usize> {
    let pid = pid?;
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()
        .map(|d| d.count())
}

pub async fn run(common: &Common, a: &AbuseArgs) -> Result<()> {
    if a.phases.contains(&1) || a.phases.contains(&2) {
        cycles_and_held(common, a).await?;
    }
    if a.phases.contains(&3) {
        let p = crate::admin_reads::Phase3 {
            tenants: a.tenants,
            leases: a.leases,
            duration: a.duration,
            rounds: a.rounds,
            readers: a.readers,
            also: a.also.clone(),
            arms: a.arms.clone(),
        };
        crate::admin_reads::run(common, &p).await?;
    }
    if a.phases.contains(&4) {
        big_waiter(common).await?;
    }
    Ok(())
}

/// Phases 1 and 2, on one broker.
async fn cycles_and_held(common: &Common, a: &AbuseArgs) -> Result<()> {
    let mut target = common.target("32TiB", None)?;
    let admin = target.admin().await?;

    // ---- 1. session cycles ----
    let (_, token) = target.tenant("cycler", QuotaSpec::new(1 << 30)).await?;
    let client = Client::connect(&target.uri, token.clone()).await?;
    client.session("warm").await?.close();
    settle_sessions(&admin).await;
    let (fd0, mem0) = (fds(target.pid), target.rss());
    for i in 0..a.cycles {
        let s = client.session(format!("c{i}")).await?;
        s.close();
    }
    settle_sessions(&admin).await;
    let (fd1, mem1) = (fds(target.pid), target.rss());
    let mut t = Table::new(
        format!(
            "abuse: {} session open/close cycles of one live process",
            a.cycles
        ),
        &["", "broker fds", "broker RSS"],
    );
    let show_fd = |v: Option<usize>| v.map(|n| n.to_string()).unwrap_or("-".into());
    let show_mem = |m: Option<crate::broker::Mem>| m.map(|m| bytes(m.rss)).unwrap_or("-".into());
    t.row(vec!["before".into(), show_fd(fd0), show_mem(mem0)]);
    t.row(vec!["after".into(), show_fd(fd1), show_mem(mem1)]);
    t.print();
    json_line(
        common.json,
        &json!({"mode": "abuse", "phase": "session_cycles", "cycles": a.cycles,
                "fds_before": fd0, "fds_after": fd1,
                "rss_before": mem0.map(|m| m.rss), "rss_after": mem1.map(|m| m.rss)}),
    );

    // ---- 2. idle connections and unauthenticated streams ----
    let socket = target
        .uri
        .strip_prefix("unix://")
        .context("abuse needs a Unix-socket broker")?
        .to_string();
    let admin_lat_before = time_admin(&admin, 200).await;
    let mut watches = Vec::new();
    let mut refused = 0u32;
    let mut channels = Vec::new();
    for i in 0..a.streams {
        if i % 100 == 0 {
            // Past the connection caps (this process is one uid) a connect fails.
            match gpu_broker_client::connect::connect_channel(&target.uri).await {
                Ok(c) => channels.push(c),
                Err(_) => {
                    refused += 100.min(a.streams - i);
                    break;
                }
            }
        }
        let Some(ch) = channels.last() else { break };
        match tokio::time::timeout(
            Duration::from_secs(2),
            gpu_broker_tests::HealthWatch::open(ch, ""),
        )
        .await
        {
            Ok(Ok((w, _))) => watches.push(w),
            _ => refused += 1,
        }
    }
    let mut idle = Vec::new();
    for _ in 0..a.idle {
        match tokio::net::UnixStream::connect(&socket).await {
            Ok(s) => idle.push(s),
            Err(_) => break,
        }
    }
    let fd_held = fds(target.pid);
    let mem_held = target.rss();
    let admin_lat = time_admin(&admin, 200).await;
    let mut t = Table::new(
        format!(
            "abuse: admin latency while {} idle connections and {} unauthenticated streams are attempted",
            a.idle, a.streams
        ),
        &["", "p50", "p99", "max", "streams open", "refused", "broker fds", "broker RSS"],
    );
    t.row(vec![
        "before".into(),
        us(admin_lat_before.q_us(0.5)),
        us(admin_lat_before.q_us(0.99)),
        us(admin_lat_before.max_us()),
        "-".into(),
        "-".into(),
        show_fd(fd1),
        show_mem(mem1),
    ]);
    t.row(vec![
        "held".into(),
        us(admin_lat.q_us(0.5)),
        us(admin_lat.q_us(0.99)),
        us(admin_lat.max_us()),
        count(watches.len() as u64),
        count(refused as u64),
        show_fd(fd_held),
        show_mem(mem_held),
    ]);
    t.print();
    json_line(
        common.json,
        &json!({"mode": "abuse", "phase": "held", "idle": a.idle, "streams": a.streams,
                "streams_open": watches.len(), "streams_refused": refused,
                "admin_p50_us": admin_lat.q_us(0.5), "admin_p99_us": admin_lat.q_us(0.99),
                "fds": fd_held, "rss": mem_held.map(|m| m.rss)}),
    );
    drop(watches);
    drop(channels);
    drop(idle);
    // What the broker gives back once they are closed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (fd_after, mem_after) = (fds(target.pid), target.rss());
    note(format!(
        "after closing them: broker fds {}, RSS {}",
        show_fd(fd_after),
        show_mem(mem_after)
    ));
    json_line(
        common.json,
        &json!({"mode": "abuse", "phase": "held_closed", "fds": fd_after,
                "rss": mem_after.map(|m| m.rss)}),
    );

    drop(target);
    Ok(())
}

/// Phase 4 (see the module doc and `big_waiter.rs`).
async fn big_waiter(common: &Common) -> Result<()> {
    let this = crate::big_waiter::Variant {
        name: "this broker".into(),
        bin: None,
        extra: Vec::new(),
    };
    crate::big_waiter::run(
        common,
        &[this],
        Duration::from_millis(1200),
        Duration::from_secs(30),
        1,
    )
    .await
}

async fn settle_sessions(admin: &gpu_broker_client::AdminClient) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if admin.list_sessions(None).await.is_ok_and(|s| s.is_empty()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `n` small admin reads (one page of tenants, the devices), timed.
async fn time_admin(admin: &gpu_broker_client::AdminClient, n: u32) -> Histogram {
    let mut h = Histogram::default();
    for _ in 0..n {
        let t0 = Instant::now();
        let _ = admin.list_tenants_page(10, "").await;
        let _ = admin.get_devices().await;
        h.record(t0.elapsed());
    }
    h
}
