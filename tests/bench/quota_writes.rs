//! `quota-writes`: what an operator changing quotas costs admission.
//!
//! One worker acquires a pooled block (same tenant, same size, released after each call,
//! so every acquire is a cache hit) for `duration`, timing each acquire on its own: alone,
//! and while an admin client on its own connection runs one admin call in a loop on
//! `tenants` other tenants in turn. Arms are interleaved `repeat` times (alone, then each
//! `--op`, then again), so a load that drifts over the run touches every arm alike; the
//! table shows, per broker and arm, the median over runs of each statistic and the ratio
//! to the arm alone, and the same ratios of the arm's pooled samples (every acquire of its
//! runs in one histogram: the verdict's figures, as a run's tail swings a median of runs'
//! p99). Target: acquire p50 and p99 while quotas are written within 10% of the figures
//! alone.
//!
//! The options separate what a write loop costs:
//!
//! - `--op set,get`: `set` sets a quota (a durable store commit with fsync, then applied
//!   in memory and the queue run); `get` reads one (`GetQuota`, no commit) at the same pace (the calls a second `set` reached on that
//!   broker just before, in the same run; or `--rate`), as a control: if it costs as
//!   much, the commit is not the cause; `burn` makes no call: a child process keeps
//!   `--burn-cores` busy (default: the cores `set` added to that broker in the run), the
//!   control for CPU busy elsewhere on the host.
//! - `--writer process|task`: the admin loop runs in a child process of the bench (the
//!   default: what an operator's `gpu-brokerctl` is, sharing no runtime or thread with the
//!   timed worker) or as a task on the bench's own runtime, beside the worker.
//! - `--rate N`: at most N admin calls a second (0: as fast as they return).
//! - `--also "[NAME=value...] BIN [FLAGS...]"`: more brokers set up alike (with those
//!   environment variables, e.g. `TOKIO_WORKER_THREADS=4`) and measured side by side, every
//!   arm of every broker in each run. A broker started with `--admin-listen PATH` (its
//!   operators' socket) gets its admin loop there, the worker on its main socket.
//!
//! Beside the latencies: the broker's state-lock takes that found the lock held and how
//! long they waited (`gpu_broker_state_lock_waits_total`), its holds over 100 us of CPU
//! (`gpu_broker_state_lock_holds_total`), the broker's CPU and the writer's (process
//! writer) during the arm, in cores. Where the state directory lies (disk or tmpfs) is the
//! bench's `TMPDIR`.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use gpu_broker_client::{AdminClient, Client, QuotaSpec, Session};
use serde_json::json;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::admin_reads::{
    lock_counters, metrics_addr, process_cpu, start_child, stop_child, stop_when_stdin_closes,
    LockCounters,
};
use crate::report::{count, json_line, note, us, Table};
use crate::stats::{median, Histogram};
use crate::Common;

/// Where the admin loop runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WriterIn {
    /// A child process of the bench (its own runtime, connection and CPU accounting).
    Process,
    /// A task on the bench's own runtime, beside the timed worker.
    Task,
}

/// The admin call the loop makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Op {
    /// `SetQuota`: a durable commit, then applied in memory.
    Set,
    /// `GetQuota`: a read, no commit (the control).
    Get,
    /// No call at all: a child process that talks to nobody burns `--burn-cores` of CPU
    /// (the control for CPU busy elsewhere on the host).
    Burn,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Set => "set",
            Op::Get => "get",
            Op::Burn => "burn",
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct QuotaWritesArgs {
    /// How long each measurement (one arm of one broker) runs.
    #[arg(long, value_parser = crate::parse_duration, default_value = "3s")]
    pub duration: Duration,
    /// Runs of each arm (interleaved); the table shows the medians.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Tenants whose quotas the admin client writes (or reads) in turn.
    #[arg(long, default_value_t = 16)]
    pub tenants: u32,
    /// Lease size of the worker's acquires.
    #[arg(long, value_parser = gpu_broker_client::units::parse_bytes, default_value = "2MiB")]
    pub size: u64,
    /// Where the admin loop runs: a child process (as an operator's `gpu-brokerctl`) or a
    /// task on the bench's runtime, beside the timed worker.
    #[arg(long, value_enum, default_value = "process")]
    pub writer: WriterIn,
    /// The admin calls of the arms besides "alone", each an arm: `set` (SetQuota, a
    /// durable commit) and/or `get` (GetQuota, no commit: the control, at the pace `set`
    /// reached just before on the same broker unless `--rate` is given).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "set")]
    pub op: Vec<Op>,
    /// At most this many admin calls a second, every arm (0: `set` as fast as calls
    /// return, `get` at the pace `set` reached).
    #[arg(long, default_value_t = 0)]
    pub rate: u32,
    /// Another broker measured side by side with the first, `"[NAME=value...] BIN
    /// [FLAGS...]"` (its environment, binary and flags; repeatable; every arm of every
    /// broker in each run).
    #[arg(long)]
    pub also: Vec<String>,
    /// Cores the `burn` arm keeps busy (0: the broker cores the `set` arm added over alone
    /// on that broker in the same run, or 0.6 without a `set` arm).
    #[arg(long, default_value_t = 0.0)]
    pub burn_cores: f64,
}

