//! `e2e-worker`: a worker process for the end-to-end tests. It talks to a real broker
//! over its socket like any worker would, and reports what it does as one line per fact
//! on stdout, so a test can drive it and read it back:
//!
//! - `hold`: opens a session (`SESSION <session_id> <peer_pid>`), acquires `--count`
//!   leases (`LEASE <lease_id> <path> <bytes> <device>` each; `ERROR <CODE> <message>` and
//!   exit 2 on failure), optionally checks their initial bytes and fills them with a
//!   pattern, prints `READY`, then holds them until killed. Session events are reported as
//!   `EVENT revoked <lease_id>`, `EVENT reclaim <lease_id>`, `EVENT shutting_down
//!   <grace_ms>`, `EVENT closed`. Commands on stdin, one per line: `check <byte>` (every
//!   byte of every lease; answers `CHECK ok` or `CHECK bad <index> <got>`), `fill <byte>`
//!   (`FILLED`), `release` (`RELEASED`), `exit`. End of stdin also exits, so a worker never
//!   outlives its test.
//! - `read`: maps a `host_shm` path and prints `SUM <len> <sum> <first> <last>`, then `OK`
//!   if every byte is `--expect-byte` (exit 0) or `MISMATCH <index> <got>` (exit 1).
//! - `write`: maps a `host_shm` path, fills it with `--pattern` and prints `WROTE <len>`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use futures::StreamExt;
use gpu_broker_client::units::parse_bytes;
use gpu_broker_client::{Client, HostMapping, Lease, LeaseHandle, SessionEvent};
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Debug, Parser)]
#[command(
    name = "e2e-worker",
    about = "Worker process for gpu-broker end-to-end tests"
)]
struct Cli {
    /// Broker address (unix:///path or http://host:port).
    #[arg(long, env = "GPU_BROKER_ADDR", default_value = "")]
    broker: String,
    /// Tenant token.
    #[arg(long, env = "GPU_BROKER_TOKEN", default_value = "")]
    token: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Lease memory, fill it, report, and hold it until killed.
    Hold {
        /// Size of each lease (`8MiB`, `4096`, ...).
        #[arg(long, value_parser = parse_bytes)]
        bytes: u64,
        /// Number of leases.
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Fill every lease with this byte (`0xAB` or decimal).
        #[arg(long, value_parser = parse_byte)]
        pattern: Option<u8>,
        /// Fail (exit 3) unless every byte of a new lease is this value.
        #[arg(long, value_parser = parse_byte)]
        expect_initial: Option<u8>,
        /// Pin the leases to this device.
        #[arg(long)]
        device: Option<u32>,
        /// Wait this long in the broker's queue.
        #[arg(long)]
        wait_ms: Option<u64>,
        /// Label of the leases.
        #[arg(long, default_value = "e2e-worker")]
        label: String,
        /// Session name.
        #[arg(long, default_value = "e2e-worker")]
        name: String,
    },
    /// Map a shared-memory file and check or summarize its bytes.
    Read {
        #[arg(long)]
        path: PathBuf,
        /// Bytes to map (default: the file's size).
        #[arg(long, value_parser = parse_bytes)]
        bytes: Option<u64>,
        #[arg(long, value_parser = parse_byte)]
        expect_byte: Option<u8>,
    },
    /// Map a shared-memory file and fill it with a pattern.
    Write {
        #[arg(long)]
        path: PathBuf,
        #[arg(long, value_parser = parse_bytes)]
        bytes: Option<u64>,
        #[arg(long, value_parser = parse_byte)]
        pattern: u8,
    },
}

fn parse_byte(s: &str) -> Result<u8, String> {
    let s = s.trim();
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u8::from_str_radix(hex, 16),
        None => s.parse::<u8>(),
    };
    r.map_err(|e| format!("invalid byte {s:?}: {e}"))
}

fn say(line: impl AsRef<str>) {
    // stdout is line-buffered: every line reaches the test at once.
    println!("{}", line.as_ref());
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say(format!("ERROR INTERNAL cannot start runtime: {e}"));
            return ExitCode::from(70);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            say(format!("ERROR INTERNAL {e:#}"));
            ExitCode::from(70)
        }
    }
}

async fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Cmd::Read {
            path,
            bytes,
            expect_byte,
        } => read(&path, bytes, expect_byte),
        Cmd::Write {
            path,
            bytes,
            pattern,
        } => {
            let mut m = map_path(&path, bytes)?;
            m.fill(pattern);
            m.flush()?;
            say(format!("WROTE {}", m.len()));
            Ok(0)
        }
        Cmd::Hold {
            bytes,
            count,
            pattern,
            expect_initial,
            device,
            wait_ms,
            label,
            name,
        } => {
            let client = Client::connect(&cli.broker, cli.token).await?;
            let session = client.session(name).await?;
            let mut events = session.events();
            say(format!("SESSION {} {}", session.id(), session.peer_pid()));
            let mut leases: Vec<Lease> = Vec::new();
            for _ in 0..count {
                let mut req = session.lease_request(bytes).label(label.clone());
                if let Some(d) = device {
                    req = req.device(d);
                }
                if let Some(w) = wait_ms {
                    req = req.wait(Duration::from_millis(w));
                }
                match req.send().await {
                    Ok(l) => leases.push(l),
                    Err(e) => {
                        say(format!("ERROR {} {}", e.code_name(), e.message()));
                        return Ok(2);
                    }
                }
            }
            for l in &leases {
                let mut m = l.map()?;
                if let Some(b) = expect_initial {
                    if let Some(i) = m.iter().position(|&x| x != b) {
                        say(format!("BAD_INITIAL {} {i} {:#04x}", l.id(), m[i]));
                        return Ok(3);
                    }
                }
                if let Some(p) = pattern {
                    m.fill(p);
                }
                let path = match l.handle() {
                    LeaseHandle::HostShm(p) => p.display().to_string(),
                    other => other.kind().to_string(),
                };
                say(format!(
                    "LEASE {} {path} {} {}",
                    l.id(),
                    l.bytes(),
                    l.device()
                ));
            }
            say("READY");
            let mut stdin = BufReader::new(tokio::io::stdin()).lines();
            let mut events_open = true;
            loop {
                tokio::select! {
                    ev = events.next(), if events_open => match ev {
                        Some(ev) => say(event_line(&ev)),
                        None => events_open = false,
                    },
                    line = stdin.next_line() => {
                        let Some(line) = line? else { return Ok(0) };
                        let mut words = line.split_whitespace();
                        match (words.next(), words.next()) {
                            (Some("check"), Some(b)) => {
                                let b = parse_byte(b).map_err(anyhow::Error::msg)?;
                                say(check(&leases, b)?);
                            }
                            (Some("fill"), Some(b)) => {
                                let b = parse_byte(b).map_err(anyhow::Error::msg)?;
                                for l in &leases {
                                    l.map()?.fill(b);
                                }
                                say("FILLED");
                            }
                            (Some("release"), _) => {
                                for l in leases.drain(..) {
                                    if let Err(e) = l.release().await {
                                        say(format!("ERROR {} {}", e.code_name(), e.message()));
                                    }
                                }
                                say("RELEASED");
                            }
                            (Some("exit"), _) => return Ok(0),
                            _ => say(format!("ERROR INVALID_ARGUMENT unknown command {line:?}")),
                        }
                    }
                }
            }
        }
    }
}

fn event_line(ev: &SessionEvent) -> String {
    match ev {
        SessionEvent::LeaseRevoked { lease_id, .. } => format!("EVENT revoked {lease_id}"),
        SessionEvent::ReclaimRequested { lease_id, .. } => format!("EVENT reclaim {lease_id}"),
        SessionEvent::ShuttingDown { grace, .. } => {
            format!("EVENT shutting_down {}", grace.as_millis())
        }
        SessionEvent::Closed { .. } => "EVENT closed".into(),
        other => format!("EVENT other {other:?}"),
    }
}

fn check(leases: &[Lease], b: u8) -> Result<String> {
    for l in leases {
        let m = l.map()?;
        if let Some(i) = m.iter().position(|&x| x != b) {
            return Ok(format!("CHECK bad {i} {:#04x}", m[i]));
        }
    }
    Ok("CHECK ok".into())
}

fn map_path(path: &PathBuf, bytes: Option<u64>) -> Result<HostMapping<'static>> {
    let len = match bytes {
        Some(b) => b,
        None => std::fs::metadata(path)
            .with_context(|| format!("stat {}", path.display()))?
            .len(),
    };
    Ok(HostMapping::open(path, 0, len)?)
}

fn read(path: &PathBuf, bytes: Option<u64>, expect: Option<u8>) -> Result<u8> {
    let m = map_path(path, bytes)?;
    let sum: u64 = m.iter().map(|&b| u64::from(b)).sum();
    say(format!(
        "SUM {} {sum} {:#04x} {:#04x}",
        m.len(),
        m.first().copied().unwrap_or(0),
        m.last().copied().unwrap_or(0)
    ));
    if let Some(b) = expect {
        if let Some(i) = m.iter().position(|&x| x != b) {
            say(format!("MISMATCH {i} {:#04x}", m[i]));
            return Ok(1);
        }
        say("OK");
    }
    Ok(0)
}
