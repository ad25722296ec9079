//! `quota-writes`: what an operator changing quotas costs admission.
//!
//! One worker acquires a pooled block (same tenant, same size, released after each call,
//! so every acquire is a cache hit) for `duration`, timing each acquire on its own: first
//! alone, then while an admin client on its own connection sets the quota of one of
//! `tenants` other tenants in a tight loop (each a durable store commit). Runs alternate
//! (alone, writing, alone, writing, ...) `repeat` times; the table shows the median of each
//! statistic across runs and the ratio of the two. Target: acquire p50 and p99 while
//! writing within 10% of the figures alone.

use anyhow::{bail, Result};
use clap::Args;
use gpu_broker_client::{AdminClient, Client, QuotaSpec, Session};
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::report::{count, json_line, note, us, Table};
use crate::stats::{median, Histogram};
use crate::Common;

#[derive(Debug, Clone, Args)]
pub struct QuotaWritesArgs {
    /// How long each measurement (alone, or while writing) runs.
    #[arg(long, value_parser = crate::parse_duration, default_value = "3s")]
    pub duration: Duration,
    /// Runs of each kind (alternating); the table shows the medians.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Tenants whose quotas the admin client rewrites in turn.
    #[arg(long, default_value_t = 16)]
    pub tenants: u32,
    /// Lease size of the worker's acquires.
    #[arg(long, value_parser = gpu_broker_client::units::parse_bytes, default_value = "2MiB")]
    pub size: u64,
}

/// One measurement: the worker's acquires, and the quota writes done meanwhile.
struct Run {
    acquire: Histogram,
    writes: u64,
    write: Histogram,
}

pub async fn run(common: &Common, a: &QuotaWritesArgs) -> Result<()> {
    if a.repeat == 0 || a.repeat > 100 || a.tenants == 0 || a.tenants > 10_000 {
        bail!("need 1..=100 runs and 1..=10000 tenants");
    }
    let mut target = common.target("32TiB", None)?;
    let admin = target.admin().await?;
    let (_, token) = target
        .tenant("quota-writes", QuotaSpec::new(1 << 40))
        .await?;
    let client = Client::connect(&target.uri, token).await?;
    let session = client.session("bench-quota-writes").await?;
    let names: Vec<String> = (0..a.tenants)
        .map(|i| format!("bench-qw-{}-{i:04}", std::process::id()))
        .collect();
    for n in &names {
        admin.set_quota(n, QuotaSpec::new(1 << 30)).await?;
    }
    for _ in 0..200 {
        session.lease(a.size).await?.release().await?;
    }
    note(format!(
        "quota-writes: {} runs x {:.1} s of pooled acquires ({} B), alone and while an admin client sets quotas of {} tenants in a loop, broker {}",
        a.repeat,
        a.duration.as_secs_f64(),
        a.size,
        a.tenants,
        target.uri
    ));
    let meter = crate::cpu::Meter::start(target.pid);
    let (mut alone, mut busy) = (Vec::new(), Vec::new());
    for rep in 0..a.repeat {
        alone.push(measure(&session, None, &names, a).await?);
        busy.push(measure(&session, Some(&admin), &names, a).await?);
        for (kind, r) in [
            ("alone", &alone[rep as usize]),
            ("writing", &busy[rep as usize]),
        ] {
            json_line(
                common.json,
                &json!({"mode": "quota-writes", "kind": kind, "run": rep,
                        "calls": r.acquire.count(), "p50_us": r.acquire.q_us(0.5),
                        "p99_us": r.acquire.q_us(0.99), "max_us": r.acquire.max_us(),
                        "writes": r.writes, "write_p50_us": r.write.q_us(0.5)}),
            );
        }
    }
    let stat =
        |runs: &[Run], f: &dyn Fn(&Run) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
    let mut table = Table::new(
        format!(
            "quota-writes: pooled acquire, one worker, microseconds (median over {} runs)",
            a.repeat
        ),
        &[
            "",
            "acquires/run",
            "p50",
            "p90",
            "p99",
            "max",
            "quota writes/s",
            "write p50",
        ],
    );
    let secs = a.duration.as_secs_f64().max(1e-9);
    for (label, runs) in [("alone", &alone), ("while writing quotas", &busy)] {
        table.row(vec![
            label.to_string(),
            count(stat(runs, &|r| r.acquire.count() as f64) as u64),
            us(stat(runs, &|r| r.acquire.q_us(0.5))),
            us(stat(runs, &|r| r.acquire.q_us(0.9))),
            us(stat(runs, &|r| r.acquire.q_us(0.99))),
            us(stat(runs, &|r| r.acquire.max_us())),
            if label == "alone" {
                "-".into()
            } else {
                format!("{:.0}", stat(runs, &|r| r.writes as f64) / secs)
            },
            if label == "alone" {
                "-".into()
            } else {
                us(stat(runs, &|r| r.write.q_us(0.5)))
            },
        ]);
    }
    table.print();
    println!("{}", meter.line());
    let (p50a, p50b) = (
        stat(&alone, &|r| r.acquire.q_us(0.5)),
        stat(&busy, &|r| r.acquire.q_us(0.5)),
    );
    let (p99a, p99b) = (
        stat(&alone, &|r| r.acquire.q_us(0.99)),
        stat(&busy, &|r| r.acquire.q_us(0.99)),
    );
    let (r50, r99) = (p50b / p50a.max(1e-9), p99b / p99a.max(1e-9));
    json_line(
        common.json,
        &json!({"mode": "quota-writes", "summary": "median_of_runs",
                "alone_p50_us": p50a, "alone_p99_us": p99a,
                "writing_p50_us": p50b, "writing_p99_us": p99b,
                "ratio_p50": r50, "ratio_p99": r99}),
    );
    println!(
        "target: acquire while writing quotas within 10% of alone: p50 x{r50:.2}, p99 x{r99:.2} -> {}\n",
        if r50 <= 1.1 && r99 <= 1.1 { "MET" } else { "MISSED" }
    );
    session.close();
    drop(session);
    for n in &names {
        let _ = admin.delete_tenant(n).await;
    }
    target.cleanup().await;
    Ok(())
}

/// Pooled acquires for `a.duration`, each timed; with `writer`, an admin task sets the
/// quota of `names` in turn meanwhile.
async fn measure(
    session: &Session,
    writer: Option<&AdminClient>,
    names: &[String],
    a: &QuotaWritesArgs,
) -> Result<Run> {
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let task = writer.map(|admin| {
        let (admin, stop, writes, names) =
            (admin.clone(), stop.clone(), writes.clone(), names.to_vec());
        tokio::spawn(async move {
            let mut h = Histogram::default();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let limit = (1u64 << 30) + (i as u64 % 1024) * (1 << 20);
                let t0 = Instant::now();
                if admin
                    .set_quota(&names[i % names.len()], QuotaSpec::new(limit))
                    .await
                    .is_err()
                {
                    break;
                }
                h.record(t0.elapsed());
                writes.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            h
        })
    });
    // Let the writer reach its steady state.
    if task.is_some() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    writes.store(0, Ordering::Relaxed);
    let mut acquire = Histogram::default();
    let end = Instant::now() + a.duration;
    while Instant::now() < end {
        let t0 = Instant::now();
        let lease = session.lease(a.size).await?;
        acquire.record(t0.elapsed());
        lease.release().await?;
    }
    let n = writes.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let write = match task {
        Some(t) => t.await?,
        None => Histogram::default(),
    };
    Ok(Run {
        acquire,
        writes: n,
        write,
    })
}
