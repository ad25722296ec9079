//! `reader`: shows what a lease holds. Give it a lease id of your own tenant and it fetches
//! the lease's memory (a descriptor from the broker's ticket server, with a ticket of its
//! own: it need not be the process holding the lease), maps it and prints its size, a
//! checksum and what bytes it contains. Nobody else can: a lease has no path to open.
//!
//! ```text
//! GPU_BROKER_TOKEN=gpb_... reader --lease 6f1c...   # leases of your own tenant only
//! ```

use anyhow::{Context, Result};
use clap::Parser;
use gpu_broker_client::units::format_bytes;
use gpu_broker_client::{Client, HostMapping};
use std::os::fd::AsFd;

#[derive(Parser)]
#[command(about = "Print a summary of the memory a gpu-broker lease holds")]
struct Args {
    /// Lease id; needs GPU_BROKER_TOKEN of the lease's tenant (and GPU_BROKER_ADDR).
    #[arg(long)]
    lease: String,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let addr = std::env::var("GPU_BROKER_ADDR")
        .unwrap_or_else(|_| "unix:///run/gpu-broker/broker.sock".into());
    let token = std::env::var("GPU_BROKER_TOKEN").context("set GPU_BROKER_TOKEN")?;
    let client = Client::connect(&addr, token).await?;
    // Only the tenant's own leases have tickets for it: another tenant's id is not found.
    let (info, fd) = client.lease_fd(&args.lease).await?;
    let len = info.size;
    let map = HostMapping::from_fd(fd.as_fd(), 0, len)?;
    drop(fd); // the mapping keeps the memory
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
        "lease {}: {} ({} bytes), fnv1a64 {fnv:016x}, {content}",
        args.lease,
        format_bytes(len),
        len
    );
    Ok(())
}
