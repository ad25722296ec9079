//! `fault-worker`: a small worker process for the fault and load tests (`tests/faults`).
//! It talks to the broker like a real worker (its own process, so the broker sees its pid
//! on the Unix socket) and reports what happened as JSON lines on stdout, one per event,
//! so a test can read them while it runs or after it was killed.
//!
//! Modes:
//! * `load`: loop acquiring random sizes with a wait, map the lease (checking that no
//!   other tenant's bytes are visible), hold it briefly, release it; give a lease back at
//!   once on `ReclaimRequested`; stop after N iterations or T seconds.
//! * `hold`: acquire `count` leases and keep them, reporting events (reclaim requested,
//!   revoked); optionally honour reclaims. Commands on stdin: `exit` (leave at once
//!   without releasing anything or closing the session), `release-all`; end of stdin
//!   also exits at once.
//! * `import`: import a publication, map it and report its first byte; `close` on stdin
//!   ends the session while the mapping (and the descriptor) stay in this process;
//!   `exit` or the end of stdin exits at once.
//! * `strand`: acquire one lease, keep a descriptor of it and a written shared mapping,
//!   seal the memfd against shrinking (so the broker's free cannot revoke it), release
//!   the lease, take and release another (whose grant frees the sealed block, found in
//!   the tenant's cache) and keep the memory: the broker charges it to the tenant as kept after its
//!   free. Exits on `exit` or stdin's end (only then does the memory go).
//! * `idle-raw`: open a session with raw gRPC calls (no automatic keepalive), acquire one
//!   lease, keep the stream open and report when the broker ends it; exits on stdin's end.

use anyhow::{anyhow, Context, Result};
use clap::{Args, Parser, Subcommand};
use futures::StreamExt;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{Client, Lease, SessionEvent};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::AsyncBufReadExt;
use tokio::sync::mpsc;

const MIB: u64 = 1 << 20;
const GRANULE: u64 = 2 * MIB;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    Load(LoadArgs),
    Hold(HoldArgs),
    Import(ImportArgs),
    IdleRaw(IdleArgs),
    Strand(StrandArgs),
}

#[derive(Args)]
struct StrandArgs {
    #[command(flatten)]
    common: Common,
    #[arg(long)]
    mib: u64,
}

#[derive(Args)]
struct ImportArgs {
    #[command(flatten)]
    common: Common,
    /// The publishing tenant.
    #[arg(long)]
    publisher: String,
    /// The publication's name.
    #[arg(long)]
    name: String,
}

#[derive(Args)]
struct Common {
    /// Broker address (`unix:///...`).
    #[arg(long)]
    uri: String,
    /// Tenant token.
    #[arg(long)]
    token: String,
}

#[derive(Args)]
struct LoadArgs {
    #[command(flatten)]
    common: Common,
    /// Byte written into every lease, and the only non-zero value it may find there.
    #[arg(long)]
    marker: u8,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    #[arg(long, default_value_t = 10.0)]
    max_secs: f64,
    #[arg(long, default_value_t = 2)]
    min_mib: u64,
    #[arg(long, default_value_t = 64)]
    max_mib: u64,
    #[arg(long, default_value_t = 2000)]
    wait_ms: u64,
    #[arg(long, default_value_t = 20)]
    hold_min_ms: u64,
    #[arg(long, default_value_t = 200)]
    hold_max_ms: u64,
    #[arg(long)]
    reclaimable: bool,
    /// Every request of this worker is within its tenant's guarantee (the test sizes the
    /// tenant so); grants are reported as such.
    #[arg(long)]
    within_guarantee: bool,
}

#[derive(Args)]
struct HoldArgs {
    #[command(flatten)]
    common: Common,
    #[arg(long, default_value_t = 1)]
    count: u32,
    #[arg(long)]
    mib: u64,
    #[arg(long)]
    reclaimable: bool,
    /// Release a lease when asked to (otherwise ignore reclaim requests).
    #[arg(long)]
    honour: bool,
    #[arg(long, default_value_t = 0)]
    wait_ms: u64,
    /// Exit (without releasing or closing) right after the last grant.
    #[arg(long)]
    exit_when_granted: bool,
}

