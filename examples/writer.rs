//! `writer`: a minimal gpu-broker worker. It leases device memory, fills it with a byte
//! pattern, prints where the memory is, and holds it until Ctrl-C (or until the broker
//! revokes the lease or shuts down). Copy it as a starting point for your own worker.
//!
//! ```text
//! GPU_BROKER_TOKEN=gpb_... writer --bytes 512MiB --pattern 0xAB
//! lease_id=6f1c... device=0 bytes=536870912 block=fd:1234...
//! ```
//!
//! Environment: `GPU_BROKER_TOKEN` (a tenant token from `gpu-brokerctl tokens issue`),
//! `GPU_BROKER_ADDR` (default `unix:///run/gpu-broker/broker.sock`).

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpu_broker_client::units::{format_bytes, parse_bytes};
use gpu_broker_client::{Client, LeaseHandle, SessionEvent};
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser)]
#[command(about = "Lease GPU memory from gpu-broker, fill it with a pattern, hold it")]
struct Args {
    /// How much memory (`8GiB`, `512MiB`, or bytes). Rounded up to the device granularity.
    #[arg(long, value_parser = parse_bytes, default_value = "64MiB")]
    bytes: u64,
    /// Byte to fill the memory with (`0xAB` or decimal).
    #[arg(long, value_parser = parse_byte, default_value = "0xAB")]
    pattern: u8,
    /// Ask for this device (default: wherever it fits).
    #[arg(long)]
    device: Option<u32>,
    /// Session name operators see in `gpu-brokerctl sessions list`.
    #[arg(long, default_value = "writer")]
    name: String,
}

fn parse_byte(s: &str) -> Result<u8, String> {
    match s.strip_prefix("0x") {
        Some(hex) => u8::from_str_radix(hex, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("invalid byte {s:?}: {e}"))
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let addr = std::env::var("GPU_BROKER_ADDR")
        .unwrap_or_else(|_| "unix:///run/gpu-broker/broker.sock".into());
    let token = std::env::var("GPU_BROKER_TOKEN").context("set GPU_BROKER_TOKEN")?;

    // One connection, one session: the session's stream tells us about revocations and
    // shutdown, and when this process exits the broker takes everything back.
    let client = Client::connect(&addr, token).await?;
    let session = client.session(args.name).await?;
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    session.on_event(move |ev| {
        let _ = tx.send(ev);
    });

    let mut request = session.lease_request(args.bytes).label("writer");
    if let Some(d) = args.device {
        request = request.device(d);
    }
    let lease = request.send().await?;
    // Catch Ctrl-C (SIGINT) and SIGTERM from now on, so the lease is released cleanly.
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;

    // The host backend hands out memfd memory (an fd lease: `map()` it); a CUDA broker
    // VMM memory (map that with `lease.map_cuda()`, client feature `cuda`).
    let LeaseHandle::Fd(fd) = lease.handle().clone() else {
        bail!(
            "lease handle is {}: this example maps fd leases only",
            lease.handle().kind()
        );
    };
    lease.map()?.fill(args.pattern); // the mapping closes at the end of the statement
    println!(
        "lease_id={} device={} bytes={} block=fd:{}",
        lease.id(),
        lease.device(),
        lease.bytes(),
        fd.block_id
    );
    eprintln!(
        "holding {} filled with {:#04x}; Ctrl-C to release",
        format_bytes(lease.bytes()),
        args.pattern
    );

    // Hold until Ctrl-C (or SIGTERM), or until the broker takes the memory away.
    loop {
        tokio::select! {
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
            ev = events.recv() => match ev {
                Some(SessionEvent::LeaseRevoked { lease_id, reason }) if lease_id == lease.id() => {
                    eprintln!("lease revoked: {reason}");
                    let _ = lease.detach(); // nothing left to release
                    return Ok(());
                }
                Some(SessionEvent::ShuttingDown { .. }) => {
                    eprintln!("broker shutting down");
                    break;
                }
                Some(SessionEvent::Closed { reason }) => {
                    bail!("session closed: {}", reason.unwrap_or_default())
                }
                None => bail!("session closed"),
                Some(_) => {}
            },
        }
    }
    // Close every mapping first (done above), then give the memory back.
    lease.release().await?;
    println!("released");
    Ok(())
}
