//! Compute turns: time-slicing a GPU between workers. A worker asks for a turn on a
//! device (`AcquireTurn`), runs its kernels while it holds it, and gives it back
//! (`ReleaseTurn`). Up to `slots` turns per device at a time (`--turn-slots`: 1 is strict
//! time slicing; N lets N small models run at once, e.g. under MPS). When several wait,
//! the next free slot goes to the tenant with the least compute time per unit of weight
//! (weighted fair share; `turn_weight` in the quota), first come first served within a
//! tenant. A holder that keeps its turn past the quantum while others wait is asked to
//! yield (`YieldRequested`); past quantum + grace the turn is taken (`TurnRevoked`) and
//! given to the next. Time held beyond the quantum while others waited is the holder's
//! *overrun*. With an anticipation window (`--turn-anticipation`), a tenant that gives a
//! turn back while still owed compute (its time per weight is below every waiter's) keeps
//! that slot for its session's next request, up to the window: one worker per tenant that
//! asks again right after each step could otherwise never take two turns in a row, and
//! weights above an even split would not hold. This module never touches memory.
//!
//! This is the scheduler's synchronous core, in the arbiter's shape: [`Turns`] owns every
//! device's holders, waiters and kept slot and every tenant's counters, is given the time
//! by its caller, and holds no lock, channel or task (no tokio type). It knows a waiter by
//! its id ([`TurnWaiterId`]) and a session by its id; each transition decides everything
//! together and pushes the [`TurnEffect`]s to carry out (answer waiter W with its grant or
//! why not, send session S an event, wake the shell when a kept slot's window ends). The
//! shell (`arbiter/turns.rs`) locks it, calls, takes the effects, unlocks, then delivers
//! them through the outbox (`arbiter/outbox.rs`) and observes the hand-off histogram.
//! Unit tests in `scheduler/tests.rs`, the model test (random sequences, the turn
//! invariants) in `scheduler/model.rs`.

use crate::error::{BrokerError, BrokerResult};
use crate::session::SessionEvent;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};
use uuid::Uuid;

#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;

/// Quantum and grace of the turns.
#[derive(Clone, Copy, Debug)]
pub struct TurnConfig {
    /// How long a turn may last while others wait before the holder is asked to yield.
    pub quantum: Duration,
    /// How long after the yield request the turn is taken away.
    pub grace: Duration,
    /// Turns held on one device at once (at least 1).
    pub slots: u32,
    /// How long a slot given back by a tenant still owed compute is kept for its
    /// session's next request (zero: never; the slot goes to the next waiter at once).
    pub anticipation: Duration,
}

impl Default for TurnConfig {
    fn default() -> Self {
        TurnConfig {
            quantum: crate::defaults::TURN_QUANTUM,
            grace: crate::defaults::TURN_GRACE,
            slots: crate::defaults::TURN_SLOTS,
            anticipation: crate::defaults::TURN_ANTICIPATION,
        }
    }
}

/// A granted turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnGrant {
    pub turn_id: Uuid,
    pub device: u32,
    pub quantum: Duration,
    /// When the `ReleaseTurn` that freed this slot was received (None: the slot was free,
    /// or freed otherwise). The service observes the hand-off time from it.
    pub handoff_from: Option<Instant>,
}

/// How a turn went, reported when it ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TurnEnd {
    pub held: Duration,
    pub overrun: Duration,
    /// The slot is kept for the same session until then (anticipation); the release also
    /// pushed [`TurnEffect::WakeAt`] for that time, so that the slot goes to the next
    /// waiter ([`Turns::expire_kept`]) if the session has not asked again.
    pub kept_until: Option<Instant>,
    /// The slot went to a waiter at once (the core decided a grant; the shell turns this
    /// into "its grant was delivered", and the caller may then let that waiter's task run
    /// before answering the release).
    pub handed_off: bool,
}

/// A tenant's compute-turn counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TurnUsage {
    pub turns: u64,
    pub compute: Duration,
    pub overrun: Duration,
}

/// Who asks for a turn (its events go to its session, by id, through the shell).
#[derive(Clone, Debug)]
pub struct Requester {
    pub tenant: String,
    pub session: Uuid,
    /// Share of compute time relative to other tenants (>= 1).
    pub weight: u32,
}

/// A waiting turn request, by the id the core gave it; the shell keeps its reply channel.
pub type TurnWaiterId = u64;

