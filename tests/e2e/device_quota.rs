//! Per-device caps in a quota (`device_limit_bytes`), on a host broker with two simulated
//! devices: a capped device takes no more than its cap from the tenant (pinned requests
//! are refused or wait, unpinned ones go to another device), exactly under concurrency;
//! the caps are set by admin gRPC, `gpu-brokerctl` and the tenants config file, shown in
//! usage, and survive a restart.

use std::collections::BTreeMap;
use std::time::Duration;

use gpu_broker_client::{Client, ClientError, Code, Lease, QuotaPatch, QuotaSpec};
use gpu_broker_tests::*;

/// The broker's reason, as it spells it.
fn reason(e: &ClientError) -> Option<&str> {
    e.reason().map(|r| r.as_str())
}

fn two_devices() -> Broker {
    Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap()
}

fn capped(limit: u64, caps: &[(u32, u64)]) -> QuotaSpec {
    QuotaSpec {
        device_limit_bytes: caps.iter().copied().collect(),
        ..QuotaSpec::new(limit)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_cap_refuses_steers_and_lets_waiters_in() {
    let mut b = two_devices();
    let token = b
        .tenant("alice", capped(GIB, &[(0, 16 * MIB)]))
        .await
        .unwrap();
    let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let s = c.session("s").await.unwrap();

    // Up to the cap on device 0.
    let first = s.lease_request(16 * MIB).device(0).send().await.unwrap();
    assert_eq!(first.device(), 0);
    // One byte more there is refused, with the numbers.
    let e = s.lease_request(2 * MIB).device(0).send().await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert_eq!(reason(&e), Some("DEVICE_QUOTA_EXCEEDED"), "{e}");
    assert_eq!(e.detail("device"), Some("0"), "{e}");
    assert_eq!(
        e.detail("limit_bytes"),
        Some(&*(16 * MIB).to_string()),
        "{e}"
    );
    assert_eq!(
        e.detail("held_bytes"),
        Some(&*(16 * MIB).to_string()),
        "{e}"
    );
    // Unpinned requests go where the cap leaves room: device 1.
    let mut elsewhere: Vec<Lease> = Vec::new();
    for _ in 0..3 {
        elsewhere.push(s.lease(8 * MIB).await.unwrap());
    }
    assert!(elsewhere.iter().all(|l| l.device() == 1), "{elsewhere:?}");
    // Above the cap itself: refused at once, even with a wait.
    let e = s
        .lease_request(32 * MIB)
        .device(0)
        .wait(Duration::from_secs(30))
        .send()
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Some("DEVICE_QUOTA_EXCEEDED"), "{e}");

    // Usage shows the caps and what is held per device, to the worker and the operator.
    let u = c.usage().await.unwrap();
    assert_eq!(u.quota.device_limit_bytes, BTreeMap::from([(0, 16 * MIB)]));
    assert_eq!(
        u.usage.device_committed_bytes,
        BTreeMap::from([(0, 16 * MIB), (1, 24 * MIB)])
    );
    let admin = b.admin().await.unwrap();
    let info = admin.get_quota("alice").await.unwrap();
    assert_eq!(info.quota.device_limit_bytes, u.quota.device_limit_bytes);
    assert_eq!(
        info.usage.device_committed_bytes,
        u.usage.device_committed_bytes
    );

    // A waiter pinned to the capped device gets in when the tenant releases there.
    let waiter = {
        let s = s.clone();
        tokio::spawn(async move {
            s.lease_request(4 * MIB)
                .device(0)
                .wait(Duration::from_secs(20))
                .send()
                .await
        })
    };
    assert!(
        eventually(Duration::from_secs(5), || async {
            c.usage().await.unwrap().usage.waiting_requests == 1
        })
        .await
    );
    first.release().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter is granted")
        .unwrap()
        .unwrap();
    assert_eq!((got.device(), got.bytes()), (0, 4 * MIB));

    // Patching: a cap for a device the node does not have is refused; removing the cap
    // lets device 0 take the rest of the total.
    let e = admin
        .patch_quota(
            "alice",
            QuotaPatch {
                device_limits: vec![(2, Some(MIB))],
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("device 2"), "{e}");
    let change = admin
        .patch_quota(
            "alice",
            QuotaPatch {
                device_limits: vec![(0, None), (1, Some(32 * MIB))],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        change.tenant.quota.device_limit_bytes,
        BTreeMap::from([(1, 32 * MIB)])
    );
    let big = s.lease_request(40 * MIB).device(0).send().await.unwrap();
    // Device 1 now caps at 32 MiB and holds 24: 8 more fit there, 10 do not.
    let e = s
        .lease_request(10 * MIB)
        .device(1)
        .send()
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Some("DEVICE_QUOTA_EXCEEDED"), "{e}");
    let last = s.lease_request(8 * MIB).device(1).send().await.unwrap();

    // The caps are durable: after a restart they still apply.
    drop((got, big, last, elsewhere));
    drop(s);
    drop(c);
    tokio::task::block_in_place(|| b.stop(Duration::from_secs(10))).unwrap();
    b.spawn().unwrap();
    let admin = b.admin().await.unwrap();
    let info = admin.get_quota("alice").await.unwrap();
    assert_eq!(
        info.quota.device_limit_bytes,
        BTreeMap::from([(1, 32 * MIB)])
    );
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("again").await.unwrap();
    let e = s
        .lease_request(34 * MIB)
        .device(1)
        .send()
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Some("DEVICE_QUOTA_EXCEEDED"), "{e}");
    s.lease_request(34 * MIB).device(0).send().await.unwrap();
}

/// Many requests at once against one cap: exactly as many are granted as fit under it,
/// whatever the interleaving; and unpinned requests fill the other device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_never_pass_a_device_cap() {
    let b = two_devices();
    // Device 0 capped at 10 MiB (5 leases of 2 MiB), the total at 40 MiB (20 leases).
    let token = b
        .tenant("alice", capped(40 * MIB, &[(0, 10 * MIB)]))
        .await
        .unwrap();
    let mut sessions = Vec::new();
    for i in 0..4 {
        let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
        sessions.push(c.session(format!("s{i}")).await.unwrap());
    }
    // Round 1: 24 requests pinned to device 0 at once; 5 fit.
    let mut tasks = Vec::new();
    for i in 0..24 {
        let s = sessions[i % sessions.len()].clone();
        tasks.push(tokio::spawn(async move {
            s.lease_request(2 * MIB).device(0).send().await
        }));
    }
    let mut pinned = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(l) => pinned.push(l),
            Err(e) => assert_eq!(reason(&e), Some("DEVICE_QUOTA_EXCEEDED"), "{e}"),
        }
    }
    assert_eq!(pinned.len(), 5, "exactly the cap's worth is granted");
    assert!(pinned.iter().all(|l| l.device() == 0));
    // Round 2: 40 unpinned requests at once; the total allows 15 more, none of them on
    // device 0 (at its cap).
    let mut tasks = Vec::new();
    for i in 0..40 {
        let s = sessions[i % sessions.len()].clone();
        tasks.push(tokio::spawn(async move { s.lease(2 * MIB).await }));
    }
    let mut unpinned = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(l) => unpinned.push(l),
            Err(e) => assert_eq!(reason(&e), Some("QUOTA_EXCEEDED"), "{e}"),
        }
    }
    assert_eq!(unpinned.len(), 15);
    assert!(unpinned.iter().all(|l| l.device() == 1), "{unpinned:?}");
    let admin = b.admin().await.unwrap();
    let info = admin.get_quota("alice").await.unwrap();
    assert_eq!(
        info.usage.device_committed_bytes,
        BTreeMap::from([(0, 10 * MIB), (1, 30 * MIB)])
    );
    let d = admin.get_devices().await.unwrap();
    assert_eq!((d[0].leased_bytes, d[1].leased_bytes), (10 * MIB, 30 * MIB));
    // Round 3: waiters pinned to device 0 while leases there are released concurrently:
    // each release lets exactly one in, never more than the cap at a time.
    let mut waiters = Vec::new();
    for i in 0..5 {
        let s = sessions[i % sessions.len()].clone();
        waiters.push(tokio::spawn(async move {
            s.lease_request(2 * MIB)
                .device(0)
                .wait(Duration::from_secs(20))
                .send()
                .await
        }));
    }
    let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            c.usage().await.unwrap().usage.waiting_requests == 5
        })
        .await
    );
    let releases: Vec<_> = pinned
        .drain(..3)
        .map(|l| tokio::spawn(async move { l.release().await }))
        .collect();
    for r in releases {
        r.await.unwrap().unwrap();
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            c.usage().await.unwrap().usage.waiting_requests == 2
        })
        .await
    );
    let u = c.usage().await.unwrap();
    assert_eq!(u.usage.device_committed_bytes.get(&0), Some(&(10 * MIB)));
    drop(pinned);
    drop(unpinned);
    let mut granted = 0;
    for w in waiters {
        if let Ok(Ok(l)) = w.await {
            assert_eq!(l.device(), 0);
            granted += 1;
            drop(l);
        }
    }
    assert_eq!(granted, 5, "every waiter got in once room was made");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokerctl_and_the_tenants_file_set_device_limits() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tenants.toml");
    std::fs::write(
        &config,
        "[tenants.file]\nlimit = \"48MiB\"\ndevice-limits = { 1 = \"8MiB\" }\n",
    )
    .unwrap();
    let b = Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "64MiB",
        extra: vec!["--config".into(), config.display().to_string()],
        ..Default::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let from_file = admin.get_quota("file").await.unwrap();
    assert_eq!(
        from_file.quota.device_limit_bytes,
        BTreeMap::from([(1, 8 * MIB)])
    );

    let ctl = |args: &[&str]| {
        let out = b.ctl().args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, text, err) = ctl(&[
        "quota",
        "set",
        "cli",
        "--limit",
        "32MiB",
        "--device-limit",
        "0=4MiB",
        "--device-limit",
        "1=0",
    ]);
    assert!(ok, "{text}{err}");
    assert!(
        text.contains("device 0: 0 B held of its 4.0 MiB limit"),
        "{text}"
    );
    assert!(
        text.contains("device 1: 0 B held of its 0 B limit"),
        "{text}"
    );
    let info = admin.get_quota("cli").await.unwrap();
    assert_eq!(
        info.quota.device_limit_bytes,
        BTreeMap::from([(0, 4 * MIB), (1, 0)])
    );
    // 0 keeps the tenant off device 1 entirely.
    let token = admin.issue_token("cli", "t").await.unwrap().token;
    let s = Client::connect(&b.uri(), token)
        .await
        .unwrap()
        .session("s")
        .await
        .unwrap();
    let l = s.lease(2 * MIB).await.unwrap();
    assert_eq!(l.device(), 0);
    let (ok, text, err) = ctl(&["quota", "get", "cli", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["quota"]["device_limit_bytes"]["0"], 4 * MIB);
    assert_eq!(v["usage"]["device_committed_bytes"]["0"], 2 * MIB);
    // Remove one cap, then all.
    let (ok, _, err) = ctl(&["quota", "set", "cli", "--device-limit", "1=none"]);
    assert!(ok, "{err}");
    let info = admin.get_quota("cli").await.unwrap();
    assert_eq!(
        info.quota.device_limit_bytes,
        BTreeMap::from([(0, 4 * MIB)])
    );
    let (ok, _, err) = ctl(&["quota", "set", "cli", "--clear-device-limits"]);
    assert!(ok, "{err}");
    assert!(admin
        .get_quota("cli")
        .await
        .unwrap()
        .quota
        .device_limit_bytes
        .is_empty());
    // Bad input: one clear line, nothing changed.
    let (ok, _, err) = ctl(&["quota", "set", "cli", "--device-limit", "x=1MiB"]);
    assert!(!ok && err.contains("not a device index"), "{err}");
    let (ok, _, err) = ctl(&["quota", "set", "cli", "--device-limit", "5=1MiB"]);
    assert!(!ok && err.contains("device 5"), "{err}");
    drop(l);
}
