//! Reclaim and revocation: a higher-priority waiter gets memory back from lower-priority
//! reclaimable leases (lowest priority, newest first, only as many as needed); a holder
//! that ignores the request is revoked and its memory quarantined while its process
//! lives (cooperative policy) or its process is killed (terminate policy); a ticket of a
//! revoked lease not yet redeemed says "lease ended".

use super::*;
use gpu_broker_client::Client;
use std::os::unix::process::ExitStatusExt;

fn ids(evs: &[Value], ev: &str) -> Vec<String> {
    evs.iter()
        .filter(|v| v["ev"] == ev)
        .map(|v| v["id"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test]
async fn reclaim_asks_lowest_priority_newest_first_only_as_needed() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let low = b.tenant("low", quota(64 * MIB, 0, 0)).await.unwrap();
    let mid = b.tenant("mid", quota(64 * MIB, 0, 5)).await.unwrap();
    let high = b.tenant("high", quota(64 * MIB, 0, 10)).await.unwrap();
    let args = ["--count", "2", "--mib", "16", "--reclaimable", "--honour"];
    let mut lowh = holder(&b, &low, &args).await;
    // MID's leases are the newest on the device.
    let mut midh = holder(&b, &mid, &args).await;
    let dev = &admin.get_devices().await.unwrap()[0];
    assert_eq!(dev.leased_bytes, 64 * MIB, "the device is full");

    let hs = session_of(&b, high, "high").await;
    let t0 = Instant::now();
    let h1 = hs
        .lease_request(16 * MIB)
        .wait(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    let first_grant = t0.elapsed();
    // LOW (lowest priority) was asked for its newest lease, and only that one.
    let evs = events_until(&mut lowh.proc, "released", Duration::from_secs(5)).await;
    assert_eq!(
        ids(&evs, "reclaim"),
        vec![lowh.leases[1].clone()],
        "{evs:?}"
    );
    let later = events_for(&mut lowh.proc, Duration::from_millis(300)).await;
    assert!(
        ids(&later, "reclaim").is_empty(),
        "more reclaims: {later:?}"
    );
    let mid_evs = events_for(&mut midh.proc, Duration::from_millis(50)).await;
    assert!(
        ids(&mid_evs, "reclaim").is_empty(),
        "MID (priority 5) was asked before LOW (0) was exhausted: {mid_evs:?}"
    );
    assert!(first_grant < Duration::from_secs(3), "{first_grant:?}");

    // 32 MiB more: LOW's last lease, then MID's newest; MID's oldest stays.
    let h2 = hs
        .lease_request(32 * MIB)
        .wait(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    let evs = events_until(&mut lowh.proc, "released", Duration::from_secs(5)).await;
    assert_eq!(
        ids(&evs, "reclaim"),
        vec![lowh.leases[0].clone()],
        "{evs:?}"
    );
    let evs = events_until(&mut midh.proc, "released", Duration::from_secs(5)).await;
    assert_eq!(
        ids(&evs, "reclaim"),
        vec![midh.leases[1].clone()],
        "{evs:?}"
    );
    let later = events_for(&mut midh.proc, Duration::from_millis(300)).await;
    assert!(
        ids(&later, "reclaim").is_empty(),
        "more reclaims: {later:?}"
    );
    assert_eq!(tenant(&admin, "low").await.usage.held_bytes, 0);
    assert_eq!(tenant(&admin, "mid").await.usage.held_bytes, 16 * MIB);
    assert_eq!(tenant(&admin, "high").await.usage.held_bytes, 48 * MIB);

    h1.release().await.unwrap();
    h2.release().await.unwrap();
    hs.close();
    lowh.proc.send("exit").await.unwrap();
    midh.proc.send("exit").await.unwrap();
    lowh.proc.wait(Duration::from_secs(5)).await.unwrap();
    midh.proc.wait(Duration::from_secs(5)).await.unwrap();
    let took = wait_all_zero(&admin, Duration::from_secs(2)).await;
    assert!(took.is_ok(), "{took:?}");
    assert_broker_alive(&b);
}

#[tokio::test]
async fn ignored_reclaim_is_revoked_and_quarantined_until_the_holder_exits() {
    let b = broker_64mib(&["--reclaim-deadline", "300ms"]);
    let admin = b.admin().await.unwrap();
    let low = b.tenant("low", quota(64 * MIB, 0, 0)).await.unwrap();
    let high = b.tenant("high", quota(64 * MIB, 0, 10)).await.unwrap();
    let mut lowh = holder(&b, &low, &["--count", "4", "--mib", "16", "--reclaimable"]).await;
    let hs = session_of(&b, high, "high").await;
    let waiter = {
        let hs = hs.clone();
        tokio::spawn(async move {
            let r = hs
                .lease_request(16 * MIB)
                .wait(Duration::from_secs(30))
                .send()
                .await;
            (r, Instant::now())
        })
    };
    // Asked for its newest lease, LOW ignores it; the lease is revoked after the deadline.
    let reclaim = event(&mut lowh.proc, "reclaim", Duration::from_secs(5)).await;
    assert_eq!(reclaim["id"], lowh.leases[3].as_str());
    let revoked = event(&mut lowh.proc, "revoked", Duration::from_secs(5)).await;
    assert_eq!(revoked["id"], lowh.leases[3].as_str());

    // Its memory is quarantined for LOW (shown per tenant and per device), not given away.
    let shown = eventually(Duration::from_secs(2), || async {
        let t = tenant(&admin, "low").await;
        let d = admin.get_devices().await.unwrap()[0].clone();
        t.usage.quarantined_bytes >= 16 * MIB
            && t.usage.held_bytes + t.usage.quarantined_bytes == 64 * MIB
            && d.quarantined_bytes == t.usage.quarantined_bytes
            && d.leased_bytes + d.quarantined_bytes == 64 * MIB
    })
    .await;
    assert!(
        shown,
        "low: {:?}\ndevice: {:?}",
        tenant(&admin, "low").await.usage,
        admin.get_devices().await.unwrap()
    );
    assert_eq!(tenant(&admin, "high").await.usage.waiting_requests, 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiter.is_finished(), "HIGH got memory that is quarantined");
    let t = tenant(&admin, "high").await;
    assert_eq!(t.usage.held_bytes, 0);
    assert_eq!(t.usage.waiting_requests, 1);
    let low_now = tenant(&admin, "low").await.usage;
    let more = events_for(&mut lowh.proc, Duration::from_millis(10)).await;
    eprintln!(
        "ignored reclaim: LOW holds {} MiB, {} MiB quarantined, {} more revocation(s) while HIGH waits",
        low_now.held_bytes / MIB,
        low_now.quarantined_bytes / MIB,
        ids(&more, "revoked").len()
    );

    // LOW's process leaves (without releasing): the quarantine lifts, HIGH is granted.
    lowh.proc.send("exit").await.unwrap();
    let exited = Instant::now();
    lowh.proc.wait(Duration::from_secs(5)).await.unwrap();
    let (r, granted_at) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("HIGH granted within 5 s of LOW's exit")
        .unwrap();
    let lease = r.expect("HIGH granted");
    assert_eq!(lease.bytes(), 16 * MIB);
    assert!(granted_at >= exited, "granted before the holder exited");
    assert!(
        granted_at - exited < Duration::from_secs(2),
        "{:?}",
        granted_at - exited
    );
    let clean = eventually(Duration::from_secs(1), || async {
        let u = tenant(&admin, "low").await.usage;
        u.held_bytes == 0 && u.quarantined_bytes == 0 && u.lease_count == 0 && u.session_count == 0
    })
    .await;
    assert!(clean, "{:?}", tenant(&admin, "low").await.usage);
    lease.release().await.unwrap();
    hs.close();
    let took = wait_all_zero(&admin, Duration::from_secs(2)).await;
    assert!(took.is_ok(), "{took:?}");
    assert_broker_alive(&b);
}

#[tokio::test]
async fn terminate_policy_kills_the_holder_and_grants() {
    let b = broker_64mib(&[
        "--reclaim-deadline",
        "300ms",
        "--reclaim-policy",
        "terminate",
    ]);
    let admin = b.admin().await.unwrap();
    let low = b.tenant("low", quota(64 * MIB, 0, 0)).await.unwrap();
    let high = b.tenant("high", quota(64 * MIB, 0, 10)).await.unwrap();
    let mut lowh = holder(&b, &low, &["--count", "4", "--mib", "16", "--reclaimable"]).await;
    let hs = session_of(&b, high, "high").await;
    let t0 = Instant::now();
    let waiter = spawn_lease(&hs, 16 * MIB, Duration::from_secs(20));
    let status = lowh.proc.wait(Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the holder should be killed: {status}"
    );
    let lease = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("HIGH granted after the holder was killed")
        .unwrap()
        .unwrap();
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(lease.bytes(), 16 * MIB);
    let clean = eventually(Duration::from_secs(2), || async {
        let u = tenant(&admin, "low").await.usage;
        u.held_bytes == 0 && u.quarantined_bytes == 0 && u.session_count == 0
    })
    .await;
    assert!(clean, "{:?}", tenant(&admin, "low").await.usage);
    lease.release().await.unwrap();
    hs.close();
    assert!(wait_all_zero(&admin, Duration::from_secs(2)).await.is_ok());
    assert_broker_alive(&b);
}

#[tokio::test]
async fn admin_revoke_quarantines_until_the_holder_exits() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let low = b.tenant("low", quota(64 * MIB, 0, 0)).await.unwrap();
    let other = b.tenant("other", quota(64 * MIB, 0, 0)).await.unwrap();
    let mut lowh = holder(&b, &low, &["--count", "2", "--mib", "16"]).await;
    let revoked = admin
        .revoke_lease(&lowh.leases[0], "operator says so")
        .await
        .unwrap();
    assert_eq!(revoked.lease_id, lowh.leases[0]);
    let ev = event(&mut lowh.proc, "revoked", Duration::from_secs(5)).await;
    assert_eq!(ev["id"], lowh.leases[0].as_str());
    let u = tenant(&admin, "low").await.usage;
    assert_eq!((u.held_bytes, u.quarantined_bytes), (16 * MIB, 16 * MIB));
    assert_eq!(
        admin.get_devices().await.unwrap()[0].quarantined_bytes,
        16 * MIB
    );
    // Only what is neither leased nor quarantined can be granted.
    let oc = Client::connect(&b.uri(), other).await.unwrap();
    let os = oc.session("other").await.unwrap();
    let r = os.lease(34 * MIB).await;
    assert_eq!(code_of(&r), Some(Code::ResourceExhausted), "{r:?}");
    let o1 = os.lease(32 * MIB).await.unwrap();
    // The holder leaves: its quarantine lifts, the memory can be granted again.
    lowh.proc.send("exit").await.unwrap();
    lowh.proc.wait(Duration::from_secs(5)).await.unwrap();
    let lifted = eventually(Duration::from_secs(1), || async {
        let u = tenant(&admin, "low").await.usage;
        u.quarantined_bytes == 0 && u.held_bytes == 0
    })
    .await;
    assert!(lifted, "{:?}", tenant(&admin, "low").await.usage);
    let o2 = os.lease(32 * MIB).await.unwrap();
    o1.release().await.unwrap();
    o2.release().await.unwrap();
    os.close();
    assert!(wait_all_zero(&admin, Duration::from_secs(2)).await.is_ok());
    assert_broker_alive(&b);
}

/// Free memory that is kept for another tenant's unused guarantee cannot serve a
/// higher-priority waiter: it must not count as free when the broker decides how much to
/// reclaim, or lower-priority reclaimable leases are never asked back.
#[tokio::test]
async fn reclaim_happens_when_the_free_memory_is_kept_for_a_guarantee() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "128MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    // 64 MiB stay free for GUAR, which uses nothing yet.
    b.tenant("guar", quota(64 * MIB, 64 * MIB, 0))
        .await
        .unwrap();
    let low = b.tenant("low", quota(128 * MIB, 0, 0)).await.unwrap();
    let high = b.tenant("high", quota(128 * MIB, 0, 10)).await.unwrap();
    // LOW takes all it may: 128 - 64 kept for GUAR.
    let mut lowh = holder(
        &b,
        &low,
        &["--count", "4", "--mib", "16", "--reclaimable", "--honour"],
    )
    .await;
    assert_eq!(lowh.leases.len(), 4);
    let dev = &admin.get_devices().await.unwrap()[0];
    assert_eq!(dev.leased_bytes, 64 * MIB);

    let hs = session_of(&b, high, "high").await;
    let t0 = Instant::now();
    let r = hs
        .lease_request(16 * MIB)
        .wait(Duration::from_secs(5))
        .send()
        .await;
    let took = t0.elapsed();
    let asked = events_for(&mut lowh.proc, Duration::from_millis(100)).await;
    let lease = r.unwrap_or_else(|e| {
        panic!(
            "HIGH (priority 10) not granted after {took:?} although LOW (priority 0) holds \
             64 MiB of reclaimable leases; LOW's events: {asked:?}; error: {e}"
        )
    });
    assert_eq!(ids(&asked, "reclaim"), vec![lowh.leases[3].clone()]);
    assert!(took < Duration::from_secs(3), "{took:?}");
    lease.release().await.unwrap();
    hs.close();
    lowh.proc.send("exit").await.unwrap();
    lowh.proc.wait(Duration::from_secs(5)).await.unwrap();
    assert!(wait_all_zero(&admin, Duration::from_secs(2)).await.is_ok());
    assert_broker_alive(&b);
}

/// A holder that ignored a reclaim request and was revoked (its memory quarantined while
/// its process lives) must not lose lease after lease while the waiter keeps waiting:
/// revoking more of its leases cannot free memory for anyone ("only as much as needed").
#[tokio::test]
async fn ignored_reclaim_revokes_only_what_is_needed() {
    let b = broker_64mib(&["--reclaim-deadline", "300ms"]);
    let admin = b.admin().await.unwrap();
    let low = b.tenant("low", quota(64 * MIB, 0, 0)).await.unwrap();
    let high = b.tenant("high", quota(64 * MIB, 0, 10)).await.unwrap();
    let mut lowh = holder(&b, &low, &["--count", "4", "--mib", "16", "--reclaimable"]).await;
    let hs = session_of(&b, high, "high").await;
    let waiter = spawn_lease(&hs, 16 * MIB, Duration::from_secs(8));
    // HIGH waits for 16 MiB for 3.5 s (about 10 reclaim deadlines).
    let evs = events_for(&mut lowh.proc, Duration::from_millis(3500)).await;
    let revoked = ids(&evs, "revoked");
    let u = tenant(&admin, "low").await.usage;
    lowh.proc.send("exit").await.unwrap();
    lowh.proc.wait(Duration::from_secs(5)).await.unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("HIGH granted once LOW is gone")
        .unwrap()
        .unwrap();
    lease.release().await.unwrap();
    hs.close();
    assert_eq!(
        revoked,
        vec![lowh.leases[3].clone()],
        "HIGH needs one 16 MiB lease, LOW lost {} ({} MiB quarantined)",
        revoked.len(),
        u.quarantined_bytes / MIB
    );
    assert_eq!(u.quarantined_bytes, 16 * MIB);
    assert!(wait_all_zero(&admin, Duration::from_secs(2)).await.is_ok());
}

/// Quarantined memory of a holder whose process lives on may never come back: it must not
/// count as "on its way back" for every waiter, or no lease of a cooperative lower-priority
/// holder is ever asked back while the quarantine lasts.
#[tokio::test]
async fn a_stuck_quarantine_does_not_stop_reclaim_from_others() {
    let b = broker_64mib(&["--reclaim-deadline", "300ms"]);
    let admin = b.admin().await.unwrap();
    let stuck = b.tenant("stuck", quota(64 * MIB, 0, 0)).await.unwrap();
    let coop = b.tenant("coop", quota(64 * MIB, 0, 0)).await.unwrap();
    let high = b.tenant("high", quota(64 * MIB, 0, 10)).await.unwrap();
    let mut stuckh = holder(&b, &stuck, &["--count", "1", "--mib", "16"]).await;
    let mut cooph = holder(
        &b,
        &coop,
        &["--count", "3", "--mib", "16", "--reclaimable", "--honour"],
    )
    .await;
    // An operator revokes STUCK's lease; STUCK lives on: 16 MiB quarantined.
    admin
        .revoke_lease(&stuckh.leases[0], "operator")
        .await
        .unwrap();
    event(&mut stuckh.proc, "revoked", Duration::from_secs(5)).await;
    let dev = &admin.get_devices().await.unwrap()[0];
    assert_eq!(
        (dev.leased_bytes, dev.quarantined_bytes),
        (48 * MIB, 16 * MIB)
    );

    let hs = session_of(&b, high, "high").await;
    let t0 = Instant::now();
    let r = hs
        .lease_request(16 * MIB)
        .wait(Duration::from_secs(4))
        .send()
        .await;
    let took = t0.elapsed();
    let asked = events_for(&mut cooph.proc, Duration::from_millis(100)).await;
    let lease = r.unwrap_or_else(|e| {
        panic!(
            "HIGH (priority 10) not granted after {took:?}: COOP (priority 0) holds 48 MiB of \
             reclaimable leases and was asked for {:?}; error: {e}",
            ids(&asked, "reclaim")
        )
    });
    assert_eq!(ids(&asked, "reclaim"), vec![cooph.leases[2].clone()]);
    lease.release().await.unwrap();
    hs.close();
    stuckh.proc.send("exit").await.unwrap();
    cooph.proc.send("exit").await.unwrap();
    stuckh.proc.wait(Duration::from_secs(5)).await.unwrap();
    cooph.proc.wait(Duration::from_secs(5)).await.unwrap();
    assert!(wait_all_zero(&admin, Duration::from_secs(2)).await.is_ok());
    assert_broker_alive(&b);
}

/// A reclaimable lease whose holder does not answer the reclaim request in time is revoked;
/// a ticket of it not yet redeemed then tells its holder "lease ended" (NOT_FOUND), not
/// "ticket refused": what a slow worker sees when the revocation comes between its grant
/// and its fetch.
#[tokio::test]
async fn a_lease_revoked_before_its_ticket_is_redeemed_is_reported_as_ended() {
    let b = broker_64mib(&["--reclaim-deadline", "300ms"]);
    let admin = b.admin().await.unwrap();
    let low = b.tenant("low", quota(64 * MIB, 0, 0)).await.unwrap();
    let high = b.tenant("high", quota(64 * MIB, 0, 10)).await.unwrap();
    let lc = Client::connect(&b.uri(), low).await.unwrap();
    let ls = lc.session("low").await.unwrap();
    let held = ls
        .lease_request(64 * MIB)
        .reclaimable(true)
        .send()
        .await
        .unwrap();
    // A ticket minted, not redeemed (the worker is slow to fetch).
    let fd = lc
        .raw()
        .renew_lease_ticket(gpu_broker_client::proto::v1::RenewLeaseTicketRequest {
            lease_id: held.id().into(),
        })
        .await
        .unwrap()
        .into_inner()
        .fd
        .unwrap();
    // HIGH waits; LOW never answers the reclaim request and is revoked after 300 ms.
    let hs = session_of(&b, high, "high").await;
    let waiter = spawn_lease(&hs, 16 * MIB, Duration::from_secs(30));
    let revoked = eventually(Duration::from_secs(10), || async {
        tenant(&admin, "low").await.usage.quarantined_bytes == 64 * MIB
    })
    .await;
    assert!(revoked, "LOW's lease was not revoked");
    let e = gpu_broker_client::fd::fetch(std::path::Path::new(&fd.socket_path), &fd.ticket, None)
        .await
        .unwrap_err();
    assert!(
        matches!(e, gpu_broker_client::ClientError::LeaseEnded(_)),
        "{e}"
    );
    assert_eq!(e.code_name(), "NOT_FOUND");
    // LOW's memory stays quarantined while this process (its holder) lives: HIGH keeps
    // waiting; the broker is healthy.
    assert!(!waiter.is_finished());
    waiter.abort();
    hs.close();
    drop(held);
    ls.close();
    assert_broker_alive(&b);
}
