//! `throughput`: W concurrent workers, each with its own connection and session over the
//! broker's socket, each doing acquire+release pairs of one pooled size back to back for
//! a warm-up and then a measured window. Workers are tasks of this process, or with
//! `--processes P` spread over P worker processes (this binary's hidden `worker`
//! subcommand), which start together on a `go` line and report a JSON line each.
//! Reports pairs per second (pairs completed inside the window / window length), the
//! pair's latency percentiles, and the CPU time the broker used during the window.

use anyhow::{bail, Context, Result};
use clap::Args;
use gpu_broker_client::units::parse_bytes;
use gpu_broker_client::{Client, QuotaSpec};
use serde_json::{json, Value};
use std::future::Future;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, watch};

use crate::cpu;
use crate::report::{bytes, count, json_line, note, us, Table};
use crate::stats::{median, Histogram};
use crate::{parse_duration, Common};

/// Environment variable carrying tenant tokens to worker processes (comma-separated).
const TOKENS_ENV: &str = "GPU_BROKER_BENCH_TOKENS";

#[derive(Debug, Clone, Args)]
pub struct ThroughputArgs {
    /// Concurrent workers (each its own connection and session).
    #[arg(long, default_value_t = 32)]
    pub workers: u32,
    /// Measured window of each run.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub duration: Duration,
    /// Unmeasured load before the window.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub warmup: Duration,
    /// Lease size of every pair.
    #[arg(long, value_parser = parse_bytes, default_value = "2MiB")]
    pub size: u64,
    /// Tenants the workers are spread over (round robin).
    #[arg(long, default_value_t = 4)]
    pub tenants: u32,
    /// Run the workers in this many separate processes (0: tasks of this process).
    #[arg(long, default_value_t = 0)]
    pub processes: u32,
    /// Runs; the table shows each and their median.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Capacity of a started (host) broker.
    #[arg(long, default_value = "1TiB")]
    pub host_capacity: String,
    /// Each worker's session retains its released block mapped
    /// (`Session::retain_mappings`): every pair after the first is its own block again, on
    /// the session's lease line.
    #[arg(long)]
    pub retain: bool,
}

/// Arguments of one worker process (internal).
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    #[arg(long)]
    uri: String,
    /// Global index of this process's first worker (tenant assignment).
    #[arg(long)]
    first: u32,
    #[arg(long)]
    workers: u32,
    #[arg(long)]
    size: u64,
    #[arg(long)]
    warmup_ms: u64,
    #[arg(long)]
    duration_ms: u64,
    #[arg(long)]
    retain: bool,
}

/// What a set of workers measured.
#[derive(Default, Clone)]
struct Outcome {
    pairs: u64,
    pair: Histogram,
    acquire: Histogram,
    release: Histogram,
    errors: u64,
    first_error: Option<String>,
}

