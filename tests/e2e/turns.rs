//! Compute turns end to end: one holder per device, yield requests past the quantum,
//! revocation past the grace, fair hand-over, usage accounting, and errors.

use futures::StreamExt;
use gpu_broker_client::{Code, Session, SessionEvent};
use gpu_broker_tests::*;
use std::time::{Duration, Instant};

fn broker() -> Broker {
    Broker::start_with(BrokerOpts {
        extra: vec![
            "--turn-quantum".into(),
            "100ms".into(),
            "--turn-grace".into(),
            "200ms".into(),
        ],
        ..BrokerOpts::default()
    })
    .unwrap()
}

/// A broker with two tenants, "a" and "c", and a session of each.
async fn two_tenants() -> (Broker, Session, Session) {
    let b = broker();
    let a = b.client("a", 64 * MIB).await.unwrap();
    let c = b.client("c", 64 * MIB).await.unwrap();
    let sa = a.session("a").await.unwrap();
    let sc = c.session("c").await.unwrap();
    (b, sa, sc)
}

async fn next_turn_event(events: &mut gpu_broker_client::SessionEvents) -> SessionEvent {
    loop {
        let e = tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .expect("an event within 5 s")
            .expect("stream open");
        if matches!(
            e,
            SessionEvent::YieldRequested { .. } | SessionEvent::TurnRevoked { .. }
        ) {
            return e;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_asked_to_yield_hands_the_turn_over() {
    let (b, sa, sc) = two_tenants().await;
    let mut ea = sa.events();
    // The quantum runs from the grant, which happens after this instant.
    let t0 = Instant::now();
    let turn = sa.turn(0).await.unwrap();
    assert_eq!(turn.quantum(), Duration::from_millis(100));
    // Busy: no wait is RESOURCE_EXHAUSTED, naming the holder.
    let busy = sc.turn(0).await.unwrap_err();
    assert_eq!(busy.code(), Code::ResourceExhausted, "{busy}");
    assert!(busy.to_string().contains("\"a\""), "{busy}");
    let waiter = tokio::spawn(async move {
        let t = sc.turn(0).wait(Duration::from_secs(5)).await;
        (t, sc)
    });
    match next_turn_event(&mut ea).await {
        SessionEvent::YieldRequested {
            turn_id, device, ..
        } => {
            assert_eq!((turn_id.as_str(), device), (turn.id(), 0));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(90),
        "yield came before the quantum"
    );
    let end = turn.release().await.unwrap();
    assert!(end.held >= Duration::from_millis(100), "{end:?}");
    let (granted, _sc) = waiter.await.unwrap();
    let granted = granted.unwrap();
    let admin = b.admin().await.unwrap();
    assert_eq!(admin.get_devices().await.unwrap()[0].turn_holder, "c");
    granted.release().await.unwrap();
    let usage = sa.usage().await.unwrap();
    assert_eq!(usage.usage.turns, 1);
    assert!(usage.usage.compute_ms >= 100, "{usage:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_ignores_the_yield_loses_the_turn() {
    let (_b, sa, sc) = two_tenants().await;
    let mut ea = sa.events();
    let turn = sa.turn(0).await.unwrap();
    let t0 = Instant::now();
    let granted = sc.turn(0).wait(Duration::from_secs(5)).await.unwrap();
    // Taken after quantum (100 ms) + grace (200 ms).
    assert!(
        t0.elapsed() >= Duration::from_millis(280),
        "{:?}",
        t0.elapsed()
    );
    assert!(matches!(
        next_turn_event(&mut ea).await,
        SessionEvent::YieldRequested { .. }
    ));
    assert!(matches!(
        next_turn_event(&mut ea).await,
        SessionEvent::TurnRevoked { .. }
    ));
    let late = turn.release().await.unwrap_err();
    assert_eq!(late.code(), Code::NotFound, "{late}");
    let usage = sa.usage().await.unwrap();
    assert!(usage.usage.overrun_ms >= 150, "overrun {usage:?}");
    granted.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_session_gives_its_turn_to_the_next() {
    let (_b, sa, sc) = two_tenants().await;
    let turn = sa.turn(0).await.unwrap();
    std::mem::forget(turn); // the holder never releases: only its session ends
    let waiter = tokio::spawn(async move {
        sc.turn(0)
            .wait(Duration::from_secs(5))
            .await
            .map(|t| (t, sc))
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    sa.close();
    drop(sa);
    let (t, _sc) = waiter.await.unwrap().unwrap();
    assert_eq!(t.device(), 0);
}

#[tokio::test]
async fn turn_requests_get_precise_statuses() {
    let (_b, sa, sc) = two_tenants().await;
    assert_eq!(sa.turn(7).await.unwrap_err().code(), Code::InvalidArgument);
    let absurd = sa.turn(0).wait(Duration::from_secs(10_000_000)).await;
    assert_eq!(
        absurd.unwrap_err().code(),
        Code::InvalidArgument,
        "absurd wait"
    );
    let turn = sa.turn(0).await.unwrap();
    assert_eq!(
        sa.turn(0).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    let mut raw = sc.client().raw();
    let other = raw
        .release_turn(gpu_broker_client::proto::v1::ReleaseTurnRequest {
            turn_id: turn.id().to_string(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        other.code(),
        Code::NotFound,
        "another tenant's turn is not found"
    );
    let bad = raw
        .release_turn(gpu_broker_client::proto::v1::ReleaseTurnRequest {
            turn_id: "not-a-uuid".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    drop(sc);
    turn.release().await.unwrap();
}

/// A session waiting for a turn whose token is revoked meanwhile is refused for its token
/// (as every call with it now is), not as though it had named no open session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_waiter_whose_token_is_revoked_is_refused_for_its_token() {
    use gpu_broker_client::{Client, QuotaSpec};
    // The holder keeps its turn for the whole test: a loaded machine must not hand it to
    // the waiter (quantum + grace) before the revocation.
    let b = Broker::start_with(BrokerOpts {
        extra: vec![
            "--turn-quantum".into(),
            "60s".into(),
            "--turn-grace".into(),
            "60s".into(),
        ],
        ..BrokerOpts::default()
    })
    .unwrap();
    let a = b.client("a", 64 * MIB).await.unwrap();
    let sa = a.session("a").await.unwrap();
    let _turn = sa.turn(0).await.unwrap();
    let token = b.tenant("c", QuotaSpec::new(64 * MIB)).await.unwrap();
    let c = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let sc = c.session("c").await.unwrap();
    let waiter = tokio::spawn(async move { sc.turn(0).wait(Duration::from_secs(20)).await });
    assert!(
        eventually(Duration::from_secs(5), || async {
            devices(&b).await.unwrap()[0].turns_waiting == 1
        })
        .await,
        "the turn request never waited"
    );
    revoked_while_waiting(&b, &token, waiter).await;
}
