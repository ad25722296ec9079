//! `breakdown`: where a pooled lease's time goes, each part timed on its own and set beside
//! its baseline measured in the same run, so a regression shows which part it is in.
//!
//! Each of W workers (its own connection, session and tenant's block; every `--workers`
//! count in turn) loops over: a gRPC health `Check` on the same channel (the transport
//! floor: one no-op round trip over the broker's socket), the `AcquireLease` RPC alone,
//! the ticket (connect to the ticket socket, redeem, receive the descriptor: the client
//! library's `fd::fetch`), the map (a memfd `mmap`; on a CUDA broker, import + reserve +
//! map + set access), and the release RPC. The raw baseline is the same memory made
//! in-process: `memfd_create` + `ftruncate` + `mmap` (host), `cuMemCreate` + reserve + map +
//! set access (CUDA), timed in the same run.
//!
//! Ratios: each RPC's and the ticket's p50 over the `Check` p50; lease + map (RPC + ticket +
//! map) over the raw p50.
//!
//! `--tickets` sets the ways a ticket is redeemed, each configuration measured beside the
//! others in the same run (`--rounds` alternates them): `library` (the client crate: a
//! kept connection, every step on the async runtime), `fresh` (a new connection per
//! ticket, on the runtime), `blocking` (a new connection per ticket with blocking system
//! calls on the runtime's thread: the client crate before it kept connections),
//! `retained` (the release keeps the mapping, `retain_mapping`: the next lease of the
//! size is the same block, granted with no ticket, and the worker reuses its descriptor
//! and mapping; a lease granted without it fetches as `library` does).

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use gpu_broker_client::units::parse_bytes;
use gpu_broker_client::{Client, QuotaSpec};
use gpu_broker_proto::ticket::{
    line_frame, line_payload_len, BUSY_REPLY, LINE_ACQUIRE, LINE_FRAME_HEAD, LINE_GRANTED,
    LINE_HELLO, LINE_OPEN_REPLY, LINE_RELEASE, LINE_RELEASED,
};
use gpu_broker_proto::v1 as pb;
use prost::Message;
use serde_json::json;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};
use tonic_health::pb::health_client::HealthClient;

use crate::report::{bytes, count, json_line, note, us, Table};
use crate::stats::Histogram;
use crate::{parse_duration, Common};

#[derive(Debug, Clone, Args)]
pub struct BreakdownArgs {
    /// Concurrent workers of each configuration, comma-separated (each its own
    /// connection, session and tenant).
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub workers: Vec<u32>,
    /// Lease size.
    #[arg(long, value_parser = parse_bytes, default_value = "2MiB")]
    pub size: u64,
    /// Measured window of each configuration.
    #[arg(long, value_parser = parse_duration, default_value = "3s")]
    pub duration: Duration,
    /// Unmeasured loops before the window.
    #[arg(long, value_parser = parse_duration, default_value = "500ms")]
    pub warmup: Duration,
    /// Ways to redeem the ticket, comma-separated: library, fresh, blocking, retained,
    /// pushed, and (asked for by name: a broker before lease lines has none) line.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "library,fresh,blocking,retained,pushed"
    )]
    pub tickets: Vec<TicketWay>,
    /// Rounds: every configuration once per round, in turn; histograms merged.
    #[arg(long, default_value_t = 2)]
    pub rounds: u32,
    /// Raw in-process allocations + maps timed for the baseline.
    #[arg(long, default_value_t = 200)]
    pub raw_iterations: u32,
    /// Capacity of a started (host) broker.
    #[arg(long, default_value = "1TiB")]
    pub host_capacity: String,
}

/// How a worker redeems its ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TicketWay {
    /// The client crate's `fd::fetch`.
    Library,
    /// A new connection per ticket, every step on the runtime.
    Fresh,
    /// A new connection per ticket, blocking system calls on the runtime's thread.
    Blocking,
    /// Released with `retain_mapping`: the next lease reuses this process's descriptor
    /// and mapping of the block (no ticket, no map).
    Retained,
    /// `retained`, the lease and its release asked on the session's lease line (a framed
    /// request on a kept Unix connection, no gRPC; docs/protocol.md), the first over gRPC.
    Line,
    /// No ticket: the descriptor comes with the grant on this process's descriptor channel
    /// (`push_descriptor`; the first lease, before the channel is open, fetches a ticket).
    Pushed,
}