/// One thing a transition asks the shell to do, after the unlock.
#[derive(Debug)]
pub enum TurnEffect {
    /// Answer waiter `to`: its grant, or why it gets none (its session ended). Every
    /// waiter is answered exactly once, unless it left first ([`Turns::cancel`] said so).
    /// A grant nobody receives goes back with [`Turns::give_back`].
    Reply {
        to: TurnWaiterId,
        result: BrokerResult<TurnGrant>,
    },
    /// Send session `session` an event (`YieldRequested`, `TurnRevoked`).
    Notify { session: Uuid, event: SessionEvent },
    /// Call [`Turns::expire_kept`] at this time (a kept slot's window ends).
    WakeAt(Instant),
}

struct Holder {
    turn_id: Uuid,
    /// The grant as its waiter was answered, and that waiter: a caller that went away
    /// before it received the answer gives the turn back by its waiter id.
    grant: TurnGrant,
    granted_to: TurnWaiterId,
    who: Requester,
    since: Instant,
    /// When someone started waiting behind this holder.
    contended_since: Option<Instant>,
    /// When the holder was asked to yield; the grace runs from here, so a holder is always
    /// asked before its turn is taken (also when the tick runs late).
    yield_sent_at: Option<Instant>,
}

struct Waiter {
    id: TurnWaiterId,
    who: Requester,
}

#[derive(Default)]
struct DeviceTurns {
    holders: Vec<Holder>,
    waiting: VecDeque<Waiter>,
    /// A slot kept for a session's next request, until a deadline (anticipation).
    kept: Option<(Uuid, Instant)>,
}

/// The compute-turn state of every device: the scheduler's core (see the module doc).
pub struct Turns {
    cfg: TurnConfig,
    devices: Vec<DeviceTurns>,
    usage: HashMap<String, TurnUsage>,
    next_waiter: TurnWaiterId,
    fx: Vec<TurnEffect>,
}

impl Turns {
    pub fn new(devices: usize, cfg: TurnConfig) -> Turns {
        let mut d = Vec::new();
        d.resize_with(devices, DeviceTurns::default);
        Turns {
            cfg: TurnConfig {
                slots: cfg.slots.max(1),
                ..cfg
            },
            devices: d,
            usage: HashMap::new(),
            next_waiter: 0,
            fx: Vec::new(),
        }
    }

    pub fn config(&self) -> TurnConfig {
        self.cfg
    }

    /// The effects the transitions pushed since the last take, in order.
    pub fn take_effects(&mut self) -> Vec<TurnEffect> {
        std::mem::take(&mut self.fx)
    }

    /// Asks for a turn on `device`: the request waits as the returned waiter (granted at
    /// once when a slot is free: its `Reply` is among the effects). Refused
    /// (`RESOURCE_EXHAUSTED`) when the tenant already has `max_waiting` requests waiting
    /// across the devices, `INVALID_ARGUMENT` for a device that does not exist (checked
    /// first: a bad device is a bad request whatever the queue), and
    /// `FAILED_PRECONDITION` when the session already holds a turn of the device.
    pub fn request(
        &mut self,
        device: u32,
        who: Requester,
        max_waiting: usize,
        now: Instant,
    ) -> BrokerResult<TurnWaiterId> {
        let n = self.devices.len();
        if device as usize >= n {
            return Err(BrokerError::unknown_device(device, n));
        }
        let waiting = self
            .devices
            .iter()
            .flat_map(|d| d.waiting.iter())
            .filter(|w| w.who.tenant == who.tenant)
            .count();
        if waiting >= max_waiting {
            return Err(BrokerError::QueueFull {
                tenant: who.tenant.clone(),
                waiting,
                queue: crate::error::Queue::Turn,
            });
        }
        let slots = self.cfg.slots as usize;
        let d = &mut self.devices[device as usize];
        if d.holders.iter().any(|h| h.who.session == who.session) {
            return Err(BrokerError::TurnAlreadyHeld { device });
        }
        self.next_waiter += 1;
        let id = self.next_waiter;
        if d.holders.len() >= slots {
            for h in &mut d.holders {
                h.contended_since.get_or_insert(now);
            }
        }
        d.waiting.push_back(Waiter { id, who });
        self.grant_next(device, now, None);
        Ok(id)
    }

    /// A waiting request gave up (its caller left or its wait ran out). Returns true when
    /// it was still waiting: it is gone and gets no answer. False: it was answered
    /// meanwhile (its `Reply` was pushed, perhaps not delivered yet).
    pub fn cancel(&mut self, device: u32, waiter: TurnWaiterId) -> bool {
        let Some(d) = self.devices.get_mut(device as usize) else {
            return false;
        };
        let before = d.waiting.len();
        d.waiting.retain(|w| w.id != waiter);
        let removed = d.waiting.len() != before;
        self.settle(device as usize);
        removed
    }

