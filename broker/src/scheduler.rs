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
//! weights above an even split would not hold. The hand-off time (from receiving a
//! `ReleaseTurn` to sending the next waiter its grant) is a histogram. This module never
//! touches memory.

use crate::error::{BrokerError, BrokerResult};
use crate::session::SessionEvent;
use parking_lot::Mutex;
use prometheus_client::metrics::histogram::Histogram;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

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
    /// The slot is kept for the same session until then (anticipation): call
    /// [`Scheduler::expire_kept`] at that time, so that it goes to the next waiter if the
    /// session has not asked again.
    pub kept_until: Option<Instant>,
    /// The slot went to a waiter at once: its grant was just sent (the caller may let
    /// that waiter's task run before answering the release).
    pub handed_off: bool,
}

/// A tenant's compute-turn counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TurnUsage {
    pub turns: u64,
    pub compute: Duration,
    pub overrun: Duration,
}

/// Who may ask for a turn, and where its events go.
#[derive(Clone, Debug)]
pub struct Requester {
    pub tenant: String,
    pub session: Uuid,
    /// Share of compute time relative to other tenants (>= 1).
    pub weight: u32,
    pub events: mpsc::UnboundedSender<SessionEvent>,
}

struct Holder {
    turn_id: Uuid,
    who: Requester,
    since: Instant,
    /// When someone started waiting behind this holder.
    contended_since: Option<Instant>,
    /// When the holder was asked to yield; the grace runs from here, so a holder is always
    /// asked before its turn is taken (also when the tick runs late).
    yield_sent_at: Option<Instant>,
}

struct Waiter {
    id: u64,
    who: Requester,
    reply: oneshot::Sender<BrokerResult<TurnGrant>>,
}

#[derive(Default)]
struct DeviceTurns {
    holders: Vec<Holder>,
    waiting: VecDeque<Waiter>,
    /// A slot kept for a session's next request, until a deadline (anticipation).
    kept: Option<(Uuid, Instant)>,
}

#[derive(Default)]
struct Inner {
    devices: Vec<DeviceTurns>,
    usage: HashMap<String, TurnUsage>,
    next_waiter: u64,
}

/// The compute-turn scheduler of every device.
pub struct Scheduler {
    cfg: TurnConfig,
    inner: Mutex<Inner>,
    handoff: Histogram,
}

/// Hand-off buckets: 2 us to about 0.2 s, x1.3 apart (fine enough to read a p99 near
/// 100 us: 79 and 102 us are neighbours).
fn handoff_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        2e-6, 1.3, 45,
    ))
}

/// A turn request: granted at once (already sent on `rx`) or waiting as `waiter`.
pub struct Pending {
    pub rx: oneshot::Receiver<BrokerResult<TurnGrant>>,
    pub device: u32,
    pub waiter: u64,
}

impl Scheduler {
    pub fn new(devices: usize, cfg: TurnConfig) -> Scheduler {
        let mut inner = Inner::default();
        inner.devices.resize_with(devices, DeviceTurns::default);
        Scheduler {
            cfg: TurnConfig {
                slots: cfg.slots.max(1),
                ..cfg
            },
            inner: Mutex::new(inner),
            handoff: handoff_histogram(),
        }
    }

    /// Records a hand-off: a grant that `handoff_from` a release is being sent now.
    pub fn observe_handoff(&self, grant: &TurnGrant) {
        if let Some(t) = grant.handoff_from {
            self.handoff.observe(t.elapsed().as_secs_f64());
        }
    }

    /// Registers the hand-off histogram (`turn_handoff_seconds`).
    pub fn register_metrics(&self, reg: &mut prometheus_client::registry::Registry) {
        reg.register(
            "turn_handoff_seconds",
            "Time from receiving a ReleaseTurn to sending the next waiter its grant",
            self.handoff.clone(),
        );
    }

    pub fn config(&self) -> TurnConfig {
        self.cfg
    }

    /// Asks for a turn on `device`.
    pub fn request(&self, device: u32, who: Requester) -> BrokerResult<Pending> {
        self.request_capped(device, who, usize::MAX)
    }

