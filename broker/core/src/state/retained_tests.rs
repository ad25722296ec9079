//! Unit tests of retained blocks (`retained.rs`) on the core alone: a block released with
//! its mapping kept stays its tenant's (counted, watched until its process exits), is
//! granted again only to the session's own process, never reaches another tenant before
//! that process confirms it let go, and that process is asked when others wait.

use super::queue_tests::{quota, Core};
use super::tests::ask;
use crate::effects::{Effect, Watch};
use crate::memory::Handle;
use crate::request::{AcquireRequest, ValidRequest};
use crate::session::{Peer, Session, SessionEvent};
use std::time::Duration;
use uuid::Uuid;

const MIB: u64 = 1 << 20;

/// Opens a session of `tenant` whose peer process is `pid`.
fn session_of(c: &mut Core, tenant: &str, pid: u32) -> Uuid {
    let id = Uuid::now_v7();
    let peer = Peer {
        pid: Some(pid),
        uid: Some(1000),
        unix: true,
    };
    c.st.open_session(Session::new(id, tenant, "", peer, None), usize::MAX)
        .unwrap();
    c.st.take_effects();
    id
}

fn request(tenant: &str, session: Uuid, bytes: u64) -> ValidRequest {
    AcquireRequest {
        tenant: tenant.into(),
        session,
        bytes,
        device: None,
        wait: Duration::ZERO,
        label: String::new(),
        reclaimable: false,
        fallback_host: false,
    }
    .checked()
}

fn block_id(h: &Handle) -> u64 {
    let Handle::Fd { block_id, .. } = h;
    *block_id
}

/// Released with its mapping kept, a block stays counted to its tenant (quarantined, not
/// cached) and its process is watched; it is granted again only to that session's own
/// process, only for its size, as the same block; another process's release is a plain
/// one.
#[test]
fn a_retained_block_stays_its_tenants_and_goes_back_only_to_its_own_process() {
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    c.st.set_quota("b", quota(64 * MIB, 0)).unwrap();
    let s = session_of(&mut c, "a", 7);
    let lease = c.hold("a", s, 16 * MIB, 0, false);
    let block = block_id(&c.st.leases().get(&lease).unwrap().block.handle);

    assert_eq!(
        c.st.release_retained("b", lease, 7, true),
        None,
        "not b's lease"
    );
    assert_eq!(c.st.release_retained("a", lease, 7, true), Some(true));
    let effects = c.st.take_effects().into_vec();
    assert!(
        effects.iter().any(|e| matches!(e,
            Effect::Watch { watch: Watch::Quarantine { lease: l, pid: Some(7) } } if *l == lease)),
        "its process is watched: {effects:?}"
    );
    let usage = c.st.ledger().get("a").unwrap().usage;
    assert_eq!((usage.held_bytes, usage.quarantined_bytes), (0, 16 * MIB));
    let pool = c.st.pools()[0].stats();
    assert_eq!((pool.cached, pool.quarantined), (0, 16 * MIB));
    c.st.check_invariant().unwrap();

    // Another process (a child using the session), another tenant, another size: no.
    let avail = c.avail.clone();
    assert!(c
        .st
        .grant_retained(&request("a", s, 16 * MIB), 8, &avail)
        .is_none());
    let other = session_of(&mut c, "b", 7);
    assert!(c
        .st
        .grant_retained(&request("b", other, 16 * MIB), 7, &avail)
        .is_none());
    assert!(c
        .st
        .grant_retained(&request("a", s, 8 * MIB), 7, &avail)
        .is_none());
    assert!(!c.st.has_effects());

    // Its own process, a size that rounds to the block's: the same block, as a lease.
    let view =
        c.st.grant_retained(&request("a", s, 15 * MIB), 7, &avail)
            .expect("granted");
    assert_eq!(block_id(&view.handle), block);
    assert_eq!((view.bytes, view.requested_bytes), (16 * MIB, 15 * MIB));
    let usage = c.st.ledger().get("a").unwrap().usage;
    assert_eq!(
        (usage.held_bytes, usage.quarantined_bytes, usage.lease_count),
        (16 * MIB, 0, 1)
    );
    let effects = c.st.take_effects().into_vec();
    assert!(
        effects.iter().any(|e| matches!(e,
            Effect::Unwatch { watch: Watch::Quarantine { lease: l, .. } } if *l == lease)),
        "no longer watched: {effects:?}"
    );
    c.st.check_invariant().unwrap();

    // A retaining release by a process that is not the session's is declined and changes
    // nothing (the caller maps the block until it releases plainly).
    assert_eq!(c.st.release_retained("a", view.id, 8, true), Some(false));
    let pool = c.st.pools()[0].stats();
    assert_eq!(
        (pool.leased, pool.cached, pool.quarantined),
        (16 * MIB, 0, 0)
    );
    c.st.check_invariant().unwrap();
}

