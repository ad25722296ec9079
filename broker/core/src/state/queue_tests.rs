//! Unit tests of the queue policy (`queue.rs`), on the core alone: no runtime, no arbiter,
//! no device. Waiters are queued by hand (with the clock they were queued at), a pass or a
//! whole run is made with a [`QueueEnv`] built here, and what it decided is read from its
//! result and the effects it pushed.

use super::queue::{Enqueued, Pass, QueueEnv};
use super::tests::{ask, env, fake_block};
use super::{Clock, Ending, SealCheck, State};
use crate::availability::{Availability, Drain};
use crate::effects::{Counted, Effect};
use crate::error::BrokerError;
use crate::lease::LeaseState;
use crate::pool::{Block, Pool, Source};
use crate::queue::{Ask, Granted, WaiterId};
use crate::quota::Quota;
use crate::session::{Peer, Session};
use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use uuid::Uuid;

const MIB: u64 = 1 << 20;
const GRAN: u64 = 2 * MIB;
/// The overtake age of [`env`].
const AGE: Duration = Duration::from_secs(2);

/// A core under test, with the availability and clock its queue runs are given (shared
/// with the other transitions' unit tests, `transition_tests.rs`).
pub(super) struct Core {
    pub(super) st: State,
    pub(super) avail: Availability,
    pub(super) t0: Instant,
    next_alloc: u64,
    /// The descriptors (raw numbers) whose seals the core's look reports touched.
    touched: Touched,
}

/// What the test's seal look answers touched: the test adds seals by naming a descriptor.
type Touched = Arc<Mutex<BTreeSet<i32>>>;

/// The seal look of a core under test: untouched unless the test said otherwise.
fn seal_check(touched: &Touched) -> SealCheck {
    let touched = touched.clone();
    SealCheck::new(move |fd, _| !touched.lock().contains(&fd.raw()))
}

impl Core {
    /// A core over `devices` devices of `capacity` bytes each, every one admitting.
    pub(super) fn new(devices: u32, capacity: u64) -> Core {
        let pools = (0..devices)
            .map(|i| Pool::new(i, GRAN, capacity, capacity))
            .collect();
        let touched = Touched::default();
        Core {
            st: State::new(
                pools,
                vec![true; devices as usize],
                seal_check(&touched),
                Clock::read(),
            ),
            avail: Availability::new(devices as usize),
            t0: Instant::now(),
            next_alloc: 1,
            touched,
        }
    }

    /// The environment `secs` seconds after the start.
    fn env(&self, secs: u64) -> QueueEnv<'_> {
        env(&self.avail, self.t0 + Duration::from_secs(secs))
    }

    /// A tenant with one open session; returns the session.
    pub(super) fn tenant(&mut self, name: &str, q: Quota) -> Uuid {
        self.st.set_quota(name, q).unwrap();
        let id = Uuid::now_v7();
        self.st
            .open_session(
                Session::new(id, name, "", Peer::default(), None),
                usize::MAX,
            )
            .unwrap();
        id
    }

    pub(super) fn block(&mut self, bytes: u64) -> Block {
        let id = self.next_alloc;
        self.next_alloc += 1;
        fake_block(id, bytes)
    }

    /// A live lease of `bytes` on device `d` for `session` of `tenant`, made directly.
    pub(super) fn hold(
        &mut self,
        tenant: &str,
        session: Uuid,
        bytes: u64,
        d: u32,
        reclaimable: bool,
    ) -> Uuid {
        let mut a = ask(tenant, session, bytes, Some(d));
        a.reclaimable = reclaimable;
        let priority = self.st.ledger().get(tenant).unwrap().quota.priority;
        let block = match self.st.reserve_grant(&a, d).unwrap() {
            Source::Cached { block, .. } => block,
            Source::Fresh { .. } => self.block(bytes),
        };
        let v = self.st.commit_grant(&a, priority, d, block, false).unwrap();
        self.st.take_effects();
        v.id
    }

    /// Queues `ask` at `secs` after the start, without running the queue.
    pub(super) fn wait(&mut self, ask: Ask, secs: u64) -> WaiterId {
        let priority = self.st.ledger().get(&ask.tenant).unwrap().quota.priority;
        let since = self.t0 + Duration::from_secs(secs);
        self.st.queue_mut().push(ask, priority, since)
    }

    fn pass(&self, secs: u64) -> Pass {
        self.st.queue_pass(&self.env(secs))
    }

    pub(super) fn run(&mut self, secs: u64) -> Vec<Effect> {
        let env = env(&self.avail, self.t0 + Duration::from_secs(secs));
        self.st.run_queue(&env);
        self.st.check_invariant().unwrap();
        self.st.take_effects().into_vec()
    }
}

