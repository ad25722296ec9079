//! Model test of the turn core, driven directly (no runtime, no shell, a clock the test
//! moves): random sequences of requests (on two devices, by sessions of three tenants of
//! different weights, a tenant's queue capped), releases (by the holder's tenant, or by
//! another, which must be `NOT_FOUND`), waiters giving up, grants given back as the shell
//! does when their caller is gone, ticks past quantum and grace, kept slots expiring and
//! sessions ending, tenants deleted (their sessions end, then their counters are forgotten,
//! as the shell does), under random slots, quantum, grace and anticipation. After every step:
//! the core's invariant holds (at most `slots` holders per device, a session holds at most
//! one slot of a device), every waiter was answered at most once and never after it left,
//! the core's waiters are exactly those not answered yet, its holders exactly those the
//! model granted and not yet released, taken, given back or ended, a revocation names a
//! turn its session holds, no free slot is left while a waiter could take it, and every
//! tenant's booked turns are the model's. At the end every session ends: every waiter was
//! answered exactly once or left, and nothing is held.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const SESSIONS: usize = 6;
const TENANTS: [(&str, u32); 3] = [("t0", 1), ("t1", 2), ("t2", 4)];
const DEVICES: usize = 2;
const MAX_WAITING: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    Request { session: usize, device: u32 },
    Release { pick: usize, wrong_tenant: bool },
    Cancel { pick: usize },
    GiveBack { pick: usize },
    Tick { ms: u64 },
    Advance { ms: u64 },
    ExpireKept,
    EndSession { session: usize },
    DeleteTenant { tenant: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..SESSIONS, 0..DEVICES as u32)
            .prop_map(|(session, device)| Op::Request { session, device }),
        3 => (any::<usize>(), prop::bool::weighted(0.1))
            .prop_map(|(pick, wrong_tenant)| Op::Release { pick, wrong_tenant }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        1 => any::<usize>().prop_map(|pick| Op::GiveBack { pick }),
        2 => (0..60u64).prop_map(|ms| Op::Tick { ms }),
        1 => (0..60u64).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::ExpireKept),
        1 => (0..SESSIONS).prop_map(|session| Op::EndSession { session }),
        1 => (0..TENANTS.len()).prop_map(|tenant| Op::DeleteTenant { tenant }),
    ]
}

fn config() -> impl Strategy<Value = TurnConfig> {
    (
        1..4u32,
        0..40u64,
        0..40u64,
        prop_oneof![Just(0u64), 1..50u64],
    )
        .prop_map(|(slots, q, g, a)| TurnConfig {
            quantum: Duration::from_millis(q),
            grace: Duration::from_millis(g),
            slots,
            anticipation: Duration::from_millis(a),
        })
}

/// A turn the model granted and nobody ended yet.
#[derive(Clone, Debug)]
struct Held {
    session: Uuid,
    tenant: &'static str,
    device: u32,
    grant: TurnGrant,
}

struct Model {
    core: Turns,
    now: Instant,
    wall: SystemTime,
    /// Each session slot's current session (a new one after it ends) and its tenant.
    sessions: Vec<(Uuid, usize)>,
    /// Waiters not answered and not gone, with their session and tenant.
    waiting: BTreeMap<TurnWaiterId, (Uuid, &'static str)>,
    /// Every waiter id ever given out (answered, left, or waiting).
    given: BTreeSet<TurnWaiterId>,
    held: BTreeMap<Uuid, Held>,
    /// Turns each tenant ended with booking (released, taken, session ended).
    booked: BTreeMap<&'static str, u64>,
    /// Grants the "shell" got but has not looked at yet (give-back candidates).
    fresh: Vec<Uuid>,
}

impl Model {
    fn new(cfg: TurnConfig) -> Model {
        Model {
            core: Turns::new(DEVICES, cfg),
            now: Instant::now(),
            wall: SystemTime::now(),
            sessions: (0..SESSIONS).map(|i| (Uuid::new_v4(), i % 3)).collect(),
            waiting: BTreeMap::new(),
            given: BTreeSet::new(),
            held: BTreeMap::new(),
            booked: BTreeMap::new(),
            fresh: Vec::new(),
        }
    }