/// Another tenant waiting for the memory of a retained block: the process is asked to let
/// go (once), the block stays out of reach until it confirms (another tenant cannot
/// confirm for it), and then the waiter gets fresh memory, never the block.
#[test]
fn another_tenant_never_gets_a_retained_block_and_its_process_is_asked_for_it() {
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    c.st.set_quota("b", quota(64 * MIB, 0)).unwrap();
    let s = session_of(&mut c, "a", 7);
    let lease = c.hold("a", s, 48 * MIB, 0, false);
    let block = block_id(&c.st.leases().get(&lease).unwrap().block.handle);
    assert_eq!(c.st.release_retained("a", lease, 7, true), Some(true));
    c.st.take_effects();
    let b = session_of(&mut c, "b", 9);

    let waiter = c.wait(ask("b", b, 32 * MIB, None), 0);
    let effects = c.run(0);
    let asked: Vec<_> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Notify {
                session,
                event: SessionEvent::DropRetained { lease_id },
            } => Some((*session, *lease_id)),
            _ => None,
        })
        .collect();
    assert_eq!(asked, vec![(s, lease)], "its process is asked: {effects:?}");
    assert!(
        !effects
            .iter()
            .any(|e| matches!(e, Effect::Reply { .. } | Effect::Materialize { .. })),
        "nothing granted while it is retained"
    );
    assert!(
        !c.run(1).iter().any(|e| matches!(e, Effect::Notify { .. })),
        "asked once"
    );

    assert!(!c.st.drop_retained("b", lease), "only its tenant confirms");
    assert!(c.st.drop_retained("a", lease));
    assert!(!c.st.drop_retained("a", lease), "once");
    let effects = c.run(2);
    let freed: Vec<u64> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Free { block, .. } => Some(block_id(&block.handle)),
            _ => None,
        })
        .collect();
    assert!(
        effects.iter().any(|e| matches!(e,
            Effect::Materialize { grant } if grant.to == waiter)),
        "the waiter gets fresh memory: {effects:?}"
    );
    assert_eq!(
        freed,
        vec![block],
        "the retained block is freed, not handed on"
    );
    // Its process let go by word only: the free checks that the memory came back.
    let reached: Vec<u32> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Free { block, .. } => Some(block.reached.pids().to_vec()),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(!reached.is_empty(), "{effects:?}");
}

/// A lease whose descriptor went to another process, or that was drawn for a published
/// or sealed block, is never retained: a retaining release of it is declined and leaves
/// it leased (the caller then unmaps and releases it plainly).
#[test]
fn a_lease_another_process_fetched_is_not_retained() {
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    let s = session_of(&mut c, "a", 7);
    let lease = c.hold("a", s, 16 * MIB, 0, false);
    c.st.add_recipient(lease, 8, None);
    c.st.take_effects();
    assert_eq!(c.st.release_retained("a", lease, 7, true), Some(false));
    assert!(c.st.quarantine().values().all(|q| q.retained_by.is_none()));
    assert_eq!(c.st.pools()[0].stats().leased, 16 * MIB, "still leased");
    c.st.check_invariant().unwrap();
    // A client that cannot be told of a decline (older than declines) gets what it
    // expects: a plain release (the lease ends as `ReleaseLease` ends it).
    assert_eq!(c.st.release_retained("a", lease, 7, false), Some(false));
    assert!(!c.st.has_lease("a", lease));
    assert_eq!(c.st.pools()[0].stats().leased, 0);
    c.st.check_invariant().unwrap();
}

/// What the keeper holds of a retained block: its quarantine record names the session
/// whose process retained it; leased again, that record goes after the lease's is
/// written; taken back after a restart, the block is still that process's retained one,
/// so its word frees it (else it would stay counted until the process exits).
#[test]
fn a_kept_retained_block_is_let_go_by_word_after_a_restart() {
    use crate::effects::Keep;
    let mut c = Core::new(1, 64 * MIB);
    c.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    c.st.set_keeping(true);
    let s = session_of(&mut c, "a", 7);
    let lease = c.hold("a", s, 16 * MIB, 0, false);
    c.st.take_effects();
    assert_eq!(c.st.release_retained("a", lease, 7, true), Some(true));
    let fx = c.st.take_effects().into_vec();
    let retained_by = fx.iter().find_map(|e| match e {
        Effect::Keep {
            change: Keep::Quarantine(r, _),
        } if r.lease == lease.to_string() => Some(r.retained_by.clone()),
        _ => None,
    });
    assert_eq!(retained_by, Some(Some(s.to_string())), "{fx:?}");

    let avail = c.avail.clone();
    let view =
        c.st.grant_retained(&request("a", s, 16 * MIB), 7, &avail)
            .unwrap();
    let fx = c.st.take_effects().into_vec();
    let at = |want: &dyn Fn(&Keep) -> bool| {
        fx.iter()
            .position(|e| matches!(e, Effect::Keep { change } if want(change)))
    };
    let leased = at(&|k| matches!(k, Keep::Lease(r, _) if r.id == view.id.to_string()));
    let lifted = at(&|k| matches!(k, Keep::QuarantineLifted(id) if *id == lease));
    assert!(
        leased.is_some() && lifted > leased,
        "the lease's record, then the quarantine's goes: {fx:?}"
    );

    // Taken back by a restarted core: the block is the session's retained one again.
    let mut r = Core::new(1, 64 * MIB);
    r.st.set_quota("a", quota(64 * MIB, 0)).unwrap();
    let block = r.block(16 * MIB);
    let adopted = super::adopt::AdoptedQuarantine {
        lease,
        tenant: "a".into(),
        device: 0,
        pid: Some(7),
        pid_start: None,
        destroy: false,
        retained_by: Some(s),
    };
    r.st.adopt_quarantine(adopted, block).unwrap();
    r.st.check_invariant().unwrap();
    assert_eq!(
        r.st.ledger().get("a").unwrap().usage.quarantined_bytes,
        16 * MIB
    );
    assert!(!r.st.drop_retained("b", lease), "only its tenant's word");
    assert!(r.st.drop_retained("a", lease), "let go by word");
    let u = r.st.ledger().get("a").unwrap().usage;
    assert_eq!((u.held_bytes, u.quarantined_bytes), (0, 0));
    r.st.check_invariant().unwrap();
}