/// One broker set up: its worker's session and the tenants the admin loop writes.
struct Broker {
    label: String,
    what: String,
    target: crate::broker::Target,
    admin: AdminClient,
    /// Where the admin loop connects: the operators' socket where the broker has one
    /// (`--admin-listen`), else the main one.
    admin_uri: String,
    /// The admin loop's client (a task writer), on `admin_uri`.
    loop_admin: AdminClient,
    session: Session,
    /// The metrics listener (brokers the bench started).
    http: Option<String>,
    names: Vec<String>,
}

/// One measurement: the worker's acquires, and the admin calls done meanwhile.
#[derive(Default)]
struct Run {
    acquire: Histogram,
    /// Admin calls a second, and their p50 (us).
    calls_per_s: f64,
    call_p50_us: f64,
    /// Lock counter deltas (None: the broker has no such counter or no metrics listener).
    locks: LockCounters,
    broker_cores: Option<f64>,
    writer_cores: Option<f64>,
}

pub async fn run(common: &Common, a: &QuotaWritesArgs) -> Result<()> {
    if a.repeat == 0 || a.repeat > 100 || a.tenants == 0 || a.tenants > 10_000 {
        bail!("need 1..=100 runs and 1..=10000 tenants");
    }
    let mut brokers = vec![setup(common, "A".into(), Vec::new(), a).await?];
    for (i, spec) in a.also.iter().enumerate() {
        // [NAME=value...] BIN [FLAGS...]: the environment words stay first in `extra`.
        let words: Vec<String> = spec.split_whitespace().map(str::to_string).collect();
        let envs = words
            .iter()
            .take_while(|w| crate::broker::env_word(w).is_some())
            .count();
        let bin = words.get(envs).context("--also needs a broker binary")?;
        let c = common.with_broker_bin(Some(bin.into()));
        let label = ((b'B' + i as u8) as char).to_string();
        let mut extra = words[..envs].to_vec();
        extra.extend(words[envs + 1..].iter().cloned());
        brokers.push(setup(&c, label, extra, a).await?);
    }
    let mut arms: Vec<Option<Op>> = vec![None];
    for op in &a.op {
        if !arms.contains(&Some(*op)) {
            arms.push(Some(*op));
        }
    }
    note(format!(
        "quota-writes: {} runs x {:.1} s of pooled acquires ({} B) per arm and broker, alone and while an admin client ({}) runs {} on {} tenants in a loop{}; state in {}",
        a.repeat,
        a.duration.as_secs_f64(),
        a.size,
        match a.writer {
            WriterIn::Process => "child process",
            WriterIn::Task => "task of the bench",
        },
        a.op.iter().map(|o| o.name()).collect::<Vec<_>>().join(" / "),
        a.tenants,
        if a.rate == 0 {
            String::new()
        } else {
            format!(", at most {}/s", a.rate)
        },
        std::env::temp_dir().display()
    ));
    let meter = crate::cpu::Meter::start(brokers[0].target.pid);
    let mut runs: Vec<Vec<Vec<Run>>> = brokers
        .iter()
        .map(|_| arms.iter().map(|_| Vec::new()).collect())
        .collect();
    for rep in 0..a.repeat {
        // The pace `set` reached on each broker this run (`get` keeps to it).
        let mut set_pace = vec![0u32; brokers.len()];
        // The broker cores alone, and what `set` added over them (the `burn` arm's load).
        let mut alone_cores = vec![None; brokers.len()];
        let mut set_excess = vec![None; brokers.len()];
        for (i, op) in arms.iter().enumerate() {
            for (b, br) in brokers.iter().enumerate() {
                let rate = match op {
                    Some(Op::Get) if a.rate == 0 => set_pace[b],
                    _ => a.rate,
                };
                let burn = if a.burn_cores > 0.0 {
                    a.burn_cores
                } else {
                    set_excess[b].filter(|c: &f64| *c > 0.0).unwrap_or(0.6)
                };
                let r = measure(br, *op, rate, burn, a).await?;
                match op {
                    None => alone_cores[b] = r.broker_cores,
                    Some(Op::Set) => {
                        set_pace[b] = r.calls_per_s.round() as u32;
                        set_excess[b] = r.broker_cores.zip(alone_cores[b]).map(|(s, a)| s - a);
                    }
                    _ => {}
                }
                json_line(
                    common.json,
                    &json!({"mode": "quota-writes", "broker": br.label, "arm": arm_name(*op),
                            "writer": format!("{:?}", a.writer).to_lowercase(), "run": rep,
                            "calls": r.acquire.count(), "p50_us": r.acquire.q_us(0.5),
                            "p99_us": r.acquire.q_us(0.99), "max_us": r.acquire.max_us(),
                            "admin_calls_per_s": r.calls_per_s, "admin_p50_us": r.call_p50_us}),
                );
                runs[b][i].push(r);
            }
        }
    }
    let stat =
        |runs: &[Run], f: &dyn Fn(&Run) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
    let opt_med = |runs: &[Run], f: &dyn Fn(&Run) -> Option<f64>| {
        let v: Option<Vec<f64>> = runs.iter().map(f).collect();
        v.map(|v| median(&v))
    };
    let mut table = Table::new(
        format!(
            "quota-writes: pooled acquire, one worker, microseconds (median over {} runs; admin loop in a {})",
            a.repeat,
            match a.writer {
                WriterIn::Process => "child process",
                WriterIn::Task => "task of the bench",
            }
        ),
        &[
            "broker",
            "arm",
            "acquires/run",
            "p50",
            "p90",
            "p99",
            "max",
            "p50 ratio",
            "p99 ratio",
            "pooled p50 ratio",
            "pooled p99 ratio",
            "admin calls/s",
            "admin p50",
            "lock waits",
            "waits > 100 us",
            "waits > 1 ms",
            "holds cpu > 100 us",
            "broker cores",
            "writer cores",
        ],
    );
    let opt = |v: Option<f64>| v.map(|v| count(v as u64)).unwrap_or_else(|| "-".into());
    let cores = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into());
    let mut verdicts = Vec::new();
    for (b, br) in brokers.iter().enumerate() {
        let alone = &runs[b][0];
        let pooled_alone = pooled(alone);
        let (p50a, p99a) = (
            stat(alone, &|r| r.acquire.q_us(0.5)),
            stat(alone, &|r| r.acquire.q_us(0.99)),
        );
        for (i, op) in arms.iter().enumerate() {
            let rs = &runs[b][i];
            let (p50, p99) = (
                stat(rs, &|r| r.acquire.q_us(0.5)),
                stat(rs, &|r| r.acquire.q_us(0.99)),
            );
            let (r50, r99) = (p50 / p50a.max(1e-9), p99 / p99a.max(1e-9));
            // Every acquire of the arm's runs in one histogram: its quantiles rest on all
            // the samples, so a run's tail does not swing the figure as a median of runs' p99 can.
            let all = pooled(rs);
            let (q50, q99) = (
                all.q_us(0.5) / pooled_alone.q_us(0.5).max(1e-9),
                all.q_us(0.99) / pooled_alone.q_us(0.99).max(1e-9),
            );
            let lock = |k: usize| opt_med(rs, &|r| r.locks[k].map(|v| v as f64));
            table.row(vec![
                br.label.clone(),
                arm_name(*op).into(),
                count(stat(rs, &|r| r.acquire.count() as f64) as u64),
                us(p50),
                us(stat(rs, &|r| r.acquire.q_us(0.9))),
                us(p99),
                us(stat(rs, &|r| r.acquire.max_us())),
                format!("{r50:.2}"),
                format!("{r99:.2}"),
                format!("{q50:.2}"),
                format!("{q99:.2}"),
                if op.is_none() {
                    "-".into()
                } else {
                    format!("{:.0}", stat(rs, &|r| r.calls_per_s))
                },
                if op.is_none() {
                    "-".into()
                } else {
                    us(stat(rs, &|r| r.call_p50_us))
                },
                opt(lock(8)),
                opt(lock(9)),
                opt(lock(10)),
                opt(lock(5)),
                cores(opt_med(rs, &|r| r.broker_cores)),
                cores(opt_med(rs, &|r| r.writer_cores)),
            ]);
            json_line(
                common.json,
                &json!({"mode": "quota-writes", "summary": "median_of_runs", "broker": br.label,
                        "what": br.what.trim(), "arm": arm_name(*op),
                        "writer": format!("{:?}", a.writer).to_lowercase(), "rate": a.rate,
                        "state_dir": std::env::temp_dir(),
                        "p50_us": p50, "p99_us": p99, "ratio_p50": r50, "ratio_p99": r99,
                        "pooled_p50_us": all.q_us(0.5), "pooled_p99_us": all.q_us(0.99),
                        "pooled_ratio_p50": q50, "pooled_ratio_p99": q99,
                        "alone_p50_us": p50a, "alone_p99_us": p99a,
                        "admin_calls_per_s": stat(rs, &|r| r.calls_per_s),
                        "admin_p50_us": stat(rs, &|r| r.call_p50_us),
                        "lock_waits": lock(8), "lock_waits_over_100us": lock(9),
                        "lock_waits_over_1ms": lock(10), "lock_holds_cpu_over_100us": lock(5),
                        "broker_cores": opt_med(rs, &|r| r.broker_cores),
                        "writer_cores": opt_med(rs, &|r| r.writer_cores)}),
            );
            if let Some(op) = op {
                verdicts.push(format!(
                    "broker {} ({}), {} in a loop: acquire p50 x{r50:.2}, p99 x{r99:.2} of alone (median of runs); pooled x{q50:.2}, x{q99:.2}{}",
                    br.label,
                    br.what.trim(),
                    op.name(),
                    if *op == Op::Set {
                        if q50 <= 1.1 && q99 <= 1.1 {
                            " -> target MET"
                        } else {
                            " -> target MISSED"
                        }
                    } else {
                        " (control)"
                    }
                ));
            }
        }
    }
    table.print();
    println!("{}", meter.line());
    println!("target: acquire while writing quotas within 10% of alone");
    for v in verdicts {
        println!("  {v}");
    }
    println!();
    for mut br in brokers {
        br.session.close();
        for n in &br.names {
            let _ = br.admin.delete_tenant(n).await;
        }
        br.target.cleanup().await;
    }
    Ok(())
}