    /// The holder gives its turn back; its `ReleaseTurn` was received at `received` (the
    /// start of the hand-off the next grant measures). `NOT_FOUND` for a turn that is not
    /// held, or not by `tenant` (taken, given back already, another tenant's).
    pub fn release(
        &mut self,
        tenant: &str,
        turn_id: Uuid,
        received: Instant,
        now: Instant,
    ) -> BrokerResult<TurnEnd> {
        let found = self.devices.iter().enumerate().find_map(|(i, d)| {
            d.holders
                .iter()
                .position(|h| h.turn_id == turn_id && h.who.tenant == tenant)
                .map(|slot| (i, slot))
        });
        let Some((device, slot)) = found else {
            return Err(BrokerError::NotFound(crate::error::Missing::Turn(
                turn_id.to_string(),
            )));
        };
        let who = self.devices[device].holders[slot].who.clone();
        let mut end = self.end_turn(device, slot, now);
        if self.owed(device, &who) {
            let until = now + self.cfg.anticipation;
            self.devices[device].kept = Some((who.session, until));
            end.kept_until = Some(until);
            self.fx.push(TurnEffect::WakeAt(until));
        }
        end.handed_off = self.grant_next(device as u32, now, Some(received)) > 0;
        Ok(end)
    }

    /// A grant its waiter never received (the caller went away as it was answered): the
    /// turn ends without being booked, and its slot goes to the next waiter as the grant
    /// would have (the same hand-off start). Returns false when it was not held any more.
    pub fn give_back(&mut self, grant: &TurnGrant, now: Instant) -> bool {
        let Some(d) = self.devices.get_mut(grant.device as usize) else {
            return false;
        };
        let Some(slot) = d.holders.iter().position(|h| h.turn_id == grant.turn_id) else {
            return false;
        };
        d.holders.remove(slot);
        self.grant_next(grant.device, now, grant.handoff_from);
        true
    }

    /// The caller of `waiter` went away before it received its answer: if that answer was
    /// a turn (decided, perhaps still on its way), the turn goes back now, its slot to the
    /// next, so the same session may ask again at once. Whoever delivers the answer then
    /// finds it given back already (`give_back` is false for a turn not held).
    pub fn give_back_unreceived(
        &mut self,
        device: u32,
        waiter: TurnWaiterId,
        now: Instant,
    ) -> bool {
        let Some(grant) = self
            .devices
            .get(device as usize)
            .and_then(|d| d.holders.iter().find(|h| h.granted_to == waiter))
            .map(|h| h.grant.clone())
        else {
            return false;
        };
        self.give_back(&grant, now)
    }

    /// Whether `who`, which just gave a turn back on `device`, keeps the slot: with an
    /// anticipation window, when others wait and its compute time per weight is below
    /// every waiting tenant's.
    fn owed(&self, device: usize, who: &Requester) -> bool {
        if self.cfg.anticipation.is_zero() {
            return false;
        }
        let d = &self.devices[device];
        if d.waiting.is_empty() || d.waiting.iter().any(|w| w.who.session == who.session) {
            return false;
        }
        let mine = share(&self.usage, &who.tenant, who.weight);
        d.waiting.iter().all(|w| {
            w.who.tenant != who.tenant && share(&self.usage, &w.who.tenant, w.who.weight) > mine
        })
    }

    /// Gives kept slots whose window has passed to the next waiters.
    pub fn expire_kept(&mut self, now: Instant) {
        for device in 0..self.devices.len() {
            if self.devices[device]
                .kept
                .is_some_and(|(_, until)| until <= now)
            {
                self.devices[device].kept = None;
                self.grant_next(device as u32, now, None);
            }
        }
    }

    /// A session ended: its waiting requests are answered (the session is gone), its
    /// turns end (booked), its kept slots go; the freed slots go to the next waiters.
    pub fn end_session(&mut self, session: Uuid, now: Instant) {
        for device in 0..self.devices.len() {
            let d = &mut self.devices[device];
            let mut kept = VecDeque::with_capacity(d.waiting.len());
            for w in d.waiting.drain(..) {
                if w.who.session == session {
                    self.fx.push(TurnEffect::Reply {
                        to: w.id,
                        result: Err(crate::error::session_not_found(session)),
                    });
                } else {
                    kept.push_back(w);
                }
            }
            d.waiting = kept;
            while let Some(slot) = self.devices[device]
                .holders
                .iter()
                .position(|h| h.who.session == session)
            {
                self.end_turn(device, slot, now);
            }
            let d = &mut self.devices[device];
            if d.kept.is_some_and(|(s, _)| s == session) {
                d.kept = None;
            }
            self.grant_next(device as u32, now, None);
        }
    }

