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
//!
//! Where the time goes is shown beside it: the takes of the state lock that found it held
//! and how long they waited (`gpu_broker_state_lock_waits_total`, brokers that count
//! them), the broker's CPU and the read loops' CPU during the arm (in cores). The read
//! loops run in a child process of the bench by default (`--readers process`), so that
//! decoding their answers takes nothing from the timed worker's process; `--readers
//! thread` runs them on a thread of the bench itself. More brokers (`--also "BIN
//! [FLAGS]"`) are set up alike and measured side by side: every arm of every broker in
//! each round, interleaved.

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use gpu_broker_client::{AdminClient, Client, QuotaSpec, Session};
use serde_json::json;
use std::io::{BufRead, Write};
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

/// Where phase 3's read loops run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReadersIn {
    /// A child process of the bench (its own runtime, connections and CPU accounting).
    Process,
    /// A thread of the bench, with its own runtime and connections.
    Thread,
}

/// Phase 3's settings beyond the sizes.
#[derive(Debug, Clone)]
pub struct Phase3 {
    pub tenants: u32,
    pub leases: u32,
    pub duration: Duration,
    pub rounds: u32,
    pub readers: ReadersIn,
    /// More brokers to measure beside the first: `BIN [FLAGS...]` each.
    pub also: Vec<String>,
    /// Read arms to run (1-7, as listed; the quiet arm always runs); empty: all.
    pub arms: Vec<usize>,
}

/// Where the read loops connect: they run on their own runtime, with their own
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

/// Runs the read loops `kinds` until `stop` is set; how many reads were done.
async fn read_loops(
    r: Readers,
    kinds: Vec<usize>,
    stop: Arc<AtomicBool>,
    ready: impl FnOnce(),
) -> Result<u64> {
    let c = Arc::new(ReadClients::connect(&r).await?);
    let done = Arc::new(AtomicU64::new(0));
    ready();
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
}

/// Read loops that are running: stop them for the reads done and the CPU they took
/// (None: not measured apart, a thread of this process).
enum Running {
    Thread(Arc<AtomicBool>, std::thread::JoinHandle<Result<u64>>),
    Process(
        std::process::Child,
        std::io::BufReader<std::process::ChildStdout>,
    ),
}

impl Running {
    fn stop(self) -> Result<(u64, Option<Duration>)> {
        match self {
            Running::Thread(stop, t) => {
                stop.store(true, Ordering::Relaxed);
                let n = t
                    .join()
                    .map_err(|_| anyhow::anyhow!("a read loop panicked"))??;
                Ok((n, None))
            }
            Running::Process(child, out) => {
                // It answers "reads N cpu_us M".
                let line = stop_child(child, out, "the read process")?;
                let mut it = line.split_whitespace();
                let field = |it: &mut std::str::SplitWhitespace, key: &str| -> Result<u64> {
                    anyhow::ensure!(it.next() == Some(key), "read process said {line:?}");
                    Ok(it.next().context("no value")?.parse()?)
                };
                let n = field(&mut it, "reads")?;
                let cpu = field(&mut it, "cpu_us")?;
                Ok((n, Some(Duration::from_micros(cpu))))
            }
        }
    }
}

/// Starts the read loops `kinds` (a child process or a thread of their own); returns
/// once they are connected.
fn start_reads(readers: &Readers, kinds: &[usize], place: ReadersIn) -> Result<Running> {
    match place {
        ReadersIn::Thread => {
            let stop = Arc::new(AtomicBool::new(false));
            let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
            let (r, kinds, s) = (readers.clone(), kinds.to_vec(), stop.clone());
            let handle = std::thread::spawn(move || -> Result<u64> {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?;
                rt.block_on(read_loops(r, kinds, s, move || {
                    let _ = ready_tx.send(());
                }))
            });
            // Connected (or failed: the thread's result says why).
            let _ = ready_rx.recv();
            Ok(Running::Thread(stop, handle))
        }
        ReadersIn::Process => {
            let kinds: Vec<String> = kinds.iter().map(|k| k.to_string()).collect();
            let (child, out, line) = start_child(
                "reads",
                &[
                    "--uri",
                    &readers.uri,
                    "--http",
                    &readers.http,
                    "--kinds",
                    &kinds.join(","),
                ],
                &[
                    ("GPB_BENCH_ADMIN_TOKEN", &readers.admin_token),
                    ("GPB_BENCH_HOLDER_TOKEN", &readers.holder_token),
                ],
            )?;
            anyhow::ensure!(
                line.trim() == "ready",
                "the read process did not start: {line:?}"
            );
            Ok(Running::Process(child, out))
        }
    }
}