/// Every acquire of `runs` in one histogram.
fn pooled(runs: &[Run]) -> Histogram {
    let mut all = Histogram::default();
    for r in runs {
        all.merge(&r.acquire);
    }
    all
}

fn arm_name(op: Option<Op>) -> &'static str {
    match op {
        None => "alone",
        Some(Op::Set) => "set quotas",
        Some(Op::Get) => "get quotas",
        Some(Op::Burn) => "burn cpu",
    }
}

/// Starts a broker (or connects to the one given), with a metrics listener when started
/// here; its worker warmed up and the tenants the admin loop writes created.
async fn setup(
    common: &Common,
    label: String,
    extra: Vec<String>,
    a: &QuotaWritesArgs,
) -> Result<Broker> {
    let what = common.broker_what(&extra);
    let flags = crate::broker::counting_lock_holds(&extra);
    let mut target = common.target_with("32TiB", None, flags)?;
    let http = target.spawned.as_ref().and_then(|s| metrics_addr(&s.log));
    let admin = target.admin().await?;
    let (_, token) = target
        .tenant(&format!("quota-writes-{label}"), QuotaSpec::new(1 << 40))
        .await?;
    let client = Client::connect(&target.uri, token).await?;
    let session = client.session("bench-quota-writes").await?;
    let names: Vec<String> = (0..a.tenants)
        .map(|i| format!("bench-qw-{}-{label}-{i:04}", std::process::id()))
        .collect();
    for n in &names {
        admin.set_quota(n, QuotaSpec::new(1 << 30)).await?;
    }
    for _ in 0..200 {
        session.lease(a.size).await?.release().await?;
    }
    let admin_uri = match operators_socket(&extra) {
        Some(path) => format!("unix://{path}"),
        None => target.uri.clone(),
    };
    let loop_admin = AdminClient::connect(&admin_uri, target.admin_token.clone()).await?;
    Ok(Broker {
        label,
        what,
        target,
        admin,
        admin_uri,
        loop_admin,
        session,
        http,
        names,
    })
}