pub(super) fn quota(limit: u64, priority: i32) -> Quota {
    Quota {
        limit_bytes: limit,
        priority,
        ..Quota::default()
    }
}

/// The answers the effects carry, by waiter: Ok(device) for a grant committed at once or
/// left to the device work, Err for a refusal.
fn answers(effects: &[Effect]) -> Vec<(WaiterId, Result<u32, BrokerError>)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Reply {
                to,
                result: Ok(Granted::Lease(v)),
            } => Some((*to, Ok(v.device))),
            Effect::Reply {
                to,
                result: Ok(Granted::Process(v)),
            } => Some((*to, Ok(v.device))),
            Effect::Reply { to, result: Err(e) } => Some((*to, Err(e.clone()))),
            Effect::Materialize { grant: p } => Some((p.to, Ok(p.device))),
            _ => None,
        })
        .collect()
}

#[test]
fn a_pass_grants_the_first_waiter_that_fits_in_order_of_service() {
    let mut c = Core::new(1, 64 * MIB);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 5));
    let wa = c.wait(ask("a", a, 16 * MIB, None), 0);
    let wb = c.wait(ask("b", b, 16 * MIB, None), 1);
    assert_eq!(
        c.pass(1),
        Pass {
            grant: Some((wb, 0)),
            reclaim: vec![]
        },
        "higher priority first"
    );
    let effects = c.run(1);
    assert_eq!(answers(&effects), vec![(wb, Ok(0)), (wa, Ok(0))]);
    assert!(c.st.queue().is_empty());
}

#[test]
fn a_head_blocked_by_capacity_is_overtaken_by_other_tenants_only_while_young() {
    let mut c = Core::new(1, 64 * MIB);
    let x = c.tenant("x", quota(64 * MIB, 0));
    c.hold("x", x, 48 * MIB, 0, false);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 0));
    let low = c.tenant("low", quota(64 * MIB, -1));
    let big = c.wait(ask("a", a, 32 * MIB, None), 0);
    let _own = c.wait(ask("a", a, 8 * MIB, None), 0);
    let _lower = c.wait(ask("low", low, 8 * MIB, None), 0);
    let other = c.wait(ask("b", b, 8 * MIB, None), 0);
    // Young: another tenant of its priority goes first; its own tenant's later request
    // and the lower priority do not.
    assert_eq!(
        c.pass(1),
        Pass {
            grant: Some((other, 0)),
            reclaim: vec![big]
        }
    );
    // As old as the overtake age: it blocks the device for everyone after it.
    assert_eq!(
        c.pass(AGE.as_secs()),
        Pass {
            grant: None,
            reclaim: vec![big]
        }
    );
}

#[test]
fn with_a_zero_overtake_age_nobody_overtakes() {
    let mut c = Core::new(1, 64 * MIB);
    let x = c.tenant("x", quota(64 * MIB, 0));
    c.hold("x", x, 48 * MIB, 0, false);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 0));
    let big = c.wait(ask("a", a, 32 * MIB, None), 0);
    c.wait(ask("b", b, 8 * MIB, None), 0);
    let env = QueueEnv {
        overtake_age: Duration::ZERO,
        ..c.env(0)
    };
    assert_eq!(
        c.st.queue_pass(&env),
        Pass {
            grant: None,
            reclaim: vec![big]
        }
    );
}

