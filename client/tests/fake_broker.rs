//! The client crate against a small in-process fake of the broker's two gRPC services
//! (`fake/`): checks what the client sends (auth header,
//! request fields, keepalives, release on drop, stream end on session drop) and how it
//! reads replies and events. The real broker is tested end to end in `tests/`.

mod fake;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use parking_lot::Mutex;

use fake::*;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{
    AdminClient, Backoff, Client, ClientError, Code, HostMapping, Lease, LeaseHandle, QuotaSpec,
    ReclaimRequest, SessionEvent, SessionEvents, Tier,
};

#[tokio::test]
async fn session_lease_map_release() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("trainer-3").await.unwrap();
    assert_eq!(session.id(), "s-1");
    assert_eq!(session.tenant(), "team-a");
    assert_eq!(session.peer_pid(), 4242);
    assert_eq!(session.keepalive_timeout(), None);
    assert_eq!(h.fake.state.lock().session_names["s-1"], "trainer-3");

    let lease = session
        .lease_request(3 << 20)
        .device(1)
        .wait(Duration::from_millis(1500))
        .label("kv-cache")
        .reclaimable(true)
        .fallback_host(true)
        .send()
        .await
        .unwrap();
    let sent = h.fake.state.lock().last_acquire.clone().unwrap();
    assert_eq!(sent.session_id, "s-1");
    assert_eq!(sent.bytes, 3 << 20);
    assert_eq!(sent.device, Some(1));
    assert_eq!(sent.wait_ms, Some(1500));
    assert_eq!(sent.label, "kv-cache");
    assert!(sent.reclaimable);
    assert_eq!(sent.fallback, pb::Fallback::Host as i32);

    assert_eq!(lease.bytes(), 4 << 20);
    assert_eq!(lease.requested_bytes(), 3 << 20);
    assert_eq!(lease.device(), 1);
    assert_eq!(lease.tier(), Tier::Host);
    assert_eq!(lease.label(), "kv-cache");
    let LeaseHandle::HostShm(path) = lease.handle().clone() else {
        panic!("expected host_shm, got {:?}", lease.handle())
    };

    {
        let mut mapping = lease.map().unwrap();
        assert_eq!(mapping.len() as u64, lease.bytes());
        mapping[..4].copy_from_slice(b"ping");
        let other = HostMapping::open(&path, 0, lease.bytes()).unwrap();
        assert_eq!(&other[..4], b"ping");
    }

    let usage = session.usage().await.unwrap();
    assert_eq!(usage.usage.held_bytes, 4 << 20);
    assert_eq!(usage.quota.limit_bytes, QUOTA);
    assert_eq!(session.list_leases().await.unwrap().len(), 1);

    lease.release().await.unwrap();
    assert!(session.list_leases().await.unwrap().is_empty());

    // Plain `lease(bytes)`: defaults.
    let lease = session.lease(1).await.unwrap();
    let sent = h.fake.state.lock().last_acquire.clone().unwrap();
    assert_eq!(
        (sent.device, sent.wait_ms, sent.reclaimable),
        (None, None, false)
    );
    assert_eq!(sent.fallback, pb::Fallback::None as i32);
    assert_eq!(lease.tier(), Tier::Device);
    let info = lease.detach();
    client.release_lease(&info.lease_id).await.unwrap();
    let err = client.release_lease(&info.lease_id).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test]
async fn errors_carry_codes() {
    let h = start(0).await;
    let bad = Client::connect(&h.uri, "wrong").await.unwrap();
    let err = bad.session("x").await.unwrap_err();
    assert!(matches!(err, ClientError::Unauthenticated(_)), "{err}");

    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let err = session.lease(0).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = session.lease(2 << 30).await.unwrap_err();
    assert!(matches!(err, ClientError::ResourceExhausted(_)), "{err}");
    assert!(
        err.to_string()
            .starts_with("RESOURCE_EXHAUSTED: tenant team-a"),
        "{err}"
    );

    let admin_with_tenant_token = AdminClient::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let err = admin_with_tenant_token.list_tenants().await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);

    let lease = session.lease_request(1).label("no-handle").await.unwrap();
    assert!(matches!(lease.handle(), LeaseHandle::Unknown));
    let err = lease.map().map(|_| ()).unwrap_err();
    assert!(matches!(err, ClientError::NotMappable), "{err}");
    lease.release().await.unwrap();
}

