//! The broker's own descriptors against a client that tries to use them up: the imports
//! one live process leaves lingering (its sessions ended) hold one pidfd between them, not
//! one each; and small leases are refused (`OUT_OF_DESCRIPTORS`) before their blocks'
//! descriptors eat into those kept for connections and operators.

use gpu_broker_client::error::Reason;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{Client, Code};
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

/// Under a descriptor limit of 1,024, one tenant takes 2 MiB leases until refused: the
/// refusal is `RESOURCE_EXHAUSTED` with its reason and numbers, well before the broker is
/// out of descriptors. An operator's call and new connections still work; a block the
/// tenant lets go (cached) makes room for another tenant's fresh one, and that tenant's
/// own cached block is reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_leases_are_refused_before_the_broker_runs_out_of_descriptors() {
    let b = Broker::start_with_nofile(
        1024,
        BrokerOpts {
            capacity: "4GiB",
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    let alice = b.client("alice", 4 * GIB).await.unwrap();
    let sa = alice.session("many").await.unwrap();
    let mut leases = Vec::new();
    let refusal = loop {
        match sa.lease(2 * MIB).await {
            Ok(l) => leases.push(l),
            Err(e) => break e,
        }
        assert!(leases.len() < 1024, "never refused");
    };
    eprintln!(
        "refused after {} leases: {refusal}; broker descriptors {:?}",
        leases.len(),
        b.open_fds()
    );
    assert_eq!(refusal.code(), Code::ResourceExhausted, "{refusal}");
    assert_eq!(
        refusal.reason(),
        Some(&Reason::OutOfDescriptors),
        "{refusal}"
    );
    assert_eq!(refusal.detail("limit"), Some("1024"), "{refusal}");
    assert!(refusal.to_string().contains("RLIMIT_NOFILE"), "{refusal}");
    assert!(leases.len() >= 256, "only {} leases", leases.len());
    // The operator and new connections get in.
    let admin = b.admin().await.expect("an operator connects");
    assert!(!admin.list_tenants().await.unwrap().is_empty());
    let bob = b.client("bob", GIB).await.expect("a new tenant connects");
    let sb = bob.session("other").await.unwrap();
    // Nothing is cached: bob's fresh block is refused the same way.
    let e = sb.lease(2 * MIB).await.unwrap_err();
    assert_eq!(e.reason(), Some(&Reason::OutOfDescriptors), "{e}");
    // Alice lets one go (cached for her): it is freed to make bob's block.
    leases.pop().unwrap().release().await.unwrap();
    let lb = sb.lease(2 * MIB).await.expect("a cached block made room");
    // Bob's own cached block is reused, with no new descriptor.
    lb.release().await.unwrap();
    sb.lease(2 * MIB)
        .await
        .expect("a cached block of one's own");
    let fds = b.open_fds().unwrap();
    assert!(fds < 1000, "the broker holds {fds} descriptors");
}
