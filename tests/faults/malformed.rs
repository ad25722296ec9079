//! Malformed input: garbage protobufs, absurd sizes and waits, unknown and foreign ids,
//! oversized strings, bad tokens. Each gets a precise status, and the broker stays up and
//! keeps serving.

use super::*;
use gpu_broker_client::proto::v1 as pb;
use tonic::Status;

const ACQUIRE: &str = "/gpubroker.v1.Broker/AcquireLease";
const RELEASE: &str = "/gpubroker.v1.Broker/ReleaseLease";
const OPEN: &str = "/gpubroker.v1.Broker/OpenSession";
const SET_QUOTA: &str = "/gpubroker.v1.Admin/SetQuota";

/// Bodies that are not valid protobuf (or not valid for these messages).
fn garbage_bodies() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("all 0xff", vec![0xff; 64]),
        ("truncated varint", vec![0x10, 0xff, 0xff, 0xff]),
        ("length past the end", vec![0x0a, 0x7f, b'a', b'b']),
        ("invalid utf-8 in a string", vec![0x0a, 0x02, 0xc3, 0x28]),
        ("wrong wire type for a string", vec![0x0d, 1, 2, 3, 4]),
        ("field number 0", vec![0x00, 0x01]),
        ("group end without start", vec![0x0c]),
        ("varint of 11 bytes", {
            let mut v = vec![0x10];
            v.extend([0xff; 10]);
            v.push(0x01);
            v
        }),
    ]
}

fn is_decode_error(s: &Status) -> bool {
    matches!(s.code(), Code::InvalidArgument | Code::Internal)
}

