//! Unit tests of the core's transitions that the shell once did by hand: opening a session
//! (and its refusals), a drain's end withdrawing what it asked, shutdown's start, and a
//! grant's end after its device work. On the core alone (the queue tests' [`Core`]): no
//! runtime, no arbiter, no device; what a transition decided is read from the state and
//! the effects it pushed.

use super::queue_tests::{quota, Core};
use super::tests::ask;
use crate::effects::{Effect, Watch};
use crate::error::{BrokerError, Missing};
use crate::lease::LeaseState;
use crate::pool::Source;
use crate::queue::Granted;
use crate::session::{Peer, Session, SessionEvent};
use std::time::{Duration, SystemTime};
use uuid::Uuid;

const MIB: u64 = 1 << 20;

fn session(tenant: &str, pid: Option<u32>) -> Session {
    let peer = Peer {
        pid,
        uid: None,
        unix: pid.is_some(),
    };
    Session::new(Uuid::now_v7(), tenant, "", peer, None)
}

/// The core refuses a session of a tenant that does not exist or is being deleted, and one
/// past the tenant's cap, changing nothing and pushing nothing; an accepted session of a
/// known pid has its peer watched.
#[test]
fn a_session_is_refused_for_a_missing_or_closing_tenant_and_past_its_tenants_cap() {
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    c.st.set_quota("gone", quota(64 * MIB, 0)).unwrap();
    let refused = c.st.open_session(session("nobody", Some(7)), 8);
    assert_eq!(
        refused,
        Err(BrokerError::NotFound(Missing::TenantGone("nobody".into())))
    );
    c.st.close_tenant("gone").unwrap();
    let refused = c.st.open_session(session("gone", Some(7)), 8);
    assert_eq!(
        refused,
        Err(BrokerError::NotFound(Missing::TenantGone("gone".into())))
    );
    assert!(!c.st.has_effects());
    assert_eq!(c.st.sessions().len(), 0);

    let first = session("a", Some(7));
    let id = first.id;
    c.st.open_session(first, 2).unwrap();
    assert!(
        matches!(
            c.st.take_effects().into_vec().as_slice(),
            [Effect::Watch { watch: Watch::Session { session, pid: 7 } }] if *session == id
        ),
        "its peer is watched"
    );
    c.st.open_session(session("a", None), 2).unwrap();
    assert!(!c.st.has_effects(), "no pid, no watcher");
    let refused = c.st.open_session(session("a", Some(8)), 2);
    assert_eq!(
        refused,
        Err(BrokerError::SessionLimit {
            tenant: "a".into(),
            open: 2
        })
    );
    assert!(!c.st.has_effects());
    assert_eq!(c.st.sessions().count_of("a"), 2);
    // Its deletion failed: the tenant takes sessions again.
    c.st.reopen_tenant("gone");
    c.st.open_session(session("gone", None), 2).unwrap();
    c.st.check_invariant().unwrap();
}

/// An undrain makes active again exactly the leases the drain asked that are still asked
/// (not one asked by nobody, nor one that ended meanwhile), telling nobody.
#[test]
fn an_undrain_withdraws_only_what_the_drain_asked_that_is_still_asked() {
    let mut c = Core::new(2, 64 * MIB);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let asked = c.hold("a", a, 2 * MIB, 0, true);
    let ended = c.hold("a", a, 2 * MIB, 0, true);
    let other = c.hold("a", a, 2 * MIB, 1, true);
    let due = c.t0 + Duration::from_secs(30);
    let by_drain =
        c.st.ask_drain_reclaim(&[0], due, SystemTime::now(), "firmware");
    assert_eq!(by_drain.len(), 2);
    c.st.end_lease(ended, super::Ending::Cache).unwrap();
    c.st.take_effects();
    let ids: Vec<Uuid> = by_drain.iter().map(|(_, id)| *id).chain([other]).collect();
    assert_eq!(c.st.withdraw_drain_reclaim(&ids), 1);
    assert_eq!(c.st.leases().get(&asked).unwrap().state, LeaseState::Active);
    assert_eq!(c.st.leases().get(&other).unwrap().state, LeaseState::Active);
    assert!(!c.st.has_effects(), "holders are not told");
    // Withdrawn once: nothing is left to withdraw.
    assert_eq!(c.st.withdraw_drain_reclaim(&ids), 0);
    c.st.check_invariant().unwrap();
}

