//! `latency`: one worker (concurrency 1), acquire then release, one call at a time.
//!
//! Pooled (default): the same tenant asks for the same size again and again, after a
//! warm-up that put a block of that size in the pool, so every acquire is served from the
//! cache with no device call (same-tenant reuse needs no scrub).
//!
//! `--fresh`: run `r` acquires `iterations` leases of `size + r * granularity` one after
//! the other *while holding them all*, so none can come from the cache: each acquire is
//! a fresh device allocation (plus export). Then it releases them (into the cache). The
//! count is capped so that they fit in the device's free leasable memory. The bench
//! checks the pool's cached bytes did not shrink during the acquires (no hit); a broker
//! that already cached blocks of those sizes (an earlier run) would show it.
//!
//! `--cross-tenant`: two tenants take turns with the same size: each acquire asks for a
//! block the *other* tenant just released. By the reuse rule (memory a process may still
//! map never changes tenant) it is not handed on: the broker frees it and allocates a fresh
//! one of that size (a memfd on the host backend; VMM memory, zeroed, on CUDA). This is
//! the cost of that rule next to the same-tenant pooled path.
//!
//! Each call is timed on its own, as the worker sees it (client library + gRPC over the
//! socket + broker).

use anyhow::{bail, Result};
use clap::Args;
use gpu_broker_client::units::parse_bytes;
use gpu_broker_client::{AdminClient, Client, DeviceInfo, QuotaSpec, Session};
use serde_json::json;
use std::time::Instant;

use crate::report::{bytes, json_line, note, us, Table};
use crate::stats::{median, Histogram};
use crate::Common;

#[derive(Debug, Clone, Args)]
pub struct LatencyArgs {
    /// Lease sizes, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_bytes, default_value = "2MiB,64MiB,1GiB")]
    pub sizes: Vec<u64>,
    /// Measured acquires (and releases) per size and run (default 2000; 100 with --fresh,
    /// capped to what fits in the device).
    #[arg(long)]
    pub iterations: Option<u32>,
    /// Unmeasured acquire+release pairs before each run (pooled: of the measured size).
    #[arg(long, default_value_t = 200)]
    pub warmup: u32,
    /// Runs per size; the table shows the median of each statistic across runs.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Fresh allocations: hold every lease of a run, so no acquire can reuse a block.
    #[arg(long, conflicts_with = "cross_tenant")]
    pub fresh: bool,
    /// Two tenants alternate: every acquire finds the other tenant's released block.
    #[arg(long)]
    pub cross_tenant: bool,
    /// Pooled, with the client crate retaining released blocks mapped
    /// (`Session::retain_mappings`): an acquire is then one RPC, no ticket.
    #[arg(long, conflicts_with_all = ["fresh", "cross_tenant"])]
    pub retain: bool,
    /// Capacity of a started (host) broker. Host blocks are sparse memfds: no RAM used.
    #[arg(long, default_value = "32TiB")]
    pub host_capacity: String,
}

/// One run's histograms.
struct Run {
    acquire: Histogram,
    release: Histogram,
}

