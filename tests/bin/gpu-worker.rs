//! A worker process for the GPU tests and the GPU benchmark (`scripts/gpu-all.sh`). Each
//! subcommand is one role: hold a lease and watch it, open another process's lease,
//! check a reused block reads zeros, or time leases against raw driver allocations.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use gpu_broker_client::{Client, LeaseHandle};
use std::io::Write;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Cli {
    /// Broker address.
    #[arg(
        long,
        env = "GPU_BROKER_ADDR",
        default_value = "unix:///run/gpu-broker/broker.sock"
    )]
    broker: String,
    /// Tenant token.
    #[arg(long, env = "GPU_BROKER_TOKEN", default_value = "")]
    token: String,
    /// Drop to this uid (and gid) first (needs root): a worker of another user.
    #[arg(long)]
    as_uid: Option<u32>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Lease, fill with a pattern, print `READY <lease> <device> <bytes> <handle-hex>`, then
    /// print `CHANGED <byte>` when another process changes the first byte; runs until killed.
    Hold {
        #[arg(long)]
        bytes: u64,
        #[arg(long, value_parser = parse_byte)]
        pattern: u8,
        #[arg(long)]
        device: Option<u32>,
    },
    /// Open another process's fd lease (`--handle fd:<block>`, as `hold` prints it) by id
    /// with a ticket of this process's own (`--lease`), check it holds `expect`, write
    /// `write` into its first 4 KiB, print `OK`.
    Open {
        #[arg(long)]
        handle: String,
        #[arg(long)]
        lease: String,
        #[arg(long)]
        device: u32,
        #[arg(long)]
        bytes: u64,
        #[arg(long, value_parser = parse_byte)]
        expect: u8,
        #[arg(long, value_parser = parse_byte)]
        write: u8,
    },
    /// Allocate `own` bytes on device 0 without the broker (a process outside it), print
    /// `READY`, hold until killed.
    Outside {
        #[arg(long)]
        own: u64,
    },
    /// Lease, fill, unmap, release; print `DONE <handle-hex>`.
    FillRelease {
        #[arg(long)]
        bytes: u64,
        #[arg(long, value_parser = parse_byte)]
        pattern: u8,
    },
    /// Lease `bytes`, then allocate `own` bytes behind the broker's back (cuMemAlloc in
    /// this process); print `READY`, hold until killed.
    Hog {
        #[arg(long)]
        bytes: u64,
        #[arg(long)]
        own: u64,
    },
    /// Ask for `bytes` with host fallback; register the host lease with CUDA, have the GPU
    /// write it through the device pointer; print `HOSTREG <tier> <bytes-not-set>`.
    HostFallback {
        #[arg(long)]
        bytes: u64,
    },
    /// Lease, map, fill with `pattern`, then end the session without releasing (the broker
    /// must quarantine the still-mapped block); print `ABANDONED <lease> <bytes>`, then
    /// `STILL <bytes-not-pattern>` from the mapping it keeps; hold until killed.
    Abandon {
        #[arg(long)]
        bytes: u64,
        #[arg(long, value_parser = parse_byte)]
        pattern: u8,
    },
    /// Lease, map, fill with `pattern`, release the lease (unmapping first unless
    /// `--keep`), print `RELEASED <handle-hex>`; with `--keep` also `STILL
    /// <bytes-not-pattern>` from the mapping it kept past the release; hold until killed.
    ReleaseAndStay {
        #[arg(long)]
        bytes: u64,
        #[arg(long, value_parser = parse_byte)]
        pattern: u8,
        #[arg(long)]
        keep: bool,
    },
    /// Lease, read every byte; print `READ <handle-hex> <nonzero-bytes>`; release.
    ReadZeros {
        #[arg(long)]
        bytes: u64,
    },
    /// Acquire a lease of its own and print `KIND <handle kind> <memory kind>`, map it, write
    /// and read back a pattern, print `MAPPED <bad bytes>` (for the namespace test).
    Selftest {
        #[arg(long, default_value_t = 64 << 20)]
        bytes: u64,
    },
    /// Time lease + map (import) for fresh, pooled and cross-tenant pooled leases, against
    /// raw in-process allocation + map; `--token2` is a second tenant's token.
    BenchMap {
        #[arg(long, default_value = "2MiB,64MiB,1GiB")]
        sizes: String,
        #[arg(long, default_value_t = 20)]
        iters: usize,
        #[arg(long)]
        token2: String,
        /// Label of the rows (e.g. `fd`).
        #[arg(long)]
        label: String,
    },
    /// Time sleep and wake of a resident lease of `--bytes`, with contents saved to a
    /// host-tier lease and without; checks the address and the saved bytes each time.
    SleepBench {
        #[arg(long, default_value_t = 1 << 30)]
        bytes: u64,
        #[arg(long, default_value_t = 5)]
        iters: usize,
    },
    /// Which local CUDA ordinal a lease's broker device is (by UUID): lease `--bytes`, map
    /// it, fill and check it, print one JSON line (local and broker UUIDs, the lease's
    /// device and UUID, the ordinal mapped), release. Under `gpu-brokerctl run` (token from
    /// GPU_BROKER_TOKEN_FILE) the lease is drawn from the reservation.
    Ordinal {
        #[arg(long, default_value_t = 64 << 20)]
        bytes: u64,
    },
    /// A shared CUDA lease across tenants: this tenant (`--publisher`, the token's) publishes
    /// a written VMM lease for `--reader`; a worker of the reader (a child process,
    /// `--token-b`) imports and reads it; a tenant not listed (`--token-c`) gets
    /// NOT_FOUND; only the publisher is charged; after the publisher's lease ends the
    /// reader still reads until it releases; then the memory is freed. Prints one line per
    /// fact and `SHAREDCHECK ok`.
    SharedCheck {
        #[arg(long, default_value_t = 256 << 20)]
        bytes: u64,
        #[arg(long)]
        publisher: String,
        #[arg(long)]
        reader: String,
        #[arg(long)]
        token_b: String,
        #[arg(long)]
        token_c: String,
    },
    /// The importing worker of `shared-check`: imports `--publisher`'s `--name`, maps it
    /// (CUDA, read-only), counts bytes other than `--expect` (`IMPORTED <memory kind>
    /// <bad>`); then on stdin `read` (`READ <bad>`) and `release` (`RELEASED`, exits).
    SharedImport {
        #[arg(long)]
        publisher: String,
        #[arg(long)]
        name: String,
        #[arg(long)]
        expect: u8,
    },
    /// Memory a worker handed to a child the broker never saw stays charged to its tenant
    /// after the worker released it and exited, until the child exits: a worker
    /// (`kept-parent`, a process of the token's tenant, as `--child-uid` where given)
    /// sends its lease's descriptor to its child (`kept-child`) over `SCM_RIGHTS`; the
    /// child maps it with a context of its own; the worker releases and exits. Once with
    /// the lease published (freed at the release, the worker alive), once cached and then
    /// evicted by `--token-b`'s tenant after the worker exited (only with `--child-uid`:
    /// found by the uid it shares with the worker). Prints one line per fact and
    /// `KEPTCHECK ok`.
    KeptCheck {
        #[arg(long, default_value_t = 256 << 20)]
        bytes: u64,
        /// Another tenant's token, whose lease evicts the cached block.
        #[arg(long)]
        token_b: String,
        /// The admin token's file (device sizes, quarantined blocks).
        #[arg(long)]
        admin_token_file: String,
        /// Run the worker and its child as this uid (needs root).
        #[arg(long)]
        child_uid: Option<u32>,
    },
    /// The worker of `kept-check`: leases `--bytes` on device 0, fills it, publishes it
    /// where `--publish` says, starts `kept-child` and sends it the descriptor over
    /// `SCM_RIGHTS`, waits for its mapping, releases (`PARENT RELEASED <bytes>`), exits.
    KeptParent {
        #[arg(long)]
        bytes: u64,
        #[arg(long)]
        publish: bool,
    },
    /// The child of `kept-parent`: receives the descriptor on fd 3, maps it (a CUDA
    /// context of its own), closes the descriptor, counts bytes other than `--expect`
    /// (`CHILD MAPPED <bad>`), again once its parent has exited (`CHILD READ-AFTER-PARENT
    /// <bad>`), then holds the mapping until killed.
    KeptChild {
        #[arg(long)]
        bytes: u64,
        #[arg(long)]
        size: u64,
        #[arg(long, value_parser = parse_byte)]
        expect: u8,
    },
    /// Time AcquireLease (fresh and pooled) against in-process cuMemCreate + fd export.
    Bench {
        #[arg(long, default_value = "2MiB,64MiB,1GiB")]
        sizes: String,
        #[arg(long, default_value_t = 30)]
        iters: usize,
    },
}

