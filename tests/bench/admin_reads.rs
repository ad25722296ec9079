//! `abuse` phase 3, admin and metrics reads at scale: with `tenants` tenants and `leases`
//! live leases, a worker's pooled acquire+release is timed with no reads, and while one
//! kind of read runs in a loop on its own connection: full walks of `ListTenants`,
//! `ListAllLeases` and the holder's own `ListLeases` (every page), `GetUsage`, a `/metrics`
//! scrape, the `/status` page, and all of these at once. The arms are interleaved over
//! `rounds` rounds (the quiet arm, then each read, then again), so a machine load that
//! drifts over the run touches every arm alike; per arm the report gives the median over
//! rounds of the acquire p50 and p99, their ratios to the quiet arm's, the added p99, and
//! the broker's own count of state-lock holds longer than 100 us, 1 ms and 10 ms during
//! the arm, by the wall clock and by the holding thread's CPU clock
//! (`gpu_broker_state_lock_holds_total`; the two scrapes that read it are in every arm
//! alike; a hold long by the wall clock only is one whose thread the OS preempted). Admission waits only for that lock, so the holds say whether a read
//! stalls admission (target: no read holds it more than 1 ms) apart from the CPU the
//! reads take from a loaded machine, which the latencies also show.

use anyhow::{Context, Result};
use gpu_broker_client::{AdminClient, Client, QuotaSpec, Session};
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::report::{count, json_line, note, us, Table};
use crate::stats::{median, Histogram};
use crate::Common;

/// The reads, by name as the report shows them.
const READS: [&str; 6] = [
    "ListTenants",
    "ListAllLeases",
    "ListLeases (own)",
    "GetUsage",
    "/metrics",
    "/status",
];

/// Where the read loops connect: they run on their own thread and runtime, with their own
/// connections, so the bench's acquire loop shares only the machine's CPUs with them, not
/// its runtime's worker threads.
#[derive(Clone)]
struct Readers {
    uri: String,
    admin_token: String,
    /// The token of the tenant holding every lease (its own `ListLeases`, `GetUsage`).
    holder_token: String,
    /// The metrics listener (`/metrics`, `/status`).
    http: String,
}

/// The clients of one arm's read loops.
struct ReadClients {
    admin: AdminClient,
    holder: Client,
    http: String,
}

impl ReadClients {
    async fn connect(r: &Readers) -> Result<ReadClients> {
        Ok(ReadClients {
            admin: AdminClient::connect(&r.uri, r.admin_token.clone()).await?,
            holder: Client::connect(&r.uri, r.holder_token.clone()).await?,
            http: r.http.clone(),
        })
    }

    /// One read of kind `i` (of [`READS`]); how many items or bytes it got.
    async fn read(&self, i: usize) -> Result<u64> {
        Ok(match i {
            0 => self.admin.list_tenants().await?.len() as u64,
            1 => self.admin.list_all_leases(None).await?.len() as u64,
            2 => self.holder.list_leases().await?.len() as u64,
            3 => self.holder.usage().await.map(|_| 1)?,
            4 => http_get(&self.http, "/metrics").await?,
            _ => http_get(&self.http, "/status").await?,
        })
    }
}

/// Starts the read loops `kinds` on a thread of their own; returns once they are
/// connected, with the thread (it returns how many reads were done once `stop` is set).
fn start_reads(
    readers: &Readers,
    kinds: &[usize],
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<Result<u64>>> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (r, kinds) = (readers.clone(), kinds.to_vec());
    let handle = std::thread::spawn(move || -> Result<u64> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let c = Arc::new(ReadClients::connect(&r).await?);
            let done = Arc::new(AtomicU64::new(0));
            let _ = ready_tx.send(());
            let mut loops = Vec::new();
            for k in kinds {
                let (c, stop, done) = (c.clone(), stop.clone(), done.clone());
                loops.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        c.read(k).await?;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    anyhow::Ok(())
                }));
            }
            for l in loops {
                l.await??;
            }
            Ok(done.load(Ordering::Relaxed))
        })
    });
    // Connected (or failed: the thread's result says why).
    let _ = ready_rx.recv();
    Ok(handle)
}

