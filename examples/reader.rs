//! `reader`: shows what a lease holds. Give it the `host_shm` path a writer printed, or
//! a lease id of your own tenant (looked up with `ListLeases`), and it maps the memory
//! and prints its size, a checksum and what bytes it contains.
//!
//! ```text
//! reader --path /dev/shm/gpu-broker-...      # any process that may open the file
//! GPU_BROKER_TOKEN=gpb_... reader --lease 6f1c...   # leases of your own tenant only
//! ```

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpu_broker_client::units::format_bytes;
use gpu_broker_client::{Client, HostMapping, LeaseHandle};
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Print a summary of the memory a gpu-broker lease holds")]
struct Args {
    /// Shared-memory file of a lease (the `host_shm` handle).
    #[arg(long, conflicts_with = "lease", required_unless_present = "lease")]
    path: Option<PathBuf>,
    /// Lease id; needs GPU_BROKER_TOKEN of the lease's tenant (and GPU_BROKER_ADDR).
    #[arg(long)]
    lease: Option<String>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let (path, offset, len) = match (args.path, args.lease) {
        (Some(path), _) => {
            let len = std::fs::metadata(&path)
                .with_context(|| format!("cannot stat {}", path.display()))?
                .len();
            (path, 0, len)
        }
        (None, Some(id)) => {
            let addr = std::env::var("GPU_BROKER_ADDR")
                .unwrap_or_else(|_| "unix:///run/gpu-broker/broker.sock".into());
            let token = std::env::var("GPU_BROKER_TOKEN").context("set GPU_BROKER_TOKEN")?;
            let client = Client::connect(&addr, token).await?;
            // Only the tenant's own leases are listed: another tenant's id is not found.
            let Some(lease) = client
                .list_leases()
                .await?
                .into_iter()
                .find(|l| l.lease_id == id)
            else {
                bail!("lease {id} not found among this tenant's leases");
            };
            let LeaseHandle::HostShm(path) = lease.handle else {
                bail!("lease {id} is not a host_shm lease");
            };
            (path, lease.offset, lease.bytes)
        }
        (None, None) => bail!("give --path or --lease"),
    };

    let map = HostMapping::open(&path, offset, len)?;
    // FNV-1a: a checksum two processes can compare.
    let fnv = map.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let mut seen = [false; 256];
    for &b in map.iter() {
        seen[b as usize] = true;
    }
    let distinct: Vec<u8> = (0..=255u8).filter(|&b| seen[b as usize]).collect();
    let content = match distinct.as_slice() {
        [] => "empty".to_string(),
        [only] => format!("all bytes {only:#04x}"),
        many => format!(
            "{} distinct byte values, starting {:02x?}",
            many.len(),
            &map[..map.len().min(8)]
        ),
    };
    println!(
        "{}: {} ({} bytes), fnv1a64 {fnv:016x}, {content}",
        path.display(),
        format_bytes(len),
        len
    );
    Ok(())
}