fn parse_byte(s: &str) -> Result<u8, String> {
    let t = s.trim_start_matches("0x");
    u8::from_str_radix(t, 16).map_err(|e| e.to_string())
}

fn parse_size(s: &str) -> Result<u64> {
    s.parse::<bytesize_like::Size>().map(|b| b.0)
}

mod bytesize_like {
    /// Minimal `1MiB`/`64MiB`/`1GiB` parser for the bench's size list.
    pub struct Size(pub u64);
    impl std::str::FromStr for Size {
        type Err = anyhow::Error;
        fn from_str(s: &str) -> anyhow::Result<Size> {
            let s = s.trim();
            let (num, mult) = if let Some(n) = s.strip_suffix("GiB") {
                (n, 1u64 << 30)
            } else if let Some(n) = s.strip_suffix("MiB") {
                (n, 1 << 20)
            } else if let Some(n) = s.strip_suffix("KiB") {
                (n, 1 << 10)
            } else {
                (s, 1)
            };
            Ok(Size(num.trim().parse::<u64>()? * mult))
        }
    }
}

/// What identifies a lease's memory: `fd:<block id>`.
fn handle_id(h: &LeaseHandle) -> Result<String> {
    match h {
        LeaseHandle::Fd(i) if i.memory_kind == gpu_broker_client::MemoryKind::CudaVmm => {
            Ok(format!("fd:{}", i.block_id))
        }
        other => bail!("not a CUDA lease: {other:?}"),
    }
}

const CHUNK: usize = 16 << 20;

