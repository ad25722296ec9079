//! `abuse`: what hostile or careless clients cost the broker, measured.
//!
//! 1. Session cycles: the broker's open descriptors and resident memory before and after
//!    `cycles` sessions opened and closed by one live process (a pidfd per session must not
//!    stay behind).
//! 2. Held connections: `idle` connections that never send a byte and `streams`
//!    unauthenticated `Health/Watch` streams are held open (the broker keeps only what its
//!    caps allow); admin calls are timed meanwhile (p50/p99).
//! 3. Listings at scale: with `tenants` tenants and `leases` live leases, a worker's
//!    pooled acquire+release is timed alone and then while an operator loops over full
//!    `ListTenants` and `ListAllLeases` walks (every page): the admission stall listings
//!    cause is the difference of the p99s.
//! 4. A big waiter (another broker, 1 GiB): a tenant holding nothing waits for 768 MiB
//!    while 512 MiB are held; four tenants of the same priority keep asking for 64 MiB
//!    (no wait). Reported: their grants and refusals, the device's utilization while the
//!    big request waits, and the big request's time to grant after the memory came back.

use anyhow::{Context, Result};
use clap::Args;
use gpu_broker_client::{Client, QuotaSpec};
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
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
    /// How long each acquire measurement of phase 3 runs.
    #[arg(long, value_parser = crate::parse_duration, default_value = "5s")]
    pub duration: Duration,
}

fn fds(pid: Option<u32>) -> Option<usize> {
    let pid = pid?;
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()
        .map(|d| d.count())
}

pub async fn run(common: &Common, a: &AbuseArgs) -> Result<()> {
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

    // ---- 3. listings at scale ----
    let started = Instant::now();
    for i in 0..a.tenants {
        admin
            .set_quota(&format!("bulk-{i:05}"), QuotaSpec::new(1 << 20))
            .await?;
    }
    let (_, holder) = target
        .tenant("holder", QuotaSpec::new(u64::MAX / 4))
        .await?;
    let holder = Client::connect(&target.uri, holder).await?;
    let hs = holder.session("holder").await?;
    let mut held = Vec::new();
    let mut pending = futures::stream::FuturesUnordered::new();
    use futures::StreamExt;
    for _ in 0..a.leases {
        pending.push(hs.lease(2 << 20));
        if pending.len() >= 32 {
            if let Some(l) = pending.next().await {
                held.push(l?);
            }
        }
    }
    while let Some(l) = pending.next().await {
        held.push(l?);
    }
    note(format!(
        "{} tenants and {} leases set up in {:.1} s",
        a.tenants,
        held.len(),
        started.elapsed().as_secs_f64()
    ));
    let (_, wtoken) = target.tenant("worker", QuotaSpec::new(1 << 30)).await?;
    let worker = Client::connect(&target.uri, wtoken).await?;
    let ws = worker.session("w").await?;
    ws.lease(2 << 20).await?.release().await?;
    let quiet = time_acquire(&ws, a.duration).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let walks = Arc::new(AtomicU64::new(0));
    let lister = {
        let (stop, walks, admin) = (stop.clone(), walks.clone(), admin.clone());
        tokio::spawn(async move {
            let mut walk = Histogram::default();
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                let a = admin.list_tenants().await;
                let b = admin.list_all_leases(None).await;
                if a.is_err() || b.is_err() {
                    break;
                }
                walk.record(t0.elapsed());
                walks.fetch_add(1, Ordering::Relaxed);
            }
            walk
        })
    };
    let busy = time_acquire(&ws, a.duration).await?;
    stop.store(true, Ordering::Relaxed);
    let walk = lister.await?;
    let mut t = Table::new(
        format!(
            "abuse: pooled acquire+release with {} tenants and {} live leases",
            a.tenants,
            held.len()
        ),
        &[
            "",
            "calls",
            "p50",
            "p99",
            "max",
            "listing walks",
            "walk p50",
        ],
    );
    t.row(vec![
        "alone".into(),
        count(quiet.count()),
        us(quiet.q_us(0.5)),
        us(quiet.q_us(0.99)),
        us(quiet.max_us()),
        "-".into(),
        "-".into(),
    ]);
    t.row(vec![
        "while listing".into(),
        count(busy.count()),
        us(busy.q_us(0.5)),
        us(busy.q_us(0.99)),
        us(busy.max_us()),
        count(walks.load(Ordering::Relaxed)),
        us(walk.q_us(0.5)),
    ]);
    t.print();
    json_line(
        common.json,
        &json!({"mode": "abuse", "phase": "listings", "tenants": a.tenants, "leases": held.len(),
                "alone_p99_us": quiet.q_us(0.99), "busy_p99_us": busy.q_us(0.99),
                "busy_max_us": busy.max_us(), "walks": walks.load(Ordering::Relaxed),
                "walk_p50_us": walk.q_us(0.5)}),
    );
    drop(held);
    drop(target);
    big_waiter(common).await
}

