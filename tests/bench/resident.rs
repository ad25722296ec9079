//! `resident`: the broker's resident memory while it holds many live leases. Opens
//! `tenants x sessions-per-tenant` sessions (each its own connection), acquires `leases`
//! leases of `size` spread over them with `concurrency` acquires in flight, and reads
//! `VmRSS`/`VmHWM` of the broker from `/proc/<pid>/status` before, with the leases held,
//! and after releasing them. On the host backend every lease is a shared-memory file
//! sized with ftruncate and never touched, so the files cost no RAM; the tmpfs must
//! have a free inode per lease (checked first).

use anyhow::{bail, Result};
use clap::Args;
use gpu_broker_client::units::parse_bytes;
use gpu_broker_client::{Client, Lease, QuotaSpec, Session};
use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::broker::{free_inodes, Mem, Target};
use crate::report::{bytes, count, json_line, note, us, Table};
use crate::stats::{median, Histogram};
use crate::Common;

#[derive(Debug, Clone, Args)]
pub struct ResidentArgs {
    /// Live leases to hold.
    #[arg(long, default_value_t = 10_000)]
    pub leases: u32,
    /// Size of each lease.
    #[arg(long, value_parser = parse_bytes, default_value = "2MiB")]
    pub size: u64,
    /// Tenants holding them.
    #[arg(long, default_value_t = 10)]
    pub tenants: u32,
    /// Sessions (connections) per tenant.
    #[arg(long, default_value_t = 4)]
    pub sessions_per_tenant: u32,
    /// Acquires (and releases) in flight at once.
    #[arg(long, default_value_t = 32)]
    pub concurrency: u32,
    /// Runs (a fresh broker each, when the bench starts it); the table shows each and the median.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
    /// Capacity of a started (host) broker: a big simulated device.
    #[arg(long, default_value = "32TiB")]
    pub host_capacity: String,
}

/// One run's numbers.
struct Measured {
    idle: Option<Mem>,
    with_sessions: Option<Mem>,
    held: Option<Mem>,
    released: Option<Mem>,
    acquire_s: f64,
    release_s: f64,
    acquire: Histogram,
    device_leases: u32,
    shm_files: Option<usize>,
}