/// The operators' socket among a broker's flags (`--admin-listen PATH` or `=PATH`).
fn operators_socket(flags: &[String]) -> Option<String> {
    flags.iter().enumerate().find_map(|(i, f)| {
        if f == "--admin-listen" {
            flags.get(i + 1).cloned()
        } else {
            f.strip_prefix("--admin-listen=").map(str::to_string)
        }
    })
}

/// The admin loop: `op` on `names` in turn until `stop`, at most `rate` a second
/// (0: no cap). Returns the calls' latencies and how long the loop ran.
async fn admin_loop(
    admin: AdminClient,
    names: Vec<String>,
    op: Op,
    rate: u32,
    stop: Arc<AtomicBool>,
    started: impl FnOnce(),
) -> Result<(Histogram, Duration)> {
    let mut h = Histogram::default();
    let mut started = Some(started);
    let t_start = Instant::now();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        if rate > 0 {
            let due = t_start + Duration::from_secs_f64(i as f64 / rate as f64);
            tokio::time::sleep_until(due.into()).await;
        }
        let name = &names[i as usize % names.len()];
        let t0 = Instant::now();
        match op {
            Op::Set => {
                let limit = (1u64 << 30) + (i % 1024) * (1 << 20);
                admin.set_quota(name, QuotaSpec::new(limit)).await?;
            }
            Op::Get => {
                admin.get_quota(name).await?;
            }
            Op::Burn => bail!("the burn arm makes no admin call"),
        }
        h.record(t0.elapsed());
        i += 1;
        if let Some(f) = started.take() {
            f();
        }
    }
    Ok((h, t_start.elapsed()))
}