/// Shutdown's start tells every open session, with the grace it has, and refuses every
/// waiting request; memory stays where it is.
#[test]
fn shutdown_tells_every_session_and_refuses_every_waiter() {
    let mut c = Core::new(1, 64 * MIB);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 0));
    let held = c.hold("a", a, 8 * MIB, 0, false);
    let w1 = c.wait(ask("a", a, 60 * MIB, None), 0);
    let w2 = c.wait(ask("b", b, 60 * MIB, None), 0);
    let grace = Duration::from_secs(9);
    c.st.begin_shutdown(grace);
    let effects = c.st.take_effects().into_vec();
    let mut told: Vec<Uuid> = Vec::new();
    let mut refused = Vec::new();
    for e in effects {
        match e {
            Effect::Notify {
                session,
                event: SessionEvent::ShuttingDown { grace: g, .. },
            } if g == grace => told.push(session),
            Effect::Reply {
                to,
                result: Err(BrokerError::ShuttingDown),
            } => refused.push(to),
            other => panic!("unexpected {other:?}"),
        }
    }
    told.sort();
    refused.sort();
    let mut want = vec![a, b];
    want.sort();
    assert_eq!(told, want);
    assert_eq!(refused, vec![w1, w2]);
    assert!(c.st.queue().is_empty());
    assert!(c.st.leases().get(&held).is_some());
    c.st.check_invariant().unwrap();
}

/// After its device work a grant is committed and its waiter answered with the lease; a
/// failed device work, a session gone or a shutdown gives the reservation back (a reused
/// block into the cache) and answers why; a grant given up before its device work gives
/// its reserved block back to the cache.
#[test]
fn a_grant_after_its_device_work_is_committed_or_given_back_and_its_waiter_answered() {
    let mut c = Core::new(1, 64 * MIB);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let req = ask("a", a, 4 * MIB, Some(0));
    let reply = |c: &mut Core| match c.st.take_effects().into_vec().as_slice() {
        [.., Effect::Reply { to, result }] => (
            *to,
            result
                .as_ref()
                .map(|g| match g {
                    Granted::Lease(v) => v.id,
                    Granted::Process(_) => panic!("a process grant"),
                })
                .map_err(Clone::clone),
        ),
        other => panic!("no reply: {other:?}"),
    };

    // Made: committed, answered with the lease.
    assert!(matches!(
        c.st.reserve_grant(&req, 0).unwrap(),
        Source::Fresh { .. }
    ));
    let block = c.block(4 * MIB);
    c.st.finish_grant(&req, 0, 0, Ok(block), false, 11);
    let (to, r) = reply(&mut c);
    let lease = r.clone().unwrap();
    assert_eq!(to, 11);
    assert!(c.st.leases().get(&lease).is_some());
    c.st.check_invariant().unwrap();

    // The device work failed: nothing held for it, the waiter gets the error.
    c.st.reserve_grant(&req, 0).unwrap();
    let err = BrokerError::Internal("scrub failed".into());
    c.st.finish_grant(&req, 0, 0, Err(err.clone()), false, 12);
    assert_eq!(reply(&mut c), (12, Err(err)));
    assert_eq!(c.st.pools()[0].stats().reserved, 0);
    assert_eq!(c.st.ledger().get("a").unwrap().usage.reserved_bytes, 0);
    c.st.check_invariant().unwrap();

    // Made while the broker shuts down: the block goes to the cache.
    c.st.reserve_grant(&req, 0).unwrap();
    let block = c.block(4 * MIB);
    c.st.finish_grant(&req, 0, 0, Ok(block), true, 13);
    assert_eq!(reply(&mut c), (13, Err(BrokerError::ShuttingDown)));
    assert_eq!(c.st.pools()[0].stats().cached, 4 * MIB);
    c.st.check_invariant().unwrap();

    // Given up before its device work (no runtime for it): the cached block it was to
    // reuse goes back to the cache.
    let Source::Cached { block, .. } = c.st.reserve_grant(&req, 0).unwrap() else {
        panic!("the cached block is reused");
    };
    assert_eq!(c.st.pools()[0].stats().cached, 0);
    let err = BrokerError::Internal("no runtime".into());
    c.st.refuse_grant(&req, 0, Some(block), 14, err.clone());
    assert_eq!(reply(&mut c), (14, Err(err)));
    assert_eq!(c.st.pools()[0].stats().cached, 4 * MIB);
    assert_eq!(c.st.pools()[0].stats().reserved, 0);
    assert_eq!(c.st.leases().iter().count(), 1);
    c.st.check_invariant().unwrap();
}