pub async fn run(common: &Common, a: &LatencyArgs) -> Result<()> {
    let iterations = a.iterations.unwrap_or(if a.fresh { 100 } else { 2000 });
    if a.sizes.is_empty() || a.repeat == 0 || iterations == 0 {
        bail!("need at least one size, one run and one iteration");
    }
    if iterations > 1_000_000 || a.warmup > 1_000_000 || a.repeat > 100 {
        bail!("at most 1,000,000 iterations and warm-up pairs, and 100 runs");
    }
    let mut target = common.target(&a.host_capacity, None)?;
    let admin = target.admin().await?;
    let dev = device0(&admin).await?;
    let gran = dev.granularity_bytes.max(1);
    let (_, token) = target
        .tenant("latency", QuotaSpec::new(dev.leasable_bytes.max(1)))
        .await?;
    let client = Client::connect(&target.uri, token).await?;
    let session = client.session("bench-latency").await?;
    let other = if a.cross_tenant {
        let (_, token) = target
            .tenant("latency-b", QuotaSpec::new(dev.leasable_bytes.max(1)))
            .await?;
        let c = Client::connect(&target.uri, token).await?;
        Some(c.session("bench-latency-b").await?)
    } else {
        None
    };
    if a.retain {
        let most = a.sizes.iter().map(|s| s.div_ceil(gran) * gran).max();
        session.retain_mappings(most.unwrap_or(0));
    }
    let kind = if a.fresh {
        "fresh"
    } else if a.retain {
        "pooled, retained"
    } else if a.cross_tenant {
        "cross-tenant"
    } else {
        "pooled"
    };
    note(format!(
        "latency ({kind}): {} sizes x {} runs x {iterations} calls (+{} warm-up pairs), device {} ({}, {} leasable), broker {}",
        a.sizes.len(),
        a.repeat,
        a.warmup,
        dev.name,
        dev.backend,
        bytes(dev.leasable_bytes),
        target.uri
    ));

    let mut table = Table::new(
        format!(
            "latency, one worker, {kind} blocks: microseconds per call (median over {} runs)",
            a.repeat
        ),
        &[
            "size",
            "call",
            "runs",
            "calls/run",
            "p50",
            "p90",
            "p99",
            "max",
            "mean",
        ],
    );
    let mut verdicts = Vec::new();
    let meter = crate::cpu::Meter::start(target.pid);
    for &size in &a.sizes {
        let mut runs = Vec::new();
        let mut per_run = iterations;
        for rep in 0..a.repeat {
            let r = if a.fresh {
                let size = size + u64::from(rep) * gran;
                let d = device0(&admin).await?;
                let free = d
                    .leasable_bytes
                    .saturating_sub(d.leased_bytes + d.quarantined_bytes);
                let rounded = size.div_ceil(gran) * gran;
                let fits = u32::try_from(free / 100 * 95 / rounded.max(1)).unwrap_or(u32::MAX);
                per_run = iterations.min(fits);
                if per_run == 0 {
                    bail!("{} does not fit in {} free", bytes(size), bytes(free));
                }
                if per_run < iterations {
                    note(format!(
                        "fresh {}: {per_run} leases fit at once (not {iterations})",
                        bytes(size)
                    ));
                }
                // Warm with a size no fresh run of this base uses.
                let warm = size + u64::from(a.repeat) * gran;
                fresh_run(&session, &admin, a.warmup, per_run, size, warm).await?
            } else if let Some(other) = &other {
                cross_run(&session, other, a.warmup, iterations, size).await?
            } else {
                pooled_run(&session, a.warmup, iterations, size).await?
            };
            for (call, h) in [("acquire", &r.acquire), ("release", &r.release)] {
                json_line(
                    common.json,
                    &json!({
                        "mode": "latency", "kind": kind, "size": size, "run": rep, "call": call,
                        "calls": h.count(), "p50_us": h.q_us(0.5), "p90_us": h.q_us(0.9),
                        "p99_us": h.q_us(0.99), "max_us": h.max_us(), "mean_us": h.mean_us(),
                    }),
                );
            }
            runs.push(r);
        }
        for call in ["acquire", "release"] {
            let hist = |r: &Run| -> Histogram {
                if call == "acquire" {
                    r.acquire.clone()
                } else {
                    r.release.clone()
                }
            };
            let hs: Vec<Histogram> = runs.iter().map(hist).collect();
            let stat = |f: fn(&Histogram) -> f64| median(&hs.iter().map(f).collect::<Vec<_>>());
            let p50 = stat(|h| h.q_us(0.5));
            let p90 = stat(|h| h.q_us(0.9));
            let p99 = stat(|h| h.q_us(0.99));
            let max = stat(|h| h.max_us());
            let mean = stat(|h| h.mean_us());
            table.row(vec![
                bytes(size),
                call.to_string(),
                runs.len().to_string(),
                per_run.to_string(),
                us(p50),
                us(p90),
                us(p99),
                us(max),
                us(mean),
            ]);
            json_line(
                common.json,
                &json!({
                    "mode": "latency", "kind": kind, "size": size, "call": call,
                    "summary": "median_of_runs", "runs": runs.len(), "calls_per_run": per_run,
                    "p50_us": p50, "p90_us": p90, "p99_us": p99, "max_us": max, "mean_us": mean,
                }),
            );
            if call == "acquire" && !a.fresh && !a.cross_tenant {
                let ok = p50 < 100.0 && p99 < 500.0;
                verdicts.push(format!(
                    "target: pooled acquire p50 < 100 us and p99 < 500 us, {}: p50 {} us, p99 {} us -> {}",
                    bytes(size),
                    us(p50),
                    us(p99),
                    if ok { "MET" } else { "MISSED" }
                ));
            }
        }
    }
    table.print();
    println!("{}", meter.line());
    for v in &verdicts {
        println!("{v}");
    }
    if !verdicts.is_empty() {
        println!();
    }
    session.close();
    drop(session);
    drop(other);
    target.cleanup().await;
    Ok(())
}