    /// Asks holders past their quantum to yield, and takes turns past quantum + grace,
    /// when others wait (after giving kept slots whose window passed to the next). Called
    /// periodically; `wall` is the wall clock at `now` (a yield request's deadline).
    pub fn tick(&mut self, now: Instant, wall: SystemTime) {
        self.expire_kept(now);
        let cfg = self.cfg;
        for device in 0..self.devices.len() {
            if self.devices[device].waiting.is_empty() {
                continue;
            }
            let mut slot = 0;
            while slot < self.devices[device].holders.len() {
                let h = &mut self.devices[device].holders[slot];
                let held = now.duration_since(h.since);
                match h.yield_sent_at {
                    Some(asked) if now.duration_since(asked) >= cfg.grace => {
                        self.fx.push(TurnEffect::Notify {
                            session: h.who.session,
                            event: SessionEvent::TurnRevoked {
                                turn_id: h.turn_id,
                                device: device as u32,
                                reason: format!(
                                    "held {} ms, past the quantum ({} ms) and grace ({} ms) while others waited",
                                    held.as_millis(),
                                    cfg.quantum.as_millis(),
                                    cfg.grace.as_millis()
                                ),
                            },
                        });
                        self.end_turn(device, slot, now);
                        continue; // the next holder moved into this slot
                    }
                    None if held >= cfg.quantum => {
                        h.yield_sent_at = Some(now);
                        self.fx.push(TurnEffect::Notify {
                            session: h.who.session,
                            event: SessionEvent::YieldRequested {
                                turn_id: h.turn_id,
                                device: device as u32,
                                deadline: wall + cfg.grace,
                            },
                        });
                    }
                    _ => {}
                }
                slot += 1;
            }
            self.grant_next(device as u32, now, None);
        }
    }

    /// A tenant was deleted: its counters go, so a tenant created again under the name
    /// starts afresh and the table does not grow with tenants that come and go. Its
    /// sessions are ended first ([`Turns::end_session`] books their turns); a turn of the
    /// name that ended after this would book a new entry.
    pub fn forget_tenant(&mut self, tenant: &str) {
        self.usage.remove(tenant);
    }

    /// How many tenants have counters (the table [`Turns::forget_tenant`] keeps small).
    pub fn tenants_counted(&self) -> usize {
        self.usage.len()
    }

    /// A tenant's counters.
    pub fn usage(&self, tenant: &str) -> TurnUsage {
        self.usage.get(tenant).copied().unwrap_or_default()
    }

    /// Tenant holding the (longest-held) turn on `device`, and how many wait.
    pub fn device_state(&self, device: u32) -> (Option<String>, u32) {
        match self.devices.get(device as usize) {
            Some(d) => (
                d.holders.first().map(|h| h.who.tenant.clone()),
                d.waiting.len() as u32,
            ),
            None => (None, 0),
        }
    }

    /// How many hold a turn on `device` now (at most the slots).
    pub fn holders(&self, device: u32) -> u32 {
        self.devices
            .get(device as usize)
            .map(|d| d.holders.len() as u32)
            .unwrap_or(0)
    }