/// `GET path` on `addr` (HTTP/1.1, one request per connection); the body's length.
async fn http_get(addr: &str, path: &str) -> Result<u64> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    anyhow::ensure!(
        out.starts_with(b"HTTP/1.1 200"),
        "{path}: {}",
        String::from_utf8_lossy(&out[..out.len().min(120)])
    );
    Ok(out.len() as u64)
}

/// The broker's counts of state-lock holds longer than 0, 100 us, 1 ms and 10 ms by the
/// wall clock, then the same by the holding thread's CPU clock
/// (`gpu_broker_state_lock_holds_total{longer_than, clock}`), from `/metrics` (zeros if
/// the broker has none).
async fn lock_holds(addr: &str) -> Result<[u64; 8]> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let mut v = [0u64; 8];
    for (c, clock) in ["wall", "cpu"].iter().enumerate() {
        for (i, t) in ["0", "100us", "1ms", "10ms"].iter().enumerate() {
            let key = format!(
                "gpu_broker_state_lock_holds_total{{longer_than=\"{t}\",clock=\"{clock}\"}} "
            );
            v[c * 4 + i] = out
                .lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .and_then(|n| n.trim().parse::<f64>().ok())
                .unwrap_or(0.0) as u64;
        }
    }
    Ok(v)
}