#[tokio::test]
async fn malformed_requests_get_precise_statuses_and_the_broker_survives() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let alice = b.tenant("alice", QuotaSpec::new(128 * MIB)).await.unwrap();
    let bob = b.tenant("bob", QuotaSpec::new(128 * MIB)).await.unwrap();
    let channel = gpu_broker_client::connect::connect_channel(&b.uri())
        .await
        .unwrap();
    let mut seen = Vec::new();

    // 1. Garbage protobufs on every kind of method.
    for (what, body) in garbage_bodies() {
        for (path, token) in [
            (ACQUIRE, alice.as_str()),
            (RELEASE, alice.as_str()),
            (SET_QUOTA, b.admin_token.as_str()),
        ] {
            let r = raw::unary(&channel, Some(token), path, body.clone()).await;
            let s = r.expect_err(&format!("{what} on {path} must fail"));
            assert!(is_decode_error(&s), "{what} on {path}: {s:?}");
            seen.push(format!("{what}@{path}: {:?}", s.code()));
        }
        let r = raw::first_of_stream(&channel, Some(&alice), OPEN, body.clone()).await;
        let s = r.expect_err(&format!("{what} on OpenSession must fail"));
        assert!(is_decode_error(&s), "{what} on OpenSession: {s:?}");
    }
    // A burst of garbage in parallel.
    let mut burst = tokio::task::JoinSet::new();
    for i in 0..64u8 {
        let ch = channel.clone();
        let tok = alice.clone();
        burst.spawn(
            async move { raw::unary(&ch, Some(&tok), ACQUIRE, vec![0xff, i, 0xff, i]).await },
        );
    }
    while let Some(r) = burst.join_next().await {
        assert!(r.unwrap().is_err());
    }
    assert_broker_alive(&b);

    // An empty body is a valid empty message: no session id.
    let s = raw::unary(&channel, Some(&alice), ACQUIRE, vec![])
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");

    // 2. Bad tokens.
    let s = raw::unary(&channel, None, ACQUIRE, vec![])
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unauthenticated, "no token: {s:?}");
    let s = raw::unary(&channel, Some("gpb_nope"), ACQUIRE, vec![])
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unauthenticated, "unknown token: {s:?}");
    let s = raw::unary(&channel, Some(&alice), SET_QUOTA, vec![])
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::PermissionDenied, "tenant on admin: {s:?}");

    // 3. Well-formed requests with bad values.
    let mut a = raw::broker(&b.uri(), &alice).await;
    let mut bo = raw::broker(&b.uri(), &bob).await;
    let (sa, _stream_a) = raw::open_session(&mut a, "alice").await;
    let (sb, _stream_b) = raw::open_session(&mut bo, "bob").await;
    let acq = |session: &str, bytes: u64| pb::AcquireLeaseRequest {
        session_id: session.to_string(),
        bytes,
        ..Default::default()
    };
    let cases: Vec<(&str, pb::AcquireLeaseRequest, Code)> = vec![
        ("zero bytes", acq(&sa, 0), Code::InvalidArgument),
        ("u64::MAX bytes", acq(&sa, u64::MAX), Code::InvalidArgument),
        (
            "1<<50 + 1 bytes",
            acq(&sa, (1 << 50) + 1),
            Code::InvalidArgument,
        ),
        (
            "1<<50 bytes (over quota)",
            acq(&sa, 1 << 50),
            Code::ResourceExhausted,
        ),
        (
            "u64::MAX - 1 bytes",
            acq(&sa, u64::MAX - 1),
            Code::InvalidArgument,
        ),
        (
            "malformed session id",
            acq("not-a-uuid", MIB),
            Code::InvalidArgument,
        ),
        (
            "unknown session id",
            acq(&uuid::Uuid::new_v4().to_string(), MIB),
            Code::NotFound,
        ),
        ("another tenant's session", acq(&sb, MIB), Code::NotFound),
        (
            "unknown device",
            pb::AcquireLeaseRequest {
                device: Some(7),
                ..acq(&sa, MIB)
            },
            Code::InvalidArgument,
        ),
        (
            "wait u64::MAX ms",
            pb::AcquireLeaseRequest {
                wait_ms: Some(u64::MAX),
                ..acq(&sa, MIB)
            },
            Code::InvalidArgument,
        ),
        (
            "wait 10 days",
            pb::AcquireLeaseRequest {
                wait_ms: Some(10 * 24 * 3600 * 1000),
                ..acq(&sa, MIB)
            },
            Code::InvalidArgument,
        ),
        (
            "label of 1 MB",
            pb::AcquireLeaseRequest {
                label: "x".repeat(1 << 20),
                ..acq(&sa, MIB)
            },
            Code::InvalidArgument,
        ),
        (
            "unknown fallback",
            pb::AcquireLeaseRequest {
                fallback: 42,
                ..acq(&sa, MIB)
            },
            Code::InvalidArgument,
        ),
    ];
    for (what, req, want) in cases {
        let t0 = Instant::now();
        let r = a.acquire_lease(req).await;
        let s = r.expect_err(what);
        assert_eq!(s.code(), want, "{what}: {s:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{what}: refused only after {:?}",
            t0.elapsed()
        );
        seen.push(format!("{what}: {:?}", s.code()));
    }
    // A label beyond the transport's message limit (4 MiB): refused, no crash.
    let r = a
        .acquire_lease(pb::AcquireLeaseRequest {
            label: "y".repeat(5 << 20),
            ..acq(&sa, MIB)
        })
        .await;
    let s = r.expect_err("5 MB label");
    assert_ne!(s.code(), Code::Ok);
    seen.push(format!("label of 5 MB: {:?}", s.code()));

    // Releases and keepalives with unknown, malformed and foreign ids.
    let mine = a
        .acquire_lease(acq(&sa, 3 * MIB))
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap();
    assert_eq!(mine.bytes, 4 * MIB);
    for (what, id, want) in [
        (
            "unknown lease",
            uuid::Uuid::new_v4().to_string(),
            Code::NotFound,
        ),
        (
            "malformed lease id",
            "../../etc/passwd".to_string(),
            Code::InvalidArgument,
        ),
        ("empty lease id", String::new(), Code::InvalidArgument),
    ] {
        let s = a
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: id,
                ..Default::default()
            })
            .await
            .expect_err(what);
        assert_eq!(s.code(), want, "{what}: {s:?}");
    }
    let s = bo
        .release_lease(pb::ReleaseLeaseRequest {
            lease_id: mine.lease_id.clone(),
            ..Default::default()
        })
        .await
        .expect_err("another tenant's lease");
    assert_eq!(s.code(), Code::NotFound, "foreign release: {s:?}");
    let s = bo
        .keepalive(pb::KeepaliveRequest {
            session_id: sa.clone(),
        })
        .await
        .expect_err("another tenant's session");
    assert_eq!(s.code(), Code::NotFound, "foreign keepalive: {s:?}");
    let s = a
        .keepalive(pb::KeepaliveRequest {
            session_id: "zzz".into(),
        })
        .await
        .expect_err("malformed session");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");

    // OpenSession with a 10 KB name.
    let r = a
        .open_session(pb::OpenSessionRequest {
            name: "n".repeat(10 * 1024),
            ..Default::default()
        })
        .await;
    let s = match r {
        Err(s) => s,
        Ok(resp) => resp
            .into_inner()
            .message()
            .await
            .expect_err("10 KB session name"),
    };
    assert_eq!(s.code(), Code::InvalidArgument, "10 KB name: {s:?}");

    // Admin: bad quotas and ids.
    let mut ad = admin.raw();
    for (what, req, want) in [
        (
            "no quota",
            pb::SetQuotaRequest {
                tenant: "x".into(),
                quota: None,
                patch: None,
            },
            Code::InvalidArgument,
        ),
        (
            "both a quota and a patch",
            pb::SetQuotaRequest {
                tenant: "x".into(),
                quota: Some(pb::Quota::default()),
                patch: Some(pb::QuotaPatch {
                    limit_bytes: Some(MIB),
                    ..Default::default()
                }),
            },
            Code::InvalidArgument,
        ),
        (
            "an empty patch",
            pb::SetQuotaRequest {
                tenant: "x".into(),
                quota: None,
                patch: Some(pb::QuotaPatch::default()),
            },
            Code::InvalidArgument,
        ),
        (
            "a patch creating a tenant without a limit",
            pb::SetQuotaRequest {
                tenant: "new-one".into(),
                quota: None,
                patch: Some(pb::QuotaPatch {
                    priority: Some(3),
                    ..Default::default()
                }),
            },
            Code::InvalidArgument,
        ),
        (
            "bad tenant name",
            pb::SetQuotaRequest {
                tenant: "a b/../c".into(),
                quota: Some(pb::Quota::default()),
                patch: None,
            },
            Code::InvalidArgument,
        ),
        (
            "tenant name of 10 KB",
            pb::SetQuotaRequest {
                tenant: "t".repeat(10 * 1024),
                quota: Some(pb::Quota::default()),
                patch: None,
            },
            Code::InvalidArgument,
        ),
        (
            "guarantee above limit",
            pb::SetQuotaRequest {
                tenant: "x".into(),
                quota: Some(pb::Quota {
                    limit_bytes: MIB,
                    guaranteed_bytes: 2 * MIB,
                    ..Default::default()
                }),
                patch: None,
            },
            Code::InvalidArgument,
        ),
        (
            "guarantee of u64::MAX",
            pb::SetQuotaRequest {
                tenant: "x".into(),
                quota: Some(pb::Quota {
                    limit_bytes: u64::MAX,
                    guaranteed_bytes: u64::MAX,
                    ..Default::default()
                }),
                patch: None,
            },
            Code::InvalidArgument,
        ),
    ] {
        let s = ad.set_quota(req).await.expect_err(what);
        assert_eq!(s.code(), want, "{what}: {s:?}");
    }
    let s = ad
        .revoke_lease(pb::RevokeLeaseRequest {
            lease_id: "nope".into(),
            reason: String::new(),
        })
        .await
        .expect_err("malformed lease id");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    let s = ad
        .revoke_lease(pb::RevokeLeaseRequest {
            lease_id: uuid::Uuid::new_v4().to_string(),
            reason: String::new(),
        })
        .await
        .expect_err("unknown lease");
    assert_eq!(s.code(), Code::NotFound, "{s:?}");
    let s = ad
        .revoke_token(pb::RevokeTokenRequest::default())
        .await
        .expect_err("empty token id");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    let s = ad
        .delete_tenant(pb::DeleteTenantRequest {
            tenant: "nobody".into(),
        })
        .await
        .expect_err("unknown tenant");
    assert_eq!(s.code(), Code::NotFound, "{s:?}");
    let s = ad
        .issue_token(pb::IssueTokenRequest {
            tenant: "alice".into(),
            description: "d".repeat(1 << 20),
            ..Default::default()
        })
        .await
        .expect_err("1 MB description");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    for (what, req) in [
        (
            "unknown scope",
            pb::IssueTokenRequest {
                tenant: "alice".into(),
                scope: 99,
                ..Default::default()
            },
        ),
        (
            "zero ttl",
            pb::IssueTokenRequest {
                tenant: "alice".into(),
                ttl_ms: Some(0),
                ..Default::default()
            },
        ),
        (
            "absurd ttl",
            pb::IssueTokenRequest {
                tenant: "alice".into(),
                ttl_ms: Some(u64::MAX),
                ..Default::default()
            },
        ),
        (
            "control characters in the name",
            pb::IssueTokenRequest {
                tenant: "alice".into(),
                name: "a\u{1b}[2J".into(),
                ..Default::default()
            },
        ),
    ] {
        let s = ad.issue_token(req).await.expect_err(what);
        assert_eq!(s.code(), Code::InvalidArgument, "{what}: {s:?}");
    }
    let s = ad
        .rotate_admin_token(pb::RotateAdminTokenRequest { grace_ms: u64::MAX })
        .await
        .expect_err("absurd grace");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");

    // After all of it: nothing leaked, a normal lease works, the broker is alive.
    let t = tenant(&admin, "alice").await;
    assert_eq!(t.usage.held_bytes, 4 * MIB, "{:?}", t.usage);
    assert_eq!(t.usage.lease_count, 1);
    assert_eq!(t.usage.waiting_requests, 0);
    a.release_lease(pb::ReleaseLeaseRequest {
        lease_id: mine.lease_id,
        ..Default::default()
    })
    .await
    .unwrap();
    let fresh = a
        .acquire_lease(pb::AcquireLeaseRequest {
            wait_ms: Some(1000),
            ..acq(&sa, 128 * MIB)
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap();
    assert_eq!(fresh.bytes, 128 * MIB);
    a.release_lease(pb::ReleaseLeaseRequest {
        lease_id: fresh.lease_id,
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(tenant(&admin, "bob").await.usage.held_bytes, 0);
    assert_broker_alive(&b);
    eprintln!("malformed: {}", seen.join("; "));
}

/// A guarantee of u64::MAX next to another tenant's guarantee: the sum of guarantees must
/// not overflow (debug build: a panic in the request; release: a wrapped sum that lets an
/// absurd guarantee through). Expected: INVALID_ARGUMENT, and the broker keeps serving.
#[tokio::test]
async fn absurd_guarantee_is_refused_without_overflow() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    admin
        .set_quota("small", quota(64 * MIB, 2 * MIB, 0))
        .await
        .unwrap();
    let r = admin.set_quota("huge", quota(u64::MAX, u64::MAX, 0)).await;
    let panics: Vec<String> = b
        .log_text()
        .lines()
        .filter(|l| l.contains("panicked"))
        .map(str::to_string)
        .collect();
    assert!(panics.is_empty(), "the broker panicked: {panics:?}");
    assert_eq!(code_of(&r), Some(Code::InvalidArgument), "{r:?}");
    assert_broker_alive(&b);
    let c = gpu_broker_client::Client::connect(
        &b.uri(),
        admin.issue_token("small", "t").await.unwrap().token,
    )
    .await
    .unwrap();
    let s = c.session("after").await.unwrap();
    s.lease(2 * MIB).await.unwrap().release().await.unwrap();
    assert_broker_alive(&b);
}
