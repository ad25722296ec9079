//! A broker restart ends every session and lease (they are not persisted): what a client
//! that held leases sees, with raw calls and with a plain (non-reconnecting) session of
//! the client crate, and that it can open a new session afterwards.

use super::*;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{Client, SessionEvent};

#[tokio::test]
async fn after_a_broker_restart_old_sessions_fail_and_new_ones_work() {
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "256MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let token = b.tenant("alpha", QuotaSpec::new(128 * MIB)).await.unwrap();

    // Raw calls: a session holding a lease.
    let mut raw = raw::broker(&b.uri(), &token).await;
    let (session_id, mut stream) = raw::open_session(&mut raw, "raw").await;
    let lease = raw
        .acquire_lease(pb::AcquireLeaseRequest {
            session_id: session_id.clone(),
            bytes: 8 * MIB,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap();
    // The client crate: a plain session holding a lease.
    let client = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let session = client.session("crate").await.unwrap();
    let mut events = session.events();
    let crate_lease = session.lease(4 * MIB).await.unwrap();

    b.kill().unwrap();

    // The raw stream breaks (after any heartbeat still in flight).
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match stream.message().await {
                Ok(Some(pb::SessionEvent {
                    event: Some(pb::session_event::Event::Heartbeat(_)),
                })) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the session stream ends when the broker dies");
    let stream_end = match &end {
        Ok(None) => "a clean end".to_string(),
        Ok(Some(m)) => panic!("unexpected message after the broker died: {m:?}"),
        Err(s) => format!("{:?} ({})", s.code(), s.message()),
    };
    // While the broker is down, calls on the old session are UNAVAILABLE.
    let down = raw
        .acquire_lease(pb::AcquireLeaseRequest {
            session_id: session_id.clone(),
            bytes: 2 * MIB,
            ..Default::default()
        })
        .await;
    let down_code = down.as_ref().err().map(|s| s.code());
    assert_eq!(down_code, Some(Code::Unavailable), "{down:?}");
    // The crate's session reports the loss as its last event.
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        use futures::StreamExt;
        while let Some(e) = events.next().await {
            if let SessionEvent::Closed { reason } = e {
                return reason;
            }
        }
        None
    })
    .await
    .expect("Closed event within 5 s");
    assert!(session.is_closed());

    b.spawn().unwrap();

    // Old session and lease ids mean nothing to the new broker.
    let mut after_codes = Vec::new();
    for _ in 0..3 {
        let r = raw
            .acquire_lease(pb::AcquireLeaseRequest {
                session_id: session_id.clone(),
                bytes: 2 * MIB,
                ..Default::default()
            })
            .await;
        let c = r.as_ref().err().map(|s| s.code());
        assert!(
            matches!(c, Some(Code::Unavailable) | Some(Code::NotFound)),
            "old session after restart: {r:?}"
        );
        after_codes.push(c);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Once the new broker answers, a session of its earlier run is UNAVAILABLE (re-open),
    // not NOT_FOUND.
    assert_eq!(
        after_codes.last().copied().flatten(),
        Some(Code::Unavailable),
        "{after_codes:?}"
    );
    let rel = raw
        .release_lease(pb::ReleaseLeaseRequest {
            lease_id: lease.lease_id.clone(),
            ..Default::default()
        })
        .await;
    let rel_code = rel.as_ref().err().map(|s| s.code());
    assert!(
        matches!(rel_code, Some(Code::Unavailable) | Some(Code::NotFound)),
        "old lease after restart: {rel:?}"
    );
    let crate_release = crate_lease.release().await;
    let crate_code = code_of(&crate_release);
    assert!(
        matches!(crate_code, Some(Code::Unavailable) | Some(Code::NotFound)),
        "{crate_release:?}"
    );
    let crate_acquire = session.lease(2 * MIB).await;
    let crate_acquire_code = code_of(&crate_acquire);
    assert!(
        matches!(
            crate_acquire_code,
            Some(Code::Unavailable) | Some(Code::NotFound)
        ),
        "{crate_acquire:?}"
    );

    // The same connection (tonic reconnects the channel) opens a new session.
    let (new_id, _new_stream) = raw::open_session(&mut raw, "raw-2").await;
    assert_ne!(new_id, session_id);
    let l = raw
        .acquire_lease(pb::AcquireLeaseRequest {
            session_id: new_id,
            bytes: 8 * MIB,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap();
    // Same with the crate's client.
    let s2 = client.session("crate-2").await.unwrap();
    let l2 = s2.lease(4 * MIB).await.unwrap();
    // Nothing of before survives: only the two new leases are held.
    let u = client.usage().await.unwrap();
    assert_eq!(u.usage.held_bytes, 12 * MIB, "{u:?}");
    assert_eq!(u.usage.lease_count, 2);
    let all = b
        .admin()
        .await
        .unwrap()
        .list_all_leases(None)
        .await
        .unwrap();
    assert!(all.iter().all(|x| x.lease_id != lease.lease_id));
    l2.release().await.unwrap();
    raw.release_lease(pb::ReleaseLeaseRequest {
        lease_id: l.lease_id,
        ..Default::default()
    })
    .await
    .unwrap();
    eprintln!(
        "restart: raw stream ended with {stream_end}; old session while down: {down_code:?}; \
         after restart: {after_codes:?}; old lease release: {rel_code:?}; crate session \
         Closed{{reason: {closed:?}}}, Lease::release {crate_code:?}, acquire {crate_acquire_code:?}"
    );
    assert_broker_alive(&b);
}