impl TicketWay {
    fn name(self) -> &'static str {
        match self {
            TicketWay::Library => "library",
            TicketWay::Fresh => "fresh",
            TicketWay::Blocking => "blocking",
            TicketWay::Retained => "retained",
            TicketWay::Line => "line",
            TicketWay::Pushed => "pushed",
        }
    }
}

/// One worker's (or all workers') histograms, one per part.
#[derive(Default, Clone)]
struct Parts {
    check: Histogram,
    rpc: Histogram,
    ticket: Histogram,
    map: Histogram,
    lease_map: Histogram,
    release: Histogram,
    loops: u64,
}

impl Parts {
    fn merge(&mut self, o: &Parts) {
        self.check.merge(&o.check);
        self.rpc.merge(&o.rpc);
        self.ticket.merge(&o.ticket);
        self.map.merge(&o.map);
        self.lease_map.merge(&o.lease_map);
        self.release.merge(&o.release);
        self.loops += o.loops;
    }
}

pub async fn run(common: &Common, a: &BreakdownArgs) -> Result<()> {
    if a.workers.is_empty() || a.workers.iter().any(|&w| w == 0 || w > 1024) {
        bail!("workers must be 1..=1024");
    }
    if a.duration > Duration::from_secs(600) || a.raw_iterations > 100_000 {
        bail!("at most 10 minutes a window and 100,000 raw iterations");
    }
    let mut target = common.target(&a.host_capacity, None)?;
    let admin = target.admin().await?;
    let dev = crate::latency::device0(&admin).await?;
    let cuda = dev.backend == "cuda";
    let gran = dev.granularity_bytes.max(1);
    let size = a.size.div_ceil(gran) * gran;
    let most = a.workers.iter().copied().max().unwrap_or(1);
    let mut tokens = Vec::new();
    for w in 0..most {
        let (_, token) = target
            .tenant(&format!("bd{w}"), QuotaSpec::new(size))
            .await?;
        tokens.push(token);
    }
    note(format!(
        "breakdown: pooled {} leases, workers {:?}, {:?} windows (+{:?} warm-up), client threads {}, device {} ({}), broker {}",
        bytes(size),
        a.workers,
        a.duration,
        a.warmup,
        common.client_threads,
        dev.name,
        dev.backend,
        target.uri
    ));
    // A CUDA worker keeps its device's primary context for the whole run, as a framework
    // does: otherwise the last unmap releases it and the next map pays a new context.
    let _context = if cuda {
        Some(raw::Context::retain(0)?)
    } else {
        None
    };
    let mut table = Table::new(
        format!(
            "breakdown of a pooled {} lease + map: microseconds; ratio to the health Check (transport floor) and to raw in-process memory + map, same run",
            bytes(size)
        ),
        &[
            "workers", "part", "count", "p50", "p99", "/check", "/raw", "loops/s",
        ],
    );
    let raw_hist = tokio::task::spawn_blocking({
        let n = a.raw_iterations;
        move || raw::timed(cuda, size, n)
    })
    .await??;
    let raw_p50 = raw_hist.q_us(0.5);
    table.row(vec![
        "-".into(),
        if cuda {
            "raw cuMemCreate+map".into()
        } else {
            "raw memfd+mmap".into()
        },
        count(raw_hist.count()),
        us(raw_p50),
        us(raw_hist.q_us(0.99)),
        String::new(),
        "1.00".into(),
        String::new(),
    ]);
    json_line(
        common.json,
        &json!({"mode": "breakdown", "part": "raw", "cuda": cuda, "size": size,
                "p50_us": raw_p50, "p99_us": raw_hist.q_us(0.99)}),
    );
    if a.tickets.is_empty() || a.rounds == 0 || a.rounds > 100 {
        bail!("need a ticket way and 1..=100 rounds");
    }
    let configs: Vec<(u32, TicketWay)> = a
        .workers
        .iter()
        .flat_map(|&w| a.tickets.iter().map(move |&t| (w, t)))
        .collect();
    let mut merged = vec![Parts::default(); configs.len()];
    for _ in 0..a.rounds {
        for (i, &(workers, way)) in configs.iter().enumerate() {
            let parts =
                run_workers(&target.uri, &tokens[..workers as usize], size, cuda, way, a).await?;
            merged[i].merge(&parts);
        }
    }
    let window = a.duration.as_secs_f64() * f64::from(a.rounds);
    for (&(workers, way), parts) in configs.iter().zip(&merged) {
        let check = parts.check.q_us(0.5);
        let rate = parts.loops as f64 / window;
        let ticket = format!("ticket ({})", way.name());
        let rows: [(&str, &Histogram, bool); 6] = [
            ("health Check", &parts.check, false),
            ("AcquireLease RPC", &parts.rpc, false),
            (&ticket, &parts.ticket, false),
            (if cuda { "import+map" } else { "mmap" }, &parts.map, true),
            ("lease+map (sum)", &parts.lease_map, true),
            ("ReleaseLease RPC", &parts.release, false),
        ];
        for (i, (name, h, vs_raw)) in rows.iter().enumerate() {
            let p50 = h.q_us(0.5);
            table.row(vec![
                format!("{workers} {}", way.name()),
                name.to_string(),
                count(h.count()),
                us(p50),
                us(h.q_us(0.99)),
                format!("{:.2}", p50 / check.max(1e-9)),
                if *vs_raw {
                    format!("{:.2}", p50 / raw_p50.max(1e-9))
                } else {
                    String::new()
                },
                if i == 0 {
                    count(rate.round() as u64)
                } else {
                    String::new()
                },
            ]);
            json_line(
                common.json,
                &json!({"mode": "breakdown", "workers": workers, "tickets": way.name(), "part": name,
                        "size": size, "count": h.count(), "p50_us": p50, "p99_us": h.q_us(0.99),
                        "over_check": p50 / check.max(1e-9),
                        "over_raw": p50 / raw_p50.max(1e-9), "loops_per_s": rate}),
            );
        }
    }
    table.print();
    target.cleanup().await;
    Ok(())
}

