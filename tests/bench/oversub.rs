//! `oversub`: contention without OOM. Three priority levels (0, 1, 2), each with
//! its tenants, a guarantee and a limit of the whole device; workers of every level ask
//! for random sizes whose sum is `oversubscription` times the leasable memory, wait in
//! the queue up to `--wait`, mark a fraction of their leases reclaimable, hold each lease
//! for a random short time and release it, and release at once when their session
//! stream brings a `ReclaimRequested` for the lease they hold. Meanwhile an admin client
//! samples the device every `--sample` (leased / leasable, waiting requests). Reports,
//! per priority, time-to-grant percentiles, requests that were not granted within their
//! wait, reclaim requests and revocations received, and the utilization while requests
//! wait. Runs `--duration` and stops by itself: in-flight requests are cancelled, held
//! leases released.

use anyhow::{bail, Result};
use clap::Args;
use futures::{FutureExt, StreamExt};
use gpu_broker_client::{Client, ClientError, Code, QuotaSpec, SessionEvent};
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{sleep_until, Instant};

use crate::report::{bytes, count, json_line, note, Table};
use crate::stats::{median, Histogram, Rng};
use crate::{parse_duration, Common};

#[derive(Debug, Clone, Args)]
pub struct OversubArgs {
    /// How long the load runs.
    #[arg(long, value_parser = parse_duration, default_value = "20s")]
    pub duration: Duration,
    /// Aggregate demand (sum of what every worker wants at once) / leasable memory.
    #[arg(long, default_value_t = 2.0)]
    pub oversubscription: f64,
    /// Workers per priority level.
    #[arg(long, default_value_t = 10)]
    pub workers_per_priority: u32,
    /// Tenants per priority level (its workers are spread over them).
    #[arg(long, default_value_t = 1)]
    pub tenants_per_priority: u32,
    /// Guarantee of each priority level as a fraction of the leasable memory (<= 1/3).
    #[arg(long, default_value_t = 0.2)]
    pub guarantee: f64,
    /// Shortest hold of a lease.
    #[arg(long, value_parser = parse_duration, default_value = "20ms")]
    pub hold_min: Duration,
    /// Longest hold of a lease.
    #[arg(long, value_parser = parse_duration, default_value = "200ms")]
    pub hold_max: Duration,
    /// Longest wait of a request in the queue.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub wait: Duration,
    /// Fraction of requests marked reclaimable.
    #[arg(long, default_value_t = 0.75)]
    pub reclaimable: f64,
    /// Sizes are uniform in [mean * (1 - spread), mean * (1 + spread)].
    #[arg(long, default_value_t = 0.5)]
    pub size_spread: f64,
    /// Utilization sampling period.
    #[arg(long, value_parser = parse_duration, default_value = "50ms")]
    pub sample: Duration,
    /// Reclaim deadline of a started broker.
    #[arg(long, default_value = "1s")]
    pub reclaim_deadline: String,
    /// Capacity of a started (host) broker.
    #[arg(long, default_value = "16GiB")]
    pub host_capacity: String,
    /// Device the load runs on.
    #[arg(long, default_value_t = 0)]
    pub device: u32,
    /// Instead of the mixed load: a big request among small ones (`big_waiter.rs`),
    /// against a broker for each of `--overtake-ages`, one after the other in this run.
    #[arg(long)]
    pub big_waiter: bool,
    /// `--overtake-age` of each broker of `--big-waiter`.
    #[arg(long, value_delimiter = ',', default_value = "0s,2s,1h")]
    pub overtake_ages: Vec<String>,
    /// With `--big-waiter`, also a broker of this binary (another build, started without
    /// `--overtake-age`), first.
    #[arg(long)]
    pub before_broker_bin: Option<std::path::PathBuf>,
    /// With `--big-waiter`: how long the 512 MiB are held while the big request waits.
    #[arg(long, value_parser = parse_duration, default_value = "3s")]
    pub big_hold: Duration,
    /// With `--big-waiter`: the big request's wait.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub big_wait: Duration,
    /// With `--big-waiter`: rounds (every broker once per round, interleaved).
    #[arg(long, default_value_t = 3)]
    pub big_rounds: u32,
}

const PRIORITIES: [i32; 3] = [0, 1, 2];