    /// Takes the effects as the shell delivers them, checking each against the model.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        for e in self.core.take_effects() {
            match e {
                TurnEffect::Reply { to, result } => {
                    let Some((session, tenant)) = self.waiting.remove(&to) else {
                        return Err(TestCaseError::fail(format!(
                            "waiter {to} answered but not waiting (answered twice or left)"
                        )));
                    };
                    match result {
                        Ok(grant) => {
                            prop_assert!(
                                !self
                                    .held
                                    .values()
                                    .any(|h| h.session == session && h.device == grant.device),
                                "session {session} granted a second slot of {}",
                                grant.device
                            );
                            self.fresh.push(grant.turn_id);
                            self.held.insert(
                                grant.turn_id,
                                Held {
                                    session,
                                    tenant,
                                    device: grant.device,
                                    grant,
                                },
                            );
                        }
                        Err(e) => prop_assert!(
                            matches!(e, BrokerError::NotFound(crate::error::Missing::Session(s)) if s == session),
                            "waiter {to} refused: {e}"
                        ),
                    }
                }
                TurnEffect::Notify { session, event } => match event {
                    SessionEvent::TurnRevoked {
                        turn_id, device, ..
                    } => {
                        let h = self.held.remove(&turn_id);
                        prop_assert!(
                            h.as_ref()
                                .is_some_and(|h| h.session == session && h.device == device),
                            "revoked a turn {turn_id} not held by {session}: {h:?}"
                        );
                        *self.booked.entry(h.unwrap().tenant).or_default() += 1;
                    }
                    SessionEvent::YieldRequested { turn_id, .. } => prop_assert!(
                        self.held
                            .get(&turn_id)
                            .is_some_and(|h| h.session == session),
                        "asked to yield a turn {turn_id} not held by {session}"
                    ),
                    other => prop_assert!(false, "unexpected event {other:?}"),
                },
                TurnEffect::WakeAt(at) => prop_assert!(at >= self.now, "a wake in the past"),
            }
        }
        Ok(())
    }

    /// The core's state against the model.
    fn check(&self) -> Result<(), TestCaseError> {
        self.core.check_invariant().map_err(TestCaseError::fail)?;
        let slots = self.core.cfg.slots as usize;
        for (i, d) in self.core.devices.iter().enumerate() {
            let ids: BTreeSet<Uuid> = d.holders.iter().map(|h| h.turn_id).collect();
            let want: BTreeSet<Uuid> = self
                .held
                .iter()
                .filter(|(_, h)| h.device as usize == i)
                .map(|(id, _)| *id)
                .collect();
            prop_assert_eq!(ids, want, "holders of device {}", i);
            // Nothing grantable is left waiting: a free slot (beyond a kept one) and a
            // waiter whose session holds none of the device never coexist. (A kept slot
            // whose window passed stays kept until the shell's wake or the next tick.)
            let kept = d.kept;
            let free = slots - d.holders.len() - usize::from(kept.is_some());
            let eligible = d.waiting.iter().any(|w| {
                !d.holders.iter().any(|h| h.who.session == w.who.session)
                    || kept.is_some_and(|(s, _)| s == w.who.session)
            });
            let kept_wanted =
                kept.is_some_and(|(s, _)| d.waiting.iter().any(|w| w.who.session == s));
            prop_assert!(
                !(kept_wanted || free > 0 && eligible),
                "device {}: {} free, a waiter could take one",
                i,
                free
            );
        }
        let core_waiting: BTreeSet<TurnWaiterId> = self
            .core
            .devices
            .iter()
            .flat_map(|d| d.waiting.iter().map(|w| w.id))
            .collect();
        let want: BTreeSet<TurnWaiterId> = self.waiting.keys().copied().collect();
        prop_assert_eq!(core_waiting, want, "waiters");
        for (t, _) in TENANTS {
            prop_assert_eq!(
                self.core.usage(t).turns,
                self.booked.get(t).copied().unwrap_or(0),
                "turns booked for {}",
                t
            );
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Request { session, device } => {
                let (id, t) = self.sessions[session];
                let (tenant, weight) = TENANTS[t];
                let holds = self
                    .held
                    .values()
                    .any(|h| h.session == id && h.device == device);
                let queued = self
                    .waiting
                    .values()
                    .filter(|(_, tn)| *tn == tenant)
                    .count();
                let who = Requester {
                    tenant: tenant.into(),
                    session: id,
                    weight,
                };
                match self.core.request(device, who, MAX_WAITING, self.now) {
                    Ok(w) => {
                        prop_assert!(!holds && queued < MAX_WAITING);
                        prop_assert!(self.given.insert(w), "waiter id {w} given twice");
                        self.waiting.insert(w, (id, tenant));
                    }
                    Err(BrokerError::TurnAlreadyHeld { .. }) => prop_assert!(holds),
                    Err(BrokerError::QueueFull { .. }) => {
                        prop_assert!(queued >= MAX_WAITING)
                    }
                    Err(e) => prop_assert!(false, "request refused: {e}"),
                }
            }
            Op::Release { pick, wrong_tenant } => {
                if self.held.is_empty() {
                    return Ok(());
                }
                let (turn, h) = self.held.iter().nth(pick % self.held.len()).unwrap();
                let (turn, h) = (*turn, h.clone());
                let tenant = if wrong_tenant { "nobody" } else { h.tenant };
                let r = self.core.release(tenant, turn, self.now, self.now);
                if wrong_tenant {
                    prop_assert!(matches!(r, Err(BrokerError::NotFound(_))), "{r:?}");
                } else {
                    prop_assert!(r.is_ok(), "{r:?}");
                    self.held.remove(&turn);
                    *self.booked.entry(h.tenant).or_default() += 1;
                }
            }
            Op::Cancel { pick } => {
                if self.given.is_empty() {
                    return Ok(());
                }
                let w = *self.given.iter().nth(pick % self.given.len()).unwrap();
                let device = self
                    .core
                    .devices
                    .iter()
                    .position(|d| d.waiting.iter().any(|x| x.id == w));
                let was_waiting = self.waiting.contains_key(&w);
                // The shell knows its waiter's device; one not waiting any more is asked on
                // device 0.
                let cancelled = self.core.cancel(device.unwrap_or(0) as u32, w);
                prop_assert_eq!(cancelled, was_waiting);
                self.waiting.remove(&w);
            }
            Op::GiveBack { pick } => {
                if self.fresh.is_empty() {
                    return Ok(());
                }
                let turn = self.fresh.swap_remove(pick % self.fresh.len());
                if let Some(h) = self.held.remove(&turn) {
                    prop_assert!(self.core.give_back(&h.grant, self.now));
                } else {
                    let g = TurnGrant {
                        turn_id: turn,
                        device: 0,
                        quantum: Duration::ZERO,
                        handoff_from: None,
                    };
                    prop_assert!(!self.core.give_back(&g, self.now), "gone already");
                }
            }
            Op::Tick { ms } => {
                self.now += Duration::from_millis(ms);
                self.wall += Duration::from_millis(ms);
                self.core.tick(self.now, self.wall);
            }
            Op::Advance { ms } => {
                self.now += Duration::from_millis(ms);
                self.wall += Duration::from_millis(ms);
                return Ok(()); // the clock alone changes nothing
            }
            Op::ExpireKept => self.core.expire_kept(self.now),
            Op::EndSession { session } => self.end_session(session)?,
            Op::DeleteTenant { tenant } => {
                for slot in 0..SESSIONS {
                    if self.sessions[slot].1 == tenant {
                        self.end_session(slot)?;
                    }
                }
                let name = TENANTS[tenant].0;
                self.core.forget_tenant(name);
                self.booked.remove(name);
                prop_assert_eq!(self.core.usage(name), TurnUsage::default());
            }
        }
        self.drain()?;
        self.check()
    }

    fn end_session(&mut self, slot: usize) -> Result<(), TestCaseError> {
        let (id, t) = self.sessions[slot];
        self.core.end_session(id, self.now);
        for (turn, h) in self.held.clone() {
            if h.session == id {
                self.held.remove(&turn);
                *self.booked.entry(h.tenant).or_default() += 1;
            }
        }
        self.drain()?;
        prop_assert!(
            !self.waiting.values().any(|(s, _)| *s == id),
            "an ended session's waiter was not answered"
        );
        // The slot gets a new session (an ended one asks no more: the shell refuses it).
        self.sessions[slot] = (Uuid::new_v4(), t);
        Ok(())
    }
}

fn run(cfg: TurnConfig, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut m = Model::new(cfg);
    for op in ops {
        m.step(op)?;
    }
    for slot in 0..SESSIONS {
        m.end_session(slot)?;
        m.check()?;
    }
    prop_assert!(m.waiting.is_empty(), "unanswered: {:?}", m.waiting);
    prop_assert!(m.held.is_empty(), "still held: {:?}", m.held);
    for d in 0..DEVICES as u32 {
        prop_assert_eq!(m.core.holders(d), 0);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_turn_core_keeps_its_invariants(cfg in config(), ops in prop::collection::vec(op(), 1..120)) {
        run(cfg, &ops)?;
    }
}
