//! `gpu-broker-bench`: a load generator for gpu-broker. It starts the real `gpu-broker`
//! binary (host backend, private Unix socket; found next to this binary, e.g.
//! `target/release/gpu-broker`) or connects to a running broker of any backend
//! (`--broker unix:///run/gpu-broker/broker.sock --admin-token-file F`), creates its own
//! tenants, and measures one of:
//!
//! - `latency`: one worker, acquire and release of a pooled block (or, with `--fresh`,
//!   sizes the pool has never seen), p50/p90/p99/max of each call separately;
//! - `throughput`: W concurrent workers (tasks, or `--processes P` worker processes),
//!   each with its own connection and session, doing acquire+release pairs for D seconds;
//! - `breakdown`: a pooled lease + map in parts (RPC, ticket, map), beside the health
//!   `Check` round trip and raw in-process memory + map of the same run;
//! - `resident`: the broker's resident memory with 10,000 live leases;
//! - `restart`: a broker SIGKILL and start with 10,000 live leases kept by a keeper: time
//!   to the first answer and the broker's breakdown of its start;
//! - `oversub`: 2x oversubscription with 3 priorities, guarantees, waits and cooperative
//!   reclaim: per-priority time-to-grant, reclaim/revocation counts, utilization;
//! - `quota-writes`: pooled acquire p50/p99 alone and while an admin client sets quotas
//!   in a loop (each a durable store commit), with controls that separate the causes;
//! - `turns`: the compute-turn hand-off between K workers (broker side and end to end);
//! - `abuse`: descriptors and memory after many session cycles, admin latency while idle
//!   connections and unauthenticated streams are held, acquire p99 while listings run;
//! - `all`: each of the above with its defaults.
//!
//! Everything is bounded in count and time; results are aligned tables on stdout, plus
//! one JSON object per line with `--json`. See docs/benchmarks.md.

mod abuse;
mod admin_reads;
mod big_waiter;
mod breakdown;
mod broker;
mod cpu;
mod latency;
mod oversub;
mod quota_writes;
mod report;
mod resident;
mod restart;
mod stats;
mod throughput;
mod turns;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use broker::{SpawnOpts, Target};

#[derive(Debug, Parser)]
#[command(
    name = "gpu-broker-bench",
    about = "Load generator for gpu-broker: latency, throughput, resident memory, oversubscription"
)]
struct Cli {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    mode: Mode,
}

/// Options every mode understands.
#[derive(Debug, Clone, Args)]
pub struct Common {
    /// Use this running broker (`unix:///path/broker.sock` or `http://host:port`) instead
    /// of starting one; any backend. Needs --admin-token-file.
    #[arg(long, global = true)]
    broker: Option<String>,
    /// Admin token file of the broker given with --broker.
    #[arg(long, global = true)]
    admin_token_file: Option<PathBuf>,
    /// Pid of the broker given with --broker (default: the peer of its Unix socket).
    #[arg(long, global = true)]
    broker_pid: Option<u32>,
    /// The `gpu-broker` binary to start (default: next to this binary).
    #[arg(long, global = true)]
    broker_bin: Option<PathBuf>,
    /// Log filter of a started broker (its GPU_BROKER_LOG).
    #[arg(long, global = true, default_value = "info")]
    broker_log: String,
    /// Headroom of a started broker.
    #[arg(long, global = true, default_value = "0%")]
    headroom: String,
    /// Also print every result as a JSON object on its own line.
    #[arg(long, global = true)]
    json: bool,
    /// Tokio worker threads of this process (1: a current-thread runtime).
    #[arg(long, global = true, default_value_t = 2)]
    client_threads: usize,
    /// Seed of the random choices (oversub).
    #[arg(long, global = true, default_value_t = 42)]
    seed: u64,
}

#[derive(Debug, Subcommand)]
enum Mode {
    /// One worker: acquire and release latency of a pooled (or fresh) block.
    Latency(latency::LatencyArgs),
    /// W concurrent workers doing acquire+release pairs for D seconds.
    Throughput(throughput::ThroughputArgs),
    /// Where a pooled lease + map's time goes (RPC, ticket, map), beside its baselines.
    Breakdown(breakdown::BreakdownArgs),
    /// Broker resident memory with many live leases.
    Resident(resident::ResidentArgs),
    /// A broker SIGKILL and start with many live leases kept by a keeper.
    Restart(restart::RestartArgs),
    /// Oversubscription with priorities, guarantees, waits and reclaim.
    Oversub(oversub::OversubArgs),
    /// Faults and abuse: session cycles, held connections and streams, listings at scale.
    Abuse(abuse::AbuseArgs),
    /// Pooled acquire latency alone and while an admin client writes quotas in a loop.
    QuotaWrites(quota_writes::QuotaWritesArgs),
    /// Every mode with its defaults, one after the other.
    All,
    /// Compute-turn hand-off between workers that take turns on one device.
    Turns(turns::TurnsArgs),
    /// A worker process of `throughput --processes` (internal).
    #[command(hide = true)]
    Worker(throughput::WorkerArgs),
    /// The read loops of `abuse` phase 3 in a process of their own (internal).
    #[command(hide = true)]
    Reads(admin_reads::ReadsArgs),
    /// The lease holder of `abuse` phase 3 in a process of its own (internal).
    #[command(hide = true)]
    Hold(admin_reads::HoldArgs),
    /// The admin loop of `quota-writes --writer process` (internal).
    #[command(hide = true)]
    QuotaWriter(quota_writes::QuotaWriterArgs),
}