    /// Asks for a turn on `device`, refused (`RESOURCE_EXHAUSTED`) when the tenant already
    /// has `max_waiting` requests waiting across the devices.
    pub fn request_capped(
        &self,
        device: u32,
        who: Requester,
        max_waiting: usize,
    ) -> BrokerResult<Pending> {
        let mut inner = self.inner.lock();
        let waiting = inner
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
        let n = inner.devices.len();
        if device as usize >= n {
            return Err(BrokerError::InvalidArgument(format!(
                "unknown device {device}: this broker has {n} device(s)"
            )));
        }
        if inner.devices[device as usize]
            .holders
            .iter()
            .any(|h| h.who.session == who.session)
        {
            return Err(BrokerError::TurnAlreadyHeld { device });
        }
        let (tx, rx) = oneshot::channel();
        inner.next_waiter += 1;
        let id = inner.next_waiter;
        let now = Instant::now();
        let slots = self.cfg.slots as usize;
        let d = &mut inner.devices[device as usize];
        if d.holders.len() >= slots {
            for h in &mut d.holders {
                h.contended_since.get_or_insert(now);
            }
        }
        d.waiting.push_back(Waiter { id, who, reply: tx });
        self.grant_next(&mut inner, device, now, None);
        Ok(Pending {
            rx,
            device,
            waiter: id,
        })
    }

    /// A waiting request gave up (its caller left or its wait ran out). Returns true when
    /// it was still waiting (false: it was granted meanwhile).
    pub fn cancel(&self, device: u32, waiter: u64) -> bool {
        let mut inner = self.inner.lock();
        let Some(d) = inner.devices.get_mut(device as usize) else {
            return false;
        };
        let before = d.waiting.len();
        d.waiting.retain(|w| w.id != waiter);
        let removed = d.waiting.len() != before;
        if d.waiting.is_empty() {
            for h in &mut d.holders {
                h.contended_since = None;
            }
        }
        removed
    }

    /// The holder gives its turn back.
    pub fn release(&self, tenant: &str, turn_id: Uuid) -> BrokerResult<TurnEnd> {
        self.release_received(tenant, turn_id, Instant::now())
    }

    /// The holder gives its turn back; its `ReleaseTurn` was received at `received` (the
    /// start of the hand-off the next grant measures).
    pub fn release_received(
        &self,
        tenant: &str,
        turn_id: Uuid,
        received: Instant,
    ) -> BrokerResult<TurnEnd> {
        let mut inner = self.inner.lock();
        let found = inner.devices.iter().enumerate().find_map(|(i, d)| {
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
        let now = Instant::now();
        let who = inner.devices[device].holders[slot].who.clone();
        let mut end = self.end_turn(&mut inner, device as u32, slot, now);
        if self.owed(&inner, device, &who) {
            let until = now + self.cfg.anticipation;
            inner.devices[device].kept = Some((who.session, until));
            end.kept_until = Some(until);
        }
        end.handed_off = self.grant_next(&mut inner, device as u32, now, Some(received)) > 0;
        Ok(end)
    }

    /// Whether `who`, which just gave a turn back on `device`, keeps the slot: with an
    /// anticipation window, when others wait and its compute time per weight is below
    /// every waiting tenant's.
    fn owed(&self, inner: &Inner, device: usize, who: &Requester) -> bool {
        if self.cfg.anticipation.is_zero() {
            return false;
        }
        let d = &inner.devices[device];
        if d.waiting.is_empty() || d.waiting.iter().any(|w| w.who.session == who.session) {
            return false;
        }
        let vt = |tenant: &str, weight: u32| {
            inner
                .usage
                .get(tenant)
                .map(|u| u.compute)
                .unwrap_or_default()
                .as_secs_f64()
                / f64::from(weight.max(1))
        };
        let mine = vt(&who.tenant, who.weight);
        d.waiting
            .iter()
            .all(|w| w.who.tenant != who.tenant && vt(&w.who.tenant, w.who.weight) > mine)
    }

    /// Gives kept slots whose window has passed to the next waiters.
    pub fn expire_kept(&self) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        for device in 0..inner.devices.len() {
            if inner.devices[device]
                .kept
                .is_some_and(|(_, until)| until <= now)
            {
                inner.devices[device].kept = None;
                self.grant_next(&mut inner, device as u32, now, None);
            }
        }
    }

    /// A session ended: its waiting requests go, its turns end.
    pub fn end_session(&self, session: Uuid) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        for device in 0..inner.devices.len() {
            inner.devices[device]
                .waiting
                .retain(|w| w.who.session != session);
            while let Some(slot) = inner.devices[device]
                .holders
                .iter()
                .position(|h| h.who.session == session)
            {
                self.end_turn(&mut inner, device as u32, slot, now);
            }
            if inner.devices[device]
                .kept
                .is_some_and(|(s, _)| s == session)
            {
                inner.devices[device].kept = None;
            }
            self.grant_next(&mut inner, device as u32, now, None);
        }
    }

