//! The descriptor budget at the arbiter: blocks and published memfds' reopens are counted
//! against the limit less the reserve, a block past it is refused with the typed reason,
//! cached blocks are freed to make room, and what ends gives its descriptors back.

use super::tests::{quota, req};
use super::*;
use crate::error::BrokerError;

const MIB: u64 = 1 << 20;

/// An arbiter that may hold `budget` descriptors for memory.
fn arbiter_with_budget(budget: usize) -> Arc<Arbiter> {
    let cfg = ArbiterConfig {
        fd_reserve: crate::fd_budget::nofile_limit() - budget,
        ..ArbiterConfig::default()
    };
    let arb = host_arbiter(64 * MIB, 1, cfg);
    for t in ["a", "b"] {
        arb.set_quota(t, quota(64 * MIB)).unwrap();
    }
    arb
}

fn session(arb: &Arc<Arbiter>, tenant: &str) -> Uuid {
    let (s, rx) = arb.open_session(tenant, "t", Peer::default()).unwrap();
    std::mem::forget(rx);
    s
}

fn out_of_descriptors(r: BrokerResult<impl std::fmt::Debug>) -> usize {
    match r {
        Err(BrokerError::OutOfDescriptors { held, .. }) => held,
        other => panic!("expected OutOfDescriptors, got {other:?}"),
    }
}

/// Waits (up to 5 s) until `arb` counts `n` descriptors (frees run on the device thread).
async fn counted(arb: &Arbiter, n: usize) -> usize {
    for _ in 0..500 {
        if arb.fds.held() == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    arb.fds.held()
}

#[tokio::test]
async fn blocks_past_the_budget_are_refused_and_a_cached_block_makes_room() {
    let arb = arbiter_with_budget(4);
    let (sa, sb) = (session(&arb, "a"), session(&arb, "b"));
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(arb.acquire(req("a", sa, 2 * MIB)).await.unwrap());
    }
    assert_eq!(arb.fds.held(), 4);
    assert_eq!(
        out_of_descriptors(arb.acquire(req("a", sa, 2 * MIB)).await),
        4
    );
    assert_eq!(
        out_of_descriptors(arb.acquire(req("b", sb, 2 * MIB)).await),
        4
    );
    // Refused before anything was charged or allocated.
    assert_eq!(arb.views().tenant("b").unwrap().usage.held_bytes, 0);
    assert_eq!(arb.fds.held(), 4);
    // One of a's lets go (cached, its descriptor kept): freed for b's fresh block.
    let l = held.pop().unwrap();
    arb.release("a", l.id).unwrap();
    let lb = arb.acquire(req("b", sb, 2 * MIB)).await.unwrap();
    assert_eq!(arb.fds.held(), 4);
    assert_eq!(arb.views().device_reports().await[0].cached, 0);
    // b's own cached block comes back with no new descriptor.
    arb.release("b", lb.id).unwrap();
    arb.acquire(req("b", sb, 2 * MIB)).await.unwrap();
    assert_eq!(arb.fds.held(), 4);
}

#[tokio::test]
async fn a_published_memfd_counts_its_reopen_until_its_publication_goes() {
    let arb = arbiter_with_budget(4);
    let sa = session(&arb, "a");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(arb.acquire(req("a", sa, 2 * MIB)).await.unwrap());
    }
    arb.sharing().publish("a", held[0].id, "w0", &[]).unwrap();
    assert_eq!(arb.fds.held(), 4, "three blocks and one reopen");
    assert_eq!(
        out_of_descriptors(arb.sharing().publish("a", held[1].id, "w1", &[])),
        4
    );
    assert_eq!(
        out_of_descriptors(arb.acquire(req("a", sa, 2 * MIB)).await),
        4
    );
    // The published lease ends: its reopen goes with the publication, its block (never
    // cached) is freed.
    arb.release("a", held[0].id).unwrap();
    assert_eq!(counted(&arb, 2).await, 2);
    arb.sharing().publish("a", held[1].id, "w1", &[]).unwrap();
    assert_eq!(arb.fds.held(), 3);
}
