//! Every error status the API promises, each for the reason it names, and a broker that
//! stays healthy after all of them.

use futures::StreamExt;
use gpu_broker_client::error::Reason;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{AdminClient, Client, ClientError, Code, QuotaSpec, SessionEvent};
use gpu_broker_tests::*;
use std::fmt::Debug;
use std::time::{Duration, Instant};

/// The error of `r`, which must have code `code`; returns its message.
fn err_of<T: Debug>(r: Result<T, ClientError>, code: Code, what: &str) -> String {
    match r {
        Ok(v) => panic!("{what}: expected {code:?}, got Ok({v:?})"),
        Err(e) => {
            assert_eq!(e.code(), code, "{what}: {e}");
            assert!(e.is_status(), "{what}: {e} should come from the broker");
            e.message()
        }
    }
}

/// The error of `r`, which must have code `code` and the broker's reason `reason`.
fn refusal_of<T: Debug>(
    r: Result<T, ClientError>,
    code: Code,
    reason: Reason,
    what: &str,
) -> ClientError {
    match r {
        Ok(v) => panic!("{what}: expected {code:?}, got Ok({v:?})"),
        Err(e) => {
            assert_eq!(e.code(), code, "{what}: {e}");
            assert_eq!(e.reason(), Some(&reason), "{what}: {e}");
            e
        }
    }
}

/// Same for a raw tonic call.
fn status_of<T: Debug>(r: Result<T, tonic::Status>, code: Code, what: &str) -> String {
    err_of(r.map_err(ClientError::from), code, what)
}

fn acquire(session: &str, bytes: u64) -> pb::AcquireLeaseRequest {
    pb::AcquireLeaseRequest {
        session_id: session.to_string(),
        bytes,
        ..Default::default()
    }
}