/// Runs one worker per token for the warm-up and the window; merges what they measured
/// inside the window.
async fn run_workers(
    uri: &str,
    tokens: &[String],
    size: u64,
    cuda: bool,
    way: TicketWay,
    a: &BreakdownArgs,
) -> Result<Parts> {
    let start = Instant::now() + Duration::from_millis(200);
    let (from, until) = (start + a.warmup, start + a.warmup + a.duration);
    let mut tasks = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        let (uri, token) = (uri.to_string(), token.clone());
        tasks.push(tokio::spawn(async move {
            worker(&uri, token, i, size, cuda, way, start, from, until).await
        }));
    }
    let mut all = Parts::default();
    for t in tasks {
        all.merge(&t.await??);
    }
    Ok(all)
}

#[allow(clippy::too_many_arguments)]
async fn worker(
    uri: &str,
    token: String,
    index: usize,
    size: u64,
    cuda: bool,
    way: TicketWay,
    start: Instant,
    from: Instant,
    until: Instant,
) -> Result<Parts> {
    // One connection for both services: the floor is measured on the connection the lease
    // calls use (the client's transport: `GPU_BROKER_CLIENT_TRANSPORT` picks it).
    let transport = gpu_broker_client::connect::connect_transport_with(
        uri,
        &gpu_broker_client::ConnectOptions::from_env(),
    )
    .await?;
    let mut health = HealthClient::new(transport.clone());
    let client = Client::from_transport(transport, token)?;
    let session = client.session(format!("bench-breakdown-{index}")).await?;
    let dialled = gpu_broker_client::connect::unix_path(uri);
    let mut raw = client.raw();
    let mut parts = Parts::default();
    // `retained`: block id -> (the ended lease it was retained under, descriptor, mapping).
    let mut kept: std::collections::HashMap<u64, (String, OwnedFd, Mapped)> =
        std::collections::HashMap::new();
    let mut line: Option<tokio::net::UnixStream> = None;
    let retaining = matches!(way, TicketWay::Retained | TicketWay::Line);
    tokio::time::sleep_until(start.into()).await;
    loop {
        let now = Instant::now();
        if now >= until {
            break;
        }
        let measured = now >= from;
        let t0 = Instant::now();
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .context("health Check")?;
        let t1 = Instant::now();
        let request = pb::AcquireLeaseRequest {
            session_id: session.id(),
            bytes: size,
            accept_handles: vec![pb::HandleKind::Fd as i32],
            push_descriptor: way == TicketWay::Pushed
                && gpu_broker_client::descriptor_channel::wanted(),
            ..Default::default()
        };
        let on_line = match line.as_mut() {
            Some(l) if !kept.is_empty() => {
                let (kind, body) = line_ask(l, LINE_ACQUIRE, &request.encode_to_vec()).await?;
                ensure!(
                    kind == LINE_GRANTED,
                    "the lease line did not grant the retained block"
                );
                Some(pb::AcquireLeaseResponse::decode(body.as_slice())?)
            }
            _ => None,
        };
        let reply = match on_line {
            Some(r) => r,
            None => raw.acquire_lease(request).await?.into_inner(),
        };
        let t2 = Instant::now();
        let lease = reply.lease.context("AcquireLease reply carries no lease")?;
        let Some(pb::lease::Handle::Fd(h)) = lease.handle.clone() else {
            bail!("the lease carries no fd handle");
        };
        let socket = std::path::Path::new(&h.socket_path);
        let reused = if h.retained {
            let (_, fd, mapped) = kept
                .remove(&h.block_id)
                .context("a retained grant of a block this worker does not hold")?;
            Some((fd, mapped))
        } else {
            None
        };
        let (fd, t3, mapped) = match reused {
            Some((fd, mapped)) => {
                let t = Instant::now();
                (fd, t, mapped)
            }
            None => {
                let places = gpu_broker_client::fd::candidates(socket, dialled.as_deref());
                let fd = match way {
                    TicketWay::Pushed if h.pushed => {
                        let key = *uuid::Uuid::parse_str(&lease.lease_id)?.as_bytes();
                        gpu_broker_client::descriptor_channel::take(&places, &key)
                            .context("a pushed descriptor not on the channel")?
                    }
                    TicketWay::Pushed => {
                        let fd =
                            gpu_broker_client::fd::fetch(socket, &h.ticket, dialled.as_deref())
                                .await?;
                        gpu_broker_client::descriptor_channel::ensure_open(&places).await;
                        fd
                    }
                    TicketWay::Library | TicketWay::Retained | TicketWay::Line => {
                        gpu_broker_client::fd::fetch(socket, &h.ticket, dialled.as_deref()).await?
                    }
                    TicketWay::Fresh => fresh_async(socket, &h.ticket).await?,
                    TicketWay::Blocking => fresh_blocking(socket, &h.ticket)?,
                };
                let t3 = Instant::now();
                let mapped = map(&fd, cuda, &lease, &h)?;
                (fd, t3, mapped)
            }
        };
        let t4 = Instant::now();
        let t5;
        if retaining {
            t5 = Instant::now();
            let request = pb::ReleaseLeaseRequest {
                lease_id: lease.lease_id.clone(),
                retain_mapping: true,
                may_decline: way == TicketWay::Line,
            };
            let reply = match line.as_mut() {
                Some(l) => {
                    let (kind, body) = line_ask(l, LINE_RELEASE, &request.encode_to_vec()).await?;
                    ensure!(kind == LINE_RELEASED, "the lease line did not release");
                    pb::ReleaseLeaseResponse::decode(body.as_slice())?
                }
                None => raw.release_lease(request).await?.into_inner(),
            };
            if way == TicketWay::Line && line.is_none() {
                line = Some(line_open(socket, dialled.as_deref(), &session.id()).await?);
            }
            if reply.retained {
                kept.insert(h.block_id, (lease.lease_id.clone(), fd, mapped));
            }
        } else {
            drop(mapped);
            drop(fd);
            t5 = Instant::now();
            client.release_lease(&lease.lease_id).await?;
        }
        let t6 = Instant::now();
        if measured {
            parts.check.record(t1 - t0);
            parts.rpc.record(t2 - t1);
            parts.ticket.record(t3 - t2);
            parts.map.record(t4 - t3);
            parts.lease_map.record(t4 - t1);
            parts.release.record(t6 - t5);
            parts.loops += 1;
        }
    }
    // Let go of what this worker retained (confirmed), then close.
    for (ended, fd, mapped) in kept.into_values() {
        drop(mapped);
        drop(fd);
        client.release_lease(&ended).await?;
    }
    session.close();
    Ok(parts)
}

