//! SIGTERM with live sessions and leases: sessions are told, every shared-memory file is
//! removed, and the broker exits 0 within a few seconds.

use futures::StreamExt;
use gpu_broker_client::QuotaSpec;
use gpu_broker_client::SessionEvent;
use gpu_broker_tests::*;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_live_leases_leaves_no_shm_files() {
    let mut b = Broker::start_with(BrokerOpts {
        devices: 2,
        capacity: "256MiB",
        ..Default::default()
    })
    .unwrap();
    let ta = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();

    // A worker process holding two leases, in-process sessions holding more, a cached
    // block, and a revoked (quarantined) one.
    let mut w = hold(
        &b,
        &ta,
        &["--bytes", "4MiB", "--count", "2", "--pattern", "1"],
    )
    .await
    .unwrap();
    let s1 = bob.session("s1").await.unwrap();
    let s2 = bob.session("s2").await.unwrap();
    let mut ev1 = s1.events();
    let mut ev2 = s2.events();
    let _l1 = s1.lease(8 * MIB).await.unwrap();
    let _l2 = s2.lease_request(2 * MIB).device(1).send().await.unwrap();
    let cached = s2.lease(6 * MIB).await.unwrap();
    cached.release().await.unwrap();
    let revoked = s1.lease(2 * MIB).await.unwrap();
    b.admin()
        .await
        .unwrap()
        .revoke_lease(revoked.id(), "test")
        .await
        .unwrap();
    revoked.detach();
    let d = devices(&b).await.unwrap();
    assert!(
        d.iter().map(|d| d.quarantined_bytes).sum::<u64>() > 0,
        "{d:?}"
    );
    assert!(d.iter().map(|d| d.cached_bytes).sum::<u64>() > 0, "{d:?}");
    assert_eq!(b.memfds().len(), 6, "{:?}", b.memfds());

    let t0 = Instant::now();
    b.signal(libc::SIGTERM);
    for ev in [&mut ev1, &mut ev2] {
        loop {
            let e = tokio::time::timeout(Duration::from_secs(5), ev.next())
                .await
                .expect("ShuttingDown within 5 s");
            match e {
                Some(SessionEvent::ShuttingDown { grace, .. }) => {
                    assert_eq!(grace, Duration::from_secs(1));
                    break;
                }
                Some(SessionEvent::LeaseRevoked { .. }) => continue,
                other => panic!("expected ShuttingDown, got {other:?}"),
            }
        }
    }
    w.proc
        .line_starting("EVENT shutting_down 1000", Duration::from_secs(5))
        .await
        .unwrap();
    // The broker ends the sessions after the grace period; the streams end.
    for ev in [&mut ev1, &mut ev2] {
        let e = tokio::time::timeout(Duration::from_secs(5), ev.next())
            .await
            .expect("Closed within 5 s");
        assert!(matches!(e, Some(SessionEvent::Closed { .. })), "{e:?}");
    }
    let status = tokio::task::block_in_place(|| b.stop(Duration::from_secs(10))).unwrap();
    let took = t0.elapsed();
    assert!(status.success(), "{status}\n{}", b.log_text());
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
    println!("shutdown took {took:?}");
    assert!(b.memfds().is_empty(), "left behind: {:?}", b.memfds());
    assert!(!b.socket.exists(), "socket file removed");
    w.proc
        .line_starting("EVENT closed", Duration::from_secs(5))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_on_an_idle_broker_exits_quickly_and_state_survives_a_restart() {
    let mut b = Broker::start().unwrap();
    let admin = b.admin().await.unwrap();
    admin.set_quota("keep", QuotaSpec::new(GIB)).await.unwrap();
    admin
        .set_quota("keep", QuotaSpec::new(3 * GIB))
        .await
        .unwrap();
    let token = admin.issue_token("keep", "restart").await.unwrap().token;
    let revoked = admin.issue_token("keep", "revoked").await.unwrap().token;
    admin.revoke_token(&revoked).await.unwrap();
    admin.set_quota("gone", QuotaSpec::new(GIB)).await.unwrap();
    let gone_token = admin.issue_token("gone", "").await.unwrap().token;
    admin.delete_tenant("gone").await.unwrap();
    drop(admin);
    let t0 = Instant::now();
    b.signal(libc::SIGINT);
    let status = tokio::task::block_in_place(|| b.stop(Duration::from_secs(10))).unwrap();
    assert!(status.success(), "{status}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(b.memfds().is_empty());

    // Same state directory: tenants, quotas and tokens survive a restart.
    tokio::task::block_in_place(|| b.spawn()).unwrap();
    let admin = b.admin().await.unwrap();
    let q = admin.get_quota("keep").await.unwrap();
    assert_eq!(q.quota.limit_bytes, 3 * GIB, "the last quota set");
    assert_eq!(q.token_count, 1);
    let names = tenant_names(&admin).await;
    assert_eq!(names, ["keep"], "a deleted tenant stays deleted");
    // A revoked token, or one of a deleted tenant, stays dead across the restart, even
    // when the tenant's name is used again.
    admin.set_quota("gone", QuotaSpec::new(GIB)).await.unwrap();
    for dead in [&revoked, &gone_token] {
        let c = gpu_broker_client::Client::connect(&b.uri(), dead.clone())
            .await
            .unwrap();
        assert_eq!(
            c.usage().await.unwrap_err().code(),
            gpu_broker_client::Code::Unauthenticated
        );
    }
    let c = gpu_broker_client::Client::connect(&b.uri(), token)
        .await
        .unwrap();
    let s = c.session("again").await.unwrap();
    s.lease(2 * MIB).await.unwrap().release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_socket_is_replaced_and_a_live_one_is_refused() {
    let mut b = Broker::start().unwrap();
    // A second broker on the same socket while the first serves: refused, and the first
    // keeps serving.
    let second_state = b.dir.path().join("second-state");
    let out = tokio::process::Command::new(bin("gpu-broker"))
        .args(["--backend", "host", "--host-capacity", "64MiB"])
        .arg("--socket")
        .arg(&b.socket)
        .arg("--state-dir")
        .arg(&second_state)
        .arg("--host-shm-dir")
        .arg(b.shm_dir.join("second"))
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(10), out)
        .await
        .expect("the second broker gives up")
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already serving"), "{err}");
    let c = b.client("alice", GIB).await.unwrap();
    assert_eq!(c.usage().await.unwrap().tenant, "alice");

    // SIGKILL leaves the socket file behind; a restart replaces it.
    tokio::task::block_in_place(|| b.kill()).unwrap();
    assert!(
        b.socket.exists(),
        "a killed broker cannot remove its socket"
    );
    tokio::task::block_in_place(|| b.spawn()).unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("after-restart").await.unwrap();
    s.lease(2 * MIB).await.unwrap().release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_token_and_ticket_socket_modes_and_no_memory_files() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let b = Broker::start().unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert!(std::fs::metadata(&b.socket)
        .unwrap()
        .file_type()
        .is_socket());
    assert_eq!(mode(&b.socket), 0o660, "socket");
    assert_eq!(mode(&b.state_dir.join("admin.token")), 0o600, "admin token");
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let l = s.lease(2 * MIB).await.unwrap();
    // Lease memory has no path at all: a memfd in the broker, nothing in the shm dir.
    let objects = b.memfds();
    assert_eq!(objects.len(), 1);
    assert!(b.shm_dir_files().is_empty(), "{:?}", b.shm_dir_files());
    // The ticket socket is open to every local process (a ticket is what grants access).
    let tickets = b.socket.with_file_name("broker.tickets.sock");
    assert!(std::fs::metadata(&tickets).unwrap().file_type().is_socket());
    assert_eq!(mode(&tickets), 0o666, "ticket socket");
    l.release().await.unwrap();
}
