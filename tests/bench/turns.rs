//! `turns`: the compute-turn hand-off. `workers` workers, each an OS thread with its own
//! current-thread runtime, connection, tenant (turn weights 1, 2, 4, 1, ...) and session
//! (like `turn-gate`), take the turn on device 0 of a broker started with
//! `--turn-slots 1`, hold it for `step` (a sleep standing in for a model's step), give it
//! back and ask again at once, for `duration`. So whenever a turn is given back others wait,
//! and every grant after the first is a hand-off.
//!
//! Two figures per run:
//! - broker side: `gpu_broker_turn_handoff_seconds` from the started broker's `/metrics`
//!   (its `ReleaseTurn` received to the next waiter's grant being sent), quantiles
//!   interpolated within the histogram's buckets;
//! - end to end: the releasing worker about to send `ReleaseTurn` to the waiting worker
//!   holding its grant (one clock: every worker is in this process).
//!
//! With `--against BIN` each run is repeated against a broker started from `BIN` (say, the
//! previous build), alternating, and the table gives the ratios of the medians across runs
//! (this build / BIN).

use anyhow::{bail, Context, Result};
use clap::Args;
use gpu_broker_client::{Client, QuotaSpec};
use serde_json::json;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::broker::{SpawnOpts, Target};
use crate::report::{json_line, note, us, Table};
use crate::stats::{median, Histogram};
use crate::Common;

#[derive(Debug, Clone, Args)]
pub struct TurnsArgs {
    /// Workers taking turns (each its own tenant, connection and session).
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// How long a worker holds each turn.
    #[arg(long, value_parser = crate::parse_duration, default_value = "2ms")]
    pub step: Duration,
    /// How long each run lasts.
    #[arg(long, value_parser = crate::parse_duration, default_value = "3s")]
    pub duration: Duration,
    /// Runs (per broker); the table shows the median of each statistic across runs.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// `--turn-anticipation` of the started broker(s).
    #[arg(long, default_value = "0s")]
    pub anticipation: String,
    /// A second broker binary to measure side by side (runs alternate).
    #[arg(long)]
    pub against: Option<PathBuf>,
}

/// One run's figures.
#[derive(Clone, Debug)]
struct Run {
    turns: u64,
    e2e: Histogram,
    broker_p50_us: f64,
    broker_p99_us: f64,
    broker_count: u64,
}

/// One statistic of a run.
type Stat<'a> = &'a dyn Fn(&Run) -> f64;

/// One worker's turns: (asked, granted, about to release) for each.
type Steps = Vec<(Instant, Instant, Instant)>;