    /// Asks holders past their quantum to yield, and takes turns past quantum + grace,
    /// when others wait. Called periodically.
    pub fn tick(&self) {
        self.expire_kept();
        let mut inner = self.inner.lock();
        let now = Instant::now();
        for device in 0..inner.devices.len() {
            if inner.devices[device].waiting.is_empty() {
                continue;
            }
            let mut slot = 0;
            while slot < inner.devices[device].holders.len() {
                let h = &mut inner.devices[device].holders[slot];
                let held = now.duration_since(h.since);
                match h.yield_sent_at {
                    Some(asked) if now.duration_since(asked) >= self.cfg.grace => {
                        let _ = h.who.events.send(SessionEvent::TurnRevoked {
                            turn_id: h.turn_id,
                            device: device as u32,
                            reason: format!(
                                "held {} ms, past the quantum ({} ms) and grace ({} ms) while others waited",
                                held.as_millis(),
                                self.cfg.quantum.as_millis(),
                                self.cfg.grace.as_millis()
                            ),
                        });
                        self.end_turn(&mut inner, device as u32, slot, now);
                        continue; // the next holder moved into this slot
                    }
                    None if held >= self.cfg.quantum => {
                        h.yield_sent_at = Some(now);
                        let _ = h.who.events.send(SessionEvent::YieldRequested {
                            turn_id: h.turn_id,
                            device: device as u32,
                            deadline: SystemTime::now() + self.cfg.grace,
                        });
                    }
                    _ => {}
                }
                slot += 1;
            }
            self.grant_next(&mut inner, device as u32, now, None);
        }
    }

    /// A tenant's counters.
    pub fn usage(&self, tenant: &str) -> TurnUsage {
        self.inner
            .lock()
            .usage
            .get(tenant)
            .copied()
            .unwrap_or_default()
    }

    /// Tenant holding the (longest-held) turn on `device`, and how many wait.
    pub fn device_state(&self, device: u32) -> (Option<String>, u32) {
        let inner = self.inner.lock();
        match inner.devices.get(device as usize) {
            Some(d) => (
                d.holders.first().map(|h| h.who.tenant.clone()),
                d.waiting.len() as u32,
            ),
            None => (None, 0),
        }
    }

    /// How many hold a turn on `device` now (at most the slots).
    pub fn holders(&self, device: u32) -> u32 {
        self.inner
            .lock()
            .devices
            .get(device as usize)
            .map(|d| d.holders.len() as u32)
            .unwrap_or(0)
    }

    /// Ends the turn in `slot` on `device` and books its time.
    fn end_turn(&self, inner: &mut Inner, device: u32, slot: usize, now: Instant) -> TurnEnd {
        let holders = &mut inner.devices[device as usize].holders;
        if slot >= holders.len() {
            return TurnEnd::default();
        }
        let h = holders.remove(slot);
        let held = now.duration_since(h.since);
        let overrun = match h.contended_since {
            Some(c) => now.saturating_duration_since(c.max(h.since + self.cfg.quantum)),
            None => Duration::ZERO,
        };
        let u = inner.usage.entry(h.who.tenant.clone()).or_default();
        u.turns += 1;
        u.compute += held;
        u.overrun += overrun;
        TurnEnd {
            held,
            overrun,
            ..TurnEnd::default()
        }
    }