fn fill(m: &gpu_broker_client::cuda::CudaMapping, bytes: u64, pattern: u8) -> Result<()> {
    let buf = vec![pattern; CHUNK];
    let mut off = 0u64;
    while off < bytes {
        let n = (bytes - off).min(CHUNK as u64) as usize;
        m.copy_from_host(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

fn count_not(m: &gpu_broker_client::cuda::CudaMapping, bytes: u64, value: u8) -> Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    let mut bad = 0u64;
    while off < bytes {
        let n = (bytes - off).min(CHUNK as u64) as usize;
        m.copy_to_host(off, &mut buf[..n])?;
        bad += buf[..n].iter().filter(|&&b| b != value).count() as u64;
        off += n as u64;
    }
    Ok(bad)
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(uid) = cli.as_uid {
        // SAFETY: plain syscalls; nothing else runs yet that depends on the ids.
        if unsafe { libc::setgid(uid) != 0 || libc::setuid(uid) != 0 } {
            bail!(
                "cannot become uid {uid}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    if let Cmd::Open {
        handle,
        lease,
        device,
        bytes,
        expect,
        write,
    } = &cli.cmd
    {
        let Some(block) = handle.strip_prefix("fd:") else {
            bail!("--handle must be fd:<block id> (as hold prints it), got {handle:?}");
        };
        let client = Client::connect(&cli.broker, cli.token.clone()).await?;
        let (info, fd) = client.lease_fd(lease).await?;
        if info.block_id.to_string() != block {
            bail!("lease {lease} is block {}, not {block}", info.block_id);
        }
        use std::os::fd::AsFd;
        let m = gpu_broker_client::cuda::map_vmm(
            fd.as_fd(),
            *device,
            *bytes,
            info.size,
            info.block_id,
        )?;
        let bad = count_not(&m, *bytes, *expect)?;
        if bad > 0 {
            bail!("{bad} bytes differ from {expect:#04x}");
        }
        m.copy_from_host(0, &[*write; 4096])?;
        m.close()?;
        say("OK".into());
        return Ok(());
    }
    if let Cmd::Outside { own } = &cli.cmd {
        use gpu_broker::device::Device;
        let mut dev = gpu_broker::device::cuda::CudaDevice::open(0)?;
        let _a = dev.alloc(*own)?;
        say("READY".into());
        loop {
            std::thread::park();
        }
    }
    if let Cmd::KeptChild {
        bytes,
        size,
        expect,
    } = &cli.cmd
    {
        return kept_child(*bytes, *size, *expect);
    }
    let token = match (cli.token.is_empty(), std::env::var("GPU_BROKER_TOKEN_FILE")) {
        (true, Ok(f)) => std::fs::read_to_string(&f)
            .with_context(|| format!("reading {f}"))?
            .trim()
            .to_string(),
        _ => cli.token.clone(),
    };
    let client = Client::connect(&cli.broker, token)
        .await
        .context("connecting")?;
    let session = client.session("gpu-worker").await?;
    match cli.cmd {
        Cmd::Hold {
            bytes,
            pattern,
            device,
        } => {
            let mut req = session.lease_request(bytes);
            if let Some(d) = device {
                req = req.device(d);
            }
            let lease = req.send().await?;
            let m = lease.map_cuda()?;
            fill(&m, lease.bytes(), pattern)?;
            say(format!(
                "READY {} {} {} {}",
                lease.id(),
                lease.device(),
                lease.bytes(),
                handle_id(lease.handle())?
            ));
            let mut first = [pattern; 1];
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                m.copy_to_host(0, &mut first)?;
                if first[0] != pattern {
                    say(format!("CHANGED {:#04x}", first[0]));
                    break;
                }
            }
            // Keep holding until killed.
            std::future::pending::<()>().await;
        }
        Cmd::FillRelease { bytes, pattern } => {
            let lease = session.lease(bytes).await?;
            let h = handle_id(lease.handle())?;
            {
                let m = lease.map_cuda()?;
                fill(&m, lease.bytes(), pattern)?;
                m.close()?;
            }
            lease.release().await?;
            say(format!("DONE {h}"));
        }
        Cmd::Abandon { bytes, pattern } => {
            let lease = session.lease(bytes).await?;
            let m = lease.map_cuda()?;
            fill(&m, lease.bytes(), pattern)?;
            say(format!("ABANDONED {} {}", lease.id(), lease.bytes()));
            session.close();
            // The mapping outlives the session: the memory must stay this process's.
            tokio::time::sleep(Duration::from_millis(500)).await;
            say(format!("STILL {}", count_not(&m, lease.bytes(), pattern)?));
            std::future::pending::<()>().await;
        }
        Cmd::ReleaseAndStay {
            bytes,
            pattern,
            keep,
        } => {
            let lease = session.lease(bytes).await?;
            let h = handle_id(lease.handle())?;
            let bytes = lease.bytes();
            let m = lease.map_cuda()?;
            fill(&m, bytes, pattern)?;
            let kept = if keep {
                Some(m)
            } else {
                m.close()?;
                None
            };
            lease.release().await?;
            say(format!("RELEASED {h}"));
            if let Some(m) = &kept {
                // The import outlives the release: the memory stays this process's.
                say(format!("STILL {}", count_not(m, bytes, pattern)?));
            }
            // Hold (the kept mapping too) until killed.
            std::future::pending::<()>().await;
        }
        Cmd::ReadZeros { bytes } => {
            let lease = session.lease(bytes).await?;
            let h = handle_id(lease.handle())?;
            let bad = {
                let m = lease.map_cuda()?;
                let bad = count_not(&m, lease.bytes(), 0)?;
                m.close()?;
                bad
            };
            lease.release().await?;
            say(format!("READ {h} {bad}"));
        }
        Cmd::Hog { bytes, own } => {
            use gpu_broker::device::Device;
            let lease = session.lease(bytes).await?;
            let _m = lease.map_cuda()?;
            // The device (and its allocation) lives on this thread until the process dies.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let r = gpu_broker::device::cuda::CudaDevice::open(0)
                    .and_then(|mut d| d.alloc(own).map(|a| (d, a)));
                match r {
                    Ok(keep) => {
                        let _ = tx.send(Ok(()));
                        let _keep = keep;
                        loop {
                            std::thread::park();
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            });
            rx.recv()??;
            say(format!("READY {}", lease.id()));
            std::future::pending::<()>().await;
        }
        Cmd::HostFallback { bytes } => {
            let lease = session
                .lease_request(bytes)
                .fallback_host(true)
                .send()
                .await?;
            let tier = format!("{:?}", lease.tier());
            let not_set = {
                let mut m = lease.map()?;
                {
                    let reg = gpu_broker_client::cuda::register_host(&mut m[..], 0)?;
                    reg.device_memset(0x3c)?;
                }
                m.iter().filter(|&&b| b != 0x3c).count()
            };
            lease.release().await?;
            say(format!("HOSTREG {tier} {not_set}"));
        }
        Cmd::Bench { sizes, iters } => bench(&session, &sizes, iters).await?,
        Cmd::Ordinal { bytes } => {
            let info = client.broker_info().await?;
            let lease = session.lease(bytes).await?;
            let ordinal =
                gpu_broker_client::cuda::local_ordinal(lease.device(), lease.device_uuid());
            let m = lease.map_cuda()?;
            fill(&m, lease.bytes(), 0x5a)?;
            let bad = count_not(&m, lease.bytes(), 0x5a)?;
            say(serde_json::json!({
                "cuda_visible_devices": std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default(),
                "local_uuids": gpu_broker_client::cuda::local_uuids(),
                "broker_uuids": info.device_uuids,
                "lease_device": lease.device(),
                "lease_uuid": lease.device_uuid(),
                "ordinal": ordinal,
                "mapped_on": m.device(),
                "bytes": lease.bytes(),
                "bad_bytes": bad,
            })
            .to_string());
            m.close()?;
            lease.release().await?;
        }
        Cmd::SleepBench { bytes, iters } => sleep_bench(&session, bytes, iters).await?,
        Cmd::SharedCheck {
            bytes,
            publisher,
            reader,
            token_b,
            token_c,
        } => {
            shared_check(
                &cli.broker,
                &client,
                &session,
                bytes,
                (&publisher, &reader),
                (&token_b, &token_c),
            )
            .await?
        }
        Cmd::SharedImport {
            publisher,
            name,
            expect,
        } => shared_import(&session, &publisher, &name, expect).await?,
        Cmd::KeptCheck {
            bytes,
            token_b,
            admin_token_file,
            child_uid,
        } => {
            let admin_token = std::fs::read_to_string(&admin_token_file)
                .with_context(|| format!("reading {admin_token_file}"))?;
            kept_check(
                &cli.broker,
                &cli.token,
                &client,
                bytes,
                &token_b,
                admin_token.trim(),
                child_uid,
            )
            .await?
        }
        Cmd::KeptParent { bytes, publish } => kept_parent(&session, bytes, publish).await?,
        Cmd::KeptChild { .. } => unreachable!("handled before connecting"),
        Cmd::Selftest { bytes } => {
            let lease = session.lease(bytes).await?;
            let memory = match lease.handle() {
                LeaseHandle::Fd(i) => format!("{:?}", i.memory_kind),
                _ => "-".into(),
            };
            say(format!("KIND {} {memory}", lease.handle().kind()));
            let bad = {
                let m = lease.map_cuda()?;
                fill(&m, lease.bytes(), 0x5a)?;
                let bad = count_not(&m, lease.bytes(), 0x5a)?;
                m.close()?;
                bad
            };
            lease.release().await?;
            say(format!("MAPPED {bad}"));
        }
        Cmd::BenchMap {
            sizes,
            iters,
            token2,
            label,
        } => {
            let other = Client::connect(&cli.broker, token2).await?;
            let other = other.session("gpu-worker-2").await?;
            bench_map(&session, &other, &sizes, iters, &label).await?
        }
        Cmd::Open { .. } | Cmd::Outside { .. } => unreachable!("handled above"),
    }
    Ok(())
}

/// Raw in-process VMM: cuMemCreate + reserve + map + set access (timed), then undone.
fn raw_vmm_us(device: u32, bytes: u64, iters: usize) -> Result<f64> {
    // On a thread of its own with the device's primary context current (opening a device
    // of the broker library makes it current), as a worker's CUDA thread would be.
    std::thread::spawn(move || raw_vmm_on_thread(device, bytes, iters))
        .join()
        .map_err(|_| anyhow::anyhow!("raw VMM bench thread panicked"))?
}

fn raw_vmm_on_thread(device: u32, bytes: u64, iters: usize) -> Result<f64> {
    use cudarc::driver::sys;
    let check = |call: &str, rc: sys::CUresult| -> Result<()> {
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            bail!("{call} failed: {rc:?}")
        }
    };
    let keep = gpu_broker::device::cuda::CudaDevice::open(device)?;
    let size = usize::try_from(bytes)?;
    // SAFETY: zeroed properties are valid; then set the fields the call needs.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device as i32,
    };
    let access = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let mut t = Vec::new();
    for _ in 0..iters {
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
        t.push(start.elapsed().as_secs_f64() * 1e6);
        // SAFETY: undoing the mapping made above.
        unsafe {
            check("cuMemUnmap", sys::cuMemUnmap(ptr, size))?;
            check("cuMemAddressFree", sys::cuMemAddressFree(ptr, size))?;
            check("cuMemRelease", sys::cuMemRelease(h))?;
        }
    }
    drop(keep);
    Ok(median(&mut t))
}

/// Lease + map (fetch the fd + import + map) for a fresh size, the
/// same size again (pooled), and a size another tenant just released (cross-tenant pooled:
/// by the reuse rule a fresh object), against raw in-process VMM allocation + map. Unmap and
/// release are not timed.
async fn bench_map(
    a: &gpu_broker_client::Session,
    b: &gpu_broker_client::Session,
    sizes: &str,
    iters: usize,
    label: &str,
) -> Result<()> {
    let sizes: Vec<u64> = sizes.split(',').map(parse_size).collect::<Result<_>>()?;
    // Keep the device's primary context alive for the whole run, as a worker's framework
    // does: otherwise the last unmap releases it and every lease pays a new context
    // (~100 ms), which is not what a lease costs.
    let _context = gpu_broker::device::cuda::CudaDevice::open(0)?;
    say(format!(
        "{label}: size_bytes raw_vmm_map_us fresh_lease_map_us pooled_lease_map_us cross_tenant_lease_map_us release_unmap_us retained_lease_map_us retained_over_raw"
    ));
    // Pooled with the block retained mapped (`Session::retain_mappings`): the lease is
    // one RPC, the descriptor and mapping this process kept are reused.
    let kept = a.client().session(format!("{label}-retained")).await?;
    let timed = |s: &gpu_broker_client::Session, bytes: u64| {
        let s = s.clone();
        async move {
            let start = Instant::now();
            let l = s.lease(bytes).await?;
            let m = l.map_cuda()?;
            let took = start.elapsed().as_secs_f64() * 1e6;
            let start = Instant::now();
            m.close()?;
            l.release().await?;
            Ok::<_, anyhow::Error>((took, start.elapsed().as_secs_f64() * 1e6))
        }
    };
    for &s in &sizes {
        let raw = raw_vmm_us(0, s, iters)?;
        let (mut fresh, mut pooled, mut cross, mut rel) = (vec![], vec![], vec![], vec![]);
        // Fresh: a size no cached block has (different per round).
        for k in 0..iters {
            let fs = s + (k as u64 + 1) * (2 << 20);
            fresh.push(timed(a, fs).await?.0);
        }
        // Pooled: tenant a again and again (its own block, warmed first).
        timed(a, s).await?;
        for _ in 0..iters {
            let (p, r) = timed(a, s).await?;
            pooled.push(p);
            rel.push(r);
        }
        // Cross-tenant: a and b take turns, each finding the block the other just released
        // (which the reuse rule replaces by a fresh one).
        for k in 0..iters {
            let who = if k % 2 == 0 { b } else { a };
            cross.push(timed(who, s).await?.0);
        }
        kept.retain_mappings(s.saturating_mul(2));
        let mut retained = vec![];
        for k in 0..=iters {
            let start = Instant::now();
            let mut l = kept.lease(s).await?;
            l.mapped_cuda()?;
            let took = start.elapsed().as_secs_f64() * 1e6;
            l.release().await?;
            // The first one maps the block it then retains.
            if k > 0 {
                retained.push(took);
            }
        }
        kept.drop_retained().await;
        let r = median(&mut retained);
        say(format!(
            "{label}: {s} {raw:.1} {:.1} {:.1} {:.1} {:.1} {r:.1} {:.2}",
            median(&mut fresh),
            median(&mut pooled),
            median(&mut cross),
            median(&mut rel),
            r / raw.max(1e-9)
        ));
    }
    Ok(())
}

/// For each size: median of in-process cuMemCreate + map + fd export (the broker's own
/// `CudaDevice`; then free, not timed), of a fresh lease (nothing cached), and of a pooled
/// lease (same size again).
async fn bench(session: &gpu_broker_client::Session, sizes: &str, iters: usize) -> Result<()> {
    use gpu_broker::device::cuda::CudaDevice;
    use gpu_broker::device::Device;
    let sizes: Vec<u64> = sizes.split(',').map(parse_size).collect::<Result<_>>()?;
    // The raw side runs on its own thread with its own context, like a worker would.
    let raw_sizes = sizes.clone();
    let raw = std::thread::spawn(move || -> Result<Vec<f64>> {
        let mut dev = CudaDevice::open(0)?;
        // VMM memory comes in whole granules, as the broker's pool rounds leases.
        let g = dev.desc().granularity;
        let mut out = Vec::new();
        for &s in &raw_sizes {
            let s = s.div_ceil(g) * g;
            let mut t = Vec::new();
            for _ in 0..iters {
                let start = Instant::now();
                let a = dev.alloc(s)?;
                let _h = dev.export(&a)?;
                t.push(start.elapsed().as_secs_f64() * 1e6);
                dev.free(a)?;
            }
            out.push(median(&mut t));
        }
        Ok(out)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("raw bench thread panicked"))??;
    say("size_bytes raw_alloc_export_us lease_fresh_us lease_pooled_us pooled_over_raw".into());
    for (i, &s) in sizes.iter().enumerate() {
        let mut fresh = Vec::new();
        let mut pooled = Vec::new();
        for k in 0..iters {
            // Fresh: a size no cached block has (odd granule count, different per round).
            let fs = s + (k as u64 + 1) * (2 << 20);
            let start = Instant::now();
            let l = session.lease(fs).await?;
            fresh.push(start.elapsed().as_secs_f64() * 1e6);
            l.release().await?;
            let start = Instant::now();
            let l = session.lease(s).await?;
            pooled.push(start.elapsed().as_secs_f64() * 1e6);
            l.release().await?;
        }
        // The first pooled one was fresh; drop it from the median set.
        pooled.remove(0);
        let (f, p) = (median(&mut fresh), median(&mut pooled));
        say(format!("{s} {:.1} {f:.1} {p:.1} {:.3}", raw[i], p / raw[i]));
    }
    Ok(())
}

/// Fills `len` bytes at device address `ptr` with `byte` and reads back the first and last
/// bytes (the device's primary context current on this thread).
fn memset_and_probe(device: u32, ptr: u64, len: u64, byte: Option<u8>) -> Result<(u8, u8)> {
    use cudarc::driver::sys;
    let n = usize::try_from(len)?;
    // SAFETY: driver calls on a range this process mapped (the resident lease), with the
    // device's primary context retained and current; buffers outlive the calls.
    unsafe {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        if sys::cuDeviceGet(&mut dev, device as i32) != sys::CUresult::CUDA_SUCCESS
            || sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) != sys::CUresult::CUDA_SUCCESS
            || sys::cuCtxSetCurrent(ctx) != sys::CUresult::CUDA_SUCCESS
        {
            bail!("no CUDA context for device {device}");
        }
        if let Some(b) = byte {
            let rc = sys::cuMemsetD8_v2(ptr, b, n);
            if rc != sys::CUresult::CUDA_SUCCESS {
                bail!("cuMemsetD8: {rc:?}");
            }
            sys::cuCtxSynchronize();
        }
        let (mut first, mut last) = (0u8, 0u8);
        let a = sys::cuMemcpyDtoH_v2((&mut first as *mut u8).cast(), ptr, 1);
        let b = sys::cuMemcpyDtoH_v2((&mut last as *mut u8).cast(), ptr + len - 1, 1);
        sys::cuDevicePrimaryCtxRelease_v2(dev);
        if a != sys::CUresult::CUDA_SUCCESS || b != sys::CUresult::CUDA_SUCCESS {
            bail!("cuMemcpyDtoH: {a:?} {b:?}");
        }
        Ok((first, last))
    }
}

async fn sleep_bench(session: &gpu_broker_client::Session, bytes: u64, iters: usize) -> Result<()> {
    use gpu_broker_client::{Contents, Resident, Staging};
    let lease = session.lease(bytes).await?;
    let device = lease.device();
    let mut r = Resident::new(lease)?;
    let addr = r.addr();
    say(format!(
        "RESIDENT {addr:#x} {} bytes device {device}",
        r.len()
    ));
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    // Per staging (pinned, pageable): sleep with contents, wake restoring them.
    let mut save: [(Vec<f64>, Vec<f64>); 2] = Default::default();
    let (mut sleep_plain, mut wake_plain) = (Vec::new(), Vec::new());
    let mut bad = 0;
    for i in 0..iters {
        // Both stagings each round, in alternating order (side by side, one run).
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let staging = [Staging::Pinned, Staging::Pageable][k];
            r.set_staging(staging);
            let pattern = 0x30 + (2 * i + k) as u8;
            memset_and_probe(device, addr, r.len(), Some(pattern))?;
            let t = Instant::now();
            r.sleep(Contents::Save).await?;
            save[k].0.push(ms(t));
            let used = session.usage().await?;
            if used.usage.held_bytes != 0 || used.usage.host_held_bytes < bytes {
                bad += 1;
                say(format!(
                    "ASLEEP usage held {} host {}",
                    used.usage.held_bytes, used.usage.host_held_bytes
                ));
            }
            let t = Instant::now();
            r.wake(None).await?;
            save[k].1.push(ms(t));
            let (first, last) = memset_and_probe(device, addr, r.len(), None)?;
            if r.addr() != addr || first != pattern || last != pattern {
                bad += 1;
                say(format!(
                    "MISMATCH {staging:?} addr {:#x} first {first:#x} last {last:#x} want {pattern:#x}",
                    r.addr()
                ));
            }
        }
        let t = Instant::now();
        r.sleep(Contents::Discard).await?;
        sleep_plain.push(ms(t));
        let t = Instant::now();
        r.wake(None).await?;
        wake_plain.push(ms(t));
        if r.addr() != addr {
            bad += 1;
        }
    }
    let [(mut ps, mut pw), (mut gs, mut gw)] = save;
    say(format!(
        "SLEEPBENCH bytes={bytes} iters={iters} pinned_sleep_save_ms={:.2} pinned_wake_restore_ms={:.2} pageable_sleep_save_ms={:.2} pageable_wake_restore_ms={:.2} sleep_ms={:.2} wake_ms={:.2} bad={bad}",
        median(&mut ps),
        median(&mut pw),
        median(&mut gs),
        median(&mut gw),
        median(&mut sleep_plain),
        median(&mut wake_plain)
    ));
    r.release().await?;
    if bad > 0 {
        bail!("{bad} sleep/wake checks failed");
    }
    Ok(())
}

/// Free memory of `device` as the driver reports it (the primary context current).
fn free_bytes(device: u32) -> Result<u64> {
    use cudarc::driver::sys;
    // SAFETY: plain driver queries with valid out pointers; the retained primary context
    // is made current on this thread.
    unsafe {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        if sys::cuInit(0) != sys::CUresult::CUDA_SUCCESS
            || sys::cuDeviceGet(&mut dev, device as i32) != sys::CUresult::CUDA_SUCCESS
            || sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) != sys::CUresult::CUDA_SUCCESS
            || sys::cuCtxSetCurrent(ctx) != sys::CUresult::CUDA_SUCCESS
        {
            bail!("no CUDA context for device {device}");
        }
        let (mut free, mut total) = (0usize, 0usize);
        let rc = sys::cuMemGetInfo_v2(&mut free, &mut total);
        sys::cuDevicePrimaryCtxRelease_v2(dev);
        if rc != sys::CUresult::CUDA_SUCCESS {
            bail!("cuMemGetInfo: {rc:?}");
        }
        Ok(free as u64)
    }
}