/// The core reads no clock: what it stamps carries the hold's time the shell gave it
/// (`State::set_clock`): a lease's creation, when its memory was quarantined, a process
/// reservation's creation and its version-7 id (in the order made, within one hold too).
#[test]
fn the_core_stamps_with_the_holds_clock() {
    let mut c = Core::new(1, 64 * MIB);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 0));
    let hold = super::Clock {
        now: c.t0 + Duration::from_secs(90),
        wall: SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
    };
    c.st.set_clock(hold);
    assert_eq!(c.st.clock(), hold);
    let l = c.hold("a", a, 2 * MIB, 0, false);
    assert_eq!(c.st.leases().get(&l).unwrap().created, hold.wall);
    c.st.end_lease(l, super::Ending::Quarantine { pid: Some(7) })
        .unwrap();
    assert_eq!(c.st.quarantine()[&l].since, hold.now);
    let first =
        c.st.grant_process(&ask("a", a, 2 * MIB, Some(0)), 0)
            .unwrap();
    let second =
        c.st.grant_process(&ask("b", b, 2 * MIB, Some(0)), 0)
            .unwrap();
    for id in [first, second] {
        let r = c.st.reservations().get(&id).unwrap();
        assert_eq!(r.created, hold.wall);
        let (secs, nanos) = id.get_timestamp().unwrap().to_unix();
        assert_eq!((secs, nanos / 1_000_000), (1_700_000_000, 123));
    }
    assert!(first < second, "ids in the order they were made");
    // The next hold's time stamps what it makes.
    let later = super::Clock {
        now: hold.now + Duration::from_secs(1),
        wall: hold.wall + Duration::from_secs(1),
    };
    c.st.set_clock(later);
    let l = c.hold("a", a, 2 * MIB, 0, false);
    assert_eq!(c.st.leases().get(&l).unwrap().created, later.wall);
    c.st.take_effects();
    c.st.check_invariant().unwrap();
}

/// A kept lease of a claim's session (its token bound to the claim's reservation, taken
/// again from the store before adoption) is drawn from that reservation again: the
/// tenant is charged the claim's bytes once, and the lease's end gives them back to it.
#[test]
fn a_kept_lease_of_a_claims_session_is_drawn_from_the_claim_again() {
    use super::adopt::Adopted;
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(32 * MIB, 0)).unwrap();
    c.st.set_keeping(true);
    let ask = crate::reservations::ClaimAsk {
        tenant: "a".into(),
        device: 0,
        bytes: 16 * MIB,
        label: "ns/c".into(),
        binding: crate::reservations::ClaimBinding {
            uid: "uid-1".into(),
            token_id: "tok".into(),
        },
    };
    let rid = c.st.grant_claim(ask).unwrap();
    let mut s = session("a", Some(7));
    s.token_id = Some("tok".into());
    let sid = s.id;
    c.st.adopt_session(s).unwrap();
    c.st.take_effects();
    let a = Adopted {
        id: Uuid::new_v4(),
        tenant: "a".into(),
        session: sid,
        device: 0,
        requested_bytes: 4 * MIB,
        label: "kv".into(),
        reclaimable: false,
        created: SystemTime::UNIX_EPOCH,
        priority: 0,
        reservation: None,
        recipients: Default::default(),
    };
    let block = c.block(4 * MIB);
    c.st.adopt_lease(a.clone(), block).unwrap();
    let u = c.st.ledger().get("a").unwrap().usage;
    assert_eq!(
        (u.held_bytes, u.process_reserved_bytes),
        (4 * MIB, 12 * MIB),
        "drawn from the claim, not charged beside it"
    );
    assert_eq!(c.st.reservations().get(&rid).unwrap().drawn, 4 * MIB);
    c.st.check_invariant().unwrap();
    c.st.end_lease(a.id, super::Ending::Cache).unwrap();
    c.st.take_effects();
    let u = c.st.ledger().get("a").unwrap().usage;
    assert_eq!((u.held_bytes, u.process_reserved_bytes), (0, 16 * MIB));
    c.st.check_invariant().unwrap();
}

/// A core restarted with a keeper (tenant "a" allowed 8 MiB of one 64 MiB device) that took
/// back a session of process 7; its effects not yet taken.
fn restarted_with_kept_session() -> (Core, Uuid) {
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(8 * MIB, 0)).unwrap();
    c.st.set_keeping(true);
    let s = session("a", Some(7));
    let sid = s.id;
    c.st.adopt_session(s).unwrap();
    (c, sid)
}

