//! Draining devices for maintenance against a real broker: no new leases there (pinned:
//! FAILED_PRECONDITION, nowhere open: UNAVAILABLE), waiting requests told why, holders of
//! reclaimable leases asked to release, progress until empty, missed deadlines revoke,
//! undrain reopens; and `gpu-brokerctl drain` waits until the device is empty.

use futures::StreamExt;
use gpu_broker_client::{Code, SessionEvent};
use gpu_broker_tests::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn two_devices() -> Broker {
    Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_stops_admission_asks_reclaimable_holders_and_reports_until_empty() {
    let b = two_devices();
    let admin = b.admin().await.unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let mut events = s.events();
    let give = s
        .lease_request(32 * MIB)
        .device(1)
        .reclaimable(true)
        .send()
        .await
        .unwrap();
    let keep = s.lease_request(32 * MIB).device(1).send().await.unwrap();
    // Device 1 is full: this one waits.
    let s2 = s.clone();
    let waiter = tokio::spawn(async move {
        s2.lease_request(8 * MIB)
            .device(1)
            .wait(Duration::from_secs(20))
            .send()
            .await
    });
    assert!(
        eventually(T, || async {
            admin.get_devices().await.unwrap()[1].waiting_requests == 1
        })
        .await
    );

    let st = admin
        .drain(Some(1), Some(Duration::from_secs(60)), "firmware")
        .await
        .unwrap();
    let d1 = &st.devices[1];
    assert!(d1.draining && !st.devices[0].draining);
    assert_eq!((d1.leases, d1.bytes), (2, 64 * MIB));
    assert_eq!((d1.reclaim_requested, d1.not_reclaimable), (1, 1));
    assert!(!st.complete);

    // The waiter is told why.
    let e = tokio::time::timeout(T, waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.message().contains("draining") && e.message().contains("firmware"),
        "{e}"
    );
    // The holder of the reclaimable lease is asked, with the reason.
    let ev = tokio::time::timeout(T, events.next()).await.unwrap();
    match ev {
        Some(SessionEvent::ReclaimRequested {
            lease_id, reason, ..
        }) => {
            assert_eq!(lease_id, give.id());
            assert!(reason.contains("draining"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // New requests: pinned there refused, unpinned go to the open device.
    let e = s.lease_request(2 * MIB).device(1).send().await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::DeviceDraining),
        "{e}"
    );
    assert_eq!(e.detail("device"), Some("1"));
    let elsewhere = s.lease(2 * MIB).await.unwrap();
    assert_eq!(elsewhere.device(), 0);
    let devs = admin.get_devices().await.unwrap();
    assert!(devs[1].draining && devs[1].drain_reason == "firmware" && !devs[0].draining);

    // Progress until empty.
    give.release().await.unwrap();
    let st = admin.drain_status().await.unwrap();
    assert_eq!((st.devices[1].leases, st.complete), (1, false));
    keep.release().await.unwrap();
    assert!(eventually(T, || async { admin.drain_status().await.unwrap().complete }).await);

    // Undrain: admits again.
    let st = admin.undrain(Some(1)).await.unwrap();
    assert!(!st.devices[1].draining);
    let back = s.lease_request(2 * MIB).device(1).send().await.unwrap();
    assert_eq!(back.device(), 1);

    // Recorded.
    let audit = admin.list_audit(&Default::default()).await.unwrap();
    let actions: Vec<&str> = audit.iter().map(|e| e.action.as_str()).collect();
    assert!(
        actions.ends_with(&["drain.start", "drain.stop"]),
        "{actions:?}"
    );
    assert_eq!(audit[audit.len() - 2].target, "1");
    drop(elsewhere);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_drain_is_unavailable_missed_deadlines_revoke_and_undrain_withdraws() {
    let b = two_devices();
    let admin = b.admin().await.unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let mut events = s.events();
    let ignored = s
        .lease_request(4 * MIB)
        .device(0)
        .reclaimable(true)
        .send()
        .await
        .unwrap();
    // Node drain with a short deadline the holder ignores: revoked after it.
    admin
        .drain(None, Some(Duration::from_millis(300)), "node reboot")
        .await
        .unwrap();
    let e = s.lease(2 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("node reboot"), "{e}");
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::NoDeviceOpen),
        "{e}"
    );
    // Readiness: nothing here takes new work.
    assert!(
        eventually(T, || async {
            health_check(&b.uri(), "gpubroker.v1.Broker").await.unwrap() == 2
        })
        .await
    );
    let mut revoked = false;
    while let Ok(Some(ev)) = tokio::time::timeout(T, events.next()).await {
        if let SessionEvent::LeaseRevoked { lease_id, .. } = ev {
            assert_eq!(lease_id, ignored.id());
            revoked = true;
            break;
        }
    }
    assert!(revoked, "the ignored reclaim was not revoked");
    let _ = ignored.detach();
    admin.undrain(None).await.unwrap();
    assert!(
        eventually(T, || async {
            health_check(&b.uri(), "gpubroker.v1.Broker").await.unwrap() == 1
        })
        .await
    );

    // A drain's reclaim request is withdrawn by undrain.
    let l = s
        .lease_request(4 * MIB)
        .device(1)
        .reclaimable(true)
        .send()
        .await
        .unwrap();
    admin
        .drain(Some(1), Some(Duration::from_secs(600)), "")
        .await
        .unwrap();
    let state = |leases: Vec<gpu_broker_client::LeaseInfo>| {
        leases
            .into_iter()
            .find(|x| x.lease_id == l.id())
            .map(|x| x.state)
    };
    assert_eq!(
        state(admin.list_all_leases(None).await.unwrap()),
        Some(gpu_broker_client::LeaseState::ReclaimRequested)
    );
    admin.undrain(Some(1)).await.unwrap();
    assert_eq!(
        state(admin.list_all_leases(None).await.unwrap()),
        Some(gpu_broker_client::LeaseState::Active)
    );

    // Bad input is precise.
    let e = admin.drain(Some(7), None, "").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let e = admin
        .drain(None, Some(Duration::from_secs(30 * 86400)), "")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokerctl_drain_waits_until_the_device_is_empty() {
    let b = two_devices();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let l = s.lease_request(4 * MIB).device(0).send().await.unwrap();
    let mut cmd = tokio::process::Command::from(b.ctl());
    cmd.args([
        "drain",
        "--device",
        "0",
        "--deadline",
        "30s",
        "--poll",
        "50ms",
    ])
    .kill_on_drop(true);
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let admin = b.admin().await.unwrap();
    assert!(
        eventually(T, || async {
            admin.get_devices().await.unwrap()[0].draining
        })
        .await
    );
    // Still waiting while the lease is held.
    tokio::time::sleep(Duration::from_millis(200)).await;
    l.release().await.unwrap();
    let out = tokio::time::timeout(T, child.wait_with_output())
        .await
        .expect("drain finished")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("device 0: 1 lease(s)"), "{stderr}");
    assert!(stderr.contains("drained"), "{stderr}");

    // A deadline that passes with a non-reclaimable lease left: non-zero exit, named.
    let _held = s.lease_request(2 * MIB).device(1).send().await.unwrap();
    let out = tokio::process::Command::from(b.ctl())
        .args([
            "drain",
            "--device",
            "1",
            "--deadline",
            "100ms",
            "--poll",
            "50ms",
        ])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("deadline passed") && stderr.contains("device 1"),
        "{stderr}"
    );
    let undrain = tokio::process::Command::from(b.ctl())
        .args(["undrain"])
        .output()
        .await
        .unwrap();
    assert!(undrain.status.success());
    assert!(admin
        .get_devices()
        .await
        .unwrap()
        .iter()
        .all(|d| !d.draining));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_device_takes_nothing_new_and_its_holders_are_told() {
    let b = Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "64MiB",
        extra: vec!["--health-interval".into(), "50ms".into()],
        ..Default::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let mut events = s.events();
    let l = s.lease_request(4 * MIB).device(0).send().await.unwrap();
    let ctl = |args: &[&str]| b.ctl().args(args).output().unwrap();
    let out = ctl(&["mark-unhealthy", "0", "--reason", "fan failure"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ev = tokio::time::timeout(T, events.next()).await.unwrap();
    match ev {
        Some(SessionEvent::DeviceUnhealthy {
            device,
            reason,
            uuid,
        }) => {
            assert_eq!(device, 0);
            assert_eq!(reason, "fan failure");
            assert!(uuid.starts_with("HOST-"), "{uuid}");
        }
        other => panic!("{other:?}"),
    }
    let d = admin.get_devices().await.unwrap();
    assert!(d[0].unhealthy && d[0].health_reason == "fan failure" && !d[1].unhealthy);
    let table = String::from_utf8(ctl(&["devices"]).stdout).unwrap();
    assert!(table.contains("unhealthy"), "{table}");
    // gRPC health: the device is NOT_SERVING, the broker still SERVING (device 1 is open).
    assert!(
        eventually(T, || async {
            health_check(&b.uri(), "gpubroker.v1.Device/0")
                .await
                .unwrap()
                == 2
        })
        .await
    );
    assert_eq!(
        health_check(&b.uri(), "gpubroker.v1.Device/1")
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        health_check(&b.uri(), "gpubroker.v1.Broker").await.unwrap(),
        1
    );
    let e = s.lease_request(2 * MIB).device(0).send().await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert_eq!(s.lease(2 * MIB).await.unwrap().device(), 1);
    // The monitor (running on the host backend too) does not clear an operator's mark.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(admin.get_devices().await.unwrap()[0].unhealthy);
    let out = ctl(&["mark-healthy", "0"]);
    assert!(out.status.success());
    assert_eq!(
        s.lease_request(2 * MIB)
            .device(0)
            .send()
            .await
            .unwrap()
            .device(),
        0
    );
    drop(l);
}