#[test]
fn a_head_blocked_on_one_device_does_not_hold_another() {
    let mut c = Core::new(2, 64 * MIB);
    let x = c.tenant("x", quota(128 * MIB, 0));
    c.hold("x", x, 48 * MIB, 0, false);
    c.hold("x", x, 48 * MIB, 1, false);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 0));
    let big = c.wait(ask("a", a, 32 * MIB, Some(0)), 0);
    let other = c.wait(ask("b", b, 8 * MIB, None), 0);
    // Old: device 0 is held for it; device 1 is not.
    assert_eq!(
        c.pass(10),
        Pass {
            grant: Some((other, 1)),
            reclaim: vec![big]
        }
    );
}

#[test]
fn a_waiter_blocked_by_its_own_quota_blocks_nobody() {
    let mut c = Core::new(1, 64 * MIB);
    let a = c.tenant("a", quota(16 * MIB, 9));
    c.hold("a", a, 16 * MIB, 0, false);
    let b = c.tenant("b", quota(64 * MIB, 0));
    c.wait(ask("a", a, 8 * MIB, None), 0);
    let wb = c.wait(ask("b", b, 8 * MIB, None), 0);
    assert_eq!(
        c.pass(10),
        Pass {
            grant: Some((wb, 0)),
            reclaim: vec![]
        }
    );
}

#[test]
fn a_request_within_its_guarantee_is_not_held_behind_a_blocked_head() {
    let mut c = Core::new(1, 64 * MIB);
    let x = c.tenant("x", quota(64 * MIB, 0));
    c.hold("x", x, 40 * MIB, 0, false);
    let g = c.tenant(
        "g",
        Quota {
            guaranteed_bytes: 16 * MIB,
            ..quota(64 * MIB, 0)
        },
    );
    let h = c.tenant("h", quota(64 * MIB, 0));
    let other = c.tenant("o", quota(64 * MIB, 0));
    let big = c.wait(ask("h", h, 32 * MIB, None), 0);
    let plain = c.wait(ask("o", other, 4 * MIB, None), 0);
    let within = c.wait(ask("g", g, 8 * MIB, None), 0);
    // The old head holds the device: the plain request waits behind it (and memory kept
    // for g's guarantee is not free for it either), the one within its guarantee goes.
    assert_eq!(
        c.pass(10),
        Pass {
            grant: Some((within, 0)),
            reclaim: vec![big]
        }
    );
    let effects = c.run(10);
    assert_eq!(answers(&effects), vec![(within, Ok(0))]);
    assert!(c.st.queue().contains(plain) && c.st.queue().contains(big));
}

#[test]
fn memory_kept_for_a_guarantee_is_not_free_for_others() {
    let mut c = Core::new(1, 64 * MIB);
    c.tenant(
        "g",
        Quota {
            guaranteed_bytes: 32 * MIB,
            ..quota(64 * MIB, 0)
        },
    );
    let x = c.tenant("x", quota(64 * MIB, 0));
    c.hold("x", x, 16 * MIB, 0, false);
    // 48 MiB free, 32 of them g's: 24 MiB does not fit for x (it asks back from nobody:
    // nothing it may take is borrowed by someone of lower priority).
    let w = c.wait(ask("x", x, 24 * MIB, None), 0);
    assert_eq!(
        c.pass(0),
        Pass {
            grant: None,
            reclaim: vec![w]
        }
    );
    // Held back by guarantees (not by capacity), it holds back nobody, not even its own
    // tenant's smaller request that fits beside them.
    let w16 = c.wait(ask("x", x, 16 * MIB, None), 0);
    assert_eq!(c.pass(0).grant, Some((w16, 0)));
}

