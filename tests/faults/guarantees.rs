//! Guarantees: the admin refuses guarantees beyond the leasable capacity; a tenant within
//! its guarantee gets memory even when a borrower filled the device (reclaim of borrowed
//! leases), and is not kept waiting behind other tenants' requests.

use super::*;
use gpu_broker_client::Client;

#[tokio::test]
async fn guarantees_beyond_leasable_capacity_are_refused() {
    // 256 MiB with 64 MiB headroom: 192 MiB leasable.
    let b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        headroom: "64MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let leasable = admin.get_devices().await.unwrap()[0].leasable_bytes;
    assert_eq!(leasable, 192 * MIB);
    admin
        .set_quota("a", quota(192 * MIB, 128 * MIB, 0))
        .await
        .unwrap();
    admin
        .set_quota("b", quota(64 * MIB, 64 * MIB, 0))
        .await
        .unwrap();
    // Exactly the leasable capacity is promised: not one granule more.
    let r = admin.set_quota("c", quota(64 * MIB, 2 * MIB, 0)).await;
    assert_eq!(code_of(&r), Some(Code::InvalidArgument), "{r:?}");
    let msg = r.unwrap_err().message();
    assert!(msg.contains("leasable"), "{msg}");
    assert_eq!(code_of(&admin.get_quota("c").await), Some(Code::NotFound));
    let r = admin.set_quota("a", quota(192 * MIB, 130 * MIB, 0)).await;
    assert_eq!(code_of(&r), Some(Code::InvalidArgument), "{r:?}");
    assert_eq!(
        tenant(&admin, "a").await.quota,
        quota(192 * MIB, 128 * MIB, 0)
    );
    // A guarantee above the tenant's own limit.
    let r = admin.set_quota("d", quota(8 * MIB, 10 * MIB, 0)).await;
    assert_eq!(code_of(&r), Some(Code::InvalidArgument), "{r:?}");
    // Freeing a promise makes room.
    admin.set_quota("b", quota(64 * MIB, 0, 0)).await.unwrap();
    admin
        .set_quota("c", quota(64 * MIB, 64 * MIB, 0))
        .await
        .unwrap();
    // The refusals changed nothing; they survive a restart as they are.
    let mut got: Vec<(String, u64)> = admin
        .list_tenants()
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.quota.guaranteed_bytes))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("a".into(), 128 * MIB),
            ("b".into(), 0),
            ("c".into(), 64 * MIB)
        ]
    );
    assert_broker_alive(&b);
}