async fn shared_check(
    broker: &str,
    client: &Client,
    session: &gpu_broker_client::Session,
    bytes: u64,
    (publisher, reader): (&str, &str),
    (token_b, token_c): (&str, &str),
) -> Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    const PATTERN: u8 = 0x6b;
    const NAME: &str = "gpu-shared-check";
    let mut failed = Vec::new();
    let mut check = |ok: bool, what: String| {
        say(format!(
            "{} {what}",
            if ok { "CHECK ok" } else { "CHECK FAILED" }
        ));
        if !ok {
            failed.push(what);
        }
    };
    let free_before = free_bytes(0)?;
    let lease = session.lease_request(bytes).device(0).send().await?;
    let kind = match lease.handle() {
        LeaseHandle::Fd(i) => format!("{:?}", i.memory_kind),
        other => bail!("not an fd lease: {other:?}"),
    };
    let m = lease.map_cuda()?;
    fill(&m, lease.bytes(), PATTERN)?;
    let shared = lease.publish(NAME, &[reader]).await?;
    say(format!(
        "PUBLISHED {} {} bytes {kind} read_only_enforced={}",
        shared.publication_id, shared.bytes, shared.read_only_enforced
    ));
    check(
        kind == "CudaVmm",
        format!("the lease is CUDA VMM memory ({kind})"),
    );

    // The reader's worker: another process, another tenant.
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(["--broker", broker, "--token", token_b, "shared-import"])
        .args(["--publisher", publisher, "--name", NAME])
        .args(["--expect", &PATTERN.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut to_child = child.stdin.take().context("child stdin")?;
    let mut from_child =
        tokio::io::BufReader::new(child.stdout.take().context("child stdout")?).lines();
    let mut next_line = async || -> Result<String> {
        let line = tokio::time::timeout(Duration::from_secs(30), from_child.next_line())
            .await
            .context("the importer said nothing for 30 s")??
            .context("the importer exited")?;
        say(format!("IMPORTER {line}"));
        Ok(line)
    };
    let imported = next_line().await?;
    check(
        imported == "IMPORTED CudaVmm 0",
        format!("tenant {reader:?}'s worker imported and read every byte ({imported})"),
    );

    // A tenant not listed: NOT_FOUND.
    let outsider = Client::connect(broker, token_c.to_string()).await?;
    let os = outsider.session("gpu-outsider").await?;
    match os.import(publisher, NAME).await {
        Err(e) => check(
            e.code() == gpu_broker_client::Code::NotFound,
            format!("a tenant not listed gets NOT_FOUND ({:?})", e.code()),
        ),
        Ok(_) => check(false, "a tenant not listed imported it".into()),
    }

    // Charged once, to the publisher.
    let reader_client = Client::connect(broker, token_b.to_string()).await?;
    let (ua, ub) = (client.usage().await?, reader_client.usage().await?);
    check(
        ua.usage.held_bytes == lease.bytes()
            && ub.usage.held_bytes == 0
            && ub.usage.quarantined_bytes == 0,
        format!(
            "charged once: publisher holds {} bytes, reader {} (+{} quarantined)",
            ua.usage.held_bytes, ub.usage.held_bytes, ub.usage.quarantined_bytes
        ),
    );

    // The publisher's lease ends; the reader still reads its bytes.
    let granted = lease.bytes();
    m.close()?;
    lease.release().await?;
    let ua = client.usage().await?;
    check(
        ua.usage.held_bytes == 0 && ua.usage.quarantined_bytes == granted,
        format!(
            "after the publisher's release its tenant holds {} and has {} quarantined (held for the reader)",
            ua.usage.held_bytes, ua.usage.quarantined_bytes
        ),
    );
    to_child.write_all(b"read\n").await?;
    let read = next_line().await?;
    check(
        read == "READ 0",
        format!("the reader still reads every byte ({read})"),
    );
    let free_held = free_bytes(0)?;
    check(
        free_before.saturating_sub(free_held) >= granted,
        format!(
            "the memory is still in use on the card ({} MiB less free than before)",
            (free_before.saturating_sub(free_held)) >> 20
        ),
    );

    // The reader lets go: the memory is freed.
    to_child.write_all(b"release\n").await?;
    let released = next_line().await?;
    check(
        released == "RELEASED",
        format!("the reader released ({released})"),
    );
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    let t = Instant::now();
    let (mut ua, mut free_after) = (client.usage().await?, free_bytes(0)?);
    while t.elapsed() < Duration::from_secs(10)
        && (ua.usage.quarantined_bytes != 0 || free_after + (64 << 20) < free_before)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        ua = client.usage().await?;
        free_after = free_bytes(0)?;
    }
    check(
        ua.usage.held_bytes == 0 && ua.usage.quarantined_bytes == 0,
        format!(
            "nothing charged after the last importer let go (held {}, quarantined {})",
            ua.usage.held_bytes, ua.usage.quarantined_bytes
        ),
    );
    check(
        free_after + (64 << 20) >= free_before,
        format!(
            "the card's free memory came back ({} MiB before, {} MiB after, {} ms)",
            free_before >> 20,
            free_after >> 20,
            t.elapsed().as_millis()
        ),
    );
    if failed.is_empty() {
        say("SHAREDCHECK ok".into());
        Ok(())
    } else {
        bail!("{} shared-lease checks failed: {failed:?}", failed.len())
    }
}

