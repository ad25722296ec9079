//! The admin service: quotas, tenants, tokens, leases, sessions, devices.

use futures::StreamExt;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::QuotaSpec;
use gpu_broker_client::{Client, Code, SessionEvent};
use gpu_broker_tests::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_tenants_and_tokens() {
    let b = Broker::start().unwrap();
    let admin = b.admin().await.unwrap();
    let mut raw = admin.raw();

    // SetQuota creates, then updates.
    let q = |limit| pb::SetQuotaRequest {
        tenant: "team-a".into(),
        quota: Some(pb::Quota {
            limit_bytes: limit,
            max_leases: 3,
            priority: 2,
            guaranteed_bytes: 0,
            host_limit_bytes: 0,
            turn_weight: 0,
            device_limit_bytes: Default::default(),
        }),
        patch: None,
    };
    let r = raw.set_quota(q(64 * MIB)).await.unwrap().into_inner();
    assert!(r.created);
    assert_eq!(r.tenant.unwrap().quota.unwrap().limit_bytes, 64 * MIB);
    let r = raw.set_quota(q(128 * MIB)).await.unwrap().into_inner();
    assert!(!r.created);
    let got = admin.get_quota("team-a").await.unwrap();
    assert_eq!(got.name, "team-a");
    assert_eq!(got.quota.limit_bytes, 128 * MIB);
    assert_eq!(got.quota.max_leases, 3);
    assert_eq!(got.quota.priority, 2);
    assert_eq!(got.token_count, 0);

    // Tokens: issued once, listed without the secret, counted.
    let t1 = admin.issue_token("team-a", "trainer").await.unwrap();
    let t2 = admin.issue_token("team-a", "server").await.unwrap();
    // Names of claims' tokens are not an operator's to take (they bind a pod to its claim).
    let e = admin
        .issue_token_with(
            Some("team-a"),
            &gpu_broker_client::TokenOptions {
                name: "claim/uid-x".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert_eq!(t1.tenant, "team-a");
    assert_ne!(t1.token, t2.token);
    assert!(!t1.token_id.is_empty() && !t1.token.contains(&t1.token_id));
    let listed = admin.list_tokens(Some("team-a")).await.unwrap();
    assert_eq!(listed.len(), 2);
    let text = format!("{listed:?}");
    assert!(
        !text.contains(&t1.token) && !text.contains(&t2.token),
        "{text}"
    );
    assert!(listed
        .iter()
        .any(|t| t.token_id == t1.token_id && t.description == "trainer"));
    assert_eq!(admin.get_quota("team-a").await.unwrap().token_count, 2);

    // ListTenants shows live usage.
    admin
        .set_quota("team-b", QuotaSpec::new(GIB))
        .await
        .unwrap();
    let c = Client::connect(&b.uri(), t1.token.clone()).await.unwrap();
    let s = c.session("usage").await.unwrap();
    let l1 = s.lease(4 * MIB).await.unwrap();
    let _l2 = s.lease(3 * MIB).await.unwrap();
    let tenants = admin.list_tenants().await.unwrap();
    let names: Vec<&str> = tenants.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["team-a", "team-b"]);
    let a = &tenants[0];
    assert_eq!(a.usage.held_bytes, 8 * MIB);
    assert_eq!(a.usage.lease_count, 2);
    assert_eq!(a.usage.session_count, 1);
    assert_eq!(tenants[1].usage, Default::default());
    // The worker's own view agrees.
    let u = c.usage().await.unwrap();
    assert_eq!(
        (u.tenant.as_str(), u.usage.held_bytes, u.quota.limit_bytes),
        ("team-a", 8 * MIB, 128 * MIB)
    );
    // max_leases = 3.
    let _l3 = s.lease(2 * MIB).await.unwrap();
    let e = s.lease(2 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");

    // A lowered quota applies to new requests (existing leases stay).
    admin
        .set_quota("team-a", QuotaSpec::new(8 * MIB))
        .await
        .unwrap();
    let e = s.lease(2 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert_eq!(c.usage().await.unwrap().usage.held_bytes, 10 * MIB);

    // DeleteTenant is refused while the tenant holds leases.
    let e = admin.delete_tenant("team-a").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    for l in [l1, _l2, _l3] {
        l.release().await.unwrap();
    }

    // RevokeToken (by id, and by the token itself): the token stops working, and the
    // sessions opened with it end; sessions of the tenant's other tokens live on.
    let c2 = Client::connect(&b.uri(), t2.token.clone()).await.unwrap();
    let s2 = c2.session("other token").await.unwrap();
    admin.revoke_token(&t1.token_id).await.unwrap();
    let e = c.usage().await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    assert!(
        eventually(T, || async { s.is_closed() }).await,
        "the revoked token's session stream ended"
    );
    let sessions = admin.list_sessions(None).await.unwrap();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    assert_eq!(sessions[0].session_id, s2.id());
    assert_eq!(c2.usage().await.unwrap().tenant, "team-a");
    admin.revoke_token(&t2.token).await.unwrap();
    assert_eq!(c2.usage().await.unwrap_err().code(), Code::Unauthenticated);
    assert!(
        eventually(T, || async { s2.is_closed() }).await,
        "the second token's session ended with it"
    );
    assert_eq!(admin.get_quota("team-a").await.unwrap().token_count, 0);

    // Holding nothing (a session of a new token still open), the tenant can be deleted.
    let t3 = admin.issue_token("team-a", "late").await.unwrap();
    let c3 = Client::connect(&b.uri(), t3.token.clone()).await.unwrap();
    let s3 = c3.session("late").await.unwrap();
    admin.delete_tenant("team-a").await.unwrap();
    assert!(
        eventually(T, || async {
            admin.list_sessions(None).await.unwrap().is_empty()
        })
        .await,
        "the deleted tenant's sessions end"
    );
    assert!(
        eventually(T, || async { s3.is_closed() }).await,
        "the session stream ended"
    );
    let names = tenant_names(&admin).await;
    assert_eq!(names, ["team-b"]);
    assert_eq!(
        admin.get_quota("team-a").await.unwrap_err().code(),
        Code::NotFound
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_all_leases_filters_and_devices_add_up() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "512MiB",
        headroom: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("a").await.unwrap();
    let sb = bob.session("b").await.unwrap();
    let mut leases = Vec::new();
    for (s, bytes) in [(&sa, 1), (&sa, 5 * MIB), (&sb, 2 * MIB), (&sb, 17 * MIB)] {
        leases.push(s.lease_request(bytes).label("sized").send().await.unwrap());
    }
    let sizes: Vec<u64> = leases.iter().map(|l| l.bytes()).collect();
    assert_eq!(sizes, [2 * MIB, 6 * MIB, 2 * MIB, 18 * MIB]);

    let all = admin.list_all_leases(None).await.unwrap();
    assert_eq!(all.len(), 4);
    let of_alice = admin.list_all_leases(Some("alice")).await.unwrap();
    assert_eq!(of_alice.len(), 2);
    assert!(of_alice
        .iter()
        .all(|l| l.tenant == "alice" && l.session_id == sa.id()));
    assert_eq!(of_alice[1].requested_bytes, 5 * MIB);
    assert_eq!(of_alice[1].label, "sized");
    let of_bob = admin.list_all_leases(Some("bob")).await.unwrap();
    assert_eq!(of_bob.iter().map(|l| l.bytes).sum::<u64>(), 20 * MIB);
    // A filter naming no tenant is an error, not an empty list (a typo must not look
    // like "nothing there").
    assert_eq!(
        admin
            .list_all_leases(Some("nobody"))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );

    let d = &admin.get_devices().await.unwrap()[0];
    assert_eq!(d.backend, "host");
    assert_eq!(d.total_bytes, 512 * MIB);
    assert_eq!(d.headroom_bytes, 64 * MIB);
    assert_eq!(d.leasable_bytes, 448 * MIB);
    assert_eq!(d.granularity_bytes, 2 * MIB);
    assert_eq!(d.leased_bytes, all.iter().map(|l| l.bytes).sum::<u64>());
    assert_eq!(d.lease_count as usize, all.len());
    assert_eq!(d.cached_bytes + d.quarantined_bytes, 0);
    assert_eq!(d.free_bytes, d.total_bytes - d.leased_bytes);
    assert_eq!(d.external_used_bytes, 0);

    // Release one: it moves from leased to cached; every byte is counted once.
    leases.remove(3).release().await.unwrap();
    let d = &admin.get_devices().await.unwrap()[0];
    assert_eq!(d.leased_bytes, 10 * MIB);
    assert_eq!(d.cached_bytes, 18 * MIB);
    assert_eq!(d.lease_count, 3);
    assert_eq!(
        d.free_bytes,
        d.total_bytes - d.leased_bytes - d.cached_bytes - d.quarantined_bytes
    );
    let tenants = admin.list_tenants().await.unwrap();
    let held: u64 = tenants.iter().map(|t| t.usage.held_bytes).sum();
    assert_eq!(held, d.leased_bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_sessions_shows_the_peer_pid_of_a_worker_process() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let mut w = hold(&b, &token, &["--bytes", "6MiB", "--name", "proc-worker"])
        .await
        .unwrap();
    assert_eq!(w.peer_pid, w.proc.pid, "the worker sees its own pid");
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let mine = c.session("in-test").await.unwrap();
    assert_eq!(mine.peer_pid(), std::process::id());

    let sessions = admin.list_sessions(None).await.unwrap();
    assert_eq!(sessions.len(), 2);
    let ws = sessions
        .iter()
        .find(|s| s.session_id == w.session_id)
        .expect("worker session listed");
    assert_eq!(ws.peer_pid, w.proc.pid);
    // SAFETY: getuid has no preconditions.
    assert_eq!(ws.peer_uid, unsafe { libc::getuid() });
    assert_eq!(ws.transport, "unix");
    assert_eq!(ws.name, "proc-worker");
    assert_eq!(ws.tenant, "alice");
    assert_eq!((ws.lease_count, ws.held_bytes), (1, 6 * MIB));
    let me = sessions.iter().find(|s| s.session_id == mine.id()).unwrap();
    assert_eq!(me.peer_pid, std::process::id());
    assert_eq!(admin.list_sessions(Some("alice")).await.unwrap().len(), 2);
    assert_eq!(
        admin.list_sessions(Some("bob")).await.unwrap_err().code(),
        Code::NotFound
    );

    // The worker dies: its session goes.
    w.proc.kill().await.unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            admin.list_sessions(None).await.unwrap().len() == 1
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_lease_is_quarantined_while_its_holder_lives() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..Default::default()
    })
    .unwrap();
    let ta = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let mut w = hold(&b, &ta, &["--bytes", "16MiB", "--pattern", "0x42"])
        .await
        .unwrap();
    let id = w.leases[0].id.clone();

    let revoked = admin.revoke_lease(&id, "maintenance").await.unwrap();
    assert_eq!(revoked.lease_id, id);
    assert_eq!(revoked.tenant, "alice");
    w.proc
        .line_starting(&format!("EVENT revoked {id}"), T)
        .await
        .unwrap();

    // Gone from the lists, no longer charged, but quarantined: not reusable.
    assert!(admin.list_all_leases(None).await.unwrap().is_empty());
    let t = admin.get_quota("alice").await.unwrap();
    assert_eq!(t.usage.held_bytes, 0);
    assert_eq!(t.usage.quarantined_bytes, 16 * MIB);
    let d = &admin.get_devices().await.unwrap()[0];
    assert_eq!(
        (d.leased_bytes, d.quarantined_bytes, d.cached_bytes),
        (0, 16 * MIB, 0)
    );
    // The holder still sees its bytes; nobody else can get that memory.
    w.proc.send("check 0x42").await.unwrap();
    assert_eq!(w.proc.line_starting("CHECK", T).await.unwrap(), "CHECK ok");
    let bob = b.client("bob", GIB).await.unwrap();
    let sb = bob.session("b").await.unwrap();
    let e = sb.lease(64 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    // Revoking twice: the lease is gone.
    assert_eq!(
        admin.revoke_lease(&id, "again").await.unwrap_err().code(),
        Code::NotFound
    );
    // The holder's release of it is NOT_FOUND (it is not its lease any more).
    w.proc.send("release").await.unwrap();
    w.proc.line_starting("ERROR NOT_FOUND", T).await.unwrap();

    // The holder exits: the quarantine is lifted, the memory is reusable (zeroed).
    w.proc.kill().await.unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            admin.get_devices().await.unwrap()[0].quarantined_bytes == 0
        })
        .await
    );
    assert_eq!(
        admin
            .get_quota("alice")
            .await
            .unwrap()
            .usage
            .quarantined_bytes,
        0
    );
    let l = sb.lease(64 * MIB).await.unwrap();
    assert!(l.map().unwrap().iter().all(|&x| x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_lease_event_reaches_an_in_process_session() {
    let b = Broker::start().unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let mut events = s.events();
    let l = s.lease(2 * MIB).await.unwrap();
    let admin = b.admin().await.unwrap();
    admin.revoke_lease(l.id(), "because").await.unwrap();
    let ev = tokio::time::timeout(T, events.next()).await.unwrap();
    match ev {
        Some(SessionEvent::LeaseRevoked { lease_id, reason }) => {
            assert_eq!(lease_id, l.id());
            assert_eq!(reason, "because");
        }
        other => panic!("{other:?}"),
    }
    assert!(c.list_leases().await.unwrap().is_empty());
    // The session itself lives on and can lease again.
    let again = s.lease(2 * MIB).await.unwrap();
    assert_ne!(again.id(), l.id());
    let _ = l.detach();
}

/// The TCP address the broker logged (`serving on TCP addr=...`).
pub(crate) fn tcp_addr(log: &str) -> Option<String> {
    // Strip ANSI colour sequences, then find the field.
    let mut plain = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            plain.push(ch);
        }
    }
    let line = plain.lines().find(|l| l.contains("serving on TCP"))?;
    let addr = line.split("addr=").nth(1)?.split_whitespace().next()?;
    Some(addr.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_sessions_have_no_pid_and_get_no_fd_leases() {
    let b = Broker::start_with(BrokerOpts {
        extra: vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--insecure-tcp".into(),
        ],
        ..Default::default()
    })
    .unwrap();
    let mut addr = None;
    assert!(
        eventually(T, || {
            addr = tcp_addr(&b.log_text());
            let found = addr.is_some();
            async move { found }
        })
        .await,
        "{}",
        b.log_text()
    );
    let uri = format!("http://{}", addr.unwrap());
    let token = b.tenant("remote", QuotaSpec::new(GIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let c = Client::connect(&uri, token).await.unwrap();
    let s = c.session("over-tcp").await.unwrap();
    assert_eq!(s.peer_pid(), 0, "no pid over TCP");
    // A TCP peer cannot receive SCM_RIGHTS, and legacy handles are off by default: no
    // lease for it (FAILED_PRECONDITION naming the Unix socket), nothing charged.
    let e = s.lease(4 * MIB).await.unwrap_err();
    assert_eq!(e.code(), gpu_broker_client::Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("Unix socket"), "{e}");
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::FdNeedsUnixSocket),
        "{e}"
    );
    let sessions = admin.list_sessions(None).await.unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].transport, "tcp");
    assert_eq!(sessions[0].peer_pid, 0);
    // The admin service answers over TCP too.
    let tcp_admin = gpu_broker_client::AdminClient::connect(&uri, b.admin_token.clone())
        .await
        .unwrap();
    assert!(tcp_admin.list_all_leases(None).await.unwrap().is_empty());
    assert!(b.memfds().is_empty(), "{:?}", b.memfds());
    assert_eq!(admin.get_quota("remote").await.unwrap().usage.held_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_lease_reports_the_revoked_state() {
    let b = Broker::start().unwrap();
    let c = b.client("alice", GIB).await.unwrap();
    let s = c.session("s").await.unwrap();
    let l = s.lease(2 * MIB).await.unwrap();
    let revoked = b
        .admin()
        .await
        .unwrap()
        .revoke_lease(l.id(), "state check")
        .await
        .unwrap();
    let _ = l.detach();
    assert_eq!(revoked.state, gpu_broker_client::LeaseState::Revoked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_holder_cannot_exceed_its_limit() {
    let b = Broker::start().unwrap();
    let token = b.tenant("greedy", QuotaSpec::new(16 * MIB)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let mut w = hold(&b, &token, &["--bytes", "16MiB", "--pattern", "0x42"])
        .await
        .unwrap();
    admin.revoke_lease(&w.leases[0].id, "test").await.unwrap();
    w.proc.line_starting("EVENT revoked", T).await.unwrap();
    // The process still maps (and can use) the revoked 16 MiB...
    w.proc.send("check 0x42").await.unwrap();
    assert_eq!(w.proc.line_starting("CHECK", T).await.unwrap(), "CHECK ok");
    // ...so another 16 MiB for the same tenant would put 32 MiB of device memory in
    // its hands under a 16 MiB limit.
    let c = Client::connect(&b.uri(), token).await.unwrap();
    let s = c.session("second").await.unwrap();
    let r = s.lease(16 * MIB).await;
    let t = admin.get_quota("greedy").await.unwrap();
    assert!(
        r.is_err(),
        "granted: tenant now holds {} + {} quarantined of limit {}",
        t.usage.held_bytes,
        t.usage.quarantined_bytes,
        t.quota.limit_bytes
    );
}