#[test]
fn fit_prefers_a_cached_block_of_the_size_then_the_most_free_device() {
    let mut c = Core::new(2, 64 * MIB);
    let a = c.tenant("a", quota(128 * MIB, 0));
    let on1 = c.hold("a", a, 8 * MIB, 1, false);
    c.hold("a", a, 4 * MIB, 1, false);
    c.st.end_lease(on1, Ending::Cache).unwrap();
    c.st.take_effects();
    let w8 = c.wait(ask("a", a, 8 * MIB, None), 0);
    assert_eq!(c.pass(0).grant, Some((w8, 1)), "the cached 8 MiB block");
    let effects = c.run(0);
    // The tenant's own block: committed at once, no device work.
    assert!(
        matches!(
            effects.as_slice(),
            [Effect::Count { what: Counted::Granted(_) }, Effect::Reply { to, result: Ok(Granted::Lease(v)) }]
                if *to == w8 && v.device == 1
        ),
        "{effects:?}"
    );
    let w10 = c.wait(ask("a", a, 10 * MIB, None), 0);
    assert_eq!(
        c.pass(0).grant,
        Some((w10, 0)),
        "the device with the most free"
    );
}

#[test]
fn another_tenants_cached_block_is_replaced_by_fresh_memory() {
    let mut c = Core::new(1, 64 * MIB);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 0));
    let l = c.hold("a", a, 8 * MIB, 0, false);
    c.st.end_lease(l, Ending::Cache).unwrap();
    c.st.take_effects();
    let w = c.wait(ask("b", b, 8 * MIB, None), 0);
    let effects = c.run(0);
    assert!(
        matches!(
            effects.as_slice(),
            [
                Effect::Count { what: Counted::CrossTenantFresh },
                Effect::Free { device: 0, .. },
                Effect::Materialize { grant: p },
            ] if p.to == w && matches!(p.source, Source::Fresh { .. })
        ),
        "{effects:?}"
    );
}

#[test]
fn holders_are_asked_back_lowest_priority_and_newest_first_only_as_much_as_needed() {
    let mut c = Core::new(1, 64 * MIB);
    let lo = c.tenant("lo", quota(64 * MIB, 0));
    let old = c.hold("lo", lo, 16 * MIB, 0, true);
    let mid = c.hold("lo", lo, 16 * MIB, 0, true);
    let new = c.hold("lo", lo, 16 * MIB, 0, true);
    let fixed = c.hold("lo", lo, 8 * MIB, 0, false);
    let hi = c.tenant("hi", quota(64 * MIB, 5));
    // 8 MiB free, 32 wanted: 24 needed, two 16 MiB leases, the newest reclaimable ones.
    let w = c.wait(ask("hi", hi, 32 * MIB, None), 0);
    let effects = c.run(0);
    let asked: Vec<Uuid> =
        c.st.leases()
            .iter()
            .filter(|l| matches!(l.state, LeaseState::ReclaimRequested { .. }))
            .map(|l| l.id)
            .collect();
    let mut want = vec![new, mid];
    want.sort();
    let mut asked_sorted = asked.clone();
    asked_sorted.sort();
    assert_eq!(asked_sorted, want);
    assert!(!asked.contains(&old) && !asked.contains(&fixed));
    let notified = effects
        .iter()
        .filter(|e| matches!(e, Effect::Notify { .. }))
        .count();
    let counted = effects
        .iter()
        .filter(|e| {
            matches!(
                e,
                Effect::Count {
                    what: Counted::ReclaimRequested
                }
            )
        })
        .count();
    assert_eq!((notified, counted), (2, 2));
    assert!(c.st.queue().get(w).unwrap().reclaim_sent);
    // Asked once: a later run asks nobody more, even re-armed (what is on its way back
    // counts).
    assert!(c.run(1).is_empty());
    c.st.rearm_reclaim(Duration::ZERO, c.t0 + Duration::from_secs(5));
    assert!(!c.st.queue().get(w).unwrap().reclaim_sent);
    let effects = c.run(5);
    assert!(
        !effects.iter().any(|e| matches!(e, Effect::Notify { .. })),
        "{effects:?}"
    );
}