/// Starts this bench's hidden mode `mode` with `args` and `env` (stdin and stdout piped:
/// closing its stdin ends it); the child, its output and its first line. A child that
/// does not get as far as its first line is killed.
pub(crate) fn start_child(
    mode: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<(
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
    String,
)> {
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .arg(mode)
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("starting the bench's {mode} process"))?;
    let mut out = std::io::BufReader::new(child.stdout.take().context("stdout")?);
    let mut line = String::new();
    if out.read_line(&mut line).is_err() || line.is_empty() {
        let _ = child.kill();
        let _ = child.wait();
        anyhow::bail!("the bench's {mode} process exited before it started");
    }
    Ok((child, out, line))
}

/// Ends a child that [`start_child`] started: closes its stdin (which stops it), reads
/// the one line it answers with, and waits for it; an error names `what` when it failed.
pub(crate) fn stop_child(
    mut child: std::process::Child,
    mut out: std::io::BufReader<std::process::ChildStdout>,
    what: &str,
) -> Result<String> {
    drop(child.stdin.take());
    let mut line = String::new();
    out.read_line(&mut line)?;
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "{what} failed: {status}");
    Ok(line)
}

/// Blocks until this process's stdin closes (the parent of a hidden mode ends it so).
pub(crate) fn until_stdin_closes() {
    let mut sink = Vec::new();
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
}

/// A flag that turns true once this process's stdin closes (watched by a thread).
pub(crate) fn stop_when_stdin_closes() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        until_stdin_closes();
        s.store(true, Ordering::Relaxed);
    });
    stop
}

/// The hidden `reads` mode: the child process of `--readers process`.
#[derive(Debug, Args)]
pub struct ReadsArgs {
    #[arg(long)]
    uri: String,
    #[arg(long)]
    http: String,
    /// Read kinds (indices of the arms' reads).
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<usize>,
}

/// Runs read loops until stdin closes; prints "ready", then "reads N cpu_us M".
pub async fn reads_process(a: &ReadsArgs) -> Result<()> {
    let readers = Readers {
        uri: a.uri.clone(),
        admin_token: std::env::var("GPB_BENCH_ADMIN_TOKEN")?,
        holder_token: std::env::var("GPB_BENCH_HOLDER_TOKEN")?,
        http: a.http.clone(),
    };
    let stop = stop_when_stdin_closes();
    let n = read_loops(readers, a.kinds.clone(), stop, || {
        println!("ready");
        let _ = std::io::stdout().flush();
    })
    .await?;
    let cpu = process_cpu(None).unwrap_or_default();
    println!("reads {n} cpu_us {}", cpu.as_micros());
    Ok(())
}

/// CPU time (user + system) of process `pid` so far (None: this process).
pub(crate) fn process_cpu(pid: Option<u32>) -> Option<Duration> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".into(),
    };
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may hold spaces): utime is the 12th, stime the 13th.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Some(Duration::from_micros(ticks * 1_000_000 / hz))
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

/// The lock counters [`lock_counters`] reads, in its order.
pub(crate) type LockCounters = [Option<u64>; 12];

