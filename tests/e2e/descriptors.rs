//! The broker's own descriptors against a client that tries to use them up: the imports
//! one live process leaves lingering (its sessions ended) hold one pidfd between them, not
//! one each.

use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::Client;
use gpu_broker_tests::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

/// Imports of `c`'s tenant's publications that linger (their session ended).
async fn lingering(c: &Client) -> usize {
    c.list_shared()
        .await
        .unwrap()
        .iter()
        .flat_map(|p| p.imports.iter())
        .filter(|i| i.lingering)
        .count()
}

/// One process (this test) imports four publications 1,024 times over eight sessions,
/// then ends the sessions while it lives: every import lingers for it, and the broker
/// holds a handful of descriptors more than before, not one per import.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lingering_imports_of_one_process_hold_one_descriptor_in_the_broker() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let publisher = alice.session("publisher").await.unwrap();
    let mut leases = Vec::new();
    for k in 0..4 {
        let l = publisher.lease(2 * MIB).await.unwrap();
        l.publish(&format!("w{k}"), &[]).await.unwrap();
        leases.push(l);
    }
    let before = b.open_fds().unwrap();
    let mut sessions = Vec::new();
    for _ in 0..8 {
        let s = alice.session("reader").await.unwrap();
        for k in 0..128 {
            // The raw call: no descriptor is fetched into this process.
            alice
                .raw()
                .import_lease(pb::ImportLeaseRequest {
                    session_id: s.id(),
                    publisher: "alice".into(),
                    name: format!("w{}", k % 4),
                })
                .await
                .unwrap();
        }
        sessions.push(s);
    }
    for s in &sessions {
        s.close();
    }
    assert!(
        eventually(T, || async { lingering(&alice).await == 1024 }).await,
        "{} lingering",
        lingering(&alice).await
    );
    // The watchers' tasks have had time to open whatever they open.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = b.open_fds().unwrap();
    eprintln!("broker descriptors: {before} before the imports, {after} with 1,024 lingering");
    assert!(
        after <= before + 16,
        "the broker's descriptors went from {before} to {after}"
    );
}