#[tokio::test]
async fn dropped_lease_is_released_in_the_background() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let lease = session.lease(1 << 20).await.unwrap();
    assert_eq!(h.fake.state.lock().leases.len(), 1);
    drop(lease);
    eventually("release after drop", || {
        h.fake.state.lock().leases.is_empty()
    })
    .await;
    assert!(h.fake.state.lock().ended_sessions.is_empty());
}

#[tokio::test]
async fn dropping_the_session_ends_the_stream_but_leases_keep_it_open() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let clone = session.clone();
    let lease = session.lease(1 << 20).await.unwrap();
    drop(session);
    drop(clone);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        h.fake.state.lock().ended_sessions.is_empty(),
        "a live lease keeps its session"
    );
    let lease_session = lease.session().clone();
    drop(lease);
    drop(lease_session);
    eventually("session end", || {
        h.fake.state.lock().ended_sessions == ["s-1"]
    })
    .await;
}

#[tokio::test]
async fn close_ends_the_session_for_every_clone() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let keep = session.clone();
    let mut events = session.events();
    session.close();
    assert!(keep.is_closed());
    assert!(matches!(
        events.next().await,
        Some(SessionEvent::Closed { .. })
    ));
    assert!(events.next().await.is_none());
    eventually("session end", || {
        h.fake.state.lock().ended_sessions.len() == 1
    })
    .await;
}

#[tokio::test]
async fn events_reach_subscribers_and_callbacks() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let admin = AdminClient::connect(&h.uri, ADMIN_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let mut events = session.events();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let callback = session.on_event(move |ev| sink.lock().push(ev));

    let lease = session.lease(1 << 20).await.unwrap();
    let revoked = admin
        .revoke_lease(lease.id(), "operator says so")
        .await
        .unwrap();
    assert_eq!(revoked.lease_id, lease.id());
    let ev = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        ev,
        SessionEvent::LeaseRevoked {
            lease_id: lease.id().to_string(),
            reason: "operator says so".into()
        }
    );

    h.fake.push(
        &session.id(),
        pb::session_event::Event::Heartbeat(pb::Heartbeat { unix_ms: 5 }),
    );
    h.fake.push(
        &session.id(),
        pb::session_event::Event::ReclaimRequested(pb::ReclaimRequested {
            lease_id: lease.id().to_string(),
            bytes: 1 << 20,
            deadline_unix_ms: 10_000,
            reason: "priority".into(),
        }),
    );
    let ev = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(ev, SessionEvent::ReclaimRequested { bytes, .. } if bytes == 1 << 20),
        "{ev:?}"
    );

    // The broker ends the stream: Closed, then the stream ends.
    h.fake.state.lock().session_ends.clear();
    let ev = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ev, SessionEvent::Closed { reason: None });
    assert!(events.next().await.is_none());
    tokio::time::timeout(Duration::from_secs(5), callback)
        .await
        .unwrap()
        .unwrap();
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen[2].is_closed());
    drop(lease);
}

#[tokio::test]
async fn keepalives_are_sent() {
    let h = start(150).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    assert_eq!(
        session.keepalive_timeout(),
        Some(Duration::from_millis(150))
    );
    eventually("three keepalives", || {
        h.fake
            .state
            .lock()
            .keepalives
            .get("s-1")
            .copied()
            .unwrap_or(0)
            >= 3
    })
    .await;
}