/// A restarted broker takes back a kept session and its lease: the same id and bytes,
/// charged to its tenant beyond a quota that shrank meanwhile, counted on its device,
/// its peer watched, and nothing pushed for the keeper (it holds them already); a lease of
/// a session not taken back, or on no such device, is handed back.
#[test]
fn kept_sessions_and_leases_are_taken_back_beyond_a_shrunk_quota() {
    use super::adopt::{Adopted, NotAdopted};
    let (mut c, sid) = restarted_with_kept_session();
    assert!(matches!(
        c.st.take_effects().into_vec().as_slice(),
        [Effect::Watch {
            watch: Watch::Session { pid: 7, .. }
        }]
    ));
    let kept = |session| Adopted {
        id: Uuid::new_v4(),
        tenant: "a".into(),
        session,
        device: 0,
        requested_bytes: 12 * MIB,
        label: "kv".into(),
        reclaimable: false,
        created: SystemTime::UNIX_EPOCH,
        priority: 0,
        reservation: None,
        recipients: Default::default(),
    };
    let a = kept(sid);
    let block = c.block(12 * MIB);
    let view = c.st.adopt_lease(a.clone(), block).unwrap();
    assert_eq!(
        (view.id, view.bytes, view.label.as_str()),
        (a.id, 12 * MIB, "kv")
    );
    assert!(!c.st.has_effects(), "nothing for the keeper: it holds it");
    let u = &c.st.ledger().get("a").unwrap().usage;
    assert_eq!(
        (u.held_bytes, u.lease_count),
        (12 * MIB, 1),
        "beyond its 8 MiB quota"
    );
    assert_eq!(c.st.pools()[0].stats().leased, 12 * MIB);
    c.st.check_invariant().unwrap();

    let stranger = c.block(2 * MIB);
    let r = c.st.adopt_lease(kept(Uuid::now_v7()), stranger);
    assert!(matches!(r, Err((NotAdopted::Session, _))));
    let elsewhere = Adopted {
        device: 3,
        ..kept(sid)
    };
    let block = c.block(2 * MIB);
    let r = c.st.adopt_lease(elsewhere, block);
    assert!(matches!(r, Err((NotAdopted::Device, _))));
    c.st.check_invariant().unwrap();

    // Its end is kept like any other lease's, and its block is freed, not cached: who
    // else got its descriptor before the restart is not known.
    c.st.end_lease(a.id, super::Ending::Cache).unwrap();
    let fx = c.st.take_effects().into_vec();
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::Keep { change: crate::effects::Keep::LeaseEnded(id) } if *id == a.id)));
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Free { .. })),
        "{fx:?}"
    );
    assert_eq!(c.st.pools()[0].stats().cached, 0);
    c.st.check_invariant().unwrap();
}

/// A lease released while its process lives leaves its block remembering that process, and
/// the block's free carries it; memory the shell then finds kept after that free is charged
/// to the block's tenant as quarantined, watched per process, until every one has exited.
/// Nothing is counted for no process or an unknown tenant.
#[test]
fn memory_kept_after_its_free_is_charged_to_its_tenant_until_its_holders_exit() {
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    let s = session("a", Some(7));
    let sid = s.id;
    c.st.open_session(s, 8).unwrap();
    let l = c.hold("a", sid, 32 * MIB, 0, false);
    c.st.end_lease(l, super::Ending::Cache).unwrap();
    c.st.take_effects();
    // The device shrinks: the cached block is freed, with the process it reached.
    c.st.set_leasable(0, 0);
    let fx = c.st.take_effects().into_vec();
    let freed: Vec<_> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Free { block, .. } => Some(block),
            _ => None,
        })
        .collect();
    assert_eq!(freed.len(), 1, "{fx:?}");
    assert_eq!(freed[0].reached.pids(), &[7]);
    assert_eq!(freed[0].last_tenant.as_deref(), Some("a"));
    c.st.set_leasable(0, 64 * MIB);
    c.st.take_effects();

    let id = c.st.stranded("a", 0, 32 * MIB, [7, 9]).unwrap();
    let watched: Vec<u32> =
        c.st.take_effects()
            .into_vec()
            .into_iter()
            .filter_map(|e| match e {
                Effect::Watch {
                    watch: Watch::Stranded { id: i, pid },
                } if i == id => Some(pid),
                _ => None,
            })
            .collect();
    assert_eq!(watched, vec![7, 9]);
    let held = |c: &Core| c.st.ledger().get("a").unwrap().usage.quarantined_bytes;
    assert_eq!(held(&c), 32 * MIB);
    assert_eq!(c.st.pools()[0].stats().quarantined, 32 * MIB);
    c.st.check_invariant().unwrap();
    assert!(!c.st.stranded_holder_gone(id, 7), "9 may still keep it");
    assert_eq!(held(&c), 32 * MIB);
    assert!(c.st.stranded_holder_gone(id, 9));
    assert_eq!(held(&c), 0);
    assert_eq!(c.st.pools()[0].stats().quarantined, 0);
    assert!(!c.st.stranded_holder_gone(id, 9), "once");
    c.st.check_invariant().unwrap();

    assert!(c.st.stranded("nobody", 0, 2 * MIB, [7]).is_none());
    assert!(c.st.stranded("a", 0, 2 * MIB, []).is_none());
    assert!(
        c.st.stranded("a", 5, 2 * MIB, [7]).is_none(),
        "no such device"
    );
    assert_eq!(held(&c), 0);
    c.st.check_invariant().unwrap();
}