async fn assert_healthy(b: &Broker, c: &Client) {
    assert_eq!(health_check(&b.uri(), "").await.unwrap(), 1, "SERVING");
    assert_eq!(
        health_check(&b.uri(), "gpubroker.v1.Broker").await.unwrap(),
        1
    );
    let s = c.session("after").await.unwrap();
    let l = s.lease(2 * MIB).await.unwrap();
    l.map().unwrap()[0] = 1;
    l.release().await.unwrap();
    assert!(b.log_text().contains("serving"), "broker still logging");
    assert!(!b.log_text().contains("panicked"), "{}", b.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_argument_for_malformed_requests() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        ..Default::default()
    })
    .unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("bad-inputs").await.unwrap();
    let ia = Code::InvalidArgument;

    let m = err_of(s.lease(0).await, ia, "bytes 0");
    assert!(m.contains("bytes"), "{m}");
    let m = err_of(s.lease(u64::MAX).await, ia, "bytes u64::MAX");
    assert!(m.contains(&u64::MAX.to_string()), "{m}");
    err_of(s.lease(1 << 51).await, ia, "2 PiB");
    let m = err_of(
        s.lease_request(2 * MIB).device(1).send().await,
        ia,
        "device 1 of 1",
    );
    assert!(m.contains("device 1"), "{m}");
    err_of(
        s.lease_request(2 * MIB).device(u32::MAX).send().await,
        ia,
        "device u32::MAX",
    );
    err_of(
        s.lease_request(2 * MIB).label("x".repeat(300)).send().await,
        ia,
        "300-byte label",
    );
    err_of(
        s.lease_request(2 * MIB)
            .wait(Duration::from_secs(365 * 86_400))
            .send()
            .await,
        ia,
        "a year's wait",
    );
    err_of(
        c.session("n".repeat(300)).await,
        ia,
        "300-byte session name",
    );

    // Malformed ids, through raw proto calls.
    let mut raw = c.raw();
    for bad in [
        "",
        "not-a-uuid",
        "123",
        "ffffffff-ffff-ffff-ffff-fffffffffffz",
    ] {
        let m = status_of(
            raw.acquire_lease(acquire(bad, 2 * MIB)).await,
            ia,
            "bad session id",
        );
        assert!(m.contains("session_id"), "{m}");
        status_of(
            raw.release_lease(pb::ReleaseLeaseRequest {
                lease_id: bad.into(),
                ..Default::default()
            })
            .await,
            ia,
            "bad lease id",
        );
        status_of(
            raw.keepalive(pb::KeepaliveRequest {
                session_id: bad.into(),
            })
            .await,
            ia,
            "bad keepalive id",
        );
    }
    let mut req = acquire(&s.id(), 2 * MIB);
    req.fallback = 7;
    status_of(raw.acquire_lease(req).await, ia, "unknown fallback");

    // Admin side.
    let admin = b.admin().await.unwrap();
    for name in ["", "a b", "../etc", "t/x", &"n".repeat(65)] {
        err_of(
            admin.set_quota(name, QuotaSpec::new(MIB)).await,
            ia,
            "bad tenant name",
        );
    }
    err_of(
        admin
            .set_quota(
                "g",
                QuotaSpec {
                    limit_bytes: 4 * MIB,
                    guaranteed_bytes: 8 * MIB,
                    ..Default::default()
                },
            )
            .await,
        ia,
        "guarantee above limit",
    );
    err_of(
        admin
            .set_quota(
                "g",
                QuotaSpec {
                    limit_bytes: GIB,
                    guaranteed_bytes: 512 * MIB,
                    ..Default::default()
                },
            )
            .await,
        ia,
        "guarantee above capacity",
    );
    let mut raw_admin = admin.raw();
    status_of(
        raw_admin
            .set_quota(pb::SetQuotaRequest {
                tenant: "q".into(),
                quota: None,
                patch: None,
            })
            .await,
        ia,
        "no quota",
    );
    status_of(
        raw_admin
            .revoke_lease(pb::RevokeLeaseRequest {
                lease_id: "nope".into(),
                reason: String::new(),
            })
            .await,
        ia,
        "bad lease id (admin)",
    );
    status_of(
        raw_admin
            .revoke_token(pb::RevokeTokenRequest::default())
            .await,
        ia,
        "revoke nothing",
    );

    // Nothing leaked, and the broker still works.
    assert_eq!(s.usage().await.unwrap().usage.held_bytes, 0);
    assert!(admin
        .list_tenants()
        .await
        .unwrap()
        .iter()
        .all(|t| t.name == "alice"));
    assert_healthy(&b, &c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_without_a_valid_token() {
    let b = Broker::start().unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let ua = Code::Unauthenticated;

    // No authorization header at all.
    let channel = gpu_broker_client::connect::connect_channel(&b.uri())
        .await
        .unwrap();
    let mut bare = pb::broker_client::BrokerClient::new(channel.clone());
    status_of(bare.get_usage(pb::GetUsageRequest {}).await, ua, "no token");
    status_of(
        bare.open_session(pb::OpenSessionRequest {
            name: "x".into(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
        ua,
        "no token, open session",
    );
    let mut bare_admin = pb::admin_client::AdminClient::new(channel.clone());
    status_of(
        bare_admin
            .list_tenants(pb::ListTenantsRequest::default())
            .await,
        ua,
        "no token on admin",
    );

    // Malformed header.
    for value in ["Basic dXNlcjpwdw==", "Bearer", "token-without-scheme"] {
        let mut req = tonic::Request::new(pb::GetUsageRequest {});
        req.metadata_mut()
            .insert("authorization", value.parse().unwrap());
        status_of(bare.get_usage(req).await, ua, value);
    }

    // Unknown token.
    let stranger = Client::connect(&b.uri(), "gpb_0000000000000000")
        .await
        .unwrap();
    err_of(stranger.usage().await, ua, "unknown token");
    err_of(stranger.session("x").await, ua, "unknown token, session");
    let stranger_admin = AdminClient::connect(&b.uri(), "not-the-admin")
        .await
        .unwrap();
    err_of(
        stranger_admin.list_tenants().await,
        ua,
        "unknown admin token",
    );

    // Revoked token: works, then stops working (also for an already open session).
    let admin = b.admin().await.unwrap();
    let issued = admin.issue_token("alice", "short-lived").await.unwrap();
    let short = Client::connect(&b.uri(), issued.token.clone())
        .await
        .unwrap();
    let s = short.session("s").await.unwrap();
    assert_eq!(short.usage().await.unwrap().tenant, "alice");
    admin.revoke_token_id(&issued.token_id).await.unwrap();
    err_of(short.usage().await, ua, "revoked token");
    err_of(s.lease(2 * MIB).await, ua, "revoked token, open session");
    // Revoking it again: the token is gone.
    err_of(
        admin.revoke_token_id(&issued.token_id).await,
        Code::NotFound,
        "revoked twice",
    );

    assert_healthy(&b, &c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permission_denied_across_services() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let pd = Code::PermissionDenied;

    // A tenant token on the admin service.
    let tenant_admin = AdminClient::connect(&b.uri(), token.clone()).await.unwrap();
    err_of(
        tenant_admin.list_tenants().await,
        pd,
        "tenant lists tenants",
    );
    err_of(
        tenant_admin
            .set_quota("alice", QuotaSpec::new(2 * GIB))
            .await,
        pd,
        "tenant raises own quota",
    );
    err_of(
        tenant_admin.issue_token("alice", "").await,
        pd,
        "tenant issues a token",
    );
    err_of(tenant_admin.get_devices().await, pd, "tenant reads devices");

    // The admin token on the worker service.
    let admin_worker = Client::connect(&b.uri(), b.admin_token.clone())
        .await
        .unwrap();
    err_of(admin_worker.usage().await, pd, "admin GetUsage");
    err_of(admin_worker.session("x").await, pd, "admin OpenSession");
    err_of(admin_worker.list_leases().await, pd, "admin ListLeases");

    // The quota did not change.
    let q = b.admin().await.unwrap().get_quota("alice").await.unwrap();
    assert_eq!(q.quota.limit_bytes, GIB);
    let c = Client::connect(&b.uri(), token).await.unwrap();
    assert_healthy(&b, &c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_found_never_leaks_another_tenants_ids() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("a").await.unwrap();
    let sb = bob.session("b").await.unwrap();
    let la = sa.lease(4 * MIB).await.unwrap();
    let nf = Code::NotFound;

    // Unknown lease vs. another tenant's lease: same code, same message but for the id.
    let unknown = uuid::Uuid::new_v4().to_string();
    let m_unknown = err_of(bob.release_lease(&unknown).await, nf, "unknown lease");
    let m_foreign = err_of(bob.release_lease(la.id()).await, nf, "alice's lease");
    assert_eq!(
        m_unknown.replace(&unknown, "<id>"),
        m_foreign.replace(la.id(), "<id>"),
        "a foreign lease must look exactly like an unknown one"
    );
    assert!(!m_foreign.contains("alice"), "{m_foreign}");

    // Another tenant's session id.
    let unknown_session = uuid::Uuid::new_v4().to_string();
    let mut raw = bob.raw();
    let m_unknown = status_of(
        raw.acquire_lease(acquire(&unknown_session, 2 * MIB)).await,
        nf,
        "unknown session",
    );
    let m_foreign = status_of(
        raw.acquire_lease(acquire(&sa.id(), 2 * MIB)).await,
        nf,
        "alice's session",
    );
    assert_eq!(
        m_unknown.replace(&unknown_session, "<id>"),
        m_foreign.replace(&sa.id(), "<id>")
    );
    status_of(
        raw.keepalive(pb::KeepaliveRequest {
            session_id: sa.id(),
        })
        .await,
        nf,
        "keepalive of alice's session",
    );

    // Admin: unknown tenant, token, lease.
    let admin = b.admin().await.unwrap();
    err_of(admin.get_quota("carol").await, nf, "unknown tenant");
    err_of(
        admin.delete_tenant("carol").await,
        nf,
        "delete unknown tenant",
    );
    err_of(
        admin.issue_token("carol", "").await,
        nf,
        "token for unknown tenant",
    );
    err_of(admin.revoke_token("gpb_nope").await, nf, "unknown token");
    err_of(
        admin.revoke_lease(&unknown, "x").await,
        nf,
        "revoke unknown lease",
    );

    // Nothing happened to alice's lease, and bob holds nothing.
    assert_eq!(sa.usage().await.unwrap().usage.held_bytes, 4 * MIB);
    assert_eq!(sb.usage().await.unwrap().usage.held_bytes, 0);
    let released = la.id().to_string();
    la.release().await.unwrap();
    // A released lease is unknown now, also to its former holder.
    let m = refusal_of(
        alice.release_lease(&released).await,
        nf,
        Reason::LeaseNotFound,
        "released lease",
    )
    .message();
    assert!(m.contains("not found"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_exhausted_names_the_numbers() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let c = b.client("alice", 8 * MIB).await.unwrap();
    let s = c.session("a").await.unwrap();
    let re = Code::ResourceExhausted;

    // Larger than the whole quota.
    let e = refusal_of(
        s.lease(10 * MIB).await,
        re,
        Reason::QuotaExceeded,
        "over quota",
    );
    assert_eq!(e.detail("requested_bytes"), Some("10485760"));
    assert_eq!(e.detail("limit_bytes"), Some("8388608"));
    assert_eq!(e.detail("tenant"), Some("alice"));
    let m = e.message();
    assert!(m.contains("10485760"), "names the request: {m}");
    assert!(m.contains("8388608"), "names the limit: {m}");
    assert!(m.contains("alice"), "{m}");

    // Fits the quota alone, not on top of what the tenant holds.
    let held = s.lease(6 * MIB).await.unwrap();
    let e = refusal_of(
        s.lease(4 * MIB).await,
        re,
        Reason::QuotaExceeded,
        "over quota with holdings",
    );
    assert_eq!(e.detail("held_bytes"), Some("6291456"));
    let m = e.message();
    assert!(m.contains("4194304"), "names the request: {m}");
    assert!(m.contains("6291456"), "names the holdings: {m}");
    assert!(m.contains("8388608"), "names the limit: {m}");
    // A rounded request is charged its rounded size: 2 MiB + 1 byte is 4 MiB.
    err_of(s.lease(2 * MIB + 1).await, re, "rounded over quota");
    let fits = s.lease(2 * MIB).await.unwrap();
    assert_eq!(s.usage().await.unwrap().usage.held_bytes, 8 * MIB);
    drop((held, fits));

    // Over capacity, no wait: bob fills the device, alice2 asks for more.
    let bob = b.client("bob", GIB).await.unwrap();
    let sb = bob.session("b").await.unwrap();
    let e = refusal_of(
        sb.lease(128 * MIB).await,
        re,
        Reason::RequestTooLarge,
        "bigger than the device",
    );
    assert_eq!(e.detail("leasable_bytes"), Some("67108864"));
    let m = e.message();
    assert!(m.contains("134217728"), "names the request: {m}");
    assert!(m.contains("67108864"), "names the capacity: {m}");
    let big = sb.lease(48 * MIB).await.unwrap();
    let carol = b.client("carol", GIB).await.unwrap();
    let sc = carol.session("c").await.unwrap();
    eventually(Duration::from_secs(5), || async {
        c.usage()
            .await
            .map(|u| u.usage.held_bytes == 0)
            .unwrap_or(false)
    })
    .await;
    let e = refusal_of(
        sc.lease(32 * MIB).await,
        re,
        Reason::CapacityExhausted,
        "over capacity",
    );
    assert_eq!(e.detail("free_bytes"), Some("16777216"));
    let m = e.message();
    assert!(m.contains("33554432"), "names the request: {m}");
    assert!(m.contains("16777216"), "names what is free: {m}");
    assert!(m.contains("67108864"), "names the leasable capacity: {m}");
    // What fits is still granted.
    let rest = sc.lease(16 * MIB).await.unwrap();
    err_of(sc.lease(2 * MIB).await, re, "device full");
    drop((big, rest));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_exceeded_after_a_lost_wait() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("a").await.unwrap();
    let _all = s.lease(64 * MIB).await.unwrap();
    let t0 = Instant::now();
    let e = refusal_of(
        s.lease_request(8 * MIB)
            .wait(Duration::from_millis(300))
            .send()
            .await,
        Code::DeadlineExceeded,
        Reason::WaitExpired,
        "lost wait",
    );
    assert_eq!(e.detail("cause"), Some("CAPACITY_EXHAUSTED"), "{e}");
    assert_eq!(e.detail("waited_ms"), Some("300"));
    assert_eq!(e.detail("requested_bytes"), Some("8388608"));
    let m = e.message();
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(300), "waited {waited:?}");
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
    assert!(m.contains("300 ms"), "names the wait: {m}");
    assert!(m.contains("8388608"), "names the request: {m}");
    assert!(m.contains("67108864"), "names the holdings / capacity: {m}");
    // The lost request left the queue.
    let d = &devices(&b).await.unwrap()[0];
    assert_eq!(d.waiting_requests, 0);
    assert_eq!(s.usage().await.unwrap().usage.waiting_requests, 0);
    // A quota that can never fit fails at once even with a wait.
    let small = b.client("small", 4 * MIB).await.unwrap();
    let ss = small.session("s").await.unwrap();
    let t0 = Instant::now();
    err_of(
        ss.lease_request(8 * MIB)
            .wait(Duration::from_secs(5))
            .send()
            .await,
        Code::ResourceExhausted,
        "never fits",
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_precondition_deleting_a_tenant_that_holds_leases() {
    let b = Broker::start().unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("a").await.unwrap();
    let l = s.lease(4 * MIB).await.unwrap();
    let admin = b.admin().await.unwrap();
    let m = err_of(
        admin.delete_tenant("alice").await,
        Code::FailedPrecondition,
        "delete while holding",
    );
    assert!(m.contains("alice"), "{m}");
    // Refused means unchanged.
    assert_eq!(s.usage().await.unwrap().usage.held_bytes, 4 * MIB);
    assert_eq!(
        admin.get_quota("alice").await.unwrap().quota.limit_bytes,
        GIB
    );
    l.release().await.unwrap();
    admin.delete_tenant("alice").await.unwrap();
    err_of(admin.get_quota("alice").await, Code::NotFound, "deleted");
    err_of(
        c.usage().await,
        Code::Unauthenticated,
        "token of a deleted tenant",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_while_shutting_down() {
    // A grace long enough for every check below on a loaded machine.
    let mut b = Broker::start_with(BrokerOpts {
        extra: vec!["--shutdown-grace".into(), "5s".into()],
        ..Default::default()
    })
    .unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("a").await.unwrap();
    let mut events = s.events();
    let held = s.lease(4 * MIB).await.unwrap();
    // The device is full, and someone waits in the queue for memory.
    let bob = b.client("bob", GIB).await.unwrap();
    let sb = bob.session("filler").await.unwrap();
    let _fill = sb.lease(GIB - 4 * MIB).await.unwrap();
    let carol = b.client("carol", GIB).await.unwrap();
    let sc = carol.session("waiter").await.unwrap();
    let waiter = {
        let sc = sc.clone();
        tokio::spawn(async move {
            sc.lease_request(8 * MIB)
                .wait(Duration::from_secs(30))
                .send()
                .await
        })
    };
    let waiter_queued = eventually(Duration::from_secs(5), || async {
        devices(&b).await.unwrap()[0].waiting_requests == 1
    })
    .await;
    b.signal(libc::SIGTERM);
    let ev = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("an event within 5 s");
    assert!(
        matches!(ev, Some(SessionEvent::ShuttingDown { .. })),
        "{ev:?}"
    );
    // Health checks say so (new connections are still accepted during the grace).
    assert_eq!(
        health_check(&b.uri(), "gpubroker.v1.Broker").await.unwrap(),
        2,
        "NOT_SERVING while draining"
    );
    // The waiter is told at once.
    let r = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter is answered")
        .unwrap();
    assert!(waiter_queued);
    err_of(r, Code::Unavailable, "waiting while the broker stops");
    // During the grace period: new work is refused as UNAVAILABLE.
    let m = refusal_of(
        s.lease(2 * MIB).await,
        Code::Unavailable,
        Reason::ShuttingDown,
        "acquire while draining",
    )
    .message();
    assert!(m.contains("shutting down"), "{m}");
    err_of(
        c.session("late").await,
        Code::Unavailable,
        "open session while draining",
    );
    // Holding on past the grace does not stop the broker from exiting cleanly.
    let status = tokio::task::block_in_place(|| b.stop(Duration::from_secs(30))).unwrap();
    assert!(status.success(), "{status}");
    assert!(b.memfds().is_empty(), "{:?}", b.memfds());
    let err = held.release().await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_leases_refusal_names_the_lease_limit() {
    let b = Broker::start().unwrap();
    let token = b
        .tenant(
            "counted",
            QuotaSpec {
                limit_bytes: GIB,
                max_leases: 1,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("s").await.unwrap();
    let _one = s.lease(2 * MIB).await.unwrap();
    let e = refusal_of(
        s.lease(2 * MIB).await,
        Code::ResourceExhausted,
        Reason::LeaseCountLimit,
        "second lease",
    );
    assert_eq!(
        (e.detail("lease_count"), e.detail("max_leases")),
        (Some("1"), Some("1"))
    );
    let m = e.message();
    // Quota bytes and device memory are plentiful: the message must say why it failed.
    assert!(
        m.contains("lease count") || m.contains("max_leases") || m.contains("leases"),
        "the refusal does not name the lease-count limit: {m}"
    );
    assert!(m.contains("1 of 1") || m.contains("limit 1"), "{m}");
}

/// Refusals a client can act on that were once plain messages under their code name
/// their reason, with what they are about: a device index past the last, a wait past
/// `--max-wait`, a publish naming too many readers, a host-fallback lease published,
/// and a host-tier lease of a broker with no host tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_a_client_can_act_on_name_their_reason() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let token = b
        .tenant(
            "alice",
            QuotaSpec {
                host_limit_bytes: 16 * MIB,
                ..QuotaSpec::new(GIB)
            },
        )
        .await
        .unwrap();
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("a").await.unwrap();
    let ia = Code::InvalidArgument;
    let e = refusal_of(
        s.lease_request(MIB).device(7).send().await,
        ia,
        Reason::UnknownDevice,
        "device 7 of 1",
    );
    assert_eq!(e.detail("device"), Some("7"), "{e}");
    assert_eq!(e.detail("device_count"), Some("1"), "{e}");
    let e = refusal_of(
        s.lease_request(MIB)
            .wait(Duration::from_secs(2 * 3600))
            .send()
            .await,
        ia,
        Reason::WaitTooLong,
        "a two-hour wait",
    );
    assert_eq!(e.detail("wait_ms"), Some("7200000"), "{e}");
    assert_eq!(e.detail("max_wait_ms"), Some("3600000"), "{e}");
    let lease = s.lease(2 * MIB).await.unwrap();
    let readers: Vec<String> = (0..257).map(|i| format!("t{i}")).collect();
    let readers: Vec<&str> = readers.iter().map(String::as_str).collect();
    let e = refusal_of(
        lease.publish("w", &readers).await,
        ia,
        Reason::TooManyReaders,
        "257 readers",
    );
    assert_eq!(e.detail("readers"), Some("257"), "{e}");
    assert_eq!(e.detail("max_readers"), Some("256"), "{e}");
    let host = s
        .lease_request(2 * MIB)
        .host_tier(true)
        .send()
        .await
        .unwrap();
    let e = refusal_of(
        host.publish("h", &[]).await,
        Code::FailedPrecondition,
        Reason::HostLeaseNotShareable,
        "a host-fallback lease published",
    );
    assert_eq!(e.detail("lease_id"), Some(host.id()), "{e}");
    drop((lease, host));

    let bare = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        extra: vec!["--host-fallback-capacity".into(), "0".into()],
        ..Default::default()
    })
    .unwrap();
    let c = bare.client("bob", GIB).await.unwrap();
    let s = c.session("b").await.unwrap();
    refusal_of(
        s.lease_request(MIB).host_tier(true).send().await,
        Code::FailedPrecondition,
        Reason::NoHostTier,
        "no host tier",
    );
    assert_healthy(&bare, &c).await;
}