pub async fn run(common: &Common, a: &TurnsArgs) -> Result<()> {
    if a.workers < 2 || a.workers > 64 || a.repeat == 0 || a.repeat > 100 {
        bail!("need 2..=64 workers and 1..=100 runs");
    }
    if common.broker.is_some() {
        bail!("turns starts its own brokers (it reads their /metrics): drop --broker");
    }
    let ours = match &common.broker_bin {
        Some(b) => b.clone(),
        None => gpu_broker_tests::bin_dir().join("gpu-broker"),
    };
    let mut bins = vec![("this", ours)];
    if let Some(b) = &a.against {
        bins.push(("against", b.clone()));
    }
    note(format!(
        "turns: {} workers, 1 slot, {:.1} ms steps, {} runs x {:.1} s per broker ({})",
        a.workers,
        a.step.as_secs_f64() * 1e3,
        a.repeat,
        a.duration.as_secs_f64(),
        bins.iter()
            .map(|(n, b)| format!("{n}: {}", b.display()))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); bins.len()];
    for rep in 0..a.repeat {
        for (i, (name, bin)) in bins.iter().enumerate() {
            let r = measure(common, a, bin).await?;
            json_line(
                common.json,
                &json!({
                    "mode": "turns", "broker": name, "run": rep, "workers": a.workers,
                    "turns": r.turns, "handoffs_broker": r.broker_count,
                    "broker_p50_us": r.broker_p50_us, "broker_p99_us": r.broker_p99_us,
                    "e2e_p50_us": r.e2e.q_us(0.5), "e2e_p99_us": r.e2e.q_us(0.99),
                    "e2e_count": r.e2e.count(),
                }),
            );
            runs[i].push(r);
        }
    }
    let med = |rs: &[Run], f: Stat| median(&rs.iter().map(f).collect::<Vec<_>>());
    let stats: [(&str, Stat); 5] = [
        ("turns/s", &|r: &Run| {
            r.turns as f64 / a.duration.as_secs_f64()
        }),
        ("broker p50 us", &|r: &Run| r.broker_p50_us),
        ("broker p99 us", &|r: &Run| r.broker_p99_us),
        ("end to end p50 us", &|r: &Run| r.e2e.q_us(0.5)),
        ("end to end p99 us", &|r: &Run| r.e2e.q_us(0.99)),
    ];
    let mut headers = vec!["statistic"];
    headers.extend(bins.iter().map(|(n, _)| *n));
    if bins.len() == 2 {
        headers.push("ratio");
    }
    let mut t = Table::new(
        format!(
            "Turn hand-off, {} workers, 1 slot, {:.1} ms steps (median of {} runs)",
            a.workers,
            a.step.as_secs_f64() * 1e3,
            a.repeat
        ),
        &headers,
    );
    for (label, f) in stats {
        let vals: Vec<f64> = runs.iter().map(|rs| med(rs, f)).collect();
        let mut row = vec![label.to_string()];
        row.extend(vals.iter().map(|v| us(*v)));
        if vals.len() == 2 {
            row.push(format!("{:.2}", vals[0] / vals[1]));
        }
        t.row(row);
    }
    t.print();
    Ok(())
}

/// One run against a fresh broker from `bin`.
async fn measure(common: &Common, a: &TurnsArgs, bin: &std::path::Path) -> Result<Run> {
    let port = free_port()?;
    let mut target = Target::spawn(&SpawnOpts {
        bin: bin.to_path_buf(),
        capacity: "1GiB".into(),
        headroom: common.headroom.clone(),
        log: common.broker_log.clone(),
        reclaim_deadline: None,
        extra: vec![
            "--metrics-listen".into(),
            format!("127.0.0.1:{port}"),
            "--turn-slots".into(),
            "1".into(),
            "--turn-anticipation".into(),
            a.anticipation.clone(),
            // No yield requests or revocations: a loaded machine may oversleep a step.
            "--turn-quantum".into(),
            "10s".into(),
        ],
    })?;
    let mut tokens = Vec::new();
    for i in 0..a.workers {
        let weight = [1, 2, 4][i as usize % 3];
        let (_, tok) = target
            .tenant(
                &format!("turns{i}"),
                QuotaSpec {
                    turn_weight: weight,
                    ..QuotaSpec::new(1 << 20)
                },
            )
            .await?;
        tokens.push(tok);
    }
    let uri = target.uri.clone();
    let (step, duration) = (a.step, a.duration);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(a.workers as usize));
    let threads: Vec<_> = tokens
        .into_iter()
        .map(|tok| {
            let (uri, barrier) = (uri.clone(), barrier.clone());
            std::thread::spawn(move || worker(&uri, tok, step, duration, &barrier))
        })
        .collect();
    let mut steps = Vec::new();
    for t in threads {
        let s = t
            .join()
            .map_err(|_| anyhow::anyhow!("a turns worker panicked"))??;
        steps.push(s);
    }
    let text = scrape(port).context("reading the broker's /metrics")?;
    let (q, count) = prom_quantiles(&text, "gpu_broker_turn_handoff_seconds", &[0.5, 0.99]);
    target.cleanup().await;
    Ok(Run {
        turns: steps.iter().map(|s| s.len() as u64).sum(),
        e2e: end_to_end(&steps),
        broker_p50_us: q[0] * 1e6,
        broker_p99_us: q[1] * 1e6,
        broker_count: count,
    })
}