    /// The turn invariants: at most `slots` holders per device, a session holds at most
    /// one slot of a device, turn and waiter ids are unique, a waiter's id was given out,
    /// and a kept slot is free and kept for a session that holds none of the device.
    /// Checked by the shell after every transition in debug builds, and by the model test.
    pub fn check_invariant(&self) -> Result<(), String> {
        let slots = self.cfg.slots as usize;
        let mut turns = std::collections::HashSet::new();
        let mut waiters = std::collections::HashSet::new();
        for (i, d) in self.devices.iter().enumerate() {
            if d.holders.len() > slots {
                return Err(format!(
                    "device {i}: {} holders, {slots} slots",
                    d.holders.len()
                ));
            }
            let mut sessions = std::collections::HashSet::new();
            for h in &d.holders {
                if !sessions.insert(h.who.session) {
                    return Err(format!(
                        "device {i}: session {} holds two slots",
                        h.who.session
                    ));
                }
                if !turns.insert(h.turn_id) {
                    return Err(format!("turn {} held twice", h.turn_id));
                }
            }
            for w in &d.waiting {
                if w.id == 0 || w.id > self.next_waiter || !waiters.insert(w.id) {
                    return Err(format!("device {i}: waiter id {} bad or repeated", w.id));
                }
            }
            if let Some((s, _)) = d.kept {
                if d.holders.len() >= slots || sessions.contains(&s) {
                    return Err(format!(
                        "device {i}: kept slot for {s} with {} holders",
                        d.holders.len()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Ends the turn in `slot` on `device` and books its time.
    fn end_turn(&mut self, device: usize, slot: usize, now: Instant) -> TurnEnd {
        let holders = &mut self.devices[device].holders;
        if slot >= holders.len() {
            return TurnEnd::default();
        }
        let h = holders.remove(slot);
        let held = now.saturating_duration_since(h.since);
        let overrun = match h.contended_since {
            Some(c) => now.saturating_duration_since(c.max(h.since + self.cfg.quantum)),
            None => Duration::ZERO,
        };
        let u = self.usage.entry(h.who.tenant.clone()).or_default();
        u.turns += 1;
        u.compute += held;
        u.overrun += overrun;
        TurnEnd {
            held,
            overrun,
            ..TurnEnd::default()
        }
    }

    /// Nobody waits on `device` any more: its holders are no longer contended (their
    /// overrun stops, and a later waiter has them asked to yield again, with a new grace).
    fn settle(&mut self, device: usize) {
        let d = &mut self.devices[device];
        if d.waiting.is_empty() {
            for h in &mut d.holders {
                h.contended_since = None;
                h.yield_sent_at = None;
            }
        }
    }

    /// Grants the free slots on `device` to the next waiters: the tenant with the least
    /// compute time per weight, first come first served within it; a waiter whose session
    /// already holds a slot of the device waits until that turn ends. `handoff_from`: when
    /// the release that freed a slot was received. Returns how many it granted.
    fn grant_next(&mut self, device: u32, now: Instant, handoff_from: Option<Instant>) -> u32 {
        let slots = self.cfg.slots as usize;
        let quantum = self.cfg.quantum;
        let mut granted = 0;
        let Turns {
            devices, usage, fx, ..
        } = self;
        let d = &mut devices[device as usize];
        loop {
            if d.kept.is_some_and(|(_, until)| until <= now) {
                d.kept = None;
            }
            if d.holders.len() >= slots || d.waiting.is_empty() {
                break;
            }
            let holds = |s: &Uuid| d.holders.iter().any(|h| h.who.session == *s);
            // A kept slot goes only to its session; the other slots as usual.
            let mut pick = None;
            if let Some((session, _)) = d.kept {
                pick = d.waiting.iter().position(|w| w.who.session == session);
                if pick.is_some() {
                    d.kept = None;
                } else if d.holders.len() + 1 >= slots {
                    break;
                }
            }
            if pick.is_none() {
                let mut best: Option<(usize, f64)> = None;
                for (i, w) in d.waiting.iter().enumerate() {
                    if holds(&w.who.session) {
                        continue;
                    }
                    let s = share(usage, &w.who.tenant, w.who.weight);
                    if best.is_none_or(|(_, b)| s < b) {
                        best = Some((i, s));
                    }
                }
                pick = best.map(|(i, _)| i);
            }
            let Some(w) = pick.and_then(|i| d.waiting.remove(i)) else {
                break;
            };
            let grant = TurnGrant {
                turn_id: Uuid::new_v4(),
                device,
                quantum,
                handoff_from,
            };
            granted += 1;
            let full = d.holders.len() + 1 >= slots;
            d.holders.push(Holder {
                turn_id: grant.turn_id,
                grant: grant.clone(),
                granted_to: w.id,
                who: w.who,
                since: now,
                contended_since: if full && !d.waiting.is_empty() {
                    Some(now)
                } else {
                    None
                },
                yield_sent_at: None,
            });
            fx.push(TurnEffect::Reply {
                to: w.id,
                result: Ok(grant),
            });
        }
        self.settle(device as usize);
        granted
    }
}

/// `tenant`'s compute time per unit of `weight` so far (the fair-share order).
fn share(usage: &HashMap<String, TurnUsage>, tenant: &str, weight: u32) -> f64 {
    let used = usage.get(tenant).map(|u| u.compute).unwrap_or_default();
    used.as_secs_f64() / f64::from(weight.max(1))
}