/// Opens the session's lease line on the ticket socket (docs/protocol.md).
async fn line_open(
    socket: &std::path::Path,
    dialled: Option<&std::path::Path>,
    session: &str,
) -> Result<tokio::net::UnixStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let place = gpu_broker_client::fd::candidates(socket, dialled)
        .into_iter()
        .find(|p| p.exists())
        .context("no ticket socket to open a lease line on")?;
    let mut s = tokio::net::UnixStream::connect(place).await?;
    let mut hello = LINE_HELLO.to_vec();
    hello.extend_from_slice(uuid::Uuid::parse_str(session)?.as_bytes());
    s.write_all(&hello).await?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await?;
    ensure!(
        b[0] == LINE_OPEN_REPLY,
        "the lease line was refused ({:#x})",
        b[0]
    );
    Ok(s)
}

/// One request on a lease line: the answer's kind and payload.
async fn line_ask(
    s: &mut tokio::net::UnixStream,
    kind: u8,
    payload: &[u8],
) -> Result<(u8, Vec<u8>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(&line_frame(kind, payload)).await?;
    let mut head = [0u8; LINE_FRAME_HEAD];
    s.read_exact(&mut head).await?;
    let mut body = vec![0u8; line_payload_len(&head).context("an answer too long")?];
    s.read_exact(&mut body).await?;
    Ok((head[0], body))
}

