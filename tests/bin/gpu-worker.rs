//! A worker process for the GPU tests and the GPU benchmark (`scripts/gpu-check.sh`). Each
//! subcommand is one role: hold a lease and watch it, open another process's handle,
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
    /// Open a handle exported for another process, check it holds `expect`, write `write`
    /// into its first 4 KiB, print `OK`.
    Open {
        #[arg(long)]
        handle: String,
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
    /// Lease, read every byte; print `READ <handle-hex> <nonzero-bytes>`; release.
    ReadZeros {
        #[arg(long)]
        bytes: u64,
    },
    /// Time AcquireLease (fresh and pooled) against in-process cuMemAlloc+cuIpcGetMemHandle.
    Bench {
        #[arg(long, default_value = "1MiB,64MiB,1GiB")]
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

fn hex(h: &[u8]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<[u8; 64]> {
    if s.len() != 128 {
        bail!("handle must be 128 hex digits");
    }
    let mut out = [0u8; 64];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)?;
    }
    Ok(out)
}

fn ipc_handle(h: &LeaseHandle) -> Result<[u8; 64]> {
    match h {
        LeaseHandle::CudaIpc(b) => Ok(*b),
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
    if let Cmd::Open {
        handle,
        device,
        bytes,
        expect,
        write,
    } = &cli.cmd
    {
        let h = unhex(handle)?;
        let m = gpu_broker_client::cuda::map_lease(&h, *device, *bytes)?;
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
    let client = Client::connect(&cli.broker, cli.token.clone())
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
                hex(&ipc_handle(lease.handle())?)
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
            let h = ipc_handle(lease.handle())?;
            {
                let m = lease.map_cuda()?;
                fill(&m, lease.bytes(), pattern)?;
                m.close()?;
            }
            lease.release().await?;
            say(format!("DONE {}", hex(&h)));
        }
        Cmd::ReadZeros { bytes } => {
            let lease = session.lease(bytes).await?;
            let h = ipc_handle(lease.handle())?;
            let bad = {
                let m = lease.map_cuda()?;
                let bad = count_not(&m, lease.bytes(), 0)?;
                m.close()?;
                bad
            };
            lease.release().await?;
            say(format!("READ {} {bad}", hex(&h)));
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
        Cmd::Open { .. } | Cmd::Outside { .. } => unreachable!("handled above"),
    }
    Ok(())
}

/// For each size: median of in-process cuMemAlloc + cuIpcGetMemHandle (then free, not
/// timed), of a fresh lease (nothing cached), and of a pooled lease (same size again).
async fn bench(session: &gpu_broker_client::Session, sizes: &str, iters: usize) -> Result<()> {
    use gpu_broker::device::cuda::CudaDevice;
    use gpu_broker::device::Device;
    let sizes: Vec<u64> = sizes.split(',').map(parse_size).collect::<Result<_>>()?;
    // The raw side runs on its own thread with its own context, like a worker would.
    let raw_sizes = sizes.clone();
    let raw = std::thread::spawn(move || -> Result<Vec<f64>> {
        let mut dev = CudaDevice::open(0)?;
        let mut out = Vec::new();
        for &s in &raw_sizes {
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