/// A restart takes back a kept publication of a lease it took back (same id and name,
/// importable again) and a kept import of a session it took back, pushing nothing for the
/// keeper; an import of a session or publication not taken back is refused. The books are
/// as before the restart: when the publisher's lease ends, its block is held for the
/// import (counted to the publisher as quarantined) and the publication's record goes;
/// the import's release ends its record and frees the block.
#[test]
fn kept_publications_and_imports_are_taken_back_with_their_lease_and_session() {
    use super::adopt::{Adopted, NotAdopted};
    use super::adopt_shared::AdoptedImport;
    use crate::effects::Keep;
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    c.st.set_quota("b", quota(64 * MIB, 0)).unwrap();
    c.st.set_keeping(true);
    let (sa, sb) = (session("a", Some(7)), session("b", Some(8)));
    let (sa_id, sb_id) = (sa.id, sb.id);
    c.st.adopt_session(sa).unwrap();
    c.st.adopt_session(sb).unwrap();
    let lease = Uuid::new_v4();
    let block = c.block(12 * MIB);
    let crate::memory::Handle::Fd { fd, .. } = &block.handle;
    let fd = fd.clone();
    let a = Adopted {
        id: lease,
        tenant: "a".into(),
        session: sa_id,
        device: 0,
        requested_bytes: 12 * MIB,
        label: String::new(),
        reclaimable: false,
        created: SystemTime::UNIX_EPOCH,
        priority: 0,
        reservation: None,
        recipients: Default::default(),
    };
    c.st.adopt_lease(a, block).unwrap();
    c.st.take_effects();
    let publication = Uuid::new_v4();
    let published_at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_800_000);
    let new = |lease| super::NewPublication {
        lease,
        publisher: "a".into(),
        name: String::new(),
        readers: ["b".to_string()].into_iter().collect(),
        published_at,
        fd: fd.clone(),
        enforced: true,
        fd_counted: None,
    };
    c.st.adopt_publication(publication, Some("w".into()), new(lease))
        .unwrap();
    // Once only: the lease has its publication.
    assert!(matches!(
        c.st.adopt_publication(Uuid::new_v4(), Some("x".into()), new(lease)),
        Err(NotAdopted::Session)
    ));
    let p =
        c.st.shared()
            .visible("a", "w", "b")
            .expect("importable again");
    assert_eq!((p.id, p.published_at), (publication, published_at));
    let import = AdoptedImport {
        id: Uuid::new_v4(),
        publication,
        tenant: "b".into(),
        session: sb_id,
        pid: Some(8),
        created: SystemTime::UNIX_EPOCH,
        recipients: Default::default(),
    };
    c.st.adopt_import(import.clone()).unwrap();
    let gone_session = AdoptedImport {
        id: Uuid::new_v4(),
        session: Uuid::now_v7(),
        ..import.clone()
    };
    assert!(matches!(
        c.st.adopt_import(gone_session),
        Err(NotAdopted::Session)
    ));
    let gone_publication = AdoptedImport {
        id: Uuid::new_v4(),
        publication: Uuid::new_v4(),
        ..import.clone()
    };
    assert!(matches!(
        c.st.adopt_import(gone_publication),
        Err(NotAdopted::Publication)
    ));
    assert!(!c.st.has_effects(), "nothing for the keeper: it holds them");
    assert_eq!(c.st.shared().imports_of_session(sb_id), vec![import.id]);
    c.st.check_invariant().unwrap();

    c.st.end_lease(lease, super::Ending::Cache).unwrap();
    let fx = c.st.take_effects().into_vec();
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Keep { change: Keep::PublicationEnded(id) } if *id == publication)),
        "{fx:?}"
    );
    let u = &c.st.ledger().get("a").unwrap().usage;
    assert_eq!(
        (u.held_bytes, u.quarantined_bytes),
        (0, 12 * MIB),
        "held for the importer"
    );
    c.st.check_invariant().unwrap();

    c.st.import_let_go(import.id, super::Ending::Cache);
    let fx = c.st.take_effects().into_vec();
    assert!(
        fx.iter().any(
            |e| matches!(e, Effect::Keep { change: Keep::ImportEnded(id) } if *id == import.id)
        ),
        "{fx:?}"
    );
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Free { .. })),
        "{fx:?}"
    );
    assert_eq!(c.st.ledger().get("a").unwrap().usage.quarantined_bytes, 0);
    c.st.check_invariant().unwrap();
}

/// A restart takes back a kept process reservation of a session it took back: its room
/// (less what drawn leases lost to quarantine) charged again, beyond a shrunk quota; a kept
/// lease drawn from it is drawn from it again, and its bytes go back into the room when it
/// ends; its end is kept. A reservation of a session not taken back is refused.
/// A kept 16 MiB reservation of tenant `a` on device 0 for `session` (2 MiB of it lost
/// to the program's context), as a restart reads it.
fn kept_reservation(session: Uuid) -> crate::reservations::Reservation {
    crate::reservations::Reservation {
        id: Uuid::now_v7(),
        tenant: "a".into(),
        session,
        device: 0,
        bytes: 16 * MIB,
        requested_bytes: 16 * MIB,
        label: "run".into(),
        pid: Some(7),
        compute_percent: None,
        created: SystemTime::UNIX_EPOCH,
        drawn: 0,
        lost: 2 * MIB,
        group: None,
        claim: None,
    }
}

