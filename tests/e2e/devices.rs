//! Several simulated devices: pinning, spreading, and unknown indexes.

use gpu_broker_client::QuotaSpec;
use gpu_broker_client::{Code, Lease};
use gpu_broker_tests::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_and_unpinned_requests_on_two_devices() {
    let b = Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let admin = b.admin().await.unwrap();
    let d = admin.get_devices().await.unwrap();
    assert_eq!(d.len(), 2);
    assert_eq!((d[0].index, d[1].index), (0, 1));
    assert!(d
        .iter()
        .all(|d| d.total_bytes == 64 * MIB && d.leasable_bytes == 64 * MIB));

    // Pinned to device 1: lands there.
    let pinned = s.lease_request(16 * MIB).device(1).send().await.unwrap();
    assert_eq!(pinned.device(), 1);
    let d = admin.get_devices().await.unwrap();
    assert_eq!((d[0].leased_bytes, d[1].leased_bytes), (0, 16 * MIB));

    // Unpinned: 40 + 40 + 24 + 8 MiB only fit if the broker spreads them sensibly
    // (both 40s on one device would not fit).
    let mut unpinned: Vec<Lease> = Vec::new();
    for mib in [40, 40, 24, 8] {
        let l = s
            .lease(mib * MIB)
            .await
            .unwrap_or_else(|e| panic!("{mib} MiB should fit somewhere: {e}\n{:?}", unpinned));
        unpinned.push(l);
    }
    let on = |dev: u32| -> u64 {
        unpinned
            .iter()
            .filter(|l| l.device() == dev)
            .map(|l| l.bytes())
            .sum()
    };
    assert_eq!(on(0), 64 * MIB);
    assert_eq!(on(1), 48 * MIB);
    let d = admin.get_devices().await.unwrap();
    assert_eq!((d[0].leased_bytes, d[1].leased_bytes), (64 * MIB, 64 * MIB));
    let listed = admin.list_all_leases(None).await.unwrap();
    for l in unpinned.iter().chain([&pinned]) {
        let info = listed.iter().find(|i| i.lease_id == l.id()).unwrap();
        assert_eq!(info.device, l.device());
    }

    // Both full now.
    let e = s.lease(2 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(
        e.message().contains("device 0") && e.message().contains("device 1"),
        "{e}"
    );
    // Unknown device index.
    let e = s.lease_request(2 * MIB).device(2).send().await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("device 2"), "{e}");
    // Larger than one device, even though both together would have room.
    drop(unpinned);
    drop(pinned);
    assert!(
        eventually(Duration::from_secs(5), || async {
            c.usage().await.unwrap().usage.held_bytes == 0
        })
        .await
    );
    let e = s.lease(80 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_waiter_waits_for_its_own_device() {
    let b = Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "32MiB",
        ..Default::default()
    })
    .unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let admin = b.admin().await.unwrap();
    let d0 = s.lease_request(32 * MIB).device(0).send().await.unwrap();
    let d1 = s.lease_request(32 * MIB).device(1).send().await.unwrap();

    let s2 = s.clone();
    let waiter = tokio::spawn(async move {
        s2.lease_request(8 * MIB)
            .device(1)
            .wait(Duration::from_secs(10))
            .send()
            .await
    });
    assert!(
        eventually(Duration::from_secs(5), || async {
            admin.get_devices().await.unwrap()[1].waiting_requests == 1
        })
        .await
    );
    // Memory on device 0 does not satisfy a request pinned to device 1.
    d0.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    d1.release().await.unwrap();
    let l = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(l.device(), 1);
    let d = admin.get_devices().await.unwrap();
    assert_eq!((d[0].leased_bytes, d[1].leased_bytes), (0, 8 * MIB));
    assert_eq!(d[1].waiting_requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_process_pinned_to_device_one() {
    let b = Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let mut w = hold(
        &b,
        &token,
        &["--bytes", "4MiB", "--device", "1", "--pattern", "9"],
    )
    .await
    .unwrap();
    assert_eq!(w.leases[0].device, 1);
    let d = devices(&b).await.unwrap();
    assert_eq!((d[0].leased_bytes, d[1].leased_bytes), (0, 4 * MIB));
    w.proc.kill().await.unwrap();
    // A worker asking for device 2 fails with INVALID_ARGUMENT.
    let mut bad = Proc::spawn(worker_cmd(
        &b,
        &token,
        &["hold", "--bytes", "4MiB", "--device", "2"],
    ))
    .unwrap();
    bad.line_starting("ERROR INVALID_ARGUMENT", Duration::from_secs(10))
        .await
        .unwrap();
    let status = bad.wait(Duration::from_secs(5)).await.unwrap();
    assert_eq!(status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_have_stable_uuids_shown_in_leases() {
    let mut b = Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let d = devices(&b).await.unwrap();
    let uuids: Vec<String> = d.iter().map(|d| d.uuid.clone()).collect();
    assert!(uuids.iter().all(|u| u.starts_with("HOST-")), "{uuids:?}");
    assert_ne!(uuids[0], uuids[1]);
    assert!(d.iter().all(|d| d.model == "host simulation"), "{d:?}");

    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let l = s.lease_request(2 * MIB).device(1).send().await.unwrap();
    assert_eq!(l.device_uuid(), uuids[1]);
    let listed = b
        .admin()
        .await
        .unwrap()
        .list_all_leases(None)
        .await
        .unwrap();
    assert_eq!(listed[0].device_uuid, uuids[1]);
    drop(l);
    drop(s);
    drop(c);

    // Same state directory after a restart: same identities.
    b.stop(Duration::from_secs(10)).unwrap();
    b.spawn().unwrap();
    let again: Vec<String> = devices(&b)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.uuid)
        .collect();
    assert_eq!(again, uuids);
    // Another broker (another state directory): other identities.
    let other = Broker::start_with(BrokerOpts {
        devices: 1,
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    assert_ne!(devices(&other).await.unwrap()[0].uuid, uuids[0]);
}