#[tokio::test]
async fn guarantee_takes_back_borrowed_memory_from_a_full_device() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "128MiB",
        extra: vec!["--reclaim-deadline".into(), "4s".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    // The borrower has a higher priority and non-reclaimable leases: guarantees beat both.
    let borrower = b.tenant("borrower", quota(128 * MIB, 0, 10)).await.unwrap();
    let mut bh = holder(&b, &borrower, &["--count", "8", "--mib", "16", "--honour"]).await;
    assert_eq!(
        admin.get_devices().await.unwrap()[0].leased_bytes,
        128 * MIB
    );
    // The guarantee is given while the borrower holds everything.
    let guar = b
        .tenant("guar", quota(64 * MIB, 48 * MIB, 0))
        .await
        .unwrap();
    let t = tenant(&admin, "borrower").await;
    assert_eq!(t.usage.borrowed_bytes, 128 * MIB);

    let gc = Client::connect(&b.uri(), guar).await.unwrap();
    let gs = gc.session("guar").await.unwrap();
    let t0 = Instant::now();
    let g1 = gs
        .lease_request(32 * MIB)
        .wait(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "within its guarantee, granted after {took:?} (reclaim deadline 4 s)"
    );
    // Exactly the two newest borrowed leases were asked back.
    let evs = events_for(&mut bh.proc, Duration::from_millis(500)).await;
    let asked: Vec<&str> = evs
        .iter()
        .filter(|v| v["ev"] == "reclaim")
        .map(|v| v["id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        asked,
        vec![bh.leases[7].as_str(), bh.leases[6].as_str()],
        "{evs:?}"
    );
    let u = tenant(&admin, "borrower").await.usage;
    assert_eq!(u.held_bytes, 96 * MIB);
    assert_eq!(u.borrowed_bytes, 96 * MIB);

    // GUAR's unused guarantee (16 MiB) is kept for it: the borrower cannot take it back.
    g1.release().await.unwrap();
    bh.proc.send("release-all").await.unwrap();
    event(&mut bh.proc, "released_all", Duration::from_secs(5)).await;
    let bc = Client::connect(&b.uri(), borrower).await.unwrap();
    let bs = bc.session("borrower-2").await.unwrap();
    let big = bs.lease(80 * MIB).await.unwrap();
    let r = bs.lease(2 * MIB).await;
    assert_eq!(code_of(&r), Some(Code::ResourceExhausted), "{r:?}");
    let msg = r.unwrap_err().message();
    assert!(msg.contains("guarantee"), "{msg}");
    // ...while GUAR gets all of its guarantee at once.
    let g2 = gs.lease(48 * MIB).await.unwrap();
    g2.release().await.unwrap();
    big.release().await.unwrap();
    bs.close();
    gs.close();
    bh.proc.send("exit").await.unwrap();
    bh.proc.wait(Duration::from_secs(5)).await.unwrap();
    assert!(wait_all_zero(&admin, Duration::from_secs(2)).await.is_ok());
    assert_broker_alive(&b);
}

/// A request within its tenant's guarantee, for memory that is free and kept for it, must
/// not wait behind a higher-priority request that is blocked by capacity.
#[tokio::test]
async fn guarantee_is_not_blocked_by_a_higher_priority_waiter() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "128MiB",
        extra: vec!["--reclaim-deadline".into(), "1s".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    // HIGH's limit is no obstacle: only capacity stops it.
    let high = b.tenant("high", quota(256 * MIB, 0, 10)).await.unwrap();
    let guar = b
        .tenant("guar", quota(32 * MIB, 32 * MIB, 0))
        .await
        .unwrap();
    // HIGH holds everything it may: 128 - 32 (GUAR's unused guarantee) = 96 MiB.
    let hc = Client::connect(&b.uri(), high).await.unwrap();
    let hs = hc.session("high").await.unwrap();
    let mut held = Vec::new();
    for _ in 0..6 {
        held.push(hs.lease(16 * MIB).await.unwrap());
    }
    // HIGH waits for 48 MiB: only 32 are free (and those are GUAR's).
    let blocked = {
        let hs = hs.clone();
        tokio::spawn(async move {
            hs.lease_request(48 * MIB)
                .wait(Duration::from_secs(6))
                .send()
                .await
        })
    };
    let queued = eventually(Duration::from_secs(3), || async {
        tenant(&admin, "high").await.usage.waiting_requests == 1
    })
    .await;
    assert!(queued);
    let gc = Client::connect(&b.uri(), guar).await.unwrap();
    let gs = gc.session("guar").await.unwrap();
    let t0 = Instant::now();
    let r = gs
        .lease_request(16 * MIB)
        .wait(Duration::from_secs(10))
        .send()
        .await;
    let took = t0.elapsed();
    let r = r.expect("GUAR is granted");
    eprintln!("guarantee behind a blocked higher-priority waiter: granted after {took:?}");
    assert!(
        took < Duration::from_millis(2000),
        "a request within its guarantee, for free memory kept for it, waited {took:?} \
         behind a higher-priority request blocked by capacity"
    );
    r.release().await.unwrap();
    let hr = blocked.await.unwrap();
    assert_eq!(code_of(&hr), Some(Code::DeadlineExceeded), "{hr:?}");
    for l in held {
        l.release().await.unwrap();
    }
    hs.close();
    gs.close();
    assert!(wait_all_zero(&admin, Duration::from_secs(3)).await.is_ok());
    assert_broker_alive(&b);
}