/// An admin loop that is running: stop it for its calls a second, their p50, and (in a
/// process) its CPU.
enum Writer {
    Task(
        Arc<AtomicBool>,
        tokio::task::JoinHandle<Result<(Histogram, Duration)>>,
    ),
    Process(
        std::process::Child,
        std::io::BufReader<std::process::ChildStdout>,
    ),
}

impl Writer {
    async fn start(b: &Broker, op: Op, rate: u32, burn: f64, place: WriterIn) -> Result<Writer> {
        // The burn arm always runs in a process of its own.
        let place = if op == Op::Burn {
            WriterIn::Process
        } else {
            place
        };
        match place {
            WriterIn::Task => {
                let stop = Arc::new(AtomicBool::new(false));
                let (tx, rx) = tokio::sync::oneshot::channel();
                let t = tokio::spawn(admin_loop(
                    b.loop_admin.clone(),
                    b.names.clone(),
                    op,
                    rate,
                    stop.clone(),
                    move || {
                        let _ = tx.send(());
                    },
                ));
                // The first call answered (or the loop failed: its result says why).
                let _ = rx.await;
                Ok(Writer::Task(stop, t))
            }
            WriterIn::Process => {
                let (uri, token) = (b.admin_uri.clone(), b.target.admin_token.clone());
                let (names, rate, burn) = (b.names.join(","), rate.to_string(), burn.to_string());
                let (child, out, line) = tokio::task::spawn_blocking(move || {
                    start_child(
                        "quota-writer",
                        &[
                            "--uri",
                            &uri,
                            "--tenants",
                            &names,
                            "--op",
                            op.name(),
                            "--rate",
                            &rate,
                            "--burn-cores",
                            &burn,
                        ],
                        &[("GPB_BENCH_ADMIN_TOKEN", &token)],
                    )
                })
                .await??;
                anyhow::ensure!(
                    line.trim() == "ready",
                    "the quota writer did not start: {line:?}"
                );
                Ok(Writer::Process(child, out))
            }
        }
    }