#[test]
fn queued_requests_that_can_never_fit_any_more_get_the_error_a_new_one_gets() {
    let mut c = Core::new(2, 64 * MIB);
    let x = c.tenant("x", quota(128 * MIB, 0));
    c.hold("x", x, 40 * MIB, 0, false);
    c.hold("x", x, 40 * MIB, 1, false);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 0));
    let p = c.tenant("p", quota(64 * MIB, 0));
    let big = c.wait(ask("a", a, 32 * MIB, None), 0);
    let capped = c.wait(ask("b", b, 32 * MIB, None), 0);
    let pinned = c.wait(ask("p", p, 30 * MIB, Some(1)), 0);
    let fine = c.wait(ask("p", p, 30 * MIB, Some(0)), 0);
    assert!(c.run(0).iter().all(|e| !matches!(e, Effect::Reply { .. })));
    // Leasable memory shrank on both devices (memory used outside the broker), b's limit
    // was lowered, and device 1 drains.
    c.st.set_leasable(0, 30 * MIB);
    c.st.set_leasable(1, 30 * MIB);
    c.st.set_quota("b", quota(16 * MIB, 0)).unwrap();
    c.avail.device_mut(1).unwrap().drain = Some(Drain {
        since: SystemTime::now(),
        deadline: None,
        reason: "kernel update".into(),
        asked: Default::default(),
    });
    let candidates = c.st.candidates(&c.avail, None);
    let new_big = c.st.never_fits("a", 32 * MIB, None, &candidates).unwrap();
    let new_capped = c.st.never_fits("b", 32 * MIB, None, &candidates).unwrap();
    let new_pinned = c.avail.refusal(Some(1)).unwrap();
    assert!(matches!(new_big, BrokerError::TooLarge { leasable, .. } if leasable == 30 * MIB));
    assert!(matches!(new_capped, BrokerError::QuotaExceeded { .. }));
    assert!(matches!(
        new_pinned,
        BrokerError::DeviceClosed { device: 1, .. }
    ));
    let effects = c.run(1);
    let mut got = answers(&effects);
    got.sort_by_key(|(id, _)| *id);
    assert_eq!(
        got,
        vec![
            (big, Err(new_big)),
            (capped, Err(new_capped)),
            (pinned, Err(new_pinned))
        ]
    );
    // The one that may still fit some day waits on.
    assert_eq!(c.st.queue().len(), 1);
    assert!(c.st.queue().contains(fine));
}

#[test]
fn enqueue_refuses_past_the_per_tenant_cap_and_a_zero_wait_that_does_not_fit() {
    let mut c = Core::new(1, 64 * MIB);
    let x = c.tenant("x", quota(64 * MIB, 0));
    c.hold("x", x, 48 * MIB, 0, false);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let st = &mut c.st;
    let env = env(&c.avail, c.t0);
    // Fits: granted in the same call.
    let got = st.enqueue(ask("a", a, 8 * MIB, None), 0, false, 2, &env);
    let Ok(Enqueued::Waiting { id, queued: false }) = got else {
        panic!("{got:?}")
    };
    assert_eq!(answers(&st.take_effects().into_vec()), vec![(id, Ok(0))]);
    // Does not fit, no wait: refused with the numbers, and gone from the queue.
    let got = st.enqueue(ask("a", a, 16 * MIB, None), 0, true, 2, &env);
    assert!(
        matches!(got, Ok(Enqueued::Refused(BrokerError::NoCapacity { requested, .. })) if requested == 16 * MIB),
        "{got:?}"
    );
    assert!(st.queue().is_empty());
    // Waits, twice; a third is past the cap.
    for _ in 0..2 {
        let got = st.enqueue(ask("a", a, 16 * MIB, None), 0, false, 2, &env);
        assert!(
            matches!(got, Ok(Enqueued::Waiting { queued: true, .. })),
            "{got:?}"
        );
    }
    let got = st.enqueue(ask("a", a, 16 * MIB, None), 0, false, 2, &env);
    assert!(
        matches!(got, Err(BrokerError::QueueFull { waiting: 2, .. })),
        "{got:?}"
    );
    // Giving up says why it did not fit; a second time it is not waiting.
    let id = st.queue().iter().next().unwrap().id;
    assert!(matches!(
        st.give_up(id, &c.avail),
        Some(BrokerError::NoCapacity { .. })
    ));
    assert!(st.give_up(id, &c.avail).is_none());
    assert!(!st.abandon(id));
    st.check_invariant().unwrap();
}