/// A kept reservation that cannot be taken back (its session, tenant or device gone) has
/// what is left of its program's process group stopped, as an ended reservation's is: a
/// program the broker no longer charges must not run on unaccounted.
#[test]
fn a_kept_reservation_not_taken_back_stops_its_programs_group() {
    use super::adopt::NotAdopted;
    use crate::process_group::ProcessGroup;
    use crate::reservations::Reservation;
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    let group = ProcessGroup {
        pgid: 4242,
        uid: 1000,
        leader_start: 77,
    };
    let kept = |device| Reservation {
        device,
        lost: 0,
        group: Some(group),
        ..kept_reservation(Uuid::now_v7())
    };
    let stopped = |c: &mut Core| {
        c.st.take_effects()
            .into_vec()
            .iter()
            .filter(|e| matches!(e, Effect::StopGroup { group: g } if *g == group))
            .count()
    };
    assert!(matches!(
        c.st.adopt_reservation(kept(0)),
        Err(NotAdopted::Session)
    ));
    assert_eq!(stopped(&mut c), 1, "its session is gone");
    c.st.reservation_not_kept(Some(group));
    assert_eq!(stopped(&mut c), 1, "its device is gone");
    c.st.reservation_not_kept(None);
    assert_eq!(stopped(&mut c), 0, "no group named");
    c.st.check_invariant().unwrap();
}

#[test]
fn a_kept_reservation_is_taken_back_with_its_session_and_its_drawn_leases() {
    use super::adopt::{Adopted, NotAdopted};
    let (mut c, sid) = restarted_with_kept_session();
    let kept = kept_reservation;
    assert!(matches!(
        c.st.adopt_reservation(kept(Uuid::now_v7())),
        Err(NotAdopted::Session)
    ));
    let r = kept(sid);
    let rid = r.id;
    c.st.adopt_reservation(r).unwrap();
    assert!(matches!(
        c.st.adopt_reservation(kept(sid)),
        Err(NotAdopted::Session)
    ));
    let usage = |c: &Core| {
        let u = &c.st.ledger().get("a").unwrap().usage;
        (u.process_reserved_bytes, u.held_bytes)
    };
    assert_eq!(usage(&c), (14 * MIB, 0), "beyond its 8 MiB quota");
    let lease = Uuid::new_v4();
    let block = c.block(4 * MIB);
    let a = Adopted {
        id: lease,
        tenant: "a".into(),
        session: sid,
        device: 0,
        requested_bytes: 4 * MIB,
        label: String::new(),
        reclaimable: false,
        created: SystemTime::UNIX_EPOCH,
        priority: 0,
        reservation: Some(rid),
        recipients: Default::default(),
    };
    c.st.adopt_lease(a, block).unwrap();
    assert_eq!(usage(&c), (10 * MIB, 4 * MIB), "drawn from it again");
    let fx = c.st.take_effects().into_vec();
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::Keep { .. })),
        "nothing for the keeper, it holds them: {fx:?}"
    );
    c.st.check_invariant().unwrap();

    c.st.end_lease(lease, super::Ending::Cache).unwrap();
    assert_eq!(usage(&c), (14 * MIB, 0), "its bytes back in the room");
    c.st.take_effects();
    c.st.end_reservation(rid);
    let fx = c.st.take_effects().into_vec();
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Keep { change: crate::effects::Keep::ReservationEnded(id) } if *id == rid)),
        "{fx:?}"
    );
    assert_eq!(usage(&c), (0, 0));
    c.st.check_invariant().unwrap();
}

/// A reclaim request is kept with its wall-clock deadline, and its end (the lease ended)
/// too; a restart asks the holder of a lease it took back again by that deadline (its
/// monotonic deadline the time left from the hold's clock), telling its session.
#[test]
fn a_kept_reclaim_request_asks_again_by_the_same_deadline() {
    use super::adopt::Adopted;
    use crate::effects::Keep;
    use crate::lease::LeaseState;
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    let s = session("a", Some(7));
    let sid = s.id;
    c.st.adopt_session(s).unwrap();
    let lease = Uuid::new_v4();
    let block = c.block(4 * MIB);
    let a = Adopted {
        id: lease,
        tenant: "a".into(),
        session: sid,
        device: 0,
        requested_bytes: 4 * MIB,
        label: String::new(),
        reclaimable: true,
        created: SystemTime::UNIX_EPOCH,
        priority: 0,
        reservation: None,
        recipients: Default::default(),
    };
    c.st.adopt_lease(a, block).unwrap();
    c.st.take_effects();
    assert!(!c.st.adopt_reclaim(Uuid::new_v4(), SystemTime::now()));
    let clock = c.st.clock();
    let due = clock.wall + Duration::from_secs(20);
    assert!(c.st.adopt_reclaim(lease, due));
    assert_eq!(
        c.st.leases().get(&lease).unwrap().state,
        LeaseState::ReclaimRequested {
            deadline: clock.now + Duration::from_secs(20),
            deadline_wall: due,
        }
    );
    let fx = c.st.take_effects().into_vec();
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Notify { event: SessionEvent::ReclaimRequested { deadline, .. }, .. } if *deadline == due)),
        "{fx:?}"
    );
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::Keep { .. })),
        "not keeping yet: {fx:?}"
    );
    c.st.set_keeping(true);
    c.st.end_lease(lease, super::Ending::Cache).unwrap();
    let fx = c.st.take_effects().into_vec();
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Keep { change: Keep::ReclaimEnded(id) } if *id == lease)),
        "{fx:?}"
    );
    c.st.check_invariant().unwrap();
}