/// Device 0 as the admin service reports it.
pub async fn device0(admin: &AdminClient) -> Result<DeviceInfo> {
    match admin.get_devices().await?.into_iter().next() {
        Some(d) => Ok(d),
        None => bail!("the broker has no device"),
    }
}

/// `warmup` unmeasured pairs, then `iterations` measured acquire+release pairs.
async fn pooled_run(session: &Session, warmup: u32, iterations: u32, size: u64) -> Result<Run> {
    let mut run = Run {
        acquire: Histogram::default(),
        release: Histogram::default(),
    };
    for i in 0..warmup + iterations {
        let t0 = Instant::now();
        let lease = session.lease_request(size).send().await?;
        let t1 = Instant::now();
        if lease.bytes() < size {
            bail!("granted {} for a request of {}", lease.bytes(), size);
        }
        lease.release().await?;
        let t2 = Instant::now();
        if i >= warmup {
            run.acquire.record(t1 - t0);
            run.release.record(t2 - t1);
        }
    }
    Ok(run)
}

/// Like `pooled_run`, but the two sessions (of two tenants) alternate, so every acquire
/// finds a cached block of the other tenant.
async fn cross_run(
    a: &Session,
    b: &Session,
    warmup: u32,
    iterations: u32,
    size: u64,
) -> Result<Run> {
    let mut run = Run {
        acquire: Histogram::default(),
        release: Histogram::default(),
    };
    for i in 0..warmup + iterations {
        let s = if i % 2 == 0 { a } else { b };
        let t0 = Instant::now();
        let lease = s.lease_request(size).send().await?;
        let t1 = Instant::now();
        lease.release().await?;
        let t2 = Instant::now();
        if i >= warmup {
            run.acquire.record(t1 - t0);
            run.release.record(t2 - t1);
        }
    }
    Ok(run)
}

/// `warmup` pairs of size `warm` (connection and code paths), then `n` acquires of
/// `size` held at once (each a fresh allocation), then their releases.
async fn fresh_run(
    session: &Session,
    admin: &AdminClient,
    warmup: u32,
    n: u32,
    size: u64,
    warm: u64,
) -> Result<Run> {
    let mut run = Run {
        acquire: Histogram::default(),
        release: Histogram::default(),
    };
    for _ in 0..warmup {
        session.lease_request(warm).send().await?.release().await?;
    }
    let cached_before = device0(admin).await?.cached_bytes;
    let mut held = Vec::with_capacity(n as usize);
    let mut failure = None;
    for _ in 0..n {
        let t0 = Instant::now();
        match session.lease_request(size).send().await {
            Ok(lease) => {
                run.acquire.record(t0.elapsed());
                held.push(lease);
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let cached_after = device0(admin).await?.cached_bytes;
    if cached_after < cached_before {
        note(format!(
            "fresh {}: the pool's cache shrank by {} during the acquires: cache hits or evictions to make room (a fresh broker avoids both)",
            bytes(size),
            bytes(cached_before - cached_after)
        ));
    }
    for lease in held {
        let t0 = Instant::now();
        lease.release().await?;
        run.release.record(t0.elapsed());
    }
    if let Some(e) = failure {
        bail!("fresh acquire of {} failed: {e}", bytes(size));
    }
    Ok(run)
}
