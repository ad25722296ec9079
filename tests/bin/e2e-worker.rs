//! `e2e-worker`: a worker process for the end-to-end tests. It talks to a real broker
//! over its socket like any worker would, and reports what it does as one line per fact
//! on stdout, so a test can drive it and read it back:
//!
//! - `hold`: opens a session (`SESSION <session_id> <peer_pid>`), acquires `--count`
//!   leases (`LEASE <lease_id> <block> <bytes> <device>` each, `<block>` = `fd:<block id>`; `ERROR <CODE> <message>` and
//!   exit 2 on failure), optionally checks their initial bytes and fills them with a
//!   pattern, prints `READY`, then holds them until killed. Session events are reported as
//!   `EVENT revoked <lease_id>`, `EVENT reclaim <lease_id>`, `EVENT shutting_down
//!   <grace_ms>`, `EVENT closed`; with `--reconnect` the session rides through a broker
//!   restart (`EVENT resumed kept=<ids,> lost=<ids,>`). Commands on stdin, one per line: `check <byte>` (every
//!   byte of every lease; answers `CHECK ok` or `CHECK bad <index> <got>`), `fill <byte>`
//!   (`FILLED`), `release` (`RELEASED`), `publish <name> [<tenant>...]` (the first lease:
//!   `PUBLISHED`), `exit`. End of stdin also exits, so a worker never
//!   outlives its test.
//! - `read`: fetches the descriptor of the tenant's fd lease `--lease` with a new ticket of
//!   its own (`RenewLeaseTicket`: this process is not the holder), maps it and prints
//!   `SUM <len> <sum> <first> <last>`, then `OK` if every byte is `--expect-byte` (exit 0)
//!   or `MISMATCH <index> <got>` (exit 1).
//! - `write`: the same, but fills the lease with `--pattern` and prints `WROTE <len>`.
//! - `redeem`: presents `--ticket` (hex) at the ticket socket `--socket` and prints
//!   `FD <size>` when a descriptor came, or `REFUSED <message>`.
//! - `cycles`: opens `--sessions` sessions, warms each up, prints `WARM <fds>` (its open
//!   descriptors), waits for a line on stdin, runs `--count` acquire/map/write/release
//!   cycles spread over the sessions, and prints `FDS <before> <after>`.
//! - `renew`: asks for a new ticket for lease `--lease` and prints `RENEWED` or
//!   `ERROR <CODE> <message>`.
//! - `meddle`: acts on another process's session and reservation: `ReserveProcessMemory`
//!   on `--session`, `SetProcessGroup` of `--reservation` to `--pgid`, then
//!   `ReleaseProcessMemory` of it; prints `<CALL> OK` or `<CALL> <CODE> <REASON>` for each
//!   (`RESERVE`, `GROUP`, `RELEASE`).
//!
//! - `import`: opens a session, imports `--publisher`'s shared lease `--name`, maps it
//!   read-only and prints `IMPORTED <import_id> <len> <first byte>`, then `READY`, and holds
//!   it until killed. Commands on stdin: `close` (ends the session but keeps the descriptor
//!   and mapping: `CLOSED`), `exit`. `read --hold` likewise holds its mapping after `SUM`
//!   until stdin ends.
//!
//! `--as-uid <uid>` (root only) drops to that uid first, to act as another user.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use futures::StreamExt;
use gpu_broker_client::units::parse_bytes;
use gpu_broker_client::{Backoff, Client, HostMapping, Lease, LeaseHandle, SessionEvent};
use std::path::PathBuf;
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
    /// Drop to this uid (and gid) before doing anything (needs root).
    #[arg(long)]
    as_uid: Option<u32>,
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
        /// Ride through a broker restart: resume the session (`EVENT resumed ...`).
        #[arg(long)]
        reconnect: bool,
    },
    /// Map a lease of the tenant (by id) and check or summarize its bytes.
    Read {
        #[arg(long)]
        lease: String,
        /// Bytes to map (default: the memory object's size).
        #[arg(long, value_parser = parse_bytes)]
        bytes: Option<u64>,
        #[arg(long, value_parser = parse_byte)]
        expect_byte: Option<u8>,
        /// Keep the mapping (and descriptor) until stdin ends.
        #[arg(long)]
        hold: bool,
    },
    /// Import a shared lease and hold it.
    Import {
        #[arg(long)]
        publisher: String,
        #[arg(long)]
        name: String,
    },
    /// Present a ticket at the ticket socket.
    Redeem {
        #[arg(long)]
        socket: PathBuf,
        /// The ticket, hex.
        #[arg(long)]
        ticket: String,
    },
    /// Many acquire/map/release cycles, counting this process's descriptors.
    Cycles {
        #[arg(long)]
        count: u32,
        #[arg(long, default_value_t = 8)]
        sessions: u32,
        #[arg(long, value_parser = parse_bytes, default_value = "2MiB")]
        bytes: u64,
    },
    /// Ask for a new ticket of a lease.
    Renew {
        #[arg(long)]
        lease: String,
    },
    /// Reserve on `session`, name `pgid` as the group of `reservation`, release it.
    Meddle {
        #[arg(long)]
        session: String,
        #[arg(long)]
        reservation: String,
        #[arg(long)]
        pgid: u32,
    },
    /// Map a lease of the tenant (by id) and fill it with a pattern.
    Write {
        #[arg(long)]
        lease: String,
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
    if let Some(uid) = cli.as_uid {
        // SAFETY: plain syscalls before any thread starts.
        let ok = unsafe { libc::setgid(uid) == 0 && libc::setuid(uid) == 0 };
        if !ok {
            say(format!(
                "ERROR INTERNAL cannot become uid {uid}: {}",
                std::io::Error::last_os_error()
            ));
            return ExitCode::from(70);
        }
    }
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
            lease,
            bytes,
            expect_byte,
            hold,
        } => {
            let client = Client::connect(&cli.broker, cli.token).await?;
            if hold {
                let m = map_lease(&client, &lease, bytes).await?;
                say(format!(
                    "SUM {} {:#04x}",
                    m.len(),
                    m.first().copied().unwrap_or(0)
                ));
                let mut lines = BufReader::new(tokio::io::stdin()).lines();
                while let Ok(Some(_)) = lines.next_line().await {}
                drop(m);
                return Ok(0);
            }
            read(&client, &lease, bytes, expect_byte).await
        }
        Cmd::Import { publisher, name } => {
            let client = Client::connect(&cli.broker, cli.token).await?;
            let session = client.session("e2e-importer").await?;
            let import = match session.import(&publisher, &name).await {
                Ok(i) => i,
                Err(e) => {
                    say(format!("ERROR {} {e}", e.code_name()));
                    return Ok(2);
                }
            };
            // Map a descriptor of our own (read-only, as the broker hands it), so the
            // mapping outlives the import object on `close`.
            use std::os::fd::AsRawFd;
            let fd = import.fd().try_clone_to_owned()?;
            let len = usize::try_from(import.bytes())?;
            // SAFETY: mapping a memfd of at least `len` bytes read-only; checked below.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            anyhow::ensure!(
                p != libc::MAP_FAILED,
                "mmap: {}",
                std::io::Error::last_os_error()
            );
            // SAFETY: `p` maps `len` (> 0) readable bytes.
            let first = unsafe { *p.cast::<u8>() };
            say(format!("IMPORTED {} {len} {first:#04x}", import.id()));
            say("READY");
            let mut lines = BufReader::new(tokio::io::stdin()).lines();
            let mut import = Some(import);
            while let Ok(Some(line)) = lines.next_line().await {
                match line.trim() {
                    "close" => {
                        // Not released: the session ends while this process still has the
                        // descriptor and the mapping.
                        if let Some(i) = import.take() {
                            i.detach();
                        }
                        session.close();
                        say("CLOSED");
                    }
                    "exit" => break,
                    _ => {}
                }
            }
            // SAFETY: unmapping what was mapped above.
            unsafe { libc::munmap(p, len) };
            drop(fd);
            Ok(0)
        }
        Cmd::Redeem { socket, ticket } => {
            let bytes: Vec<u8> = (0..ticket.len() / 2)
                .map(|i| u8::from_str_radix(&ticket[2 * i..2 * i + 2], 16))
                .collect::<Result<_, _>>()
                .context("ticket hex")?;
            match gpu_broker_client::fd::fetch(&socket, &bytes, None).await {
                Ok(fd) => {
                    let size = std::fs::File::from(fd).metadata()?.len();
                    say(format!("FD {size}"));
                }
                Err(e) => say(format!("REFUSED {e}")),
            }
            Ok(0)
        }
        Cmd::Cycles {
            count,
            sessions,
            bytes,
        } => {
            let client = Client::connect(&cli.broker, cli.token).await?;
            let mut open = Vec::new();
            for t in 0..sessions {
                let s = client.session(format!("cycles-{t}")).await?;
                let l = s.lease_request(bytes).send().await?;
                l.map()?[0] = 1;
                l.release().await?;
                open.push(s);
            }
            let fds = || {
                std::fs::read_dir("/proc/self/fd")
                    .map(|d| d.count())
                    .unwrap_or(0)
            };
            let before = fds();
            say(format!("WARM {before}"));
            let mut stdin = BufReader::new(tokio::io::stdin()).lines();
            let _ = stdin.next_line().await?;
            let per = count / sessions.max(1);
            let mut tasks = Vec::new();
            for s in open {
                tasks.push(tokio::spawn(async move {
                    for i in 0..per {
                        let l = s.lease_request(bytes).send().await?;
                        {
                            let mut m = l.map()?;
                            let n = m.len();
                            m[(i as usize) % n] = i as u8;
                        }
                        l.release().await?;
                    }
                    Ok::<_, anyhow::Error>(s)
                }));
            }
            let mut open = Vec::new();
            for t in tasks {
                open.push(t.await??);
            }
            say(format!("FDS {before} {}", fds()));
            let _ = stdin.next_line().await;
            drop(open);
            Ok(0)
        }
        Cmd::Renew { lease } => {
            let client = Client::connect(&cli.broker, cli.token).await?;
            match client.lease_fd(&lease).await {
                Ok(_) => say("RENEWED"),
                Err(e) => say(format!("ERROR {} {}", e.code_name(), e.message())),
            }
            Ok(0)
        }
        Cmd::Meddle {
            session,
            reservation,
            pgid,
        } => {
            use gpu_broker_proto::v1 as pb;
            let client = Client::connect(&cli.broker, cli.token).await?;
            let outcome = |call: &str, r: Result<(), tonic::Status>| match r {
                Ok(()) => say(format!("{call} OK")),
                Err(s) => {
                    let e = gpu_broker_client::ClientError::from(s);
                    let reason = e.reason().map(|r| r.to_string()).unwrap_or_default();
                    say(format!("{call} {} {reason}", e.code_name()));
                }
            };
            let mut raw = client.raw();
            let r = raw
                .reserve_process_memory(pb::ReserveProcessMemoryRequest {
                    session_id: session,
                    bytes: 1 << 20,
                    ..Default::default()
                })
                .await;
            outcome("RESERVE", r.map(drop));
            let r = raw
                .set_process_group(pb::SetProcessGroupRequest {
                    reservation_id: reservation.clone(),
                    pgid,
                })
                .await;
            outcome("GROUP", r.map(drop));
            let r = raw
                .release_process_memory(pb::ReleaseProcessMemoryRequest {
                    reservation_id: reservation,
                })
                .await;
            outcome("RELEASE", r.map(drop));
            Ok(0)
        }
        Cmd::Write {
            lease,
            bytes,
            pattern,
        } => {
            let client = Client::connect(&cli.broker, cli.token).await?;
            let mut m = map_lease(&client, &lease, bytes).await?;
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
            reconnect,
        } => {
            let client = Client::connect(&cli.broker, cli.token).await?;
            let mut builder = client.session_builder(name);
            if reconnect {
                builder = builder.reconnect(Backoff::new(
                    Duration::from_millis(20),
                    Duration::from_millis(200),
                ));
            }
            let session = builder.await?;
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
                let block = match l.handle() {
                    LeaseHandle::Fd(i) => format!("fd:{}", i.block_id),
                    LeaseHandle::HostShm(p) => p.display().to_string(),
                    other => other.kind().to_string(),
                };
                say(format!(
                    "LEASE {} {block} {} {}",
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
                            (Some("publish"), Some(name)) => {
                                // `publish <name> [tenant...]`: the first lease.
                                let readers: Vec<&str> = words.collect();
                                match leases.first() {
                                    Some(l) => match l.publish(name, &readers).await {
                                        Ok(_) => say("PUBLISHED"),
                                        Err(e) => say(format!("ERROR {} {}", e.code_name(), e.message())),
                                    },
                                    None => say("ERROR FAILED_PRECONDITION no lease"),
                                }
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
        SessionEvent::Resumed {
            kept_leases,
            lost_leases,
            ..
        } => format!(
            "EVENT resumed kept={} lost={}",
            kept_leases.join(","),
            lost_leases.join(",")
        ),
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

/// Maps a lease this process does not hold: a new ticket of its own, then the descriptor
/// (closed once mapped: the mapping keeps the memory).
async fn map_lease(
    client: &Client,
    lease: &str,
    bytes: Option<u64>,
) -> Result<HostMapping<'static>> {
    let (info, fd) = client
        .lease_fd(lease)
        .await
        .with_context(|| format!("fetching the descriptor of lease {lease}"))?;
    use std::os::fd::AsFd;
    Ok(HostMapping::from_fd(
        fd.as_fd(),
        0,
        bytes.unwrap_or(info.size),
    )?)
}

async fn read(client: &Client, lease: &str, bytes: Option<u64>, expect: Option<u8>) -> Result<u8> {
    let m = map_lease(client, lease, bytes).await?;
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