/// Stranded memory the shell looked at again: a watched holder seen letting go while
/// alive loses its watch, and the last one lets the memory go; unwatched memory (a
/// memfd the kernel says lives, whoever holds it) is charged with no watch, even with
/// nobody named, and let go only when the shell says nobody holds it.
#[test]
fn stranded_memory_is_let_go_when_the_shell_sees_it_let_go() {
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    c.st.take_effects();
    let held = |c: &Core| c.st.ledger().get("a").unwrap().usage.quarantined_bytes;
    let watches = |c: &mut Core| -> Vec<Effect> {
        c.st.take_effects()
            .into_vec()
            .into_iter()
            .filter(|e| matches!(e, Effect::Watch { .. } | Effect::Unwatch { .. }))
            .collect()
    };

    let id = c.st.stranded("a", 0, 8 * MIB, [7, 9]).unwrap();
    watches(&mut c);
    assert!(!c.st.stranded_let_go(id, 7), "9 may still keep it");
    assert!(
        matches!(
            watches(&mut c)[..],
            [Effect::Unwatch {
                watch: Watch::Stranded { pid: 7, .. }
            }]
        ),
        "7's watch goes"
    );
    assert!(!c.st.stranded_let_go(id, 7), "once");
    assert_eq!(held(&c), 8 * MIB);
    assert!(c.st.stranded_let_go(id, 9));
    assert!(matches!(
        watches(&mut c)[..],
        [Effect::Unwatch {
            watch: Watch::Stranded { pid: 9, .. }
        }]
    ));
    assert_eq!(held(&c), 0);
    assert!(!c.st.is_stranded(id));
    c.st.check_invariant().unwrap();

    let id =
        c.st.stranded_unwatched("a", 0, 8 * MIB, [])
            .expect("nobody named");
    assert!(watches(&mut c).is_empty(), "nothing to watch");
    assert_eq!(held(&c), 8 * MIB);
    let named = c.st.stranded_unwatched("a", 0, 4 * MIB, [7]).unwrap();
    assert!(watches(&mut c).is_empty());
    assert!(
        !c.st.stranded_let_go(named, 7),
        "no longer named, still held"
    );
    assert!(
        !c.st.stranded_holder_gone(named, 7),
        "an exit does not let it go"
    );
    assert_eq!(held(&c), 12 * MIB);
    c.st.check_invariant().unwrap();
    assert!(c.st.stranded_released(id));
    assert!(!c.st.stranded_released(id), "once");
    assert!(c.st.stranded_released(named));
    assert!(watches(&mut c).is_empty());
    assert_eq!(held(&c), 0);
    assert_eq!(c.st.pools()[0].stats().quarantined, 0);
    c.st.check_invariant().unwrap();
}