pub async fn run(common: &Common, a: &ResidentArgs) -> Result<()> {
    if a.leases == 0 || a.leases > 1_000_000 || a.tenants == 0 || a.sessions_per_tenant == 0 {
        bail!("leases must be 1..=1,000,000; tenants and sessions >= 1");
    }
    if a.concurrency == 0 || a.concurrency > 1024 || a.repeat == 0 || a.repeat > 20 {
        bail!("concurrency must be 1..=1024 and runs 1..=20");
    }
    if common.broker.is_none() {
        // Each lease is one file in the started broker's directory under /dev/shm.
        if let Some(free) = free_inodes(Path::new("/dev/shm")) {
            if free < u64::from(a.leases) + 1000 {
                bail!(
                    "/dev/shm has {free} free inodes, fewer than {} leases need",
                    a.leases
                );
            }
            note(format!(
                "/dev/shm: {} free inodes for {} lease files",
                count(free.min(u64::MAX / 2)),
                count(u64::from(a.leases))
            ));
        }
    }
    let mut runs = Vec::new();
    let mut connected: Option<Target> = None;
    for rep in 0..a.repeat {
        let mut target = match connected.take() {
            Some(t) => t,
            None => common.target(&a.host_capacity, None)?,
        };
        let m = one_run(&mut target, a).await;
        target.cleanup().await;
        if common.broker.is_some() {
            connected = Some(target);
        } else {
            drop(target);
        }
        let m = m?;
        json_line(
            common.json,
            &json!({
                "mode": "resident", "run": rep, "leases": a.leases, "size": a.size,
                "sessions": a.tenants * a.sessions_per_tenant,
                "rss_idle": m.idle.map(|x| x.rss), "rss_sessions": m.with_sessions.map(|x| x.rss),
                "rss_held": m.held.map(|x| x.rss), "hwm_held": m.held.map(|x| x.hwm),
                "rss_released": m.released.map(|x| x.rss),
                "acquire_s": m.acquire_s, "release_s": m.release_s,
                "acquire_p50_us": m.acquire.q_us(0.5), "acquire_p99_us": m.acquire.q_us(0.99),
                "device_leases": m.device_leases, "shm_files": m.shm_files,
            }),
        );
        runs.push(m);
    }

    let mut headers = vec!["metric".to_string()];
    headers.extend((1..=runs.len()).map(|i| format!("run {i}")));
    if runs.len() > 1 {
        headers.push("median".into());
    }
    let header_refs: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut table = Table::new(
        format!(
            "resident: {} live leases of {} over {} tenants x {} sessions, {} acquires in flight",
            count(u64::from(a.leases)),
            bytes(a.size),
            a.tenants,
            a.sessions_per_tenant,
            a.concurrency
        ),
        &header_refs,
    );
    let mut add = |name: &str, vals: Vec<Option<f64>>, fmt: &dyn Fn(f64) -> String| {
        let mut row = vec![name.to_string()];
        row.extend(
            vals.iter()
                .map(|v| v.map(fmt).unwrap_or_else(|| "-".into())),
        );
        if vals.len() > 1 {
            let present: Vec<f64> = vals.iter().flatten().copied().collect();
            row.push(if present.is_empty() {
                "-".into()
            } else {
                fmt(median(&present))
            });
        }
        table.row(row);
    };
    let mem = |f: fn(&Measured) -> Option<Mem>, hwm: bool| -> Vec<Option<f64>> {
        runs.iter()
            .map(|m| f(m).map(|x| if hwm { x.hwm } else { x.rss } as f64))
            .collect()
    };
    let show_bytes = |v: f64| bytes(v as u64);
    add("broker RSS, idle", mem(|m| m.idle, false), &show_bytes);
    add(
        "broker RSS, sessions open",
        mem(|m| m.with_sessions, false),
        &show_bytes,
    );
    add(
        "broker RSS, leases held",
        mem(|m| m.held, false),
        &show_bytes,
    );
    add(
        "broker peak RSS (VmHWM)",
        mem(|m| m.held, true),
        &show_bytes,
    );
    add(
        "RSS per live lease",
        runs.iter()
            .map(|m| match (m.held, m.with_sessions) {
                (Some(h), Some(s)) => {
                    Some((h.rss as f64 - s.rss as f64) / f64::from(a.leases.max(1)))
                }
                _ => None,
            })
            .collect(),
        &|v| format!("{v:.0} B"),
    );
    add(
        "broker RSS, after release",
        mem(|m| m.released, false),
        &show_bytes,
    );
    add(
        "time to acquire all",
        runs.iter().map(|m| Some(m.acquire_s)).collect(),
        &|v| format!("{v:.2} s"),
    );
    add(
        "acquires per second",
        runs.iter()
            .map(|m| Some(f64::from(a.leases) / m.acquire_s.max(1e-9)))
            .collect(),
        &|v| count(v.round() as u64),
    );
    add(
        "acquire p50 (us)",
        runs.iter().map(|m| Some(m.acquire.q_us(0.5))).collect(),
        &us,
    );
    add(
        "acquire p99 (us)",
        runs.iter().map(|m| Some(m.acquire.q_us(0.99))).collect(),
        &us,
    );
    add(
        "time to release all",
        runs.iter().map(|m| Some(m.release_s)).collect(),
        &|v| format!("{v:.2} s"),
    );
    add(
        "leases on the device",
        runs.iter()
            .map(|m| Some(f64::from(m.device_leases)))
            .collect(),
        &|v| count(v as u64),
    );
    add(
        "lease files in /dev/shm",
        runs.iter().map(|m| m.shm_files.map(|n| n as f64)).collect(),
        &|v| count(v as u64),
    );
    table.print();
    let held: Vec<f64> = runs
        .iter()
        .filter_map(|m| m.held.map(|x| x.rss as f64))
        .collect();
    if held.is_empty() {
        println!("target: broker RSS < 100 MiB with 10,000 live leases: broker pid unknown (pass --broker-pid)\n");
    } else {
        let rss = median(&held);
        println!(
            "target: broker RSS < 100 MiB with 10,000 live leases: {} with {} -> {}\n",
            bytes(rss as u64),
            count(u64::from(a.leases)),
            if a.leases < 10_000 {
                "n/a (fewer than 10,000 leases)"
            } else if rss < 100.0 * 1024.0 * 1024.0 {
                "MET"
            } else {
                "MISSED"
            }
        );
    }
    Ok(())
}