    /// Grants the free slots on `device` to the next waiters: the tenant with the least
    /// compute time per weight, first come first served within it. Skips waiters whose
    /// caller is gone. `handoff_from`: when the release that freed a slot was received.
    /// Returns how many it granted.
    fn grant_next(
        &self,
        inner: &mut Inner,
        device: u32,
        now: Instant,
        handoff_from: Option<Instant>,
    ) -> u32 {
        let slots = self.cfg.slots as usize;
        let mut granted = 0;
        loop {
            let Inner { devices, usage, .. } = inner;
            let d = &mut devices[device as usize];
            if d.kept.is_some_and(|(_, until)| until <= now) {
                d.kept = None;
            }
            if d.holders.len() >= slots || d.waiting.is_empty() {
                return granted;
            }
            // A kept slot goes only to its session; the other slots as usual.
            let mut forced = None;
            if let Some((session, _)) = d.kept {
                forced = d.waiting.iter().position(|w| w.who.session == session);
                if forced.is_some() {
                    d.kept = None;
                } else if d.holders.len() + 1 >= slots {
                    return granted;
                }
            }
            let share = |w: &Waiter| {
                let used = usage
                    .get(&w.who.tenant)
                    .map(|u| u.compute)
                    .unwrap_or_default();
                used.as_secs_f64() / f64::from(w.who.weight.max(1))
            };
            let best = forced.unwrap_or_else(|| {
                let mut best = 0;
                for (i, w) in d.waiting.iter().enumerate() {
                    if share(w) < share(&d.waiting[best]) {
                        best = i;
                    }
                }
                best
            });
            let Some(w) = d.waiting.remove(best) else {
                return granted;
            };
            let grant = TurnGrant {
                turn_id: Uuid::new_v4(),
                device,
                quantum: self.cfg.quantum,
                handoff_from,
            };
            let who = w.who.clone();
            if w.reply.send(Ok(grant.clone())).is_err() {
                continue; // the caller left; next
            }
            granted += 1;
            let full = d.holders.len() + 1 >= slots;
            d.holders.push(Holder {
                turn_id: grant.turn_id,
                who,
                since: now,
                contended_since: if full && !d.waiting.is_empty() {
                    Some(now)
                } else {
                    None
                },
                yield_sent_at: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(tenant: &str, weight: u32) -> (Requester, mpsc::UnboundedReceiver<SessionEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Requester {
                tenant: tenant.into(),
                session: Uuid::new_v4(),
                weight,
                events: tx,
            },
            rx,
        )
    }

    fn granted(p: &mut Pending) -> Option<TurnGrant> {
        p.rx.try_recv().ok().and_then(|r| r.ok())
    }

    fn sched(quantum_ms: u64) -> Scheduler {
        Scheduler::new(
            1,
            TurnConfig {
                quantum: Duration::from_millis(quantum_ms),
                grace: Duration::from_millis(quantum_ms),
                slots: 1,
                anticipation: Duration::ZERO,
            },
        )
    }

    #[test]
    fn a_tenant_can_queue_only_so_many_turn_requests() {
        let s = sched(1000);
        let (holder, _eh) = who("h", 1);
        let _ph = s.request(0, holder).unwrap();
        let mut pending = Vec::new();
        for _ in 0..3 {
            let (w, e) = who("flood", 1);
            pending.push((s.request_capped(0, w, 3).unwrap(), e));
        }
        let (w, _e) = who("flood", 1);
        let err = s
            .request_capped(0, w, 3)
            .err()
            .expect("the fourth is refused");
        assert!(matches!(err, BrokerError::QueueFull { .. }), "{err:?}");
        // Another tenant is not affected.
        let (o, _eo) = who("other", 1);
        assert!(s.request_capped(0, o, 3).is_ok());
    }

    #[test]
    fn one_turn_at_a_time_then_the_next_waiter() {
        let s = sched(1000);
        let (a, _ea) = who("a", 1);
        let (b, _eb) = who("b", 1);
        let mut pa = s.request(0, a).unwrap();
        let mut pb = s.request(0, b).unwrap();
        let ga = granted(&mut pa).expect("a granted at once");
        assert!(granted(&mut pb).is_none(), "b waits");
        assert_eq!(s.device_state(0), (Some("a".into()), 1));
        assert!(matches!(
            s.release("b", ga.turn_id),
            Err(BrokerError::NotFound(_))
        ));
        s.release("a", ga.turn_id).unwrap();
        assert!(granted(&mut pb).is_some(), "b granted on release");
        assert_eq!(s.usage("a").turns, 1);
    }

    #[test]
    fn weighted_fair_share_picks_the_tenant_with_least_time_per_weight() {
        let s = sched(1000);
        let (a, _e1) = who("a", 1);
        let (h, _e2) = who("heavy", 4);
        // Both used 40 ms of compute; heavy has 4x the weight, so it goes first.
        {
            let mut inner = s.inner.lock();
            for t in ["a", "heavy"] {
                inner.usage.insert(
                    t.into(),
                    TurnUsage {
                        turns: 1,
                        compute: Duration::from_millis(40),
                        overrun: Duration::ZERO,
                    },
                );
            }
        }
        let (x, _ex) = who("x", 1);
        let mut px = s.request(0, x).unwrap();
        let gx = granted(&mut px).unwrap();
        let mut pa = s.request(0, a).unwrap();
        let mut ph = s.request(0, h).unwrap();
        s.release("x", gx.turn_id).unwrap();
        assert!(granted(&mut ph).is_some(), "heavier weight first");
        assert!(granted(&mut pa).is_none());
    }

    #[test]
    fn fifo_within_a_tenant() {
        let s = sched(1000);
        let (first, _e0) = who("t", 1);
        let mut p0 = s.request(0, first).unwrap();
        let g0 = granted(&mut p0).unwrap();
        let (w1, _e1) = who("t", 1);
        let (w2, _e2) = who("t", 1);
        let mut p1 = s.request(0, w1).unwrap();
        let mut p2 = s.request(0, w2).unwrap();
        s.release("t", g0.turn_id).unwrap();
        assert!(granted(&mut p1).is_some());
        assert!(granted(&mut p2).is_none());
    }

    #[test]
    fn a_holder_past_its_quantum_is_asked_to_yield_then_loses_the_turn() {
        let s = sched(20);
        let (a, mut ea) = who("a", 1);
        let (b, _eb) = who("b", 1);
        let mut pa = s.request(0, a).unwrap();
        let ga = granted(&mut pa).unwrap();
        s.tick();
        assert!(ea.try_recv().is_err(), "nobody waits: no yield request");
        let mut pb = s.request(0, b).unwrap();
        std::thread::sleep(Duration::from_millis(25));
        s.tick();
        match ea.try_recv() {
            Ok(SessionEvent::YieldRequested { turn_id, .. }) => assert_eq!(turn_id, ga.turn_id),
            other => panic!("{other:?}"),
        }
        std::thread::sleep(Duration::from_millis(20));
        s.tick();
        assert!(matches!(
            ea.try_recv(),
            Ok(SessionEvent::TurnRevoked { .. })
        ));
        assert!(granted(&mut pb).is_some(), "the next waiter got the turn");
        let u = s.usage("a");
        assert!(u.overrun >= Duration::from_millis(15), "{u:?}");
        assert!(matches!(
            s.release("a", ga.turn_id),
            Err(BrokerError::NotFound(_))
        ));
    }

    #[test]
    fn a_late_tick_asks_before_it_takes() {
        // The tick runs only after quantum + grace have passed (a loaded machine): the
        // holder is still asked to yield first and keeps the whole grace.
        let s = sched(20);
        let (a, mut ea) = who("a", 1);
        let (b, _eb) = who("b", 1);
        let mut pa = s.request(0, a).unwrap();
        let ga = granted(&mut pa).unwrap();
        let mut pb = s.request(0, b).unwrap();
        std::thread::sleep(Duration::from_millis(60));
        s.tick();
        match ea.try_recv() {
            Ok(SessionEvent::YieldRequested { turn_id, .. }) => assert_eq!(turn_id, ga.turn_id),
            other => panic!("asked first, not taken: {other:?}"),
        }
        assert!(
            granted(&mut pb).is_none(),
            "the turn is not taken before the grace"
        );
        std::thread::sleep(Duration::from_millis(25));
        s.tick();
        assert!(matches!(
            ea.try_recv(),
            Ok(SessionEvent::TurnRevoked { .. })
        ));
        assert!(granted(&mut pb).is_some());
    }

    #[test]
    fn an_ended_session_gives_its_turn_to_the_next() {
        let s = sched(1000);
        let (a, _ea) = who("a", 1);
        let session = a.session;
        let (b, _eb) = who("b", 1);
        let mut pa = s.request(0, a).unwrap();
        granted(&mut pa).unwrap();
        let mut pb = s.request(0, b).unwrap();
        s.end_session(session);
        assert!(granted(&mut pb).is_some());
    }

    #[test]
    fn a_cancelled_waiter_is_skipped() {
        let s = sched(1000);
        let (a, _ea) = who("a", 1);
        let (b, _eb) = who("b", 1);
        let (c, _ec) = who("c", 1);
        let mut pa = s.request(0, a).unwrap();
        let ga = granted(&mut pa).unwrap();
        let pb = s.request(0, b).unwrap();
        let mut pc = s.request(0, c).unwrap();
        assert!(s.cancel(0, pb.waiter));
        s.release("a", ga.turn_id).unwrap();
        assert!(granted(&mut pc).is_some());
        assert!(matches!(
            s.request(9, who("d", 1).0),
            Err(BrokerError::InvalidArgument(_))
        ));
    }

    fn sched_slots(slots: u32) -> Scheduler {
        Scheduler::new(
            1,
            TurnConfig {
                quantum: Duration::from_secs(10),
                grace: Duration::from_secs(10),
                slots,
                anticipation: Duration::ZERO,
            },
        )
    }

    #[test]
    fn n_slots_admit_n_holders_then_the_next_waits_for_a_release() {
        let s = sched_slots(2);
        let (a, _ea) = who("a", 1);
        let (b, _eb) = who("b", 1);
        let (c, _ec) = who("c", 1);
        let mut pa = s.request(0, a).unwrap();
        let mut pb = s.request(0, b).unwrap();
        let mut pc = s.request(0, c).unwrap();
        let ga = granted(&mut pa).expect("first slot");
        let gb = granted(&mut pb).expect("second slot");
        assert!(ga.handoff_from.is_none() && gb.handoff_from.is_none());
        assert!(granted(&mut pc).is_none(), "both slots taken");
        assert_eq!(s.holders(0), 2);
        assert_eq!(s.device_state(0), (Some("a".into()), 1));
        let received = Instant::now() - Duration::from_millis(3);
        let end = s.release_received("b", gb.turn_id, received).unwrap();
        assert!(end.handed_off, "c was waiting: the slot went to it at once");
        let gc = granted(&mut pc).expect("c takes the freed slot");
        assert_eq!(gc.handoff_from, Some(received));
        assert_eq!(s.holders(0), 2);
        let end = s.release("a", ga.turn_id).unwrap();
        assert!(!end.handed_off, "nobody waited");
        assert_eq!(s.holders(0), 1);
        assert_eq!(s.usage("b").turns, 1);
    }

    #[test]
    fn a_session_holds_at_most_one_slot_of_a_device() {
        let s = sched_slots(4);
        let (a, _ea) = who("a", 1);
        let mut pa = s.request(0, a.clone()).unwrap();
        granted(&mut pa).unwrap();
        assert!(matches!(
            s.request(0, a),
            Err(BrokerError::TurnAlreadyHeld { .. })
        ));
    }

    #[test]
    fn hand_offs_are_counted_in_the_histogram() {
        let s = sched_slots(1);
        let (a, _ea) = who("a", 1);
        let (b, _eb) = who("b", 1);
        let mut pa = s.request(0, a).unwrap();
        let ga = granted(&mut pa).unwrap();
        s.observe_handoff(&ga); // not a hand-off: not counted
        let mut pb = s.request(0, b).unwrap();
        s.release_received("a", ga.turn_id, Instant::now()).unwrap();
        let gb = granted(&mut pb).unwrap();
        s.observe_handoff(&gb);
        // A waiter whose caller left is skipped: no hand-off.
        let (c, _ec) = who("c", 1);
        drop(s.request(0, c).unwrap());
        assert!(!s.release("b", gb.turn_id).unwrap().handed_off);
        let mut reg = prometheus_client::registry::Registry::default();
        s.register_metrics(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(text.contains("turn_handoff_seconds_count 1"), "{text}");
    }

    /// Runs `rounds` turns of 10 ms (booked by backdating each holder's start) with every
    /// tenant always waiting; returns each tenant's share of the compute.
    fn shares(slots: u32, weights: &[(&str, u32)], rounds: usize) -> Vec<f64> {
        shares_with(sched_slots(slots), weights, 2, rounds)
    }

    /// As [`shares`] with `per_tenant` sessions each, on scheduler `s`; a session asks again
    /// right after it gives its turn back (the next round), as a worker's step loop does.
    fn shares_with(
        s: Scheduler,
        weights: &[(&str, u32)],
        per_tenant: usize,
        rounds: usize,
    ) -> Vec<f64> {
        let mut events = Vec::new();
        let mut pending: Vec<(usize, Pending)> = Vec::new();
        // Two sessions per tenant, so that every tenant has a waiter whatever holds.
        for (i, (t, w)) in weights.iter().enumerate() {
            for _ in 0..per_tenant {
                let (r, e) = who(t, *w);
                events.push((i, r.clone(), e));
                pending.push((i, s.request(0, r).unwrap()));
            }
        }
        for _ in 0..rounds {
            // Backdate every holder by 10 ms, then release the oldest one and queue its
            // session again.
            for (_, p) in pending.iter_mut() {
                let _ = granted(p);
            }
            {
                let mut inner = s.inner.lock();
                for h in &mut inner.devices[0].holders {
                    h.since -= Duration::from_millis(10);
                }
            }
            let (tenant, turn, session) = {
                let inner = s.inner.lock();
                let h = &inner.devices[0].holders[0];
                (h.who.tenant.clone(), h.turn_id, h.who.session)
            };
            s.release(&tenant, turn).unwrap();
            let (i, r, _) = events
                .iter()
                .find(|(_, r, _)| r.session == session)
                .unwrap();
            pending.push((*i, s.request(0, r.clone()).unwrap()));
            pending.retain(|(_, p)| !p.rx.is_terminated());
        }
        let total: f64 = weights
            .iter()
            .map(|(t, _)| s.usage(t).compute.as_secs_f64())
            .sum();
        weights
            .iter()
            .map(|(t, _)| s.usage(t).compute.as_secs_f64() / total)
            .collect()
    }

    #[test]
    fn shares_follow_the_weights_with_one_slot_and_with_several() {
        let weights = [("w1", 1), ("w2", 2), ("w4", 4)];
        for slots in [1, 2] {
            let got = shares(slots, &weights, 700);
            for (g, want) in got.iter().zip([1.0 / 7.0, 2.0 / 7.0, 4.0 / 7.0]) {
                assert!(
                    (g - want).abs() / want < 0.05,
                    "slots {slots}: shares {got:?}, want 1:2:4"
                );
            }
        }
    }

    #[test]
    fn with_slots_only_holders_past_the_quantum_are_asked_to_yield() {
        let s = Scheduler::new(
            1,
            TurnConfig {
                quantum: Duration::from_millis(20),
                grace: Duration::from_millis(20),
                slots: 2,
                anticipation: Duration::ZERO,
            },
        );
        let (a, mut ea) = who("a", 1);
        let (b, mut eb) = who("b", 1);
        let (c, _ec) = who("c", 1);
        let mut pa = s.request(0, a).unwrap();
        let ga = granted(&mut pa).unwrap();
        std::thread::sleep(Duration::from_millis(25));
        let mut pb = s.request(0, b).unwrap();
        granted(&mut pb).unwrap();
        s.tick();
        assert!(ea.try_recv().is_err(), "a free slot was left: nobody waits");
        let mut pc = s.request(0, c).unwrap();
        s.tick();
        assert!(matches!(
            ea.try_recv(),
            Ok(SessionEvent::YieldRequested { .. })
        ));
        assert!(eb.try_recv().is_err(), "b is within its quantum");
        std::thread::sleep(Duration::from_millis(25));
        s.tick();
        assert!(matches!(
            ea.try_recv(),
            Ok(SessionEvent::TurnRevoked { .. })
        ));
        assert!(granted(&mut pc).is_some(), "c got a's slot");
        assert!(s.release("a", ga.turn_id).is_err());
        assert_eq!(s.holders(0), 2);
    }

    fn anticipating(ms: u64) -> Scheduler {
        Scheduler::new(
            1,
            TurnConfig {
                quantum: Duration::from_secs(10),
                grace: Duration::from_secs(10),
                slots: 1,
                anticipation: Duration::from_millis(ms),
            },
        )
    }

    #[test]
    fn one_worker_per_tenant_gets_its_weight_only_with_anticipation() {
        let weights = [("light", 1), ("heavy", 2)];
        // Without it, two single workers alternate whatever their weights.
        let even = shares_with(sched_slots(1), &weights, 1, 300);
        assert!((even[0] - 0.5).abs() < 0.02, "{even:?}");
        let got = shares_with(anticipating(1000), &weights, 1, 300);
        for (g, want) in got.iter().zip([1.0 / 3.0, 2.0 / 3.0]) {
            assert!((g - want).abs() / want < 0.05, "shares {got:?}, want 1:2");
        }
    }

    #[test]
    fn a_kept_slot_goes_to_its_session_or_to_the_next_waiter_when_the_window_ends() {
        let s = anticipating(30);
        let (h, _eh) = who("heavy", 4);
        let (l, _el) = who("light", 1);
        let mut ph = s.request(0, h.clone()).unwrap();
        let gh = granted(&mut ph).unwrap();
        let mut pl = s.request(0, l).unwrap();
        {
            // light has used far more per weight: heavy is owed compute.
            let mut inner = s.inner.lock();
            inner.usage.insert(
                "light".into(),
                TurnUsage {
                    turns: 1,
                    compute: Duration::from_secs(5),
                    overrun: Duration::ZERO,
                },
            );
        }
        let end = s.release("heavy", gh.turn_id).unwrap();
        assert!(end.kept_until.is_some(), "kept for heavy");
        assert!(
            granted(&mut pl).is_none(),
            "light waits while the slot is kept"
        );
        assert_eq!(s.holders(0), 0);
        // heavy asks again within the window: it gets the slot ahead of light.
        let mut ph = s.request(0, h).unwrap();
        let gh = granted(&mut ph).expect("the kept slot");
        assert!(granted(&mut pl).is_none());
        // Again, but heavy does not come back: light gets the slot once the window ends.
        assert!(s.release("heavy", gh.turn_id).unwrap().kept_until.is_some());
        s.expire_kept();
        assert!(granted(&mut pl).is_none(), "not before the window ends");
        std::thread::sleep(Duration::from_millis(35));
        s.expire_kept();
        assert!(
            granted(&mut pl).is_some(),
            "the next waiter after the window"
        );
    }

    #[test]
    fn a_tenant_ahead_of_its_share_keeps_nothing() {
        let s = anticipating(1000);
        let (a, _ea) = who("a", 1);
        let (b, _eb) = who("b", 1);
        let mut pa = s.request(0, a).unwrap();
        let ga = granted(&mut pa).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let mut pb = s.request(0, b).unwrap();
        // a used 2 ms, b nothing: b is owed, not a.
        let end = s.release("a", ga.turn_id).unwrap();
        assert_eq!(end.kept_until, None);
        assert!(granted(&mut pb).is_some());
    }
}