/// What one worker saw.
#[derive(Default, Clone)]
struct WorkerStats {
    grants: Histogram,
    not_granted: u64,
    other_errors: u64,
    first_error: Option<String>,
    reclaim_events: u64,
    /// Reclaim requests for a lease while its tenant held no more than its guarantee
    /// (as this process counts the tenant's leases).
    reclaims_within_guarantee: u64,
    released_on_reclaim: u64,
    revocations: u64,
    release_failures: u64,
    granted_bytes: u64,
    /// Sum over leases of bytes x seconds held (from grant to release or revocation).
    byte_seconds: f64,
}

impl WorkerStats {
    fn merge(&mut self, o: &WorkerStats) {
        self.grants.merge(&o.grants);
        self.not_granted += o.not_granted;
        self.other_errors += o.other_errors;
        if self.first_error.is_none() {
            self.first_error.clone_from(&o.first_error);
        }
        self.reclaim_events += o.reclaim_events;
        self.reclaims_within_guarantee += o.reclaims_within_guarantee;
        self.released_on_reclaim += o.released_on_reclaim;
        self.revocations += o.revocations;
        self.release_failures += o.release_failures;
        self.granted_bytes += o.granted_bytes;
        self.byte_seconds += o.byte_seconds;
    }
}

/// One utilization sample.
#[derive(Clone, Copy)]
struct Sample {
    util: f64,
    waiting: u32,
    quarantined: u64,
}

/// How a hold ended.
enum Hold {
    Done,
    Reclaimed,
    Revoked,
    Closed,
}

#[derive(Clone)]
struct WorkerSpec {
    uri: String,
    token: String,
    name: String,
    device: u32,
    sizes: (u64, u64),
    gran: u64,
    hold: (Duration, Duration),
    wait: Duration,
    reclaimable: f64,
    seed: u64,
    end: Instant,
    /// Bytes the worker's tenant holds now (all its workers), and its guarantee.
    tenant_held: Arc<AtomicU64>,
    guarantee: u64,
}