#[test]
fn an_offer_is_rounded_to_the_largest_granularity_and_refused_at_once_when_it_never_fits() {
    let mut c = Core::new(2, 64 * MIB);
    c.st = State::new(
        vec![
            Pool::new(0, GRAN, 64 * MIB, 64 * MIB),
            Pool::new(1, 8 * MIB, 64 * MIB, 64 * MIB),
        ],
        vec![true, true],
        seal_check(&c.touched),
        Clock::read(),
    );
    let a = c.tenant("a", quota(128 * MIB, 0));
    let req = |tenant: &str, bytes: u64, device: Option<u32>| {
        crate::request::AcquireRequest {
            tenant: tenant.into(),
            session: a,
            bytes,
            device,
            wait: Duration::ZERO,
            label: String::new(),
            reclaimable: false,
            fallback_host: false,
        }
        .checked()
    };
    let st = &mut c.st;
    let env = env(&c.avail, c.t0);
    // Either device: the larger granularity (8 MiB); pinned to device 0: its own (2 MiB).
    for (device, want) in [(None, 8 * MIB), (Some(0), 4 * MIB)] {
        let got = st.offer(&req("a", 3 * MIB, device), None, 4, &env).unwrap();
        assert!(
            matches!(got, (b, Enqueued::Waiting { queued: false, .. }) if b == want),
            "{got:?}"
        );
    }
    // Larger than any device leases: refused, no wait needed, nothing queued.
    let got = st.offer(&req("a", 80 * MIB, None), None, 4, &env).unwrap();
    assert!(
        matches!(&got, (b, Enqueued::Refused(BrokerError::TooLarge { leasable, .. }))
            if *b == 80 * MIB && *leasable == 64 * MIB),
        "{got:?}"
    );
    let other = req("nobody", 2 * MIB, None);
    assert!(matches!(
        st.offer(&other, None, 4, &env),
        Err(BrokerError::NotFound(_))
    ));
    assert!(st.queue().is_empty());
    st.check_invariant().unwrap();
}

/// A cached memfd found sealed when it would be handed out (whatever sealed it) is freed
/// and fresh memory allocated instead, also for the tenant that used it last. The core
/// learns of the seals only through the look the shell gave it (here, the test's).
#[test]
fn a_cached_memfd_found_sealed_is_freed_not_handed_out() {
    use crate::memory::{Allocation, Handle, MemoryKind};
    let mut c = Core::new(1, 64 * MIB);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let bytes = 8 * MIB;
    let Handle::Fd { fd, .. } = fake_block(1, bytes).handle;
    let block = Block {
        alloc: Allocation {
            id: 1,
            bytes,
            addr: 0,
            path: None,
        },
        handle: Handle::Fd {
            kind: MemoryKind::HostMemfd,
            fd: fd.clone(),
            block_id: 1,
            size: bytes,
        },
        last_tenant: None,
        reached: Default::default(),
    };
    let req = ask("a", a, bytes, Some(0));
    assert!(matches!(
        c.st.reserve_grant(&req, 0).unwrap(),
        Source::Fresh { .. }
    ));
    let l = c.st.commit_grant(&req, 0, 0, block, false).unwrap().id;
    c.st.end_lease(l, Ending::Cache).unwrap();
    c.st.take_effects();
    assert_eq!(c.st.pools()[0].stats().cached, bytes);
    // Sealed while cached (the look now says so).
    c.touched.lock().insert(fd.raw());
    let w = c.wait(ask("a", a, bytes, None), 0);
    let effects = c.run(0);
    assert!(
        matches!(
            effects.as_slice(),
            [
                Effect::Free { device: 0, block },
                Effect::Materialize { grant: p },
            ] if block.alloc.id == 1 && p.to == w && matches!(p.source, Source::Fresh { .. })
        ),
        "{effects:?}"
    );
    let s = c.st.pools()[0].stats();
    assert_eq!((s.cached, s.reserved, s.hits, s.misses), (0, bytes, 0, 2));
}