#[tokio::test]
async fn admin_calls() {
    let h = start(0).await;
    let admin = AdminClient::connect(&h.uri, ADMIN_TOKEN).await.unwrap();
    let quota = QuotaSpec {
        limit_bytes: 8 << 30,
        max_leases: 4,
        priority: 2,
        guaranteed_bytes: 1 << 30,
        host_limit_bytes: 0,
        turn_weight: 0,
        device_limit_bytes: Default::default(),
    };
    let info = admin.set_quota("a", quota.clone()).await.unwrap();
    assert_eq!(
        (info.name.as_str(), info.quota.clone()),
        ("a", quota.clone())
    );
    assert_eq!(admin.get_quota("a").await.unwrap().quota, quota);
    let err = admin.get_quota("zz").await.unwrap_err();
    assert!(matches!(err, ClientError::NotFound(_)));
    let err = admin
        .set_quota(
            "b",
            QuotaSpec {
                guaranteed_bytes: 2,
                ..QuotaSpec::new(1)
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(admin.list_tenants().await.unwrap().len(), 1);

    let t1 = admin.issue_token("a", "ci").await.unwrap();
    let t2 = admin.issue_token("a", "ci").await.unwrap();
    assert_eq!(t1.tenant, "a");
    assert!(!format!("{t1:?}").contains(&t1.token));
    assert_eq!(admin.list_tokens(Some("a")).await.unwrap().len(), 2);
    assert_eq!(admin.list_tokens(Some("other")).await.unwrap().len(), 0);
    admin.revoke_token(&t1.token_id).await.unwrap(); // by id
    admin.revoke_token(&t2.token).await.unwrap(); // by the token itself
    let err = admin.revoke_token(&t2.token).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert!(admin.list_tokens(None).await.unwrap().is_empty());

    let devices = admin.get_devices().await.unwrap();
    assert_eq!(devices[0].granularity_bytes, GRANULARITY);
    assert!(admin.list_all_leases(None).await.unwrap().is_empty());
    assert!(admin.list_sessions(Some("a")).await.unwrap().is_empty());
    admin.delete_tenant("a").await.unwrap();
    assert!(matches!(
        admin.delete_tenant("a").await,
        Err(ClientError::NotFound(_))
    ));
}

fn fast() -> Backoff {
    Backoff::new(Duration::from_millis(20), Duration::from_millis(200))
}

/// The next event within 5 s, skipping heartbeat-free noise is not needed: the fake
/// sends only what a test pushes.
async fn next_event(events: &mut SessionEvents) -> SessionEvent {
    tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("an event within 5 s")
        .expect("the event stream goes on")
}

#[tokio::test]
async fn reconnecting_session_replaces_a_lost_one_and_old_leases_send_nothing() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session_builder("w").reconnect(fast()).await.unwrap();
    let mut events = session.events();
    assert_eq!(session.id(), "s-1");
    let kept_id: String = session.id();
    let a = session.lease(1 << 20).await.unwrap(); // l-2
    let b = session.lease(1 << 20).await.unwrap(); // l-3
    let c = session.lease(1 << 20).await.unwrap(); // l-4
    let detached = session.lease(1 << 20).await.unwrap().detach(); // l-5
    c.release().await.unwrap();
    assert_eq!(h.fake.state.lock().releases, ["l-4"]);

    // The broker ends the stream: the session is lost and re-opened.
    h.fake.state.lock().session_ends.clear();
    assert_eq!(
        next_event(&mut events).await,
        SessionEvent::Disconnected {
            session_id: "s-1".into(),
            reason: "the broker ended the session".into()
        }
    );
    assert_eq!(
        next_event(&mut events).await,
        SessionEvent::Reconnected {
            old_session_id: "s-1".into(),
            new_session_id: "s-6".into(),
            lost_leases: vec!["l-2".into(), "l-3".into()],
        }
    );
    assert_eq!(session.id(), "s-6");
    assert_eq!(kept_id, "s-1", "ids handed out earlier stay valid");
    assert!(session.is_connected());
    assert_eq!(h.fake.state.lock().session_names["s-6"], "w");
    assert!(a.is_lost() && b.is_lost());
    assert!(matches!(a.map(), Err(ClientError::LeaseLost { .. })));
    assert_eq!(a.session_id(), "s-1");
    assert_eq!(detached.session_id, "s-1");

    // Old leases: release fails locally, drop sends nothing.
    let err = a.release().await.unwrap_err();
    assert!(
        matches!(&err, ClientError::LeaseLost { lease_id, session_id } if lease_id == "l-2" && session_id == "s-1"),
        "{err}"
    );
    drop(b);
    // A new lease goes to the new session and is released normally when dropped.
    let fresh = session.lease(1 << 20).await.unwrap();
    assert_eq!(
        h.fake
            .state
            .lock()
            .last_acquire
            .as_ref()
            .unwrap()
            .session_id,
        "s-6"
    );
    assert_eq!(fresh.session_id(), "s-6");
    let fresh_id = fresh.id().to_string();
    drop(fresh);
    eventually("release of the fresh lease", || {
        h.fake.state.lock().releases.len() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.fake.state.lock().releases, ["l-4".to_string(), fresh_id]);
    session.close();
    assert!(matches!(
        next_event(&mut events).await,
        SessionEvent::Closed { reason: Some(_) }
    ));
}

#[tokio::test]
async fn silent_stream_and_rejected_keepalive_count_as_lost() {
    // No heartbeats from the fake: the idle timeout fires.
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client
        .session_builder("w")
        .reconnect(fast())
        .idle_timeout(Some(Duration::from_millis(300)))
        .await
        .unwrap();
    let mut events = session.events();
    let ev = next_event(&mut events).await;
    assert!(
        matches!(&ev, SessionEvent::Disconnected { session_id, reason } if session_id == "s-1" && reason.contains("no message")),
        "{ev:?}"
    );
    assert!(matches!(
        next_event(&mut events).await,
        SessionEvent::Reconnected { .. }
    ));
    eventually("the old stream dropped", || {
        h.fake
            .state
            .lock()
            .ended_sessions
            .iter()
            .any(|s| s == "s-1")
    })
    .await;
    drop(session);

    // A keepalive refused with NOT_FOUND: the broker forgot the session.
    let h = start(90).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client
        .session_builder("w")
        .reconnect(fast())
        .idle_timeout(None)
        .await
        .unwrap();
    let mut events = session.events();
    h.fake.state.lock().forgotten.push("s-1".into());
    let ev = next_event(&mut events).await;
    assert!(
        matches!(&ev, SessionEvent::Disconnected { reason, .. } if reason.contains("NOT_FOUND")),
        "{ev:?}"
    );
    assert!(matches!(
        next_event(&mut events).await,
        SessionEvent::Reconnected { new_session_id, .. } if new_session_id == "s-2"
    ));
}

#[tokio::test]
async fn reconnecting_stops_on_permanent_refusal_or_after_the_limit() {
    for (code, give_up, expect) in [
        (Code::Unauthenticated, None, "UNAUTHENTICATED"),
        (Code::NotFound, None, "NOT_FOUND"),
        (
            Code::Unavailable,
            Some(Duration::from_millis(300)),
            "gave up",
        ),
    ] {
        let h = start(0).await;
        let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
        let mut builder = client.session_builder("w").reconnect(fast());
        if let Some(limit) = give_up {
            builder = builder.give_up_after(limit);
        }
        let session = builder.open().await.unwrap();
        let mut events = session.events();
        let lease = session.lease(1 << 20).await.unwrap();
        {
            let mut st = h.fake.state.lock();
            st.refuse_sessions = Some(code);
            st.session_ends.clear();
        }
        assert!(matches!(
            next_event(&mut events).await,
            SessionEvent::Disconnected { .. }
        ));
        let ev = next_event(&mut events).await;
        assert!(
            matches!(&ev, SessionEvent::Closed { reason: Some(r) } if r.contains(expect)),
            "{code:?}: {ev:?}"
        );
        assert!(events.next().await.is_none());
        assert!(session.is_closed() && !session.is_connected());
        assert!(matches!(
            lease.release().await,
            Err(ClientError::LeaseLost { .. })
        ));
        assert!(h.fake.state.lock().releases.is_empty());
    }
}

#[tokio::test]
async fn reclaim_handler_releases_leases() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("w").await.unwrap();
    let held: Arc<Mutex<HashMap<String, Lease>>> = Arc::default();
    for _ in 0..2 {
        let lease = session
            .lease_request(1 << 20)
            .reclaimable(true)
            .await
            .unwrap();
        held.lock().insert(lease.id().to_string(), lease);
    }
    let asked: Arc<Mutex<Vec<ReclaimRequest>>> = Arc::default();
    let handler = session.on_reclaim({
        let (held, asked) = (held.clone(), asked.clone());
        move |req: ReclaimRequest| {
            asked.lock().push(req.clone());
            let lease = held.lock().remove(&req.lease_id);
            async move {
                match lease {
                    Some(lease) => lease.release().await,
                    None => Err(ClientError::NotFound(req.lease_id.into())),
                }
            }
        }
    });
    let deadline_ms = (std::time::SystemTime::now() + Duration::from_secs(5))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for lease_id in ["l-2", "unknown"] {
        h.fake.push(
            &session.id(),
            pb::session_event::Event::ReclaimRequested(pb::ReclaimRequested {
                lease_id: lease_id.into(),
                bytes: 1 << 20,
                deadline_unix_ms: deadline_ms,
                reason: "priority".into(),
            }),
        );
    }
    eventually("the reclaimed lease released", || {
        h.fake.state.lock().releases == ["l-2"]
    })
    .await;
    eventually("both requests handled", || asked.lock().len() == 2).await;
    let first = asked.lock()[0].clone();
    assert_eq!(first.lease_id, "l-2");
    assert_eq!(first.bytes, 1 << 20);
    assert!(first.time_left() > Duration::from_secs(2));
    assert_eq!(held.lock().len(), 1);
    session.close();
    tokio::time::timeout(Duration::from_secs(5), handler)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_broker_without_get_info_is_reported_as_older() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let w = gpu_broker_client::version_warning(&client.broker_info().await).unwrap();
    assert!(w.contains("predates") && w.contains("upgrade"), "{w}");
    // Everything else still works against it.
    client.usage().await.unwrap();
}