pub async fn run(common: &Common, a: &OversubArgs) -> Result<()> {
    if a.big_waiter {
        let mut variants = Vec::new();
        if let Some(bin) = &a.before_broker_bin {
            variants.push(crate::big_waiter::Variant {
                name: format!("{}", bin.display()),
                bin: Some(bin.clone()),
                extra: Vec::new(),
            });
        }
        for age in &a.overtake_ages {
            variants.push(crate::big_waiter::Variant {
                name: format!("--overtake-age {age}"),
                bin: None,
                extra: vec!["--overtake-age".into(), age.clone()],
            });
        }
        return crate::big_waiter::run(common, &variants, a.big_hold, a.big_wait, a.big_rounds)
            .await;
    }
    if !(0.0..=1.0 / 3.0 + 1e-9).contains(&a.guarantee) {
        bail!("--guarantee must be in [0, 1/3]: three levels share the device");
    }
    if !(0.0..=1.0).contains(&a.reclaimable) || !(0.0..1.0).contains(&a.size_spread) {
        bail!("--reclaimable must be in [0, 1] and --size-spread in [0, 1)");
    }
    if a.workers_per_priority == 0 || a.workers_per_priority > 1000 || a.tenants_per_priority == 0 {
        bail!("workers per priority must be 1..=1000, tenants per priority >= 1");
    }
    if a.oversubscription <= 0.0 || a.oversubscription > 100.0 {
        bail!("--oversubscription must be in (0, 100]");
    }
    if a.duration > Duration::from_secs(600) || a.hold_min > a.hold_max {
        bail!("duration at most 10 minutes; hold-min <= hold-max");
    }
    if a.sample < Duration::from_millis(5) {
        bail!("--sample must be at least 5ms");
    }
    let mut target = common.target(&a.host_capacity, Some(&a.reclaim_deadline))?;
    let admin = target.admin().await?;
    let devices = admin.get_devices().await?;
    let Some(dev) = devices.iter().find(|d| d.index == a.device).cloned() else {
        bail!("the broker has no device {}", a.device);
    };
    let gran = dev.granularity_bytes.max(1);
    let leasable = dev.leasable_bytes;
    let workers = a.workers_per_priority * PRIORITIES.len() as u32;
    let mean = a.oversubscription * leasable as f64 / f64::from(workers);
    let round = |v: f64| ((v / gran as f64).ceil() as u64).max(1) * gran;
    let lo = round(mean * (1.0 - a.size_spread));
    let hi = round(mean * (1.0 + a.size_spread)).min(leasable / gran * gran);
    if lo > hi {
        bail!("the device is too small for these sizes");
    }
    let guarantee =
        ((a.guarantee * leasable as f64 / f64::from(a.tenants_per_priority)) as u64) / gran * gran;
    let mut tenants: Vec<(i32, String, String, Arc<AtomicU64>)> = Vec::new();
    for &p in &PRIORITIES {
        for t in 0..a.tenants_per_priority {
            let (name, token) = target
                .tenant(
                    &format!("p{p}-{t}"),
                    QuotaSpec {
                        limit_bytes: leasable,
                        max_leases: 0,
                        priority: p,
                        guaranteed_bytes: guarantee,
                        host_limit_bytes: 0,
                        turn_weight: 0,
                        device_limit_bytes: Default::default(),
                    },
                )
                .await?;
            tenants.push((p, name, token, Arc::new(AtomicU64::new(0))));
        }
    }
    note(format!(
        "oversub: {workers} workers ({} per priority over {} tenant(s) each), sizes {}..{} (mean {}), demand {:.2}x of {} leasable, guarantee {} per tenant, hold {:?}..{:?}, wait {:?}, {:.0}% reclaimable, {:?}, device {} ({})",
        a.workers_per_priority,
        a.tenants_per_priority,
        bytes(lo),
        bytes(hi),
        bytes(mean as u64),
        a.oversubscription,
        bytes(leasable),
        bytes(guarantee),
        a.hold_min,
        a.hold_max,
        a.wait,
        a.reclaimable * 100.0,
        a.duration,
        dev.name,
        dev.backend
    ));

    // Connect every worker first, then start the clock.
    let mut specs = Vec::new();
    for (pi, &p) in PRIORITIES.iter().enumerate() {
        for w in 0..a.workers_per_priority {
            let level: Vec<_> = tenants.iter().filter(|t| t.0 == p).collect();
            let t = level[w as usize % level.len()];
            specs.push((
                pi,
                WorkerSpec {
                    uri: target.uri.clone(),
                    token: t.2.clone(),
                    name: format!("bench-oversub-p{p}-{w}"),
                    device: a.device,
                    sizes: (lo, hi),
                    gran,
                    hold: (a.hold_min, a.hold_max),
                    wait: a.wait,
                    reclaimable: a.reclaimable,
                    seed: common.seed ^ ((pi as u64) << 32 | u64::from(w)).wrapping_mul(0x9E37),
                    end: Instant::now(), // set below
                    tenant_held: t.3.clone(),
                    guarantee,
                },
            ));
        }
    }
    let mut sessions = Vec::new();
    for (_, spec) in &specs {
        let client = Client::connect(&spec.uri, spec.token.clone()).await?;
        sessions.push(client.session(spec.name.clone()).await?);
    }
    let meter = crate::cpu::Meter::start(target.pid);
    let start = Instant::now();
    let end = start + a.duration;
    let mut handles = Vec::new();
    for ((pi, mut spec), session) in specs.into_iter().zip(sessions) {
        spec.end = end;
        handles.push((pi, tokio::spawn(worker(spec, session))));
    }
    let sampler = {
        let admin = admin.clone();
        let (period, device) = (a.sample, a.device);
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while Instant::now() < end {
                tick.tick().await;
                let Ok(devs) = admin.get_devices().await else {
                    continue;
                };
                if let Some(d) = devs.iter().find(|d| d.index == device) {
                    samples.push(Sample {
                        util: d.leased_bytes as f64 / d.leasable_bytes.max(1) as f64,
                        waiting: d.waiting_requests,
                        quarantined: d.quarantined_bytes,
                    });
                }
            }
            samples
        })
    };
    let mut per_priority: Vec<WorkerStats> = vec![WorkerStats::default(); PRIORITIES.len()];
    for (pi, h) in handles {
        per_priority[pi].merge(&h.await?);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu_line = meter.line();
    let samples = sampler.await?;
    let after = admin.get_devices().await?;

    // Per-priority table.
    let mut table = Table::new(
        format!(
            "oversub: {:.1}x demand, 3 priorities x {} workers, {} leasable, {:?}; time-to-grant in milliseconds",
            a.oversubscription,
            a.workers_per_priority,
            bytes(leasable),
            a.duration
        ),
        &[
            "priority",
            "guarantee",
            "mean held",
            "grants",
            "grants/s",
            "ttg p50",
            "ttg p90",
            "ttg p99",
            "ttg max",
            "not granted",
            "reclaims recv",
            "within guarantee",
            "released on reclaim",
            "revoked",
        ],
    );
    let ms = |h: &Histogram, q: f64| format!("{:.2}", h.q_us(q) / 1e3);
    let mut total = WorkerStats::default();
    for (pi, s) in per_priority.iter().enumerate() {
        total.merge(s);
        table.row(vec![
            PRIORITIES[pi].to_string(),
            bytes(guarantee * u64::from(a.tenants_per_priority)),
            bytes((s.byte_seconds / elapsed) as u64),
            count(s.grants.count()),
            format!("{:.0}", s.grants.count() as f64 / elapsed),
            ms(&s.grants, 0.5),
            ms(&s.grants, 0.9),
            ms(&s.grants, 0.99),
            ms(&s.grants, 1.0),
            count(s.not_granted),
            count(s.reclaim_events),
            count(s.reclaims_within_guarantee),
            count(s.released_on_reclaim),
            count(s.revocations),
        ]);
        json_line(
            common.json,
            &json!({
                "mode": "oversub", "priority": PRIORITIES[pi], "grants": s.grants.count(),
                "ttg_p50_ms": s.grants.q_us(0.5) / 1e3, "ttg_p90_ms": s.grants.q_us(0.9) / 1e3,
                "ttg_p99_ms": s.grants.q_us(0.99) / 1e3, "ttg_max_ms": s.grants.max_us() / 1e3,
                "not_granted": s.not_granted, "reclaim_events": s.reclaim_events,
                "reclaims_within_guarantee": s.reclaims_within_guarantee,
                "released_on_reclaim": s.released_on_reclaim, "revocations": s.revocations,
                "other_errors": s.other_errors, "granted_bytes": s.granted_bytes,
                "mean_held_bytes": s.byte_seconds / elapsed,
            }),
        );
    }
    table.print();

    let waiting: Vec<f64> = samples
        .iter()
        .filter(|s| s.waiting > 0)
        .map(|s| s.util)
        .collect();
    let all: Vec<f64> = samples.iter().map(|s| s.util).collect();
    let mean_of = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let pct = |v: &[f64], q: f64| {
        if v.is_empty() {
            return 0.0;
        }
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        s[((q * (s.len() - 1) as f64).round() as usize).min(s.len() - 1)]
    };
    let util_waiting = mean_of(&waiting);
    let max_quarantined = samples.iter().map(|s| s.quarantined).max().unwrap_or(0);
    let mut summary = Table::new(
        format!(
            "oversub: utilization = leased / leasable, sampled every {:?}",
            a.sample
        ),
        &["metric", "value"],
    );
    let rows: Vec<(&str, String)> = vec![
        ("samples", count(samples.len() as u64)),
        (
            "samples with requests waiting",
            format!(
                "{} ({:.0}%)",
                count(waiting.len() as u64),
                100.0 * waiting.len() as f64 / samples.len().max(1) as f64
            ),
        ),
        (
            "utilization while requests wait, mean",
            format!("{:.1}%", 100.0 * util_waiting),
        ),
        (
            "utilization while requests wait, median",
            format!("{:.1}%", 100.0 * median(&waiting)),
        ),
        (
            "utilization while requests wait, p10",
            format!("{:.1}%", 100.0 * pct(&waiting, 0.1)),
        ),
        (
            "utilization, all samples, mean",
            format!("{:.1}%", 100.0 * mean_of(&all)),
        ),
        (
            "waiting requests per sample, mean",
            format!(
                "{:.1}",
                samples.iter().map(|s| f64::from(s.waiting)).sum::<f64>()
                    / samples.len().max(1) as f64
            ),
        ),
        ("grants, all priorities", count(total.grants.count())),
        ("not granted within the wait", count(total.not_granted)),
        ("reclaim requests received", count(total.reclaim_events)),
        (
            "leases released on reclaim",
            count(total.released_on_reclaim),
        ),
        ("revocations", count(total.revocations)),
        ("quarantined, max sampled", bytes(max_quarantined)),
        (
            "other errors",
            format!(
                "{}{}",
                total.other_errors,
                total
                    .first_error
                    .as_ref()
                    .map(|e| format!(" (first: {e})"))
                    .unwrap_or_default()
            ),
        ),
        (
            "leases left after the run",
            count(
                after
                    .iter()
                    .find(|d| d.index == a.device)
                    .map(|d| u64::from(d.lease_count))
                    .unwrap_or(0),
            ),
        ),
    ];
    for (k, v) in rows {
        summary.row(vec![k.to_string(), v]);
    }
    summary.print();
    println!("{cpu_line}");
    json_line(
        common.json,
        &json!({
            "mode": "oversub", "summary": true, "duration_s": elapsed, "workers": workers,
            "oversubscription": a.oversubscription, "leasable": leasable, "size_lo": lo, "size_hi": hi,
            "samples": samples.len(), "samples_waiting": waiting.len(),
            "util_waiting_mean": util_waiting, "util_waiting_median": median(&waiting),
            "util_waiting_p10": pct(&waiting, 0.1), "util_mean": mean_of(&all),
            "grants": total.grants.count(), "not_granted": total.not_granted,
            "reclaim_events": total.reclaim_events, "revocations": total.revocations,
            "max_quarantined": max_quarantined, "other_errors": total.other_errors,
        }),
    );
    println!(
        "target: >= 90% utilization while requests wait: {:.1}% (mean over {} samples with requests waiting) -> {}\n",
        100.0 * util_waiting,
        waiting.len(),
        if waiting.is_empty() {
            "n/a (no request waited)"
        } else if util_waiting >= 0.9 {
            "MET"
        } else {
            "MISSED"
        }
    );
    target.cleanup().await;
    Ok(())
}