async fn one_run(target: &mut Target, a: &ResidentArgs) -> Result<Measured> {
    let admin = target.admin().await?;
    let dev = crate::latency::device0(&admin).await?;
    let gran = dev.granularity_bytes.max(1);
    let rounded = a.size.div_ceil(gran) * gran;
    let need = rounded * u64::from(a.leases);
    if need > dev.leasable_bytes.saturating_sub(dev.leased_bytes) {
        bail!(
            "{} leases of {} need {}, the device has {} leasable ({} leased)",
            a.leases,
            bytes(a.size),
            bytes(need),
            bytes(dev.leasable_bytes),
            bytes(dev.leased_bytes)
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = target.rss();
    // Leases go round robin over sessions; each tenant may hold them all.
    let per_tenant = need;
    let mut sessions: Vec<Session> = Vec::new();
    for t in 0..a.tenants {
        let (_, token) = target
            .tenant(&format!("res{t}"), QuotaSpec::new(per_tenant))
            .await?;
        for s in 0..a.sessions_per_tenant {
            let client = Client::connect(&target.uri, token.clone()).await?;
            sessions.push(client.session(format!("bench-resident-{t}-{s}")).await?);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let with_sessions = target.rss();
    note(format!(
        "resident: {} sessions open; acquiring {} leases of {}",
        sessions.len(),
        a.leases,
        bytes(a.size)
    ));

    let meter = crate::cpu::Meter::start(target.pid);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for j in 0..a.concurrency {
        let sessions = sessions.clone();
        let (n, c, size) = (a.leases, a.concurrency, a.size);
        tasks.push(tokio::spawn(async move {
            let mut held: Vec<Lease> = Vec::new();
            let mut hist = Histogram::default();
            let mut i = j;
            while i < n {
                let s = &sessions[i as usize % sessions.len()];
                let t = Instant::now();
                match s.lease(size).await {
                    Ok(l) => {
                        hist.record(t.elapsed());
                        held.push(l);
                    }
                    Err(e) => return (held, hist, Some(e)),
                }
                i += c;
            }
            (held, hist, None)
        }));
    }
    let mut held: Vec<Lease> = Vec::with_capacity(a.leases as usize);
    let mut acquire = Histogram::default();
    let mut failure = None;
    for t in tasks {
        let (h, hist, err) = t.await?;
        held.extend(h);
        acquire.merge(&hist);
        if failure.is_none() {
            failure = err;
        }
    }
    let acquire_s = t0.elapsed().as_secs_f64();
    note(format!("acquire phase: {}", meter.line()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held_mem = target.rss();
    let device_leases = crate::latency::device0(&admin).await?.lease_count;
    let shm_files = target.spawned.as_ref().map(|s| s.memfds());
    note(format!(
        "resident: {} leases held after {acquire_s:.2} s; broker RSS {}",
        held.len(),
        held_mem.map(|m| bytes(m.rss)).unwrap_or_else(|| "?".into())
    ));

    // Release everything, `concurrency` at a time.
    let t1 = Instant::now();
    let mut chunks: Vec<Vec<Lease>> = (0..a.concurrency).map(|_| Vec::new()).collect();
    for (i, l) in held.into_iter().enumerate() {
        chunks[i % a.concurrency as usize].push(l);
    }
    let mut tasks = Vec::new();
    for chunk in chunks {
        tasks.push(tokio::spawn(async move {
            for l in chunk {
                l.release().await?;
            }
            anyhow::Ok(())
        }));
    }
    let mut release_failure = None;
    for t in tasks {
        if let Err(e) = t.await? {
            release_failure.get_or_insert(e);
        }
    }
    let release_s = t1.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = target.rss();
    for s in &sessions {
        s.close();
    }
    drop(sessions);
    if let Some(e) = failure {
        bail!("an acquire failed: {e}");
    }
    if let Some(e) = release_failure {
        return Err(e.context("a release failed"));
    }
    Ok(Measured {
        idle,
        with_sessions,
        held: held_mem,
        released,
        acquire_s,
        release_s,
        acquire,
        device_leases,
        shm_files,
    })
}