/// The broker's lock counters: holds longer than 0, 100 us, 1 ms and 10 ms by the wall
/// clock, then the same by the holding thread's CPU clock
/// (`gpu_broker_state_lock_holds_total{longer_than, clock}`), then takes that waited
/// longer than 0, 100 us, 1 ms, 10 ms (`gpu_broker_state_lock_waits_total`), from
/// `/metrics` (None where the broker has no such counter).
pub(crate) async fn lock_counters(addr: &str) -> Result<LockCounters> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let find = |key: String| {
        out.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|n| n.trim().parse::<f64>().ok())
            .map(|v| v as u64)
    };
    let mut v = [None; 12];
    let thresholds = ["0", "100us", "1ms", "10ms"];
    for (c, clock) in ["wall", "cpu"].iter().enumerate() {
        for (i, t) in thresholds.iter().enumerate() {
            v[c * 4 + i] = find(format!(
                "gpu_broker_state_lock_holds_total{{longer_than=\"{t}\",clock=\"{clock}\"}} "
            ));
        }
    }
    for (i, t) in thresholds.iter().enumerate() {
        v[8 + i] = find(format!(
            "gpu_broker_state_lock_waits_total{{longer_than=\"{t}\"}} "
        ));
    }
    Ok(v)
}

/// The metrics listener's address, from the broker's log.
pub(crate) fn metrics_addr(log: &std::path::Path) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(a) = gpu_broker_tests::logged_metrics_addr(&text) {
            return Some(a);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// What one arm measured.
struct ArmResult {
    acquires: Histogram,
    reads: u64,
    /// CPU of the read loops (process readers only).
    reader_cpu: Option<Duration>,
}

/// One arm: acquire+release pairs timed for `dur` while the reads `kinds` loop (in their
/// own process or thread).
async fn arm(
    ws: &Session,
    readers: &Readers,
    kinds: &[usize],
    dur: Duration,
    place: ReadersIn,
) -> Result<ArmResult> {
    let reads = if kinds.is_empty() {
        None
    } else {
        let (r, k) = (readers.clone(), kinds.to_vec());
        let running = tokio::task::spawn_blocking(move || start_reads(&r, &k, place)).await??;
        // Let the loops get going before timing.
        tokio::time::sleep(Duration::from_millis(50)).await;
        Some(running)
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
    let (n, reader_cpu) = match reads {
        Some(r) => tokio::task::spawn_blocking(move || r.stop()).await??,
        None => (0, None),
    };
    timed?;
    Ok(ArmResult {
        acquires: h,
        reads: n,
        reader_cpu,
    })
}

/// One broker set up for phase 3: tenants, the holder's leases, the timed worker.
struct Setup {
    label: String,
    /// The binary and its extra flags.
    what: String,
    /// The process holding the leases.
    holder: Holder,
    target: crate::broker::Target,
    readers: Readers,
    ws: Session,
    sizes: Vec<u64>,
}

/// The child process holding one broker's leases (each lease's descriptor is open in the
/// holder: one process of the bench could not hold those of several brokers), until it
/// is dropped.
struct Holder {
    child: std::process::Child,
    held: u64,
}

impl Drop for Holder {
    fn drop(&mut self) {
        // Closing its stdin ends it (its leases are released as its session ends).
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Starts the holder of `leases` leases of 2 MiB for the tenant of `token`; returns once
/// they are held.
fn start_holder(uri: &str, token: &str, leases: u32) -> Result<Holder> {
    let (child, _out, line) = start_child(
        "hold",
        &["--uri", uri, "--leases", &leases.to_string()],
        &[("GPB_BENCH_HOLDER_TOKEN", token)],
    )?;
    let held = line
        .strip_prefix("held ")
        .and_then(|n| n.trim().parse().ok());
    let held = held.with_context(|| format!("the lease holder did not start: {line:?}"))?;
    Ok(Holder { child, held })
}

/// The hidden `hold` mode: the lease holder of phase 3.
#[derive(Debug, Args)]
pub struct HoldArgs {
    #[arg(long)]
    uri: String,
    #[arg(long)]
    leases: u32,
}

/// Acquires the leases (32 in flight), prints "held N", holds them until stdin closes.
pub async fn hold_process(a: &HoldArgs) -> Result<()> {
    use futures::StreamExt;
    let holder = Client::connect(&a.uri, std::env::var("GPB_BENCH_HOLDER_TOKEN")?).await?;
    let hs = holder.session("holder").await?;
    let mut held = Vec::new();
    let mut pending = futures::stream::FuturesUnordered::new();
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
    drop(pending);
    println!("held {}", held.len());
    std::io::stdout().flush()?;
    tokio::task::spawn_blocking(until_stdin_closes).await?;
    drop(held);
    Ok(())
}

async fn setup(common: &Common, label: String, extra: Vec<String>, p: &Phase3) -> Result<Setup> {
    let what = common.broker_what(&extra);
    let flags = crate::broker::counting_lock_holds(&extra);
    let mut target = common.target_with("32TiB", None, flags)?;
    let http = target
        .spawned
        .as_ref()
        .and_then(|s| metrics_addr(&s.log))
        .context(
            "admin reads need a broker started by the bench (its metrics listener, an info log)",
        )?;
    let admin = target.admin().await?;
    let started = Instant::now();
    for i in 0..p.tenants {
        admin
            .set_quota(&format!("bulk-{i:05}"), QuotaSpec::new(1 << 20))
            .await?;
    }
    let (_, holder_token) = target
        .tenant("holder", QuotaSpec::new(u64::MAX / 4))
        .await?;
    let holder = start_holder(&target.uri, &holder_token, p.leases)?;
    note(format!(
        "broker {label}: {} tenants and {} leases set up in {:.1} s",
        p.tenants,
        holder.held,
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
    Ok(Setup {
        label,
        what,
        holder,
        target,
        readers,
        ws,
        sizes,
    })
}

/// What one (broker, arm) gathered over the rounds.
#[derive(Default, Clone)]
struct Tally {
    p50s: Vec<f64>,
    p99s: Vec<f64>,
    acquires: u64,
    reads: u64,
    /// Lock counter deltas ([`lock_counters`] order); None: the broker has no such counter.
    locks: [Option<u64>; 12],
    broker_cpu: Duration,
    reader_cpu: Option<Duration>,
    wall: Duration,
}

/// Phase 3 (see the module doc); runs on its own brokers (with a metrics listener).
pub async fn run(common: &Common, p: &Phase3) -> Result<()> {
    let mut brokers = vec![setup(common, "A".into(), Vec::new(), p).await?];
    for (i, spec) in p.also.iter().enumerate() {
        let mut words = spec.split_whitespace().map(str::to_string);
        let bin = words.next().context("--also needs a broker binary")?;
        let c = common.with_broker_bin(Some(bin.into()));
        let label = ((b'B' + i as u8) as char).to_string();
        brokers.push(setup(&c, label, words.collect(), p).await?);
    }
    // Arms: quiet, each read alone, all reads at once (those asked for).
    let mut arms: Vec<(String, Vec<usize>)> = vec![("no reads".into(), vec![])];
    for (k, name) in READS.iter().enumerate() {
        arms.push((format!("{name} in a loop"), vec![k]));
    }
    arms.push(("all of them at once".into(), (0..READS.len()).collect()));
    let arms: Vec<(String, Vec<usize>)> = arms
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i == 0 || p.arms.is_empty() || p.arms.contains(i))
        .map(|(_, a)| a)
        .collect();
    let mut tally = vec![vec![Tally::default(); arms.len()]; brokers.len()];
    for _ in 0..p.rounds.max(1) {
        for (i, (_, kinds)) in arms.iter().enumerate() {
            for (b, s) in brokers.iter().enumerate() {
                let before = lock_counters(&s.readers.http).await?;
                let cpu0 = process_cpu(s.target.pid);
                let t0 = Instant::now();
                let r = arm(&s.ws, &s.readers, kinds, p.duration, p.readers).await?;
                let wall = t0.elapsed();
                let cpu1 = process_cpu(s.target.pid);
                let after = lock_counters(&s.readers.http).await?;
                let t = &mut tally[b][i];
                for (k, (a, b0)) in after.iter().zip(before).enumerate() {
                    t.locks[k] = match (a, b0) {
                        (Some(a), Some(b0)) => Some(t.locks[k].unwrap_or(0) + a.saturating_sub(b0)),
                        _ => None,
                    };
                }
                if let (Some(c0), Some(c1)) = (cpu0, cpu1) {
                    t.broker_cpu += c1.saturating_sub(c0);
                }
                t.reader_cpu = r.reader_cpu.map(|c| t.reader_cpu.unwrap_or_default() + c);
                t.wall += wall;
                t.p50s.push(r.acquires.q_us(0.5));
                t.p99s.push(r.acquires.q_us(0.99));
                t.acquires += r.acquires.count();
                t.reads += r.reads;
            }
        }
    }
    let mut table = Table::new(
        format!(
            "abuse: pooled acquire+release with {} tenants and {} live leases, while admin and metrics reads loop ({} rounds of {:.1} s per arm; medians over rounds; readers in a {})",
            p.tenants,
            brokers[0].holder.held,
            p.rounds.max(1),
            p.duration.as_secs_f64(),
            match p.readers {
                ReadersIn::Process => "child process",
                ReadersIn::Thread => "thread of the bench",
            }
        ),
        &[
            "broker",
            "arm",
            "acquires",
            "reads",
            "p50",
            "p99",
            "p50 ratio",
            "p99 ratio",
            "added p99",
            "lock holds",
            "wall > 1 ms",
            "cpu > 1 ms",
            "waits",
            "waits > 100 us",
            "waits > 1 ms",
            "broker cores",
            "reader cores",
        ],
    );
    let opt = |v: Option<u64>| v.map(count).unwrap_or_else(|| "-".into());
    let cores = |d: Duration, wall: Duration| {
        format!("{:.2}", d.as_secs_f64() / wall.as_secs_f64().max(1e-9))
    };
    for (b, s) in brokers.iter().enumerate() {
        let quiet_p99 = median(&tally[b][0].p99s);
        let quiet_p50 = median(&tally[b][0].p50s);
        for (i, (name, _)) in arms.iter().enumerate() {
            let t = &tally[b][i];
            let (p50, p99) = (median(&t.p50s), median(&t.p99s));
            table.row(vec![
                s.label.clone(),
                name.clone(),
                count(t.acquires),
                if i == 0 { "-".into() } else { count(t.reads) },
                us(p50),
                us(p99),
                format!("{:.2}", p50 / quiet_p50.max(1e-9)),
                format!("{:.2}", p99 / quiet_p99.max(1e-9)),
                if i == 0 {
                    "-".into()
                } else {
                    us(p99 - quiet_p99)
                },
                opt(t.locks[0]),
                opt(t.locks[2]),
                opt(t.locks[6]),
                opt(t.locks[8]),
                opt(t.locks[9]),
                opt(t.locks[10]),
                cores(t.broker_cpu, t.wall),
                t.reader_cpu
                    .map(|c| cores(c, t.wall))
                    .unwrap_or_else(|| "-".into()),
            ]);
            json_line(
                common.json,
                &json!({"mode": "abuse", "phase": "admin_reads", "broker": s.label, "arm": name,
                        "tenants": p.tenants, "leases": s.holder.held, "rounds": p.rounds,
                        "readers": format!("{:?}", p.readers).to_lowercase(),
                        "acquires": t.acquires, "reads": t.reads,
                        "p50_us": p50, "p99_us": p99, "p99s_us": t.p99s, "added_p99_us": p99 - quiet_p99,
                        "lock_holds": t.locks[0], "lock_holds_over_100us": t.locks[1],
                        "lock_holds_over_1ms": t.locks[2], "lock_holds_over_10ms": t.locks[3],
                        "lock_holds_cpu_over_100us": t.locks[5], "lock_holds_cpu_over_1ms": t.locks[6],
                        "lock_holds_cpu_over_10ms": t.locks[7],
                        "lock_waits": t.locks[8], "lock_waits_over_100us": t.locks[9],
                        "lock_waits_over_1ms": t.locks[10], "lock_waits_over_10ms": t.locks[11],
                        "broker_cpu_s": t.broker_cpu.as_secs_f64(),
                        "reader_cpu_s": t.reader_cpu.map(|c| c.as_secs_f64()),
                        "wall_s": t.wall.as_secs_f64()}),
            );
        }
    }
    table.print();
    for s in &brokers {
        note(format!(
            "broker {}: {}; one read returns: {}",
            s.label,
            s.what.trim(),
            READS
                .iter()
                .zip(&s.sizes)
                .map(|(n, z)| format!("{n} {z}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    drop(brokers);
    Ok(())
}