    /// (calls a second, call p50 us, the writer's CPU in cores if measured apart).
    async fn stop(self) -> Result<(f64, f64, Option<f64>)> {
        match self {
            Writer::Task(stop, t) => {
                stop.store(true, Ordering::Relaxed);
                let (h, ran) = t.await??;
                Ok((
                    h.count() as f64 / ran.as_secs_f64().max(1e-9),
                    h.q_us(0.5),
                    None,
                ))
            }
            Writer::Process(child, out) => {
                tokio::task::spawn_blocking(move || {
                    // It answers one line of its figures.
                    let line = stop_child(child, out, "the quota writer")?;
                    let w = WriterReport::parse(&line)?;
                    let ran = w.secs.max(1e-9);
                    Ok((w.calls as f64 / ran, w.p50_us, Some(w.cpu_s / ran)))
                })
                .await?
            }
        }
    }
}

/// What the writer process says when it stops.
#[derive(Debug, PartialEq)]
struct WriterReport {
    calls: u64,
    secs: f64,
    p50_us: f64,
    cpu_s: f64,
}

impl WriterReport {
    fn line(&self) -> String {
        format!(
            "calls {} secs {} p50_us {} cpu_s {}",
            self.calls, self.secs, self.p50_us, self.cpu_s
        )
    }

    fn parse(line: &str) -> Result<WriterReport> {
        let mut it = line.split_whitespace();
        let mut field = |key: &str| -> Result<f64> {
            anyhow::ensure!(it.next() == Some(key), "the quota writer said {line:?}");
            Ok(it.next().context("no value")?.parse()?)
        };
        Ok(WriterReport {
            calls: field("calls")? as u64,
            secs: field("secs")?,
            p50_us: field("p50_us")?,
            cpu_s: field("cpu_s")?,
        })
    }
}

/// Pooled acquires for `a.duration`, each timed; with `op`, the admin loop runs meanwhile.
async fn measure(
    b: &Broker,
    op: Option<Op>,
    rate: u32,
    burn: f64,
    a: &QuotaWritesArgs,
) -> Result<Run> {
    let writer = match op {
        Some(op) => {
            let w = Writer::start(b, op, rate, burn, a.writer).await?;
            // Let the loop reach its steady state.
            tokio::time::sleep(Duration::from_millis(50)).await;
            Some(w)
        }
        None => None,
    };
    let before = match &b.http {
        Some(h) => lock_counters(h).await?,
        None => [None; 12],
    };
    let cpu0 = process_cpu(b.target.pid);
    let t0 = Instant::now();
    let mut acquire = Histogram::default();
    let end = t0 + a.duration;
    let timed = async {
        while Instant::now() < end {
            let t = Instant::now();
            let lease = b.session.lease(a.size).await?;
            acquire.record(t.elapsed());
            lease.release().await?;
        }
        anyhow::Ok(())
    }
    .await;
    let wall = t0.elapsed().as_secs_f64().max(1e-9);
    let cpu1 = process_cpu(b.target.pid);
    let after = match &b.http {
        Some(h) => lock_counters(h).await?,
        None => [None; 12],
    };
    let (calls_per_s, call_p50_us, writer_cores) = match writer {
        Some(w) => w.stop().await?,
        None => (0.0, 0.0, None),
    };
    timed?;
    let mut locks = [None; 12];
    for (k, l) in locks.iter_mut().enumerate() {
        *l = after[k].zip(before[k]).map(|(x, y)| x.saturating_sub(y));
    }
    Ok(Run {
        acquire,
        calls_per_s,
        call_p50_us,
        locks,
        broker_cores: cpu0
            .zip(cpu1)
            .map(|(x, y)| y.saturating_sub(x).as_secs_f64() / wall),
        writer_cores,
    })
}

/// The hidden `quota-writer` mode: the admin loop of `--writer process`.
#[derive(Debug, Args)]
pub struct QuotaWriterArgs {
    #[arg(long)]
    uri: String,
    /// The tenants to write, comma-separated.
    #[arg(long, value_delimiter = ',')]
    tenants: Vec<String>,
    #[arg(long, value_enum)]
    op: Op,
    #[arg(long, default_value_t = 0)]
    rate: u32,
    /// Cores the burn arm keeps busy.
    #[arg(long, default_value_t = 0.6)]
    burn_cores: f64,
}