/// A worker: its own runtime, connection and session; turns for `duration` after all
/// workers are connected.
fn worker(
    uri: &str,
    token: String,
    step: Duration,
    duration: Duration,
    barrier: &std::sync::Barrier,
) -> Result<Steps> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = Client::connect(uri, token).await?;
        let session = client.session("bench-turns").await?;
        barrier.wait();
        let end = Instant::now() + duration;
        let mut steps = Vec::new();
        while Instant::now() < end {
            let asked = Instant::now();
            let turn = session.turn(0).wait(Duration::from_secs(10)).await?;
            let granted = Instant::now();
            std::thread::sleep(step);
            let releasing = Instant::now();
            turn.release().await?;
            steps.push((asked, granted, releasing));
        }
        session.close();
        Ok(steps)
    })
}

/// Hand-offs as the waiter sees them: each grant to a worker that asked before another
/// worker's latest release preceding the grant, timed from that release.
fn end_to_end(workers: &[Steps]) -> Histogram {
    let mut releases: Vec<(Instant, usize)> = workers
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.iter().map(move |&(_, _, r)| (r, i)))
        .collect();
    releases.sort();
    let mut h = Histogram::default();
    for (j, s) in workers.iter().enumerate() {
        for &(asked, granted, _) in s {
            let k = releases.partition_point(|&(t, _)| t < granted);
            let Some(&(released, _)) = releases[..k].iter().rev().find(|&&(_, i)| i != j) else {
                continue;
            };
            if asked < released {
                h.record(granted - released);
            }
        }
    }
    h
}

/// A TCP port free on loopback now.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET /metrics` from the broker's metrics listener on loopback.
fn scrape(port: u16) -> Result<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// Quantiles of a Prometheus histogram `name` in `text`, interpolated linearly within
/// buckets (like `histogram_quantile`), and its count.
pub fn prom_quantiles(text: &str, name: &str, qs: &[f64]) -> (Vec<f64>, u64) {
    let prefix = format!("{name}_bucket{{");
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let c: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((le, c))
        })
        .collect();
    let total = buckets.last().map(|b| b.1).unwrap_or(0.0);
    if total == 0.0 {
        return (vec![f64::NAN; qs.len()], 0);
    }
    let out = qs
        .iter()
        .map(|q| {
            let want = q * total;
            let (mut prev_le, mut prev_c) = (0.0, 0.0);
            for &(le, c) in &buckets {
                if c >= want {
                    if le.is_infinite() {
                        return prev_le;
                    }
                    let frac = if c > prev_c {
                        (want - prev_c) / (c - prev_c)
                    } else {
                        1.0
                    };
                    return prev_le + (le - prev_le) * frac;
                }
                (prev_le, prev_c) = (le, c);
            }
            prev_le
        })
        .collect();
    (out, total as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let text = "x_bucket{le=\"0.00001\"} 0\nx_bucket{le=\"0.00002\"} 50\n\
                    x_bucket{le=\"0.00004\"} 100\nx_bucket{le=\"+Inf\"} 100\nx_count 100\n";
        let (q, n) = prom_quantiles(text, "x", &[0.5, 0.75]);
        assert_eq!(n, 100);
        assert!((q[0] - 20e-6).abs() < 1e-9, "{q:?}");
        assert!((q[1] - 30e-6).abs() < 1e-9, "{q:?}");
        let (q, n) = prom_quantiles("", "x", &[0.5]);
        assert!(q[0].is_nan() && n == 0);
    }

    #[test]
    fn end_to_end_counts_only_waiters_of_another_release() {
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        // Worker 0 holds 0..100 and releases at 100; worker 1 asked at 10, granted at 130.
        // Worker 1 releases at 200; worker 0 asked again at 150, granted at 240.
        let w0 = vec![(at(0), at(0), at(100)), (at(150), at(240), at(300))];
        let w1 = vec![(at(10), at(130), at(200))];
        let h = end_to_end(&[w0, w1]);
        assert_eq!(h.count(), 2);
        assert!((h.q_us(0.0) - 30.0).abs() < 1.0, "{}", h.q_us(0.0));
        assert!((h.max_us() - 40.0).abs() < 1.0, "{}", h.max_us());
    }
}