#[derive(Args)]
struct IdleArgs {
    #[command(flatten)]
    common: Common,
    #[arg(long, default_value_t = 2)]
    mib: u64,
}

fn emit(v: Value) {
    // stdout is line-buffered: each event reaches the file or pipe at once.
    println!("{v}");
}

/// xorshift64*: enough randomness for sizes and pauses, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next() % (hi - lo + 1)
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    let r = match cli.mode {
        Mode::Load(a) => load(a).await,
        Mode::Hold(a) => hold(a).await,
        Mode::Import(a) => import(a).await,
        Mode::IdleRaw(a) => idle_raw(a).await,
        Mode::Strand(a) => strand(a).await,
    };
    if let Err(e) = r {
        emit(json!({"ev": "error", "error": format!("{e:#}")}));
        std::process::exit(1);
    }
}

/// Lease ids the broker asked back (`false`) or revoked (`true`), from the event stream.
fn watch_events(
    mut events: gpu_broker_client::SessionEvents,
) -> mpsc::UnboundedReceiver<(bool, String)> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(e) = events.next().await {
            match e {
                SessionEvent::ReclaimRequested { lease_id, .. } => {
                    let _ = tx.send((false, lease_id));
                }
                SessionEvent::LeaseRevoked { lease_id, .. } => {
                    let _ = tx.send((true, lease_id));
                }
                SessionEvent::Closed { reason } => {
                    emit(json!({"ev": "closed", "reason": reason}));
                    break;
                }
                _ => {}
            }
        }
    });
    rx
}

/// Maps a lease, checks it shows no other tenant's bytes, and writes `marker`.
fn touch(lease: &Lease, marker: u8) -> Result<Option<String>> {
    let mut m = lease.map().context("mapping the lease")?;
    let n = m.len();
    let mut violation = None;
    for i in [0, n / 2, n - 1] {
        if m[i] != 0 && m[i] != marker {
            violation = Some(format!(
                "lease {} shows byte {} at {i} written by another tenant (mine is {marker})",
                lease.id(),
                m[i]
            ));
        }
        m[i] = marker;
    }
    Ok(violation)
}

async fn load(a: LoadArgs) -> Result<()> {
    let start = Instant::now();
    let mut rng = Rng::new(a.seed);
    let client = Client::connect(&a.common.uri, a.common.token.clone()).await?;
    let session = client
        .session(format!("load-{}", std::process::id()))
        .await?;
    let mut events = watch_events(session.events());
    emit(json!({"ev": "start", "pid": std::process::id()}));
    let (mut grants, mut denied, mut reclaims, mut revoked) = (0u32, 0u32, 0u32, 0u32);
    let max = Duration::from_secs_f64(a.max_secs);
    for _ in 0..a.iterations {
        if start.elapsed() > max {
            break;
        }
        let bytes = rng.range(a.min_mib * MIB, a.max_mib * MIB);
        let t0 = Instant::now();
        let r = session
            .lease_request(bytes)
            .wait(Duration::from_millis(a.wait_ms))
            .reclaimable(a.reclaimable)
            .label("load")
            .send()
            .await;
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        let lease = match r {
            Ok(l) => l,
            Err(e) => {
                denied += 1;
                emit(
                    json!({"ev": "deny", "ms": ms, "bytes": bytes, "code": e.code_name(),
                    "within": a.within_guarantee, "msg": e.message(),
                    "ended": matches!(e, gpu_broker_client::ClientError::LeaseEnded(_))}),
                );
                continue;
            }
        };
        grants += 1;
        emit(
            json!({"ev": "grant", "ms": ms, "bytes": lease.bytes(), "requested": bytes,
            "within": a.within_guarantee}),
        );
        if lease.bytes() % GRANULE != 0 || lease.bytes() < bytes {
            emit(json!({"ev": "violation", "what": format!(
                "granted {} for a request of {bytes}", lease.bytes())}));
        }
        if let Some(v) = touch(&lease, a.marker)? {
            emit(json!({"ev": "violation", "what": v}));
        }
        let until = tokio::time::Instant::now()
            + Duration::from_millis(rng.range(a.hold_min_ms, a.hold_max_ms));
        let mut lost = false;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                msg = events.recv() => match msg {
                    Some((was_revoked, id)) if id == lease.id() => {
                        if was_revoked {
                            revoked += 1;
                            lost = true;
                            emit(json!({"ev": "revoked"}));
                        } else {
                            reclaims += 1;
                            emit(json!({"ev": "reclaim"}));
                        }
                        break;
                    }
                    Some(_) => continue,
                    None => break,
                },
            }
        }
        if lost {
            lease.detach();
        } else if let Err(e) = lease.release().await {
            emit(json!({"ev": "release_error", "code": e.code_name(), "msg": e.message()}));
        }
        tokio::time::sleep(Duration::from_millis(rng.range(0, 20))).await;
    }
    emit(
        json!({"ev": "done", "grants": grants, "denied": denied, "reclaims": reclaims,
        "revoked": revoked, "secs": start.elapsed().as_secs_f64()}),
    );
    session.close();
    Ok(())
}