/// The burn arm: threads that keep `cores` of CPU busy (each a duty cycle of 1 ms slices)
/// until `stop`; (slices, seconds).
fn burn(cores: f64, stop: Arc<AtomicBool>) -> (u64, Duration) {
    let threads = cores.ceil().max(1.0) as usize;
    let duty = (cores / threads as f64).clamp(0.0, 1.0);
    let t0 = Instant::now();
    let slices: u64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                s.spawn(move || {
                    let mut n = 0u64;
                    let slice = Duration::from_millis(1);
                    while !stop.load(Ordering::Relaxed) {
                        let start = Instant::now();
                        let mut x = 0u64;
                        while start.elapsed() < slice.mul_f64(duty) {
                            x = std::hint::black_box(
                                x.wrapping_mul(6364136223846793005).wrapping_add(1),
                            );
                        }
                        std::thread::sleep(slice.mul_f64(1.0 - duty));
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    (slices, t0.elapsed())
}

/// Runs the admin loop until stdin closes; prints "ready" once the first call is
/// answered, then the figures ([`WriterReport`]).
pub async fn writer_process(a: &QuotaWriterArgs) -> Result<()> {
    if a.op == Op::Burn {
        anyhow::ensure!(
            a.burn_cores > 0.0 && a.burn_cores <= 64.0,
            "--burn-cores must be in (0, 64]"
        );
        let stop = stop_when_stdin_closes();
        let cpu0 = process_cpu(None).unwrap_or_default();
        println!("ready");
        let _ = std::io::stdout().flush();
        let cores = a.burn_cores;
        let (_, ran) = tokio::task::spawn_blocking(move || burn(cores, stop)).await?;
        let cpu = process_cpu(None).unwrap_or_default().saturating_sub(cpu0);
        let r = WriterReport {
            calls: 0,
            secs: ran.as_secs_f64(),
            p50_us: 0.0,
            cpu_s: cpu.as_secs_f64(),
        };
        println!("{}", r.line());
        return Ok(());
    }
    anyhow::ensure!(!a.tenants.is_empty(), "no tenants to write");
    let admin = AdminClient::connect(&a.uri, std::env::var("GPB_BENCH_ADMIN_TOKEN")?).await?;
    let stop = stop_when_stdin_closes();
    let cpu0 = process_cpu(None).unwrap_or_default();
    let (h, ran) = admin_loop(admin, a.tenants.clone(), a.op, a.rate, stop, || {
        println!("ready");
        let _ = std::io::stdout().flush();
    })
    .await?;
    let cpu = process_cpu(None).unwrap_or_default().saturating_sub(cpu0);
    let r = WriterReport {
        calls: h.count(),
        secs: ran.as_secs_f64(),
        p50_us: h.q_us(0.5),
        cpu_s: cpu.as_secs_f64(),
    };
    println!("{}", r.line());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writer_report_round_trips() {
        let r = WriterReport {
            calls: 1234,
            secs: 1.5,
            p50_us: 812.25,
            cpu_s: 0.25,
        };
        assert_eq!(WriterReport::parse(&r.line()).unwrap(), r);
        assert!(WriterReport::parse("reads 3 cpu_us 4").is_err());
        assert!(WriterReport::parse("calls x secs 1 p50_us 1 cpu_s 1").is_err());
    }

    #[test]
    fn the_admin_loop_finds_the_operators_socket_among_the_flags() {
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            operators_socket(&words(&[
                "--admin-threads",
                "2",
                "--admin-listen",
                "/r/a.sock"
            ])),
            Some("/r/a.sock".into())
        );
        assert_eq!(
            operators_socket(&words(&["X=1", "--admin-listen=/r/b.sock"])),
            Some("/r/b.sock".into())
        );
        assert_eq!(operators_socket(&words(&["--admin-threads", "0"])), None);
        assert_eq!(operators_socket(&words(&["--admin-listen"])), None);
    }

    #[test]
    fn environment_words() {
        use crate::broker::env_word;
        assert_eq!(
            env_word("TOKIO_WORKER_THREADS=4"),
            Some(("TOKIO_WORKER_THREADS".into(), "4".into()))
        );
        assert_eq!(env_word("GPU_BROKER_LOG=warn,x=y").unwrap().1, "warn,x=y");
        assert_eq!(env_word("--admin-threads=0"), None);
        assert_eq!(env_word("/bin/gpu-broker"), None);
        assert_eq!(env_word("lower=1"), None);
        assert_eq!(env_word("=1"), None);
    }
}
