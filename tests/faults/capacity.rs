//! The broker never asks the device for more than its leasable capacity, not even for a
//! moment: a block evicted from the cache to make room for one grant must be freed on the
//! device before any later grant allocates. With no headroom, a late free shows up as an
//! out-of-memory error from the (simulated) device.

use super::*;
use gpu_broker_client::Client;

/// One attempt: a full device (56 MiB leased + one cached 8 MiB block), two 4 MiB requests
/// queued behind a blocked higher-priority request; cancelling that request grants both in
/// one pass: the first evicts the cached block, the second then fits without eviction.
/// Returns the two results' errors, if any, and what the device had allocated after.
async fn attempt() -> (Vec<String>, u64) {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        headroom: "0%",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let fill = b.tenant("fill", quota(64 * MIB, 0, 0)).await.unwrap();
    let high = b.tenant("high", quota(64 * MIB, 0, 10)).await.unwrap();
    let w = b.tenant("w", quota(64 * MIB, 0, 0)).await.unwrap();
    let fc = Client::connect(&b.uri(), fill).await.unwrap();
    let fs = fc.session("fill").await.unwrap();
    // The cached block first, then 56 MiB of leases: the device is fully allocated.
    fs.lease(8 * MIB).await.unwrap().release().await.unwrap();
    let held = fs.lease(56 * MIB).await.unwrap();
    let dev = &admin.get_devices().await.unwrap()[0];
    assert_eq!((dev.leased_bytes, dev.cached_bytes), (56 * MIB, 8 * MIB));
    assert_eq!(dev.free_bytes, 0);

    // HIGH waits for more than is free and blocks the device for the others.
    let hc = Client::connect(&b.uri(), high).await.unwrap();
    let hs = hc.session("high").await.unwrap();
    let blocker = {
        let hs = hs.clone();
        tokio::spawn(async move {
            hs.lease_request(16 * MIB)
                .wait(Duration::from_secs(20))
                .send()
                .await
        })
    };
    assert!(
        eventually(Duration::from_secs(3), || async {
            tenant(&admin, "high").await.usage.waiting_requests == 1
        })
        .await
    );
    let wc = Client::connect(&b.uri(), w).await.unwrap();
    let ws = wc.session("w").await.unwrap();
    let mut asks = Vec::new();
    for _ in 0..2 {
        let ws = ws.clone();
        asks.push(tokio::spawn(async move {
            ws.lease_request(4 * MIB)
                .wait(Duration::from_secs(10))
                .send()
                .await
        }));
    }
    assert!(
        eventually(Duration::from_secs(3), || async {
            tenant(&admin, "w").await.usage.waiting_requests == 2
        })
        .await
    );
    // Cancel HIGH's request: both 4 MiB requests are granted in one pass of the queue.
    blocker.abort();
    let mut errors = Vec::new();
    let mut leases = Vec::new();
    for a in asks {
        match tokio::time::timeout(Duration::from_secs(10), a).await {
            Ok(Ok(Ok(l))) => leases.push(l),
            Ok(Ok(Err(e))) => errors.push(e.to_string()),
            other => errors.push(format!("{other:?}")),
        }
    }
    let dev = &admin.get_devices().await.unwrap()[0];
    let allocated = dev.total_bytes - dev.free_bytes;
    for l in leases {
        l.release().await.unwrap();
    }
    held.release().await.unwrap();
    hs.close();
    ws.close();
    fs.close();
    assert_broker_alive(&b);
    (errors, allocated)
}

#[tokio::test]
async fn evicted_blocks_are_freed_before_a_later_grant_allocates() {
    // A race between two device jobs: a few attempts make it show reliably.
    for i in 0..12 {
        let (errors, allocated) = attempt().await;
        assert!(
            errors.is_empty(),
            "attempt {i}: a grant failed on the device (allocated {allocated} of 64 MiB): {errors:#?}"
        );
    }
}