/// One worker: request, hold (or give back on reclaim), release, until the end.
async fn worker(spec: WorkerSpec, session: gpu_broker_client::Session) -> WorkerStats {
    let mut st = WorkerStats::default();
    let mut rng = Rng::new(spec.seed);
    let mut events = session.events();
    let end = spec.end;
    'outer: while Instant::now() < end {
        let size = rng.range(spec.sizes.0 / spec.gran, spec.sizes.1 / spec.gran) * spec.gran;
        let reclaimable = rng.unit() < spec.reclaimable;
        let t0 = Instant::now();
        let request = session
            .lease_request(size)
            .device(spec.device)
            .wait(spec.wait)
            .reclaimable(reclaimable)
            .label("bench-oversub")
            .send();
        let result = tokio::select! {
            r = request => r,
            _ = sleep_until(end) => break,
        };
        let lease = match result {
            Ok(l) => l,
            Err(e) if matches!(e.code(), Code::DeadlineExceeded | Code::ResourceExhausted) => {
                st.not_granted += 1;
                continue;
            }
            Err(e) => {
                st.other_errors += 1;
                st.first_error.get_or_insert_with(|| e.to_string());
                if matches!(e, ClientError::Transport(_) | ClientError::Unavailable(_)) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        st.grants.record(t0.elapsed());
        st.granted_bytes += lease.bytes();
        spec.tenant_held.fetch_add(lease.bytes(), Ordering::SeqCst);
        let granted_at = Instant::now();
        let hold_ns = rng.range(spec.hold.0.as_nanos() as u64, spec.hold.1.as_nanos() as u64);
        let hold_end = (Instant::now() + Duration::from_nanos(hold_ns)).min(end);
        let outcome = loop {
            tokio::select! {
                _ = sleep_until(hold_end) => break Hold::Done,
                ev = events.next() => match ev {
                    Some(SessionEvent::ReclaimRequested { lease_id, .. }) => {
                        st.reclaim_events += 1;
                        if lease_id == lease.id() {
                            if spec.tenant_held.load(Ordering::SeqCst) <= spec.guarantee {
                                st.reclaims_within_guarantee += 1;
                            }
                            break Hold::Reclaimed;
                        }
                    }
                    Some(SessionEvent::LeaseRevoked { lease_id, .. }) => {
                        st.revocations += 1;
                        if lease_id == lease.id() {
                            break Hold::Revoked;
                        }
                    }
                    Some(SessionEvent::Closed { .. }) | None => break Hold::Closed,
                    Some(_) => {}
                }
            }
        };
        st.byte_seconds += lease.bytes() as f64 * granted_at.elapsed().as_secs_f64();
        spec.tenant_held.fetch_sub(lease.bytes(), Ordering::SeqCst);
        match outcome {
            Hold::Done | Hold::Reclaimed => {
                if matches!(outcome, Hold::Reclaimed) {
                    st.released_on_reclaim += 1;
                }
                if lease.release().await.is_err() {
                    st.release_failures += 1;
                }
            }
            Hold::Revoked => {
                lease.detach();
            }
            Hold::Closed => {
                lease.detach();
                st.first_error
                    .get_or_insert_with(|| "session closed by the broker".into());
                break 'outer;
            }
        }
    }
    // Count reclaim requests that arrived for leases already released.
    while let Some(Some(ev)) = events.next().now_or_never() {
        match ev {
            SessionEvent::ReclaimRequested { .. } => st.reclaim_events += 1,
            SessionEvent::LeaseRevoked { .. } => st.revocations += 1,
            SessionEvent::Closed { .. } => break,
            _ => {}
        }
    }
    session.close();
    st
}