/// Phase 4 (see the module doc).
async fn big_waiter(common: &Common) -> Result<()> {
    let mut target = common.target("1GiB", None)?;
    let admin = target.admin().await?;
    const MIB: u64 = 1 << 20;
    let (_, h) = target
        .tenant("fair-holder", QuotaSpec::new(1 << 30))
        .await?;
    let (_, b) = target.tenant("fair-big", QuotaSpec::new(1 << 30)).await?;
    let holder = Client::connect(&target.uri, h).await?;
    let hs = holder.session("h").await?;
    let held = hs.lease(512 * MIB).await?;
    let big = Client::connect(&target.uri, b).await?;
    let bs = big.session("big").await?;
    let t0 = Instant::now();
    let big_task = tokio::spawn(async move {
        let r = bs
            .lease_request(768 * MIB)
            .wait(Duration::from_secs(30))
            .send()
            .await;
        (r.map(|l| l.bytes()), Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut smalls = Vec::new();
    for i in 0..4 {
        let (_, t) = target
            .tenant(&format!("fair-small{i}"), QuotaSpec::new(1 << 30))
            .await?;
        let c = Client::connect(&target.uri, t).await?;
        let s = c.session("s").await?;
        let (stop, ok, refused) = (stop.clone(), ok.clone(), refused.clone());
        smalls.push(tokio::spawn(async move {
            let _c = c;
            while !stop.load(Ordering::Relaxed) {
                match s.lease(64 * MIB).await {
                    Ok(l) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        let _ = l.release().await;
                    }
                    Err(_) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        }));
    }
    // Utilization while the big request waits (sampled for 1 s).
    let mut util = Vec::new();
    let end = Instant::now() + Duration::from_secs(1);
    while Instant::now() < end {
        if let Some(d) = admin.get_devices().await?.first() {
            util.push(d.leased_bytes as f64 / d.leasable_bytes.max(1) as f64);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let released = Instant::now();
    held.release().await?;
    let (granted, at) = big_task.await?;
    stop.store(true, Ordering::Relaxed);
    for s in smalls {
        let _ = s.await;
    }
    let mean_util = util.iter().sum::<f64>() / util.len().max(1) as f64;
    let mut t = Table::new(
        "abuse: a 768 MiB request waits while 512 MiB of 1 GiB are held; 4 tenants of its priority ask 64 MiB",
        &["small grants", "small refused", "utilization while waiting", "big: granted", "after release", "waited in all"],
    );
    t.row(vec![
        count(ok.load(Ordering::Relaxed)),
        count(refused.load(Ordering::Relaxed)),
        format!("{:.0}%", mean_util * 100.0),
        match &granted {
            Ok(b) => bytes(*b),
            Err(e) => format!("no: {e}"),
        },
        us(at.duration_since(released).as_secs_f64() * 1e6),
        us(at.duration_since(t0).as_secs_f64() * 1e6),
    ]);
    t.print();
    json_line(
        common.json,
        &json!({"mode": "abuse", "phase": "big_waiter", "small_ok": ok.load(Ordering::Relaxed),
                "small_refused": refused.load(Ordering::Relaxed), "utilization": mean_util,
                "big_granted": granted.is_ok(),
                "big_after_release_us": at.duration_since(released).as_secs_f64() * 1e6}),
    );
    Ok(())
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

/// Pooled acquire+release pairs for `dur`, each pair timed.
async fn time_acquire(s: &gpu_broker_client::Session, dur: Duration) -> Result<Histogram> {
    let mut h = Histogram::default();
    let end = Instant::now() + dur;
    while Instant::now() < end {
        let t0 = Instant::now();
        s.lease(2 << 20).await?.release().await?;
        h.record(t0.elapsed());
    }
    Ok(h)
}