impl Common {
    /// The broker to measure: the one given with --broker, else a fresh host-backend one.
    pub fn target(&self, capacity: &str, reclaim_deadline: Option<&str>) -> Result<Target> {
        self.target_with(capacity, reclaim_deadline, Vec::new())
    }

    /// The same settings, starting `bin` instead (None: unchanged).
    pub fn with_broker_bin(&self, bin: Option<PathBuf>) -> Common {
        let mut c = self.clone();
        if bin.is_some() {
            c.broker_bin = bin;
        }
        c
    }

    /// What a started broker is, for the reports: its binary and `extra` flags.
    pub fn broker_what(&self, extra: &[String]) -> String {
        format!(
            "{} {}",
            self.broker_bin
                .as_ref()
                .map(|b| b.display().to_string())
                .unwrap_or_else(|| "gpu-broker".into()),
            extra.join(" ")
        )
    }

    /// [`Common::target`], starting the broker (if one is started) with `extra` flags.
    pub fn target_with(
        &self,
        capacity: &str,
        reclaim_deadline: Option<&str>,
        extra: Vec<String>,
    ) -> Result<Target> {
        if let Some(uri) = &self.broker {
            let file = self
                .admin_token_file
                .as_ref()
                .context("--broker needs --admin-token-file")?;
            return Target::connect(uri, file, self.broker_pid);
        }
        let bin = match &self.broker_bin {
            Some(b) => b.clone(),
            None => gpu_broker_tests::bin_dir().join("gpu-broker"),
        };
        if !bin.exists() {
            bail!(
                "{} not found: build it first (cargo build --release -p gpu-broker -p gpu-broker-tests --bins) or pass --broker-bin",
                bin.display()
            );
        }
        Target::spawn(&SpawnOpts {
            bin,
            capacity: capacity.to_string(),
            headroom: self.headroom.clone(),
            log: self.broker_log.clone(),
            reclaim_deadline: reclaim_deadline.map(str::to_string),
            extra,
        })
    }
}

/// Parses `500ms`, `5s`, `2m`, `1.5s`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], s[i..].trim()),
        None => (s, "s"),
    };
    let v: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}"))?;
    let secs = match unit {
        "ms" => v / 1e3,
        "s" => v,
        "m" | "min" => v * 60.0,
        _ => return Err(format!("invalid duration unit in {s:?} (ms, s, m)")),
    };
    if !secs.is_finite() || !(0.0..=24.0 * 3600.0).contains(&secs) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let mut rt = if cli.common.client_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    if cli.common.client_threads > 1 {
        rt.worker_threads(cli.common.client_threads);
    }
    let rt = rt.enable_all().build()?;
    rt.block_on(run(cli))
}

async fn run(cli: Cli) -> Result<()> {
    let common = cli.common;
    match cli.mode {
        Mode::Latency(a) => latency::run(&common, &a).await,
        Mode::Throughput(a) => throughput::run(&common, &a).await,
        Mode::Breakdown(a) => breakdown::run(&common, &a).await,
        Mode::Resident(a) => resident::run(&common, &a).await,
        Mode::Restart(a) => restart::run(&common, &a).await,
        Mode::Oversub(a) => oversub::run(&common, &a).await,
        Mode::Abuse(a) => abuse::run(&common, &a).await,
        Mode::QuotaWrites(a) => quota_writes::run(&common, &a).await,
        Mode::Turns(a) => turns::run(&common, &a).await,
        Mode::Worker(a) => throughput::worker_process(&common, &a).await,
        Mode::Reads(a) => admin_reads::reads_process(&a).await,
        Mode::Hold(a) => admin_reads::hold_process(&a).await,
        Mode::QuotaWriter(a) => quota_writes::writer_process(&a).await,
        Mode::All => {
            let defaults = |mode: &str| Cli::try_parse_from(["gpu-broker-bench", mode]);
            if let Mode::Latency(a) = defaults("latency")?.mode {
                latency::run(&common, &a).await?;
            }
            if let Mode::Latency(mut a) = defaults("latency")?.mode {
                a.fresh = true;
                latency::run(&common, &a).await?;
            }
            if let Mode::Throughput(a) = defaults("throughput")?.mode {
                throughput::run(&common, &a).await?;
            }
            if let Mode::Resident(a) = defaults("resident")?.mode {
                resident::run(&common, &a).await?;
            }
            if let Mode::Oversub(a) = defaults("oversub")?.mode {
                oversub::run(&common, &a).await?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("3h").is_err());
    }

    #[test]
    fn cli_parses() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from([
            "gpu-broker-bench",
            "latency",
            "--sizes",
            "2MiB,64MiB",
            "--json",
        ])
        .unwrap();
        assert!(c.common.json);
        match c.mode {
            Mode::Latency(a) => assert_eq!(a.sizes, vec![2 << 20, 64 << 20]),
            _ => panic!("not latency"),
        }
    }

    use clap::CommandFactory;
}