/// A restart takes back a block held for importers (counted to the publisher as
/// quarantined again), its publication (by id, unpublished), a lingering import whose
/// process lives and an import of a session taken back (never beside a live lease of its
/// id); a held block nobody imports any more is let go at once. Afterwards the books go on as before the restart: the
/// block is freed, uncharged, and its record ends, when the last importer lets go.
#[test]
fn kept_held_blocks_and_lingering_imports_are_taken_back() {
    use super::adopt::Adopted;
    use super::adopt_shared::{
        AdoptedHeld, AdoptedHeldPublication, AdoptedImport, AdoptedLingering,
    };
    use crate::effects::Keep;
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    c.st.set_quota("b", quota(64 * MIB, 0)).unwrap();
    let sb = session("b", Some(9));
    let sb_id = sb.id;
    c.st.adopt_session(sb).unwrap();
    let sa = session("a", Some(7));
    let sa_id = sa.id;
    c.st.adopt_session(sa).unwrap();
    let held = |lease| AdoptedHeld {
        lease,
        tenant: "a".into(),
        device: 0,
        waiters: Default::default(),
        recipient_starts: Default::default(),
        timeout: false,
        destroy: true,
    };
    let (lease, idle) = (Uuid::new_v4(), Uuid::new_v4());
    let block = c.block(4 * MIB);
    let crate::memory::Handle::Fd { fd, .. } = &block.handle;
    let fd = fd.clone();
    c.st.adopt_held(held(lease), block).unwrap();
    let b = c.block(4 * MIB);
    c.st.adopt_held(held(idle), b).unwrap();
    // Never beside a live lease of its id.
    let live = Uuid::new_v4();
    let b = c.block(4 * MIB);
    c.st.adopt_lease(
        Adopted {
            id: live,
            tenant: "a".into(),
            session: sa_id,
            device: 0,
            requested_bytes: 4 * MIB,
            label: String::new(),
            reclaimable: false,
            created: SystemTime::UNIX_EPOCH,
            priority: 0,
            reservation: None,
            recipients: Default::default(),
        },
        b,
    )
    .unwrap();
    let b = c.block(4 * MIB);
    assert!(c.st.adopt_held(held(live), b).is_err());
    let publication = Uuid::new_v4();
    c.st.adopt_held_publication(
        lease,
        AdoptedHeldPublication {
            id: publication,
            readers: ["b".to_string()].into_iter().collect(),
            published_at: SystemTime::UNIX_EPOCH,
            fd,
            enforced: false,
            fd_counted: None,
        },
    )
    .unwrap();
    let import = |session| AdoptedImport {
        id: Uuid::new_v4(),
        publication,
        tenant: "b".into(),
        session,
        pid: Some(8),
        created: SystemTime::UNIX_EPOCH,
        recipients: Default::default(),
    };
    let lingering = import(Uuid::now_v7());
    c.st.adopt_lingering(AdoptedLingering {
        import: lingering.clone(),
        pid_start: Some(1234),
        waiters: [8].into_iter().collect(),
        timeout: false,
    })
    .unwrap();
    let live_import = AdoptedImport {
        pid: Some(9),
        ..import(sb_id)
    };
    c.st.adopt_import(live_import.clone()).unwrap();
    assert_eq!(c.st.settle_adopted_held(), vec![idle], "nobody imports it");
    let fx = c.st.take_effects().into_vec();
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::Keep { .. })),
        "{fx:?}"
    );
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Free { .. })),
        "{fx:?}"
    );
    assert_eq!(
        c.st.ledger().get("a").unwrap().usage.quarantined_bytes,
        4 * MIB
    );
    c.st.check_invariant().unwrap();

    c.st.set_keeping(true);
    c.st.import_waiter_gone(lingering.id, Some(8));
    c.st.import_let_go(live_import.id, super::Ending::Cache);
    let fx = c.st.take_effects().into_vec();
    let kept: Vec<&str> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Keep { change } => Some(change.name()),
            _ => None,
        })
        .collect();
    // The importer let go by word: the held block's record names it (a free after a
    // restart would check for it) before the block is let go.
    assert_eq!(
        kept,
        ["lingering-ended", "held", "import-ended", "held-let-go"]
    );
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Keep { change: Keep::HeldLetGo(l) } if *l == lease)),
        "{fx:?}"
    );
    assert_eq!(c.st.ledger().get("a").unwrap().usage.quarantined_bytes, 0);
    c.st.check_invariant().unwrap();
}

/// Memory processes the broker never recorded may keep: when its last named process
/// exits it stays charged until the shell has looked; the processes that look finds are
/// named and watched in turn, and a look that finds none lets it go.
#[test]
fn stranded_memory_with_unrecorded_holders_waits_for_the_shells_look() {
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    c.st.take_effects();
    let held = |c: &Core| c.st.ledger().get("a").unwrap().usage.quarantined_bytes;
    let watched = |c: &mut Core| -> Vec<u32> {
        c.st.take_effects()
            .into_vec()
            .into_iter()
            .filter_map(|e| match e {
                Effect::Watch {
                    watch: Watch::Stranded { pid, .. },
                } => Some(pid),
                _ => None,
            })
            .collect()
    };

    assert!(c.st.stranded_rechecking("a", 0, 8 * MIB, []).is_none());
    let id = c.st.stranded_rechecking("a", 0, 8 * MIB, [7, 9]).unwrap();
    assert_eq!(watched(&mut c), vec![7, 9]);
    assert!(!c.st.stranded_rechecked(id, [11]), "7 and 9 still named");
    assert!(!c.st.stranded_holder_gone(id, 7));
    assert!(!c.st.stranded_awaits_recheck(id));
    assert!(
        !c.st.stranded_holder_gone(id, 9),
        "not let go by the last exit"
    );
    assert!(c.st.stranded_awaits_recheck(id));
    assert_eq!(held(&c), 8 * MIB);
    c.st.check_invariant().unwrap();

    // The look finds 11 (a child of 7's): named, watched.
    assert!(!c.st.stranded_rechecked(id, [11]));
    assert_eq!(watched(&mut c), vec![11]);
    assert!(!c.st.stranded_awaits_recheck(id));
    assert!(!c.st.stranded_holder_gone(id, 11));
    assert_eq!(held(&c), 8 * MIB);
    // The next look finds nobody: let go.
    assert!(c.st.stranded_rechecked(id, []));
    assert!(!c.st.is_stranded(id));
    assert!(!c.st.stranded_rechecked(id, []), "once");
    assert_eq!(held(&c), 0);
    assert_eq!(c.st.pools()[0].stats().quarantined, 0);
    c.st.check_invariant().unwrap();
}