async fn import(a: ImportArgs) -> Result<()> {
    let client = Client::connect(&a.common.uri, a.common.token.clone()).await?;
    let session = client
        .session(format!("import-{}", std::process::id()))
        .await?;
    let import = session.import(&a.publisher, &a.name).await?;
    let first = {
        let m = import.map()?;
        m[0]
    };
    emit(json!({"ev": "imported", "id": import.id(), "byte": first, "pid": std::process::id()}));
    // Kept mapped and never released: only this process's exit lets the broker know it
    // no longer maps the memory.
    let mapping = import.map()?;
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = stdin.next_line().await? {
        match line.trim() {
            "close" => {
                session.close();
                emit(json!({"ev": "session-closed", "byte": mapping[0]}));
            }
            "exit" => break,
            _ => {}
        }
    }
    std::process::exit(0);
}

async fn hold(a: HoldArgs) -> Result<()> {
    let client = Client::connect(&a.common.uri, a.common.token.clone()).await?;
    let session = client
        .session(format!("hold-{}", std::process::id()))
        .await?;
    let mut events = watch_events(session.events());
    emit(json!({"ev": "ready", "pid": std::process::id(), "session": session.id()}));
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut leases: Vec<Lease> = Vec::new();
    for _ in 0..a.count {
        emit(json!({"ev": "asking", "bytes": a.mib * MIB}));
        let t0 = Instant::now();
        let r = session
            .lease_request(a.mib * MIB)
            .wait(Duration::from_millis(a.wait_ms))
            .reclaimable(a.reclaimable)
            .label("hold")
            .send()
            .await;
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        match r {
            Ok(l) => {
                emit(json!({"ev": "granted", "id": l.id(), "bytes": l.bytes(), "ms": ms}));
                leases.push(l);
            }
            Err(e) => {
                emit(json!({"ev": "denied", "code": e.code_name(), "msg": e.message(), "ms": ms}))
            }
        }
    }
    emit(json!({"ev": "holding", "count": leases.len()}));
    if a.exit_when_granted {
        std::process::exit(0);
    }
    let mut events_open = true;
    loop {
        tokio::select! {
            msg = events.recv(), if events_open => match msg {
                Some((true, id)) => {
                    emit(json!({"ev": "revoked", "id": id}));
                    if let Some(i) = leases.iter().position(|l| l.id() == id) {
                        leases.swap_remove(i).detach();
                    }
                }
                Some((false, id)) => {
                    emit(json!({"ev": "reclaim", "id": id}));
                    if a.honour {
                        if let Some(i) = leases.iter().position(|l| l.id() == id) {
                            let l = leases.swap_remove(i);
                            match l.release().await {
                                Ok(()) => emit(json!({"ev": "released", "id": id})),
                                Err(e) => emit(json!({"ev": "release_error", "id": id,
                                    "code": e.code_name()})),
                            }
                        }
                    }
                }
                // The stream ended; keep living until told to exit.
                None => events_open = false,
            },
            line = stdin.next_line() => match line {
                Ok(Some(cmd)) if cmd.trim() == "release-all" => {
                    for l in leases.drain(..) {
                        let id = l.id().to_string();
                        match l.release().await {
                            Ok(()) => emit(json!({"ev": "released", "id": id})),
                            Err(e) => emit(json!({"ev": "release_error", "id": id,
                                "code": e.code_name()})),
                        }
                    }
                    emit(json!({"ev": "released_all"}));
                }
                Ok(Some(cmd)) if cmd.trim() == "exit" => std::process::exit(0),
                Ok(Some(_)) => {}
                // End of stdin (the test dropped it or died): leave at once.
                Ok(None) | Err(_) => std::process::exit(0),
            },
        }
    }
}