/// A ticket on a new connection, every step on the runtime; presented again after 1 ms
/// while the broker says busy.
async fn fresh_async(socket: &std::path::Path, ticket: &[u8]) -> Result<OwnedFd> {
    use tokio::io::AsyncWriteExt;
    for _ in 0..10_000 {
        let mut s = tokio::net::UnixStream::connect(socket).await?;
        let _ = s.write_all(ticket).await;
        let got = loop {
            s.readable().await?;
            match s.try_io(tokio::io::Interest::READABLE, || {
                gpu_broker_client::fd::recv_with_fd(s.as_fd())
            }) {
                Ok(got) => break got,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
        };
        match got {
            r if r.len == 1 && r.byte == BUSY_REPLY => {
                tokio::time::sleep(Duration::from_millis(1)).await
            }
            r => {
                return r.fd.with_context(|| {
                    format!(
                        "the ticket server sent no descriptor ({} bytes, {:#x})",
                        r.len, r.byte
                    )
                })
            }
        }
    }
    bail!("the ticket socket stayed busy")
}

/// A ticket on a new connection with blocking system calls on the calling (runtime)
/// thread, as the client crate did before it kept connections (busy: again after 1 ms).
fn fresh_blocking(socket: &std::path::Path, ticket: &[u8]) -> Result<OwnedFd> {
    use std::io::Write;
    for _ in 0..10_000 {
        let mut s = std::os::unix::net::UnixStream::connect(socket)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let _ = s.write_all(ticket);
        match gpu_broker_client::fd::recv_with_fd(s.as_fd())? {
            r if r.len == 1 && r.byte == BUSY_REPLY => std::thread::sleep(Duration::from_millis(1)),
            r => {
                return r.fd.with_context(|| {
                    format!(
                        "the ticket server sent no descriptor ({} bytes, {:#x})",
                        r.len, r.byte
                    )
                })
            }
        }
    }
    bail!("the ticket socket stayed busy")
}

/// A mapping of the lease's memory, undone when dropped.
enum Mapped {
    Host(#[allow(dead_code)] gpu_broker_client::mapping::HostMapping<'static>),
    Cuda(#[allow(dead_code)] gpu_broker_client::cuda::CudaMapping),
}

fn map(fd: &OwnedFd, cuda: bool, lease: &pb::Lease, h: &pb::FdHandle) -> Result<Mapped> {
    if cuda {
        let ordinal = gpu_broker_client::cuda::local_ordinal(lease.device, &lease.device_uuid);
        Ok(Mapped::Cuda(gpu_broker_client::cuda::map_vmm(
            fd.as_fd(),
            ordinal,
            lease.bytes,
            h.size,
            h.block_id,
        )?))
    } else {
        Ok(Mapped::Host(
            gpu_broker_client::mapping::HostMapping::from_fd(fd.as_fd(), 0, lease.bytes)?,
        ))
    }
}

/// The raw baselines: the same memory made and mapped in this process, no broker.
mod raw {
    use super::Histogram;
    use anyhow::{bail, Result};
    use cudarc::driver::sys;
    use std::time::Instant;

    fn check(call: &str, rc: sys::CUresult) -> Result<()> {
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            bail!("{call} failed: {rc:?}")
        }
    }

    /// The device's primary context, retained (and current on the retaining thread).
    pub struct Context(sys::CUdevice);

    impl Context {
        pub fn retain(device: i32) -> Result<Context> {
            let mut dev = 0;
            let mut ctx = std::ptr::null_mut();
            // SAFETY: plain driver calls with valid out pointers; released on drop.
            unsafe {
                check("cuInit", sys::cuInit(0))?;
                check("cuDeviceGet", sys::cuDeviceGet(&mut dev, device))?;
                check(
                    "cuDevicePrimaryCtxRetain",
                    sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                )?;
                check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
            }
            Ok(Context(dev))
        }
    }

    impl Drop for Context {
        fn drop(&mut self) {
            // SAFETY: balances the retain.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.0) };
        }
    }

    /// `n` in-process allocations + maps of `size` bytes, each timed, each undone.
    pub fn timed(cuda: bool, size: u64, n: u32) -> Result<Histogram> {
        let mut h = Histogram::default();
        let _ctx = if cuda {
            Some(Context::retain(0)?)
        } else {
            None
        };
        for _ in 0..n {
            if cuda {
                h.record(vmm(size)?);
            } else {
                h.record(memfd(size)?);
            }
        }
        Ok(h)
    }

    /// `memfd_create` + `ftruncate` + `mmap` (timed), then undone.
    fn memfd(size: u64) -> Result<std::time::Duration> {
        let len = usize::try_from(size)?;
        let start = Instant::now();
        // SAFETY: plain system calls; every result checked, undone below.
        unsafe {
            let fd = libc::memfd_create(c"bench-raw".as_ptr(), libc::MFD_CLOEXEC);
            if fd < 0 || libc::ftruncate(fd, size as libc::off_t) != 0 {
                bail!("memfd: {}", std::io::Error::last_os_error());
            }
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            let took = start.elapsed();
            if p == libc::MAP_FAILED {
                bail!("mmap: {}", std::io::Error::last_os_error());
            }
            libc::munmap(p, len);
            libc::close(fd);
            Ok(took)
        }
    }

    /// `cuMemCreate` + `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess` on device 0
    /// (timed), then undone.
    fn vmm(size: u64) -> Result<std::time::Duration> {
        let size = usize::try_from(size)?;
        // SAFETY: zeroed properties are valid; the fields the call needs are set.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        };
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let start = Instant::now();
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: raw driver calls with valid out pointers, undone below.
        unsafe {
            check("cuMemCreate", sys::cuMemCreate(&mut h, size, &prop, 0))?;
            check(
                "cuMemAddressReserve",
                sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0),
            )?;
            check("cuMemMap", sys::cuMemMap(ptr, size, 0, h, 0))?;
            check("cuMemSetAccess", sys::cuMemSetAccess(ptr, size, &access, 1))?;
        }
        let took = start.elapsed();
        // SAFETY: undoing the mapping made above.
        unsafe {
            check("cuMemUnmap", sys::cuMemUnmap(ptr, size))?;
            check("cuMemAddressFree", sys::cuMemAddressFree(ptr, size))?;
            check("cuMemRelease", sys::cuMemRelease(h))?;
        }
        Ok(took)
    }
}