async fn shared_import(
    session: &gpu_broker_client::Session,
    publisher: &str,
    name: &str,
    expect: u8,
) -> Result<()> {
    use tokio::io::AsyncBufReadExt;
    let import = session.import(publisher, name).await?;
    let m = import.map_cuda()?;
    let bytes = import.bytes();
    let bad = count_not(&m, bytes, expect)?;
    say(format!("IMPORTED {:?} {bad}", import.memory_kind()));
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        match line.trim() {
            "read" => say(format!("READ {}", count_not(&m, bytes, expect)?)),
            "release" => {
                m.close()?;
                import.release().await?;
                say("RELEASED".into());
                return Ok(());
            }
            other => say(format!("ERROR unknown command {other:?}")),
        }
    }
    Ok(())
}

/// What `kept-parent` fills its lease with.
const KEPT_PATTERN: u8 = 0x3c;

/// One case of `kept-check`: the worker's lease handed to its child, released, the worker
/// gone; the tenant charged until the child exits, then not; the card's memory back.
struct KeptCase<'a> {
    broker: &'a str,
    token: &'a str,
    client: &'a Client,
    admin: &'a gpu_broker_client::AdminClient,
    bytes: u64,
    child_uid: Option<u32>,
}

async fn kept_check(
    broker: &str,
    token: &str,
    client: &Client,
    bytes: u64,
    token_b: &str,
    admin_token: &str,
    child_uid: Option<u32>,
) -> Result<()> {
    let admin = gpu_broker_client::AdminClient::connect(broker, admin_token.to_string()).await?;
    let case = KeptCase {
        broker,
        token,
        client,
        admin: &admin,
        bytes,
        child_uid,
    };
    let mut failed = Vec::new();
    say("=== a published lease, freed at its release while its worker lives ===".into());
    failed.extend(case.run(None).await?);
    if child_uid.is_some() {
        say("=== a cached lease, evicted by another tenant after its worker exited ===".into());
        let evictor = Client::connect(broker, token_b.to_string()).await?;
        let session = evictor.session("gpu-kept-evictor").await?;
        failed.extend(case.run(Some(&session)).await?);
    } else {
        say("SKIP the evicted case: it needs --child-uid (root), the worker of a uid the broker does not share".into());
    }
    if failed.is_empty() {
        say("KEPTCHECK ok".into());
        Ok(())
    } else {
        bail!("{} kept-memory checks failed: {failed:?}", failed.len())
    }
}