async fn idle_raw(a: IdleArgs) -> Result<()> {
    let client = Client::connect(&a.common.uri, a.common.token.clone()).await?;
    let mut raw = client.raw();
    let mut stream = raw
        .open_session(pb::OpenSessionRequest {
            name: "idle-raw".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let opened = match stream.message().await? {
        Some(pb::SessionEvent {
            event: Some(pb::session_event::Event::Opened(o)),
        }) => o,
        other => return Err(anyhow!("first event is not `opened`: {other:?}")),
    };
    let lease = raw
        .acquire_lease(pb::AcquireLeaseRequest {
            session_id: opened.session_id.clone(),
            bytes: a.mib * MIB,
            ..Default::default()
        })
        .await?
        .into_inner()
        .lease
        .ok_or_else(|| anyhow!("no lease in the reply"))?;
    let t0 = Instant::now();
    emit(
        json!({"ev": "granted", "id": lease.lease_id, "session": opened.session_id,
        "keepalive_timeout_ms": opened.keepalive_timeout_ms}),
    );
    let ended = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => break "end".to_string(),
            Err(s) => break format!("{:?}: {}", s.code(), s.message()),
        }
    };
    emit(json!({"ev": "stream_end", "how": ended, "after_ms": t0.elapsed().as_millis() as u64}));
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(_)) = stdin.next_line().await {}
    std::process::exit(0);
}

async fn strand(a: StrandArgs) -> Result<()> {
    use std::os::fd::AsRawFd;
    let client = Client::connect(&a.common.uri, a.common.token.clone()).await?;
    let session = client
        .session(format!("strand-{}", std::process::id()))
        .await?;
    let lease = session.lease(a.mib * MIB).await?;
    let id = lease.id().to_string();
    let fd = lease
        .fd()
        .ok_or_else(|| anyhow!("not a memfd lease"))?
        .as_raw_fd();
    let len = lease.bytes() as usize;
    // SAFETY: a duplicate of the lease's valid descriptor, kept (never closed) on purpose.
    let kept = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if kept < 0 {
        return Err(std::io::Error::last_os_error()).context("dup");
    }
    // SAFETY: a shared mapping of `len` bytes of a valid memfd, never unmapped on purpose.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            kept,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error()).context("mmap");
    }
    // SAFETY: `addr` maps `len` writable bytes.
    unsafe { std::ptr::write_bytes(addr.cast::<u8>(), 0x5a, len) };
    // A seal against shrinking: the broker's free cannot truncate the memfd away.
    // SAFETY: fcntl on our own descriptor.
    if unsafe { libc::fcntl(kept, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
        return Err(std::io::Error::last_os_error()).context("seal");
    }
    lease.release().await?;
    // The released block waits in the tenant's cache; the next lease finds it sealed and
    // has the broker free it, which is what strands it.
    session.lease(a.mib * MIB).await?.release().await?;
    emit(json!({"ev": "stranded", "id": id, "bytes": len, "pid": std::process::id()}));
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = stdin.next_line().await {
        if line.trim() == "exit" {
            break;
        }
    }
    drop(session);
    std::process::exit(0);
}