/// A drain asks back, in one transition, exactly the active reclaimable device leases on
/// the drained devices (marked, their sessions told why and by when), and none twice; a
/// device found unhealthy tells each session holding a lease there once.
#[test]
fn a_drain_asks_back_reclaimable_leases_there_and_an_unhealthy_device_tells_its_holders() {
    let mut c = Core::new(2, 64 * MIB);
    let a = c.tenant("a", quota(64 * MIB, 0));
    let b = c.tenant("b", quota(64 * MIB, 0));
    let lease = |c: &mut Core, session: Uuid, tenant: &str, device: u32, reclaimable| {
        let mut req = ask(tenant, session, 2 * MIB, Some(device));
        req.reclaimable = reclaimable;
        c.st.reserve_grant(&req, device).unwrap();
        let block = fake_block(c.next_alloc, 2 * MIB);
        c.next_alloc += 1;
        c.st.commit_grant(&req, 0, device, block, false).unwrap().id
    };
    let asked_back = lease(&mut c, a, "a", 0, true);
    let _kept = lease(&mut c, a, "a", 0, false);
    let _elsewhere = lease(&mut c, b, "b", 1, true);
    let _b_on_0 = lease(&mut c, b, "b", 0, false);
    c.st.take_effects();
    let (due, due_wall) = (c.t0 + Duration::from_secs(30), SystemTime::now());
    let asked = c.st.ask_drain_reclaim(&[0], due, due_wall, "firmware");
    assert_eq!(asked, vec![(0, asked_back)]);
    assert!(matches!(
        c.st.leases().get(&asked_back).unwrap().state,
        LeaseState::ReclaimRequested { deadline, .. } if deadline == due
    ));
    let effects = c.st.take_effects().into_vec();
    assert!(
        matches!(
            effects.as_slice(),
            [Effect::Notify {
                session,
                event: crate::session::SessionEvent::ReclaimRequested { lease_id, bytes, reason, .. },
            }] if *session == a && *lease_id == asked_back && *bytes == 2 * MIB
                && reason == "device 0 is draining for maintenance (firmware)"
        ),
        "{effects:?}"
    );
    // Asked once: a second drain of the device asks nothing more.
    assert!(c
        .st
        .ask_drain_reclaim(&[0], due, due_wall, "again")
        .is_empty());
    assert!(c.st.take_effects().is_empty());
    // Device 0 unhealthy: sessions a and b (each once, a holding two leases there).
    assert_eq!(c.st.tell_device_unhealthy(0, "GPU-0", "Xid 79"), 2);
    let mut told: Vec<Uuid> =
        c.st.take_effects()
            .into_vec()
            .into_iter()
            .map(|e| match e {
                Effect::Notify {
                    session,
                    event:
                        crate::session::SessionEvent::DeviceUnhealthy {
                            device: 0,
                            uuid,
                            reason,
                        },
                } if uuid == "GPU-0" && reason == "Xid 79" => session,
                other => panic!("{other:?}"),
            })
            .collect();
    told.sort();
    let mut want = vec![a, b];
    want.sort();
    assert_eq!(told, want);
    assert_eq!(c.st.tell_device_unhealthy(1, "GPU-1", "Xid 48"), 1);
    c.st.check_invariant().unwrap();
}
