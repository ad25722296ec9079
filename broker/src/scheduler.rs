//! Compute turns: time-slicing a GPU between workers. A worker asks for a turn on a
//! device (`AcquireTurn`), runs its kernels while it holds it, and gives it back
//! (`ReleaseTurn`). One turn per device at a time. When several wait, the next turn goes
//! to the tenant with the least compute time per unit of weight (weighted fair share;
//! `turn_weight` in the quota), first come first served within a tenant. A holder that
//! keeps its turn past the quantum while others wait is asked to yield
//! (`YieldRequested`); past quantum + grace the turn is taken (`TurnRevoked`) and given to
//! the next. Time held beyond the quantum while others waited is the holder's *overrun*.
//! This module never touches memory.

use crate::error::{BrokerError, BrokerResult};
use crate::session::SessionEvent;
use parking_lot::Mutex;
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
}

impl Default for TurnConfig {
    fn default() -> Self {
        TurnConfig {
            quantum: Duration::from_millis(100),
            grace: Duration::from_millis(100),
        }
    }
}

/// A granted turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnGrant {
    pub turn_id: Uuid,
    pub device: u32,
    pub quantum: Duration,
}

/// How a turn went, reported when it ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TurnEnd {
    pub held: Duration,
    pub overrun: Duration,
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
    holder: Option<Holder>,
    waiting: VecDeque<Waiter>,
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
            cfg,
            inner: Mutex::new(inner),
        }
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
            .holder
            .as_ref()
            .is_some_and(|h| h.who.session == who.session)
        {
            return Err(BrokerError::TurnAlreadyHeld { device });
        }
        let (tx, rx) = oneshot::channel();
        inner.next_waiter += 1;
        let id = inner.next_waiter;
        let now = Instant::now();
        let d = &mut inner.devices[device as usize];
        if let Some(h) = d.holder.as_mut() {
            h.contended_since.get_or_insert(now);
        }
        d.waiting.push_back(Waiter { id, who, reply: tx });
        self.grant_next(&mut inner, device, now);
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
            if let Some(h) = d.holder.as_mut() {
                h.contended_since = None;
            }
        }
        removed
    }

    /// The holder gives its turn back.
    pub fn release(&self, tenant: &str, turn_id: Uuid) -> BrokerResult<TurnEnd> {
        let mut inner = self.inner.lock();
        let found = inner.devices.iter().position(|d| {
            d.holder
                .as_ref()
                .is_some_and(|h| h.turn_id == turn_id && h.who.tenant == tenant)
        });
        let Some(device) = found else {
            return Err(BrokerError::NotFound(crate::error::Missing::Turn(
                turn_id.to_string(),
            )));
        };
        let now = Instant::now();
        let end = self.end_turn(&mut inner, device as u32, now);
        self.grant_next(&mut inner, device as u32, now);
        Ok(end)
    }

    /// A session ended: its waiting requests go, its turns end.
    pub fn end_session(&self, session: Uuid) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        for device in 0..inner.devices.len() {
            inner.devices[device]
                .waiting
                .retain(|w| w.who.session != session);
            let holds = inner.devices[device]
                .holder
                .as_ref()
                .is_some_and(|h| h.who.session == session);
            if holds {
                self.end_turn(&mut inner, device as u32, now);
                self.grant_next(&mut inner, device as u32, now);
            }
        }
    }

    /// Asks holders past their quantum to yield, and takes turns past quantum + grace,
    /// when others wait. Called periodically.
    pub fn tick(&self) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        for device in 0..inner.devices.len() {
            let d = &mut inner.devices[device];
            if d.waiting.is_empty() {
                continue;
            }
            let Some(h) = d.holder.as_mut() else { continue };
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
                    self.end_turn(&mut inner, device as u32, now);
                    self.grant_next(&mut inner, device as u32, now);
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

    /// Tenant holding the turn on `device`, and how many wait.
    pub fn device_state(&self, device: u32) -> (Option<String>, u32) {
        let inner = self.inner.lock();
        match inner.devices.get(device as usize) {
            Some(d) => (
                d.holder.as_ref().map(|h| h.who.tenant.clone()),
                d.waiting.len() as u32,
            ),
            None => (None, 0),
        }
    }

    /// Ends the current turn on `device` and books its time.
    fn end_turn(&self, inner: &mut Inner, device: u32, now: Instant) -> TurnEnd {
        let Some(h) = inner.devices[device as usize].holder.take() else {
            return TurnEnd::default();
        };
        let held = now.duration_since(h.since);
        let overrun = match h.contended_since {
            Some(c) => now.saturating_duration_since(c.max(h.since + self.cfg.quantum)),
            None => Duration::ZERO,
        };
        let u = inner.usage.entry(h.who.tenant.clone()).or_default();
        u.turns += 1;
        u.compute += held;
        u.overrun += overrun;
        TurnEnd { held, overrun }
    }

    /// Grants the free turn on `device` to the next waiter: the tenant with the least
    /// compute time per weight, first come first served within it. Skips waiters whose
    /// caller is gone.
    fn grant_next(&self, inner: &mut Inner, device: u32, now: Instant) {
        loop {
            let Inner { devices, usage, .. } = inner;
            let d = &mut devices[device as usize];
            if d.holder.is_some() || d.waiting.is_empty() {
                return;
            }
            let share = |w: &Waiter| {
                let used = usage
                    .get(&w.who.tenant)
                    .map(|u| u.compute)
                    .unwrap_or_default();
                used.as_secs_f64() / f64::from(w.who.weight.max(1))
            };
            let mut best = 0;
            for (i, w) in d.waiting.iter().enumerate() {
                if share(w) < share(&d.waiting[best]) {
                    best = i;
                }
            }
            let Some(w) = d.waiting.remove(best) else {
                return;
            };
            let grant = TurnGrant {
                turn_id: Uuid::new_v4(),
                device,
                quantum: self.cfg.quantum,
            };
            let who = w.who.clone();
            if w.reply.send(Ok(grant.clone())).is_err() {
                continue; // the caller left; next
            }
            d.holder = Some(Holder {
                turn_id: grant.turn_id,
                who,
                since: now,
                contended_since: if d.waiting.is_empty() {
                    None
                } else {
                    Some(now)
                },
                yield_sent_at: None,
            });
            return;
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
}
