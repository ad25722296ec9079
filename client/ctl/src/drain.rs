//! `gpu-brokerctl drain`: start a drain, then report progress until the drained devices
//! are empty (exit 0) or the deadline passed with leases left (an error naming them).
//! Progress goes to stderr, one line per device whenever it changes; the final status to
//! stdout (a table, or JSON).

use anyhow::{bail, Result};
use gpu_broker_client::units::format_bytes;
use gpu_broker_client::{AdminClient, DeviceDrain, DrainStatus};
use std::time::{Duration, Instant};

/// How long past the deadline to keep watching: revocations of missed reclaims land then.
const AFTER_DEADLINE: Duration = Duration::from_secs(2);

/// One device's progress, as a line.
pub fn progress_line(d: &DeviceDrain) -> String {
    format!(
        "device {}: {} lease(s), {} left ({} asked to release, {} not reclaimable), {} quarantined",
        d.index,
        d.leases,
        format_bytes(d.bytes),
        d.reclaim_requested,
        d.not_reclaimable,
        format_bytes(d.quarantined_bytes)
    )
}

/// Starts the drain and, unless `no_wait`, waits for it as described in the module doc.
pub async fn run(
    admin: &AdminClient,
    device: Option<u32>,
    deadline: Option<Duration>,
    reason: &str,
    no_wait: bool,
    poll: Duration,
) -> Result<DrainStatus> {
    let started = Instant::now();
    let mut status = admin.drain(device, deadline, reason).await?;
    if no_wait {
        return Ok(status);
    }
    let mut last: Vec<String> = Vec::new();
    loop {
        let lines: Vec<String> = status
            .devices
            .iter()
            .filter(|d| d.draining)
            .map(progress_line)
            .collect();
        if lines != last {
            for l in &lines {
                eprintln!("{l}");
            }
            last = lines;
        }
        if status.complete {
            eprintln!("drained: nothing left on the drained device(s)");
            return Ok(status);
        }
        if let Some(d) = deadline {
            if started.elapsed() > d + AFTER_DEADLINE {
                let left: Vec<String> = status
                    .devices
                    .iter()
                    .filter(|d| d.draining && !d.is_empty())
                    .map(progress_line)
                    .collect();
                bail!(
                    "FAILED_PRECONDITION: drain deadline passed with memory left: {}",
                    left.join("; ")
                );
            }
        }
        tokio::time::sleep(poll).await;
        status = admin.drain_status().await?;
    }
}
