//! Unit tests of claim reservations (`claims.rs`): charged to the tenant at once or
//! refused with the quota's reason and nothing left behind, drawn from by the sessions of
//! their token only, ended with their token by a release.

use super::claims::{claim_token_name, ClaimRequest};
use super::durable_tests::stored_arbiter;
use super::tests::{quota, req};
use super::*;
use crate::audit::Who;
use crate::error::BrokerError;
use crate::error::ErrorKind;
use crate::session::Peer;

const MIB: u64 = 1 << 20;

fn who() -> Who {
    Who::system("test")
}

fn claim(uid: &str, tenant: &str, bytes: u64) -> ClaimRequest {
    ClaimRequest {
        uid: uid.into(),
        tenant: tenant.into(),
        bytes,
        device: 0,
        label: format!("{tenant}/{uid}"),
    }
}

fn session_of(arb: &Arc<Arbiter>, tenant: &str, token_id: Option<String>) -> Uuid {
    let peer = Peer {
        pid: None,
        uid: None,
        unix: true,
    };
    let (id, rx) = arb
        .sessions()
        .open(tenant, "w", peer, token_id)
        .map(|(id, rx, _)| (id, rx))
        .unwrap();
    std::mem::forget(rx);
    id
}

fn usage(arb: &Arbiter, t: &str) -> crate::ledger::Usage {
    arb.views().tenant(t).unwrap().usage
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_reserved_with_a_bound_token_and_its_sessions_draw_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    arb.set_quota("a", quota(600 * MIB)).unwrap();
    let g = arb
        .claims()
        .reserve(claim("uid-1", "a", 255 * MIB), who())
        .await
        .unwrap();
    assert_eq!(g.reservation.bytes, 256 * MIB, "rounded to the granularity");
    assert_eq!(g.reservation.requested_bytes, 255 * MIB);
    let u = usage(&arb, "a");
    assert_eq!(
        (
            u.process_reserved_bytes,
            u.process_reservations,
            u.held_bytes
        ),
        (256 * MIB, 1, 0)
    );
    let tokens = arb.auth.list(Some("a"));
    assert_eq!(tokens.len(), 1);
    assert_eq!(tokens[0].name, claim_token_name("uid-1"));
    assert_eq!(tokens[0].token_id, g.token_id);
    assert_eq!(arb.claims().list().len(), 1);
    // A session of the claim's token draws from it: the tenant's total stays the claim.
    let s = session_of(&arb, "a", Some(g.token_id.clone()));
    let l = arb.acquire(req("a", s, 100 * MIB)).await.unwrap();
    let u = usage(&arb, "a");
    assert_eq!(
        (u.held_bytes, u.process_reserved_bytes),
        (100 * MIB, 156 * MIB)
    );
    // Past its room: refused, though the quota would allow it.
    let e = arb.acquire(req("a", s, 200 * MIB)).await.unwrap_err();
    assert!(
        matches!(e, BrokerError::ReservationExceeded { .. }),
        "{e:?}"
    );
    // A session of another token of the tenant is charged beside it.
    let other = session_of(&arb, "a", None);
    let o = arb.acquire(req("a", other, 64 * MIB)).await.unwrap();
    assert_eq!(usage(&arb, "a").committed_bytes(), 320 * MIB);
    arb.release("a", o.id).unwrap();
    arb.release("a", l.id).unwrap();
    assert_eq!(usage(&arb, "a").process_reserved_bytes, 256 * MIB);
    // The same claim again: refused, nothing changes.
    let e = arb
        .claims()
        .reserve(claim("uid-1", "a", 8 * MIB), who())
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::FailedPrecondition(_)), "{e:?}");
    assert_eq!(arb.auth.list(Some("a")).len(), 1);
    // Released: the room is uncharged, the token revoked, its sessions ended.
    arb.claims().release("uid-1", who()).await.unwrap();
    let u = usage(&arb, "a");
    assert_eq!((u.process_reserved_bytes, u.process_reservations), (0, 0));
    assert!(arb.auth.list(Some("a")).is_empty());
    assert!(arb.claims().list().is_empty());
    assert!(matches!(
        arb.acquire(req("a", s, MIB)).await.unwrap_err(),
        BrokerError::NotFound(_)
    ));
    // Unknown now: NOT_FOUND.
    let e = arb.claims().release("uid-1", who()).await.unwrap_err();
    assert!(
        matches!(&e, BrokerError::NotFound(crate::error::Missing::Claim(u)) if u == "uid-1"),
        "{e:?}"
    );
    assert_eq!(arb.state.lock().pools()[0].committed(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_over_the_quota_or_the_room_is_refused_and_leaves_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    arb.set_quota("a", quota(512 * MIB)).unwrap();
    let e = arb
        .claims()
        .reserve(claim("big", "a", 600 * MIB), who())
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::QuotaExceeded { .. }), "{e:?}");
    assert_eq!(e.kind(), ErrorKind::Exhausted);
    assert!(arb.auth.list(Some("a")).is_empty(), "its token revoked");
    assert_eq!(usage(&arb, "a"), crate::ledger::Usage::default());
    // The device's room: b holds most of it.
    arb.set_quota("b", quota(1024 * MIB)).unwrap();
    let sb = session_of(&arb, "b", None);
    arb.acquire(req("b", sb, 900 * MIB)).await.unwrap();
    let e = arb
        .claims()
        .reserve(claim("room", "a", 200 * MIB), who())
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::NoCapacity { .. }), "{e:?}");
    assert!(arb.auth.list(Some("a")).is_empty());
    // Bad values are invalid arguments; an unknown tenant is not found.
    for (c, want) in [
        (claim("", "a", MIB), ErrorKind::Invalid),
        (claim("x y", "a", MIB), ErrorKind::Invalid),
        (claim("z", "a", 0), ErrorKind::Invalid),
        (claim("z", "nobody", MIB), ErrorKind::NotFound),
        (
            ClaimRequest {
                device: 3,
                ..claim("z", "a", MIB)
            },
            ErrorKind::Invalid,
        ),
    ] {
        let e = arb.claims().reserve(c, who()).await.unwrap_err();
        assert_eq!(e.kind(), want);
    }
    assert!(arb.auth.list(None).is_empty());
}

/// A reserve that lost the race for a claim undoes only what it made: the winner's
/// reservation and stored record stay.
#[tokio::test]
async fn a_refused_reserve_leaves_the_winners_claim_alone() {
    let dir = tempfile::tempdir().unwrap();
    let arb = stored_arbiter(dir.path());
    arb.set_quota("a", quota(64 * MIB)).unwrap();
    let won = arb
        .claims()
        .reserve(claim("uid-1", "a", 8 * MIB), who())
        .await
        .unwrap();
    // The loser's undo, with the token it minted.
    arb.claims().undo("uid-1", "the-losers-token", who()).await;
    let claims = arb.claims().list();
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert_eq!(claims[0].0.token_id, won.token_id);
    assert_eq!(claims[0].1.id, won.reservation.id);
    let stored = arb.changes().commit(|s| s.load_claims()).unwrap();
    assert_eq!(stored.len(), 1, "the winner's record is kept");
}
