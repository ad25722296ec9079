//! A worker that holds reclaimable leases and gives them back when the broker asks
//! (a higher-priority or guaranteed tenant needs the memory), and that survives broker
//! restarts by reconnecting and acquiring again.
//!
//! ```text
//! cargo run -p gpu-broker-client --example reclaim_worker -- unix:///tmp/b.sock <token> [leases] [MiB]
//! ```
//!
//! Then make another tenant with a higher priority ask for the memory to see `reclaim`
//! lines, or kill and restart the broker to see `reconnected`. Ctrl-C ends the worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpu_broker_client::{Backoff, Client, ClientError, Lease, Session, SessionEvent};
use parking_lot::Mutex;

/// The worker's leases by id: the reclaim handler takes them out of here.
type Held = Arc<Mutex<HashMap<String, Lease>>>;

#[tokio::main]
async fn main() -> Result<(), ClientError> {
    let mut args = std::env::args().skip(1);
    let (Some(uri), Some(token)) = (args.next(), args.next()) else {
        eprintln!("usage: reclaim_worker <broker-uri> <token> [leases] [MiB]");
        std::process::exit(2);
    };
    let count: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(4);
    let mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);

    let client = Client::connect(&uri, token).await?;
    // Opt in to reconnection: when the broker restarts, a new session replaces this one.
    let session = client
        .session_builder("reclaim-worker")
        .reconnect(Backoff::default())
        .await?;
    println!("session {} of tenant {}", session.id(), session.tenant());
    let held: Held = Arc::default();
    acquire(&session, &held, count, mib).await;

    // Runs on its own task for every ReclaimRequested event.
    session.on_reclaim({
        let held = held.clone();
        move |req| {
            // Take the lease out of the table first, so nothing else uses it any more.
            let lease = held.lock().remove(&req.lease_id);
            async move {
                println!(
                    "reclaim {} ({} MiB, {:?} left): {}",
                    req.lease_id,
                    req.bytes >> 20,
                    req.time_left(),
                    req.reason
                );
                let Some(lease) = lease else {
                    return Ok(()); // already given back
                };
                // A real worker would stop its kernels and drop its mappings here.
                lease.release().await?;
                println!("released {}", req.lease_id);
                Ok::<(), ClientError>(())
            }
        }
    });

    // Everything else the broker says, until the session ends or Ctrl-C.
    let mut events = session.events();
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let event = tokio::select! {
            _ = &mut ctrl_c => break,
            event = events.next() => event,
        };
        match event {
            Some(SessionEvent::Reconnected {
                new_session_id,
                lost_leases,
                ..
            }) => {
                // The old session's leases are gone (dropping them sends nothing).
                println!("reconnected as {new_session_id}; lost {lost_leases:?}");
                held.lock().clear();
                acquire(&session, &held, count, mib).await;
            }
            Some(SessionEvent::Closed { reason }) => {
                println!("session closed: {reason:?}");
                break;
            }
            None => break,
            Some(other) => println!("event: {other:?}"),
        }
    }

    // Give back what is left before exiting.
    let leases: Vec<Lease> = held.lock().drain().map(|(_, lease)| lease).collect();
    for lease in leases {
        let id = lease.id().to_string();
        if let Err(e) = lease.release().await {
            println!("release {id}: {e}");
        }
    }
    Ok(())
}

/// Acquires `count` reclaimable leases of `mib` MiB and fills the host-mappable ones.
async fn acquire(session: &Session, held: &Held, count: usize, mib: u64) {
    for _ in 0..count {
        let request = session
            .lease_request(mib << 20)
            .reclaimable(true)
            .label("reclaim-demo")
            .wait(Duration::from_secs(2));
        match request.await {
            Ok(lease) => {
                if let Ok(mut mapping) = lease.map() {
                    mapping.fill(0xab);
                }
                println!("holding {} ({} MiB)", lease.id(), lease.bytes() >> 20);
                held.lock().insert(lease.id().to_string(), lease);
            }
            Err(e) => println!("acquire failed: {e}"),
        }
    }
}