impl KeptCase<'_> {
    /// What the tenant is charged on the device: held and quarantined bytes.
    async fn charged(&self) -> Result<u64> {
        let u = self.client.usage().await?;
        Ok(u.usage.held_bytes + u.usage.quarantined_bytes)
    }

    /// Waits up to `secs` for the charge to be `want`; returns the last reading.
    async fn charged_within(&self, want: u64, secs: u64) -> Result<u64> {
        let t = Instant::now();
        loop {
            let c = self.charged().await?;
            if c == want || t.elapsed() > Duration::from_secs(secs) {
                return Ok(c);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs the case: freed at the release (`evictor` none: the lease is published), or
    /// cached and evicted by `evictor`'s lease after the worker exited. Returns the
    /// failed checks.
    async fn run(&self, evictor: Option<&gpu_broker_client::Session>) -> Result<Vec<String>> {
        use tokio::io::AsyncBufReadExt;
        let mut failed = Vec::new();
        let mut check = |ok: bool, what: String| {
            say(format!(
                "{} {what}",
                if ok { "CHECK ok" } else { "CHECK FAILED" }
            ));
            if !ok {
                failed.push(what);
            }
        };
        let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
        if let Some(uid) = self.child_uid {
            cmd.args(["--as-uid", &uid.to_string()]);
        }
        cmd.args([
            "--broker",
            self.broker,
            "--token",
            self.token,
            "kept-parent",
        ])
        .args(["--bytes", &self.bytes.to_string()]);
        if evictor.is_none() {
            cmd.arg("--publish");
        }
        let mut parent = cmd
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        // The child writes here too: the pipe outlives the worker.
        let mut lines =
            tokio::io::BufReader::new(parent.stdout.take().context("worker stdout")?).lines();
        let mut next_line = async || -> Result<String> {
            let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
                .await
                .context("the worker and its child said nothing for 60 s")??
                .context("the worker's output ended")?;
            say(format!("  {line}"));
            Ok(line)
        };
        // Whatever fails from the moment it is named, the child does not outlive the
        // check with the memory (a worker that fails after the hand-off leaves it mapped).
        let (mut reap, mut granted, mut mapped) = (None, 0u64, None);
        while granted == 0 {
            let line = next_line().await?;
            let mut w = line.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("PARENT"), Some("CHILD"), Some(pid)) => {
                    reap = pid.parse::<u32>().ok().map(KillOnDrop)
                }
                (Some("CHILD"), Some("MAPPED"), Some(bad)) => mapped = Some(bad.to_string()),
                (Some("PARENT"), Some("RELEASED"), Some(b)) => granted = b.parse()?,
                _ => {}
            }
        }
        let child = reap.as_ref().context("the worker named no child")?.0;
        check(
            mapped.as_deref() == Some("0"),
            format!("the child (pid {child}) mapped the worker's lease with its own context and read every byte ({mapped:?})"),
        );
        let status = tokio::time::timeout(Duration::from_secs(30), parent.wait()).await??;
        check(
            status.success(),
            format!("the worker released and exited ({status})"),
        );
        let mut evicting = None;
        if let Some(session) = evictor {
            // The leasable refresh follows the contexts that came and went first; a lease
            // of all the room left then needs the cached block's too. A refresh between
            // the reading and the lease may shrink the room: read again and retry.
            tokio::time::sleep(Duration::from_secs(3)).await;
            for attempt in 1..=5 {
                let d = self
                    .admin
                    .get_devices()
                    .await?
                    .into_iter()
                    .find(|d| d.index == 0)
                    .context("no device 0")?;
                let room = d
                    .leasable_bytes
                    .saturating_sub(d.leased_bytes + d.quarantined_bytes + d.process_reserved_bytes)
                    .saturating_sub(64 << 20);
                say(format!(
                    "EVICT another tenant leases {} MiB of device 0 (cached {} MiB)",
                    room >> 20,
                    d.cached_bytes >> 20
                ));
                match session.lease_request(room).device(0).send().await {
                    Ok(l) => {
                        evicting = Some(l);
                        break;
                    }
                    Err(e) if attempt < 5 => {
                        say(format!("EVICT refused ({e}); again"));
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let charged = self.charged_within(granted, 10).await?;
        check(
            charged == granted,
            format!("after the worker exited its tenant is charged {charged} of {granted} bytes (the child maps them)"),
        );
        let read = next_line().await?;
        check(
            read == "CHILD READ-AFTER-PARENT 0",
            format!("the child still reads every byte after the worker exited ({read})"),
        );
        if let Ok(out) = std::process::Command::new("nvidia-smi")
            .args([
                "--query-compute-apps=pid,used_memory",
                "--format=csv,noheader",
            ])
            .output()
        {
            for l in String::from_utf8_lossy(&out.stdout).lines() {
                say(format!("NVML {l}"));
            }
        }
        for q in self.admin.list_quarantined().await? {
            say(format!(
                "QUARANTINED tenant={} bytes={} reason={:?} holders={:?}",
                q.tenant, q.bytes, q.reason, q.holder_pids
            ));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let charged = self.charged().await?;
        check(
            charged == granted,
            format!("2 s later still charged {charged} of {granted} bytes"),
        );
        if let Some(l) = evicting {
            l.release().await?;
        }
        let free_held = free_bytes(0)?;
        // SAFETY: a process this check started (through its worker).
        unsafe { libc::kill(child as i32, libc::SIGKILL) };
        let charged = self.charged_within(0, 10).await?;
        check(
            charged == 0,
            format!("once the child exited nothing is charged ({charged})"),
        );
        let t = Instant::now();
        let mut free_after = free_bytes(0)?;
        while free_after < free_held + granted - (64 << 20) && t.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
            free_after = free_bytes(0)?;
        }
        check(
            free_after + (64 << 20) >= free_held + granted,
            format!(
                "the child's exit gave the card its {} MiB back ({} MiB free before, {} MiB after)",
                granted >> 20,
                free_held >> 20,
                free_after >> 20
            ),
        );
        Ok(failed)
    }
}

/// Kills process `.0` when dropped (a `kept-check` child, not this process's own).
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: a process this check started; gone already is harmless (ESRCH).
        unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
    }
}

async fn kept_parent(
    session: &gpu_broker_client::Session,
    bytes: u64,
    publish: bool,
) -> Result<()> {
    use sendfd::SendWithFd;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let lease = session.lease_request(bytes).device(0).send().await?;
    let LeaseHandle::Fd(info) = lease.handle() else {
        bail!("not an fd lease: {:?}", lease.handle());
    };
    let size = info.size;
    let m = lease.map_cuda()?;
    fill(&m, lease.bytes(), KEPT_PATTERN)?;
    m.close()?;
    if publish {
        // A published block is never cached: its release frees it.
        lease.publish("gpu-kept-check", &[]).await?;
    }
    let (mine, theirs) = std::os::unix::net::UnixStream::pair()?;
    let theirs_fd = theirs.as_raw_fd();
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(["kept-child", "--bytes", &lease.bytes().to_string()])
        .args(["--size", &size.to_string()])
        .args(["--expect", &format!("{KEPT_PATTERN:x}")]);
    // SAFETY: only dup2 between fork and exec; it leaves the new fd 3 without CLOEXEC.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(theirs_fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    drop(theirs);
    say(format!("PARENT CHILD {}", child.id()));
    let fd = lease.fd().context("the lease has no descriptor")?;
    mine.send_with_fd(b"f", &[fd.as_raw_fd()])?;
    mine.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut ack = [0u8; 1];
    (&mine)
        .read_exact(&mut ack)
        .context("the child did not map the lease")?;
    let granted = lease.bytes();
    lease.release().await?;
    say(format!("PARENT RELEASED {granted}"));
    // Not waited for: it outlives this process.
    std::mem::forget(child);
    Ok(())
}

fn kept_child(bytes: u64, size: u64, expect: u8) -> Result<()> {
    use sendfd::RecvWithFd;
    use std::io::Write;
    use std::os::fd::{AsFd, FromRawFd};
    // SAFETY: fd 3 is the socket `kept-parent` left open for this process, owned here.
    let sock = unsafe { std::os::unix::net::UnixStream::from_raw_fd(3) };
    let (mut buf, mut fds) = ([0u8; 1], [-1; 1]);
    let (_, n) = sock.recv_with_fd(&mut buf, &mut fds)?;
    if n != 1 {
        bail!("no descriptor received");
    }
    // SAFETY: a descriptor just received, owned by nobody else.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fds[0]) };
    let m = gpu_broker_client::cuda::map_vmm_import(fd.as_fd(), 0, bytes, size)?;
    // The mapping alone keeps the memory from here on.
    drop(fd);
    say(format!("CHILD MAPPED {}", count_not(&m, bytes, expect)?));
    (&sock).write_all(b"m")?;
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    // SAFETY: as above.
    while unsafe { libc::getppid() } == parent {
        std::thread::sleep(Duration::from_millis(20));
    }
    say(format!(
        "CHILD READ-AFTER-PARENT {}",
        count_not(&m, bytes, expect)?
    ));
    // Holds the mapping until killed, or until nobody reads its output any more: the
    // check that would kill it is gone (killed itself), and the card gets the memory back.
    let mut out = libc::pollfd {
        fd: libc::STDOUT_FILENO,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd; POLLERR (a pipe's reader gone) and POLLHUP need no events.
    while unsafe { libc::poll(&mut out, 1, -1) } < 0 || out.revents == 0 {}
    Ok(())
}