impl Outcome {
    fn merge(&mut self, o: &Outcome) {
        self.pairs += o.pairs;
        self.pair.merge(&o.pair);
        self.acquire.merge(&o.acquire);
        self.release.merge(&o.release);
        self.errors += o.errors;
        if self.first_error.is_none() {
            self.first_error.clone_from(&o.first_error);
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "pairs": self.pairs,
            "pair": self.pair.to_json(),
            "acquire": self.acquire.to_json(),
            "release": self.release.to_json(),
            "errors": self.errors,
            "first_error": self.first_error,
        })
    }

    fn from_json(v: &Value) -> Option<Outcome> {
        Some(Outcome {
            pairs: v.get("pairs")?.as_u64()?,
            pair: Histogram::from_json(v.get("pair")?)?,
            acquire: Histogram::from_json(v.get("acquire")?)?,
            release: Histogram::from_json(v.get("release")?)?,
            errors: v.get("errors")?.as_u64()?,
            first_error: v
                .get("first_error")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }
}

/// Shape of one load run.
#[derive(Clone)]
struct Load {
    uri: String,
    tokens: Vec<String>,
    first: u32,
    workers: u32,
    size: u64,
    warmup: Duration,
    duration: Duration,
    retain: bool,
}

pub async fn run(common: &Common, a: &ThroughputArgs) -> Result<()> {
    if a.workers == 0 || a.workers > 4096 || a.tenants == 0 || a.repeat == 0 || a.repeat > 100 {
        bail!("workers must be 1..=4096, tenants >= 1, runs 1..=100");
    }
    if a.processes > a.workers {
        bail!("more processes than workers");
    }
    if a.duration > Duration::from_secs(600) || a.warmup > Duration::from_secs(600) {
        bail!("duration and warm-up are limited to 10 minutes each");
    }
    let mut target = common.target(&a.host_capacity, None)?;
    let admin = target.admin().await?;
    let dev = crate::latency::device0(&admin).await?;
    let per_worker = a.size.div_ceil(dev.granularity_bytes.max(1)) * dev.granularity_bytes.max(1);
    let per_tenant = per_worker * u64::from(a.workers.div_ceil(a.tenants));
    let mut tokens = Vec::new();
    for t in 0..a.tenants {
        let (_, token) = target
            .tenant(&format!("tp{t}"), QuotaSpec::new(per_tenant))
            .await?;
        tokens.push(token);
    }
    let how = if a.processes == 0 {
        "tasks of one process".to_string()
    } else {
        format!("{} processes", a.processes)
    };
    note(format!(
        "throughput: {} workers ({how}), {} tenants, {} pairs, {} runs of {:?} (+{:?} warm-up), client threads {}, device {} ({}), broker {}",
        a.workers,
        a.tenants,
        bytes(a.size),
        a.repeat,
        a.duration,
        a.warmup,
        common.client_threads,
        dev.name,
        dev.backend,
        target.uri
    ));
    let load = Load {
        uri: target.uri.clone(),
        tokens,
        first: 0,
        workers: a.workers,
        size: a.size,
        warmup: a.warmup,
        duration: a.duration,
        retain: a.retain,
    };
    let mut table = Table::new(
        format!(
            "throughput: {} workers ({how}), {} acquire+release pairs{}, {:?} windows; latency in microseconds",
            a.workers,
            bytes(a.size),
            if a.retain { " (retained)" } else { "" },
            a.duration
        ),
        &[
            "run",
            "pairs",
            "pairs/s",
            "pair p50",
            "pair p99",
            "acq p50",
            "acq p99",
            "rel p50",
            "rel p99",
            "broker CPU",
            "client CPU",
            "other CPU",
            "errors",
        ],
    );
    let mut rates = Vec::new();
    let mut p50s = Vec::new();
    let mut p99s = Vec::new();
    let mut cpus = Vec::new();
    for rep in 0..a.repeat {
        let window = a.duration.as_secs_f64();
        let (out, cpu) = if a.processes == 0 {
            run_workers(&load, target.pid, || {}, async {}).await?
        } else {
            run_processes(common, &load, target.pid, a.processes).await?
        };
        let broker_cpu = cpu.pids.first().copied().flatten();
        let client_cpu: Option<f64> = cpu.pids.iter().skip(1).copied().sum();
        let other_cpu = match (cpu.machine, broker_cpu, client_cpu) {
            (Some(m), Some(b), Some(c)) => Some((m - b - c).max(0.0)),
            _ => None,
        };
        if let Some(e) = &out.first_error {
            note(format!("run {rep}: {} errors, first: {e}", out.errors));
        }
        let rate = out.pairs as f64 / window;
        rates.push(rate);
        p50s.push(out.pair.q_us(0.5));
        p99s.push(out.pair.q_us(0.99));
        if let Some(c) = broker_cpu {
            cpus.push(c);
        }
        table.row(vec![
            (rep + 1).to_string(),
            count(out.pairs),
            count(rate.round() as u64),
            us(out.pair.q_us(0.5)),
            us(out.pair.q_us(0.99)),
            us(out.acquire.q_us(0.5)),
            us(out.acquire.q_us(0.99)),
            us(out.release.q_us(0.5)),
            us(out.release.q_us(0.99)),
            cpu::show(broker_cpu),
            cpu::show(client_cpu),
            cpu::show(other_cpu),
            out.errors.to_string(),
        ]);
        json_line(
            common.json,
            &json!({
                "mode": "throughput", "run": rep, "workers": a.workers, "processes": a.processes,
                "tenants": a.tenants, "size": a.size, "window_s": window, "pairs": out.pairs,
                "pairs_per_s": rate, "pair_p50_us": out.pair.q_us(0.5), "pair_p99_us": out.pair.q_us(0.99),
                "acquire_p50_us": out.acquire.q_us(0.5), "acquire_p99_us": out.acquire.q_us(0.99),
                "release_p50_us": out.release.q_us(0.5), "release_p99_us": out.release.q_us(0.99),
                "broker_cpu_cores": broker_cpu, "client_cpu_cores": client_cpu,
                "other_cpu_cores": other_cpu, "errors": out.errors,
            }),
        );
    }
    let rate = median(&rates);
    table.row(vec![
        "median".into(),
        String::new(),
        count(rate.round() as u64),
        us(median(&p50s)),
        us(median(&p99s)),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        if cpus.is_empty() {
            "-".into()
        } else {
            format!("{:.0}%", median(&cpus) * 100.0)
        },
        String::new(),
        String::new(),
        String::new(),
    ]);
    table.print();
    json_line(
        common.json,
        &json!({
            "mode": "throughput", "summary": "median_of_runs", "runs": a.repeat,
            "workers": a.workers, "processes": a.processes, "pairs_per_s": rate,
            "pair_p50_us": median(&p50s), "pair_p99_us": median(&p99s),
        }),
    );
    println!(
        "target: 32 workers >= 10,000 acquire+release pairs/s: {} pairs/s with {} workers -> {}\n",
        count(rate.round() as u64),
        a.workers,
        if rate >= 10_000.0 && a.workers >= 32 {
            "MET"
        } else if a.workers < 32 {
            "n/a (fewer than 32 workers)"
        } else {
            "MISSED"
        }
    );
    target.cleanup().await;
    Ok(())
}

/// CPU use of the broker (first entry) and the load generator's processes (the rest)
/// over the measured window, which starts `load.warmup` after now.
async fn cpu_probe(load: &Load, broker: Option<u32>, clients: Vec<u32>) -> cpu::Usage {
    let Some(broker) = broker else {
        return cpu::Usage::default();
    };
    let mut pids = vec![broker];
    pids.extend(clients);
    tokio::time::sleep(load.warmup).await;
    let a = cpu::snapshot(&pids);
    tokio::time::sleep(load.duration).await;
    cpu::between(&a, &cpu::snapshot(&pids))
}

/// Runs `load.workers` worker tasks: each connects, opens its session and does one pair,
/// then reports ready; once all are ready `on_ready` runs, then `go` resolves, then
/// every worker loops until the window ends. With a `broker` pid, CPU use over the
/// window is measured too.
async fn run_workers(
    load: &Load,
    broker: Option<u32>,
    on_ready: impl FnOnce(),
    go: impl Future<Output = ()>,
) -> Result<(Outcome, cpu::Usage)> {
    let (start_tx, start_rx) = watch::channel::<Option<Instant>>(None);
    let (ready_tx, mut ready_rx) = mpsc::channel::<bool>(load.workers as usize);
    let mut handles = Vec::new();
    for i in 0..load.workers {
        let index = load.first + i;
        let token = load.tokens[index as usize % load.tokens.len()].clone();
        let uri = load.uri.clone();
        let (size, warmup, duration, retain) = (load.size, load.warmup, load.duration, load.retain);
        let ready_tx = ready_tx.clone();
        let mut start_rx = start_rx.clone();
        handles.push(tokio::spawn(async move {
            let setup = async {
                let client = Client::connect(&uri, token).await?;
                let session = client.session(format!("bench-worker-{index}")).await?;
                if retain {
                    session.retain_mappings(size);
                }
                session.lease(size).await?.release().await?;
                anyhow::Ok(session)
            }
            .await;
            let _ = ready_tx.send(setup.is_ok()).await;
            drop(ready_tx);
            let session = setup?;
            let start = loop {
                if let Some(s) = *start_rx.borrow_and_update() {
                    break s;
                }
                start_rx.changed().await.context("coordinator gone")?;
            };
            let (ws, we) = (start + warmup, start + warmup + duration);
            let mut out = Outcome::default();
            let mut consecutive = 0u32;
            loop {
                let t0 = Instant::now();
                if t0 >= we {
                    break;
                }
                let lease = match session.lease(size).await {
                    Ok(l) => l,
                    Err(e) => {
                        out.errors += 1;
                        out.first_error.get_or_insert_with(|| e.to_string());
                        consecutive += 1;
                        if consecutive > 1000 {
                            bail!("1000 acquires in a row failed: {e}");
                        }
                        tokio::task::yield_now().await;
                        continue;
                    }
                };
                consecutive = 0;
                let t1 = Instant::now();
                if let Err(e) = lease.release().await {
                    out.errors += 1;
                    out.first_error.get_or_insert_with(|| e.to_string());
                    continue;
                }
                let t2 = Instant::now();
                if t0 >= ws && t2 <= we {
                    out.pairs += 1;
                    out.pair.record(t2 - t0);
                    out.acquire.record(t1 - t0);
                    out.release.record(t2 - t1);
                }
            }
            session.close();
            anyhow::Ok(out)
        }));
    }
    drop(ready_tx);
    let mut all_ok = true;
    for _ in 0..load.workers {
        match ready_rx.recv().await {
            Some(ok) => all_ok &= ok,
            None => {
                all_ok = false;
                break;
            }
        }
    }
    if all_ok {
        on_ready();
        go.await;
    }
    let _ = start_tx.send(Some(Instant::now()));
    let probed = cpu_probe(load, broker, vec![std::process::id()]).await;
    let mut total = Outcome::default();
    let mut first_failure = None;
    for h in handles {
        match h.await {
            Ok(Ok(o)) => total.merge(&o),
            Ok(Err(e)) => {
                first_failure.get_or_insert(e);
            }
            Err(e) => {
                first_failure.get_or_insert(anyhow::anyhow!("worker task failed: {e}"));
            }
        }
    }
    if let Some(e) = first_failure {
        return Err(e.context("a throughput worker failed"));
    }
    Ok((total, probed))
}

/// Spreads the workers over `processes` child processes of this binary.
async fn run_processes(
    common: &Common,
    load: &Load,
    broker: Option<u32>,
    processes: u32,
) -> Result<(Outcome, cpu::Usage)> {
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    let mut first = 0;
    for p in 0..processes {
        let n = load.workers / processes + u32::from(p < load.workers % processes);
        let mut child = tokio::process::Command::new(&exe)
            .args([
                "--client-threads".to_string(),
                common.client_threads.to_string(),
                "worker".into(),
                "--uri".into(),
                load.uri.clone(),
                "--first".into(),
                first.to_string(),
                "--workers".into(),
                n.to_string(),
                "--size".into(),
                load.size.to_string(),
                "--warmup-ms".into(),
                load.warmup.as_millis().to_string(),
                "--duration-ms".into(),
                load.duration.as_millis().to_string(),
            ])
            .args(load.retain.then_some("--retain"))
            .env(TOKENS_ENV, load.tokens.join(","))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting a worker process")?;
        let stdout = child.stdout.take().context("worker stdout")?;
        let stdin = child.stdin.take().context("worker stdin")?;
        children.push((child, BufReader::new(stdout).lines(), stdin));
        first += n;
    }
    // Wait until every process is connected and warm.
    let ready_by = tokio::time::Instant::now() + Duration::from_secs(60);
    for (_, lines, _) in children.iter_mut() {
        let line = tokio::time::timeout_at(ready_by, lines.next_line())
            .await
            .context("a worker process did not get ready within 60 s")??;
        if line.as_deref() != Some("READY") {
            bail!("a worker process failed to start: {line:?}");
        }
    }
    for (_, _, stdin) in children.iter_mut() {
        stdin.write_all(b"go\n").await?;
        stdin.flush().await?;
    }
    let pids: Vec<u32> = children.iter().filter_map(|c| c.0.id()).collect();
    let probed = cpu_probe(load, broker, pids).await;
    let mut total = Outcome::default();
    let done_by = tokio::time::Instant::now() + load.duration + Duration::from_secs(60);
    for (mut child, mut lines, stdin) in children {
        drop(stdin);
        let line = tokio::time::timeout_at(done_by, lines.next_line())
            .await
            .context("a worker process did not report in time")??
            .context("a worker process ended without a result")?;
        let v: Value = serde_json::from_str(&line).context("worker result")?;
        if let Some(e) = v.get("error").and_then(Value::as_str) {
            bail!("a worker process failed: {e}");
        }
        total.merge(&Outcome::from_json(&v).context("malformed worker result")?);
        let _ = child.wait().await;
    }
    Ok((total, probed))
}

/// The hidden `worker` subcommand: one process of `throughput --processes`.
pub async fn worker_process(_common: &Common, a: &WorkerArgs) -> Result<()> {
    let tokens: Vec<String> = std::env::var(TOKENS_ENV)
        .context("no tenant tokens in the environment")?
        .split(',')
        .map(str::to_string)
        .collect();
    let load = Load {
        uri: a.uri.clone(),
        tokens,
        first: a.first,
        workers: a.workers,
        size: a.size,
        warmup: Duration::from_millis(a.warmup_ms),
        duration: Duration::from_millis(a.duration_ms),
        retain: a.retain,
    };
    let go = async {
        let mut stdin = BufReader::new(tokio::io::stdin()).lines();
        let _ = stdin.next_line().await;
    };
    let result = run_workers(&load, None, || println!("READY"), go).await;
    match result {
        Ok((out, _)) => println!("{}", out.to_json()),
        Err(e) => println!("{}", json!({ "error": format!("{e:#}") })),
    }
    Ok(())
}