/// The metrics listener's address, from the broker's log.
fn metrics_addr(log: &std::path::Path) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(a) = text
            .lines()
            .find(|l| l.contains("metrics at /metrics"))
            .and_then(|l| l.split("addr=").nth(1))
            .and_then(|a| a.split_whitespace().next())
        {
            return Some(a.to_string());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// One arm: acquire+release pairs timed for `dur` while the reads `kinds` loop (on their
/// own thread); the acquire histogram and the reads done.
async fn arm(
    ws: &Session,
    readers: &Readers,
    kinds: &[usize],
    dur: Duration,
) -> Result<(Histogram, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let reads = if kinds.is_empty() {
        None
    } else {
        let h = start_reads(readers, kinds, stop.clone())?;
        // Let the loops get going before timing.
        tokio::time::sleep(Duration::from_millis(50)).await;
        Some(h)
    };
    let mut h = Histogram::default();
    let end = Instant::now() + dur;
    let timed = async {
        while Instant::now() < end {
            let t0 = Instant::now();
            ws.lease(2 << 20).await?.release().await?;
            h.record(t0.elapsed());
        }
        anyhow::Ok(())
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    let done = match reads {
        Some(t) => tokio::task::spawn_blocking(move || t.join())
            .await?
            .map_err(|_| anyhow::anyhow!("a read loop panicked"))??,
        None => 0,
    };
    timed?;
    Ok((h, done))
}

/// Phase 3 (see the module doc); runs on its own broker (with a metrics listener).
pub async fn run(
    common: &Common,
    tenants: u32,
    leases: u32,
    dur: Duration,
    rounds: u32,
) -> Result<()> {
    let mut target = common.target_with(
        "32TiB",
        None,
        vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
    )?;
    let http = target
        .spawned
        .as_ref()
        .and_then(|s| metrics_addr(&s.log))
        .context("admin reads need a broker started by the bench (its metrics listener)")?;
    let admin = target.admin().await?;
    let started = Instant::now();
    for i in 0..tenants {
        admin
            .set_quota(&format!("bulk-{i:05}"), QuotaSpec::new(1 << 20))
            .await?;
    }
    let (_, holder_token) = target
        .tenant("holder", QuotaSpec::new(u64::MAX / 4))
        .await?;
    let holder = Client::connect(&target.uri, holder_token.clone()).await?;
    let hs = holder.session("holder").await?;
    let mut held = Vec::new();
    let mut pending = futures::stream::FuturesUnordered::new();
    use futures::StreamExt;
    for _ in 0..leases {
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
        "{tenants} tenants and {} leases set up in {:.1} s",
        held.len(),
        started.elapsed().as_secs_f64()
    ));
    let (_, wtoken) = target.tenant("worker", QuotaSpec::new(1 << 30)).await?;
    let worker = Client::connect(&target.uri, wtoken).await?;
    let ws = worker.session("w").await?;
    ws.lease(2 << 20).await?.release().await?;
    let readers = Readers {
        uri: target.uri.clone(),
        admin_token: target.admin_token.clone(),
        holder_token: holder_token.clone(),
        http,
    };
    // What one read of each kind returns (and a warm-up).
    let mut sizes = Vec::new();
    {
        let c = ReadClients::connect(&readers).await?;
        for k in 0..READS.len() {
            sizes.push(c.read(k).await?);
        }
    }
    // Arms: quiet, each read alone, all reads at once.
    let mut arms: Vec<(String, Vec<usize>)> = vec![("no reads".into(), vec![])];
    for (k, name) in READS.iter().enumerate() {
        arms.push((format!("{name} in a loop"), vec![k]));
    }
    arms.push(("all of them at once".into(), (0..READS.len()).collect()));
    let mut p50s = vec![Vec::new(); arms.len()];
    let mut p99s = vec![Vec::new(); arms.len()];
    let mut calls = vec![0u64; arms.len()];
    let mut reads = vec![0u64; arms.len()];
    let mut holds = vec![[0u64; 8]; arms.len()];
    for _ in 0..rounds.max(1) {
        for (i, (_, kinds)) in arms.iter().enumerate() {
            let before = lock_holds(&readers.http).await?;
            let (h, n) = arm(&ws, &readers, kinds, dur).await?;
            let after = lock_holds(&readers.http).await?;
            for (k, (a, b)) in after.iter().zip(before).enumerate() {
                holds[i][k] += a.saturating_sub(b);
            }
            p50s[i].push(h.q_us(0.5));
            p99s[i].push(h.q_us(0.99));
            calls[i] += h.count();
            reads[i] += n;
        }
    }
    let quiet_p99 = median(&p99s[0]);
    let quiet_p50 = median(&p50s[0]);
    let mut t = Table::new(
        format!(
            "abuse: pooled acquire+release with {tenants} tenants and {} live leases, while admin and metrics reads loop ({} rounds of {:.1} s per arm; medians over rounds)",
            held.len(),
            rounds.max(1),
            dur.as_secs_f64()
        ),
        &[
            "arm",
            "acquires",
            "reads",
            "p50",
            "p99",
            "p50 ratio",
            "p99 ratio",
            "added p99",
            "lock holds",
            "wall > 100 us",
            "wall > 1 ms",
            "wall > 10 ms",
            "cpu > 100 us",
            "cpu > 1 ms",
        ],
    );
    for (i, (name, _)) in arms.iter().enumerate() {
        let (p50, p99) = (median(&p50s[i]), median(&p99s[i]));
        t.row(vec![
            name.clone(),
            count(calls[i]),
            if i == 0 { "-".into() } else { count(reads[i]) },
            us(p50),
            us(p99),
            format!("{:.2}", p50 / quiet_p50.max(1e-9)),
            format!("{:.2}", p99 / quiet_p99.max(1e-9)),
            if i == 0 {
                "-".into()
            } else {
                us(p99 - quiet_p99)
            },
            count(holds[i][0]),
            count(holds[i][1]),
            count(holds[i][2]),
            count(holds[i][3]),
            count(holds[i][5]),
            count(holds[i][6]),
        ]);
        json_line(
            common.json,
            &json!({"mode": "abuse", "phase": "admin_reads", "arm": name, "tenants": tenants,
                    "leases": held.len(), "rounds": rounds, "acquires": calls[i], "reads": reads[i],
                    "p50_us": p50, "p99_us": p99, "p99s_us": p99s[i], "added_p99_us": p99 - quiet_p99,
                    "lock_holds": holds[i][0], "lock_holds_over_100us": holds[i][1],
                    "lock_holds_over_1ms": holds[i][2], "lock_holds_over_10ms": holds[i][3],
                    "lock_holds_cpu_over_100us": holds[i][5], "lock_holds_cpu_over_1ms": holds[i][6],
                    "lock_holds_cpu_over_10ms": holds[i][7]}),
        );
    }
    t.print();
    note(format!(
        "one read returns: {}",
        READS
            .iter()
            .zip(&sizes)
            .map(|(n, s)| format!("{n} {s}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    drop(held);
    Ok(())
}
