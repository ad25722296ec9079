//! Compute turns through the arbiter: the thin shell around the scheduler's core
//! ([`crate::scheduler::Turns`]), asked through [`ComputeTurns`] ([`Arbiter::turns`]). It
//! checks the session, locks the core, calls one transition, takes its effects, unlocks,
//! and then has them carried out by the turn effect executor (`Executor::execute_turns`,
//! `effects.rs`): a waiter's answer goes to its reply channel (kept in the outbox,
//! `outbox.rs`, registered in the hold that queued the request), a session's event to its
//! mailbox, a kept slot's window gets a timer. A grant nobody receives (the caller went
//! away just as it was answered) is given back to the core, which hands the slot on. It
//! waits for a grant with a deadline and never leaves a turn held by a caller that went
//! away. The hand-off histogram lives here.

use super::{session_not_found, Arbiter};
use crate::error::{BrokerError, BrokerResult};
use crate::scheduler::{
    Requester, TurnConfig, TurnEffect, TurnEnd, TurnGrant, TurnUsage, TurnWaiterId, Turns,
};
use parking_lot::Mutex;
use prometheus_client::metrics::histogram::Histogram;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use uuid::Uuid;

/// The compute-turn scheduler of every device: the core under its own lock (taken under
/// the state lock or alone; under it only the outbox's turn reply table is taken, to
/// register a request's channel: docs/architecture.md, "Locks and their order") and the
/// hand-off histogram.
pub(crate) struct Scheduler {
    core: Mutex<Turns>,
    handoff: Histogram,
}

/// Hand-off buckets: 2 us to about 0.2 s, x1.3 apart (fine enough to read a p99 near
/// 100 us: 79 and 102 us are neighbours).
fn handoff_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        2e-6, 1.3, 45,
    ))
}

impl Scheduler {
    pub fn new(devices: usize, cfg: TurnConfig) -> Scheduler {
        Scheduler {
            core: Mutex::new(Turns::new(devices, cfg)),
            handoff: handoff_histogram(),
        }
    }

    /// Records a hand-off: a grant that `handoff_from` a release is being sent now.
    pub fn observe_handoff(&self, grant: &TurnGrant) {
        if let Some(t) = grant.handoff_from {
            self.handoff.observe(t.elapsed().as_secs_f64());
        }
    }

    /// One hold of the turn core's lock: `f`, the invariant (debug builds), the effects.
    pub(super) fn hold<R>(&self, f: impl FnOnce(&mut TurnsHeld<'_>) -> R) -> (R, Vec<TurnEffect>) {
        let mut core = TurnsHeld(self.core.lock());
        let r = f(&mut core);
        #[cfg(debug_assertions)]
        if let Err(e) = core.check_invariant() {
            panic!("turn invariant broken: {e}");
        }
        (r, core.take_effects())
    }

    /// Registers the hand-off histogram (`turn_handoff_seconds`).
    pub fn register_metrics(&self, reg: &mut prometheus_client::registry::Registry) {
        reg.register(
            "turn_handoff_seconds",
            "Time from receiving a ReleaseTurn to sending the next waiter its grant",
            self.handoff.clone(),
        );
    }

    /// A tenant's counters.
    pub fn usage(&self, tenant: &str) -> TurnUsage {
        self.core.lock().usage(tenant)
    }

    /// Tenant holding the (longest-held) turn on `device`, and how many wait.
    pub fn device_state(&self, device: u32) -> (Option<String>, u32) {
        self.core.lock().device_state(device)
    }

    /// How many hold a turn on `device` now.
    pub fn holders(&self, device: u32) -> u32 {
        self.core.lock().holders(device)
    }
}

/// The turn core's lock, held: derefs to [`Turns`]. A turn request's reply channel is made
/// only with one ([`super::outbox::Outbox::register_turn_reply`] takes it), so the channel
/// is in place in the hold that queued the request, before any delivery of its answer
/// (deliveries run after the unlock).
pub(crate) struct TurnsHeld<'a>(parking_lot::MutexGuard<'a, Turns>);

impl std::ops::Deref for TurnsHeld<'_> {
    type Target = Turns;
    fn deref(&self) -> &Turns {
        &self.0
    }
}

impl std::ops::DerefMut for TurnsHeld<'_> {
    fn deref_mut(&mut self) -> &mut Turns {
        &mut self.0
    }
}

/// Cancels a turn request whose caller went away; a grant that arrived (or is arriving)
/// for nobody is given back at once.
struct TurnWait {
    arb: Arc<Arbiter>,
    device: u32,
    waiter: TurnWaiterId,
    /// None once the request was answered (or cancelled) and the caller has the answer.
    rx: Option<oneshot::Receiver<BrokerResult<TurnGrant>>>,
}

impl Drop for TurnWait {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        // Still waiting: it is gone from the queue and nothing will answer it. Else its
        // answer was decided: a turn granted to it is given back in the same hold, before
        // the drop returns (a delivery on its way then finds it given back already, in
        // `rx` or with no channel to send to, and its own give-back does nothing).
        let (cancelled, _) = self.arb.with_turns(|t| {
            let cancelled = t.cancel(self.device, self.waiter);
            if !cancelled {
                t.give_back_unreceived(self.device, self.waiter, Instant::now());
            }
            cancelled
        });
        self.arb.outbox.forget_turn_reply(self.waiter);
        if !cancelled {
            rx.close();
            if let Ok(Ok(grant)) = rx.try_recv() {
                // The turn goes back, its slot to the next.
                tracing::debug!(turn = %grant.turn_id, "caller gone before it received the turn; giving it back");
                self.arb.with_turns(|t| t.give_back(&grant, Instant::now()));
            }
        }
    }
}

/// Compute turns of one arbiter ([`Arbiter::turns`]): asking for a device's turn and
/// giving it back. It keeps no fields: the core is the arbiter's `scheduler`, the reply
/// channels are in the outbox.
pub(crate) struct ComputeTurns<'a> {
    pub(super) arb: &'a Arc<Arbiter>,
}

impl ComputeTurns<'_> {
    /// Grants the compute turn on `device` now, after waiting up to `wait`, or says why not.
    /// Takes the view by value: the future it returns holds no borrow of a temporary.
    pub(crate) async fn acquire(
        self,
        tenant: &str,
        session: Uuid,
        device: u32,
        wait: Duration,
    ) -> BrokerResult<TurnGrant> {
        self.arb.lifecycle.refuse_new_work()?;
        if wait > self.arb.cfg.max_wait {
            return Err(BrokerError::wait_too_long(wait, self.arb.cfg.max_wait));
        }
        // The session is checked and the request queued in one hold of the state lock
        // (state, then scheduler): a session ending in between would leave a turn queued
        // or held for a session that is gone. The effects are carried out after both.
        let max_waiting = self.arb.cfg.max_waiting_per_tenant;
        let (queued, fx) = {
            let st = self.arb.lock();
            let weight = st
                .ledger()
                .get(tenant)
                .map(|t| t.quota.turn_weight.max(1))
                .unwrap_or(1);
            let s = st
                .sessions()
                .get(&session)
                .filter(|s| s.tenant == tenant)
                .ok_or_else(|| session_not_found(session))?;
            s.last_seen.touch();
            let who = Requester {
                tenant: tenant.to_string(),
                session,
                weight,
            };
            self.arb.scheduler.hold(|t| {
                let id = t.request(device, who, max_waiting, Instant::now())?;
                // In the hold that queued it: in place before any answer is delivered.
                Ok::<_, BrokerError>((id, self.arb.outbox.register_turn_reply(t, id)))
            })
        };
        if !fx.is_empty() {
            self.arb.executor().execute_turns(fx);
        }
        let (waiter, rx) = queued?;
        let mut guard = TurnWait {
            arb: self.arb.clone(),
            device,
            waiter,
            rx: Some(rx),
        };
        let Some(rx) = guard.rx.as_mut() else {
            return Err(BrokerError::Internal("turn request lost".into()));
        };
        let dropped = || Err(BrokerError::Internal("turn grant dropped".into()));
        let outcome = if wait.is_zero() {
            // A free slot was granted in the hold above and delivered before it returned.
            rx.try_recv().ok()
        } else {
            tokio::time::timeout(wait, &mut *rx)
                .await
                .ok()
                .map(|r| r.unwrap_or_else(|_| dropped()))
        };
        let result = match outcome {
            Some(r) => r,
            None => {
                let (cancelled, _) = self.arb.with_turns(|t| t.cancel(device, waiter));
                if cancelled {
                    self.arb.outbox.forget_turn_reply(waiter);
                    let (holder, waiting) = self.arb.scheduler.device_state(device);
                    let busy = BrokerError::TurnBusy {
                        device,
                        holder: holder.unwrap_or_default(),
                        waiting,
                    };
                    Err(if wait.is_zero() {
                        busy
                    } else {
                        BrokerError::WaitExpired {
                            waited_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                            cause: Box::new(busy),
                        }
                    })
                } else {
                    // Answered just now: the answer is being delivered (the guard gives a
                    // grant back if this future is dropped before it arrives).
                    (&mut *rx).await.unwrap_or_else(|_| dropped())
                }
            }
        };
        guard.rx = None;
        result
    }

    /// The holder gives its compute turn back; its `ReleaseTurn` arrived at `received`
    /// (the start of the hand-off to the next waiter). `handed_off` says whether the slot's
    /// grant reached a waiter (the caller may let that waiter's task run first).
    pub(crate) fn release_received(
        &self,
        tenant: &str,
        turn_id: Uuid,
        received: Instant,
    ) -> BrokerResult<TurnEnd> {
        let (end, delivered) = self
            .arb
            .with_turns(|t| t.release(tenant, turn_id, received, Instant::now()));
        let mut end = end?;
        end.handed_off = delivered > 0;
        Ok(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Quota;
    use crate::session::{Peer, SessionEvent};
    use std::time::SystemTime;

    fn arbiter(turns: TurnConfig) -> Arc<Arbiter> {
        super::super::host_arbiter(
            1 << 30,
            1,
            super::super::ArbiterConfig {
                turns,
                ..Default::default()
            },
        )
    }

    fn slots(quantum_ms: u64) -> TurnConfig {
        TurnConfig {
            quantum: Duration::from_millis(quantum_ms),
            grace: Duration::from_millis(quantum_ms),
            slots: 1,
            anticipation: Duration::ZERO,
        }
    }

    /// A tenant and an open session of it, with its event stream.
    fn session(
        arb: &Arc<Arbiter>,
        tenant: &str,
    ) -> (Uuid, tokio::sync::mpsc::UnboundedReceiver<SessionEvent>) {
        arb.set_quota(tenant, Quota::default()).unwrap();
        arb.open_session(tenant, "t", Peer::default()).unwrap()
    }

    /// The holder gives its compute turn back, received now.
    fn release_turn(arb: &Arc<Arbiter>, tenant: &str, turn_id: Uuid) -> BrokerResult<TurnEnd> {
        arb.turns()
            .release_received(tenant, turn_id, Instant::now())
    }

    /// Waits (a bounded number of yields) until `n` requests wait on device 0.
    async fn waiting(arb: &Arbiter, n: u32) {
        for _ in 0..10_000 {
            if arb.scheduler.device_state(0).1 == n {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("{n} never waited: {:?}", arb.scheduler.device_state(0));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn hand_offs_are_counted_in_the_histogram_and_no_channel_is_left() {
        let arb = arbiter(slots(10_000));
        let (a, _ea) = session(&arb, "a");
        let (b, _eb) = session(&arb, "b");
        let (c, _ec) = session(&arb, "c");
        let ga = arb
            .turns()
            .acquire("a", a, 0, Duration::ZERO)
            .await
            .unwrap();
        arb.scheduler.observe_handoff(&ga); // not a hand-off: not counted
        let wb = tokio::spawn({
            let arb = arb.clone();
            async move {
                arb.turns()
                    .acquire("b", b, 0, Duration::from_secs(10))
                    .await
            }
        });
        waiting(&arb, 1).await;
        let end = arb
            .turns()
            .release_received("a", ga.turn_id, Instant::now())
            .unwrap();
        assert!(end.handed_off);
        let gb = wb.await.unwrap().unwrap();
        assert!(gb.handoff_from.is_some());
        arb.scheduler.observe_handoff(&gb);
        // A waiter whose caller left is no hand-off: its request leaves with it.
        let wc = tokio::spawn({
            let arb = arb.clone();
            async move {
                arb.turns()
                    .acquire("c", c, 0, Duration::from_secs(10))
                    .await
            }
        });
        waiting(&arb, 1).await;
        wc.abort();
        assert!(wc.await.unwrap_err().is_cancelled());
        assert_eq!(arb.scheduler.device_state(0), (Some("b".into()), 0));
        assert!(!release_turn(&arb, "b", gb.turn_id).unwrap().handed_off);
        assert_eq!(arb.outbox.turn_replies_len(), 0);
        let mut reg = prometheus_client::registry::Registry::default();
        arb.scheduler.register_metrics(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(text.contains("turn_handoff_seconds_count 1"), "{text}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_grant_whose_caller_is_gone_goes_to_the_next_waiter() {
        let arb = arbiter(slots(10_000));
        let (a, _ea) = session(&arb, "a");
        let (c, _ec) = session(&arb, "c");
        let ga = arb
            .turns()
            .acquire("a", a, 0, Duration::ZERO)
            .await
            .unwrap();
        // b's request is queued with its reply channel, and its caller goes just as the
        // grant is decided (its receiver is dropped without a cancel).
        let who = Requester {
            tenant: "b".into(),
            session: Uuid::now_v7(),
            weight: 1,
        };
        let ((), _) = arb.with_turns(|t| {
            let id = t.request(0, who, usize::MAX, Instant::now()).unwrap();
            drop(arb.outbox.register_turn_reply(t, id));
        });
        let wc = tokio::spawn({
            let arb = arb.clone();
            async move {
                arb.turns()
                    .acquire("c", c, 0, Duration::from_secs(10))
                    .await
            }
        });
        waiting(&arb, 2).await;
        let received = Instant::now();
        let end = arb
            .turns()
            .release_received("a", ga.turn_id, received)
            .unwrap();
        assert!(end.handed_off, "the slot reached c");
        let gc = wc.await.unwrap().unwrap();
        assert_eq!(gc.handoff_from, Some(received), "the same hand-off");
        assert_eq!(arb.scheduler.device_state(0), (Some("c".into()), 0));
        assert_eq!(arb.scheduler.usage("b"), TurnUsage::default());
        assert_eq!(arb.outbox.turn_replies_len(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn yield_requests_and_revocations_reach_the_sessions_stream() {
        // Quantum and grace of zero: the first tick asks, the second takes.
        let arb = arbiter(slots(0));
        let (a, mut ea) = session(&arb, "a");
        let (b, _eb) = session(&arb, "b");
        let ga = arb
            .turns()
            .acquire("a", a, 0, Duration::ZERO)
            .await
            .unwrap();
        let wb = tokio::spawn({
            let arb = arb.clone();
            async move {
                arb.turns()
                    .acquire("b", b, 0, Duration::from_secs(10))
                    .await
            }
        });
        waiting(&arb, 1).await;
        arb.with_turns(|t| t.tick(Instant::now(), SystemTime::now()));
        match ea.try_recv() {
            Ok(SessionEvent::YieldRequested { turn_id, .. }) => assert_eq!(turn_id, ga.turn_id),
            other => panic!("{other:?}"),
        }
        arb.with_turns(|t| t.tick(Instant::now(), SystemTime::now()));
        match ea.try_recv() {
            Ok(SessionEvent::TurnRevoked { turn_id, .. }) => assert_eq!(turn_id, ga.turn_id),
            other => panic!("{other:?}"),
        }
        let gb = wb.await.unwrap().unwrap();
        assert_eq!(gb.handoff_from, None, "taken, not handed off");
        assert!(matches!(
            release_turn(&arb, "a", ga.turn_id),
            Err(BrokerError::NotFound(_))
        ));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_waiter_whose_session_ends_is_told_so() {
        let arb = arbiter(slots(10_000));
        let (a, _ea) = session(&arb, "a");
        let (b, _eb) = session(&arb, "b");
        arb.turns()
            .acquire("a", a, 0, Duration::ZERO)
            .await
            .unwrap();
        let wb = tokio::spawn({
            let arb = arb.clone();
            async move {
                arb.turns()
                    .acquire("b", b, 0, Duration::from_secs(10))
                    .await
            }
        });
        waiting(&arb, 1).await;
        arb.end_session(b, "test");
        match wb.await.unwrap() {
            Err(BrokerError::NotFound(crate::error::Missing::Session(id))) => assert_eq!(id, b),
            other => panic!("{other:?}"),
        }
        // a's session ends too: its turn goes, nothing is left.
        arb.end_session(a, "test");
        assert_eq!(arb.scheduler.device_state(0), (None, 0));
        assert_eq!(arb.outbox.turn_replies_len(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn callers_that_come_go_and_release_at_once_leave_nothing_behind() {
        // Eight sessions ask for turns on two slots, some with no wait, some giving up
        // mid-wait (their futures dropped by a short timeout, as a disconnect would), and
        // release what they get; the core's invariant is checked on every hold (debug
        // builds). At the end no turn is held, nobody waits, no reply channel is left, and
        // every turn a caller received it could release (none was given to two).
        let arb = arbiter(TurnConfig {
            slots: 2,
            ..slots(60_000)
        });
        // One caller certainly gives up mid-wait: both slots are held (a minute's quantum)
        // while it waits, and its future is dropped; the rest of the run only may.
        let holders: Vec<_> = (0..2).map(|i| session(&arb, &format!("t{i}"))).collect();
        let mut held = Vec::new();
        for (i, (s, _)) in holders.iter().enumerate() {
            let g = arb
                .turns()
                .acquire(&format!("t{i}"), *s, 0, Duration::ZERO)
                .await
                .expect("a free slot");
            held.push((format!("t{i}"), g.turn_id));
        }
        let (waiter, _waiter_rx) = session(&arb, "t2");
        let ask = arb
            .turns()
            .acquire("t2", waiter, 0, Duration::from_secs(60));
        assert!(
            tokio::time::timeout(Duration::from_millis(20), ask)
                .await
                .is_err(),
            "both slots are held: the third waits"
        );
        for (tenant, id) in &held {
            release_turn(&arb, tenant, *id).expect("still held");
        }
        let (mut got, mut dropped) = (2u32, 1u32);
        let mut tasks = Vec::new();
        for i in 0..8u64 {
            let tenant = format!("t{}", i % 3);
            let (s, rx) = session(&arb, &tenant);
            let arb = arb.clone();
            tasks.push(tokio::spawn(async move {
                let _rx = rx;
                let (mut got, mut dropped) = (0u32, 0u32);
                for j in 0..60u64 {
                    let wait = Duration::from_millis((i + j) % 3 * 5);
                    let ask = arb.turns().acquire(&tenant, s, 0, wait);
                    // Every other ask is dropped after 0-900 us, mid-wait if not granted.
                    let give_up = if j % 2 == 0 {
                        Duration::from_micros((i * 7 + j * 13) % 4 * 300)
                    } else {
                        wait + Duration::from_secs(5)
                    };
                    let grant = match tokio::time::timeout(give_up, ask).await {
                        Ok(Ok(g)) => g,
                        Ok(Err(BrokerError::TurnBusy { .. }))
                        | Ok(Err(BrokerError::WaitExpired { .. })) => continue,
                        Err(_) => {
                            dropped += 1;
                            continue;
                        }
                        Ok(Err(e)) => panic!("{e}"),
                    };
                    got += 1;
                    tokio::task::yield_now().await;
                    release_turn(&arb, &tenant, grant.turn_id)
                        .expect("a received turn is the caller's until released");
                }
                (got, dropped)
            }));
        }
        for t in tasks {
            let (g, d) = t.await.unwrap();
            got += g;
            dropped += d;
        }
        assert!(got > 2, "{got} granted, {dropped} dropped mid-wait");
        assert_eq!(arb.scheduler.device_state(0), (None, 0));
        assert_eq!(arb.scheduler.holders(0), 0);
        assert_eq!(arb.outbox.turn_replies_len(), 0);
        let booked: u64 = (0..3)
            .map(|t| arb.scheduler.usage(&format!("t{t}")).turns)
            .sum();
        // A turn given back for a caller that left is not booked: exactly the received ones.
        assert_eq!(booked, u64::from(got));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_turn_is_never_left_for_a_session_that_ended_while_it_asked() {
        // A session ends while its turn request comes in, many times over: whichever
        // comes first, no turn, waiter or reply channel is left for the gone session.
        let arb = arbiter(slots(60_000));
        for _ in 0..200 {
            let (s, _rx) = session(&arb, "t");
            let ask = {
                let arb = arb.clone();
                tokio::spawn(async move { arb.turns().acquire("t", s, 0, Duration::ZERO).await })
            };
            let end = {
                let arb = arb.clone();
                tokio::task::spawn_blocking(move || arb.end_session(s, "gone"))
            };
            let _ = end.await;
            let _ = ask.await.unwrap();
            assert_eq!(
                arb.scheduler.holders(0),
                0,
                "a turn held for an ended session"
            );
            assert_eq!(arb.scheduler.device_state(0), (None, 0));
            assert_eq!(arb.outbox.turn_replies_len(), 0);
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_dropped_request_gives_back_a_grant_decided_for_it() {
        let arb = arbiter(slots(60_000));
        let who = |t: &str| Requester {
            tenant: t.into(),
            session: Uuid::now_v7(),
            weight: 1,
        };
        let ask = |w: Requester| {
            arb.with_turns(|t| {
                let id = t.request(0, w, usize::MAX, Instant::now()).unwrap();
                (id, arb.outbox.register_turn_reply(t, id))
            })
            .0
        };
        // Granted and delivered (the slot was free) but the caller's future is dropped
        // before it looked: the guard finds the grant in its channel and gives it back.
        let (id, rx) = ask(who("a"));
        drop(TurnWait {
            arb: arb.clone(),
            device: 0,
            waiter: id,
            rx: Some(rx),
        });
        assert_eq!(arb.scheduler.holders(0), 0);
        // Decided but not delivered yet when the caller forgot its channel: the delivery
        // finds none and gives it back; the slot goes to the next waiter.
        let (_, mut rb) = ask(who("b"));
        let (c, _rc) = ask(who("c"));
        let (_, mut rd) = ask(who("d"));
        assert!(arb.outbox.forget_turn_reply(c));
        let tb = rb.try_recv().unwrap().unwrap();
        let end = release_turn(&arb, "b", tb.turn_id).unwrap();
        assert!(end.handed_off, "d got it, past c");
        assert!(rd.try_recv().unwrap().is_ok());
        assert_eq!(arb.scheduler.device_state(0), (Some("d".into()), 0));
        assert_eq!(arb.scheduler.usage("c"), TurnUsage::default());
        assert_eq!(arb.outbox.turn_replies_len(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_deleted_tenant_leaves_no_turn_usage_for_one_created_again() {
        let arb = arbiter(slots(10_000));
        let (a, _ea) = session(&arb, "a");
        let ga = arb
            .turns()
            .acquire("a", a, 0, Duration::ZERO)
            .await
            .unwrap();
        release_turn(&arb, "a", ga.turn_id).unwrap();
        // A turn still held when the tenant goes is booked as its session ends, then
        // forgotten with the rest.
        let ga = arb
            .turns()
            .acquire("a", a, 0, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(arb.views().tenant("a").unwrap().turns.turns, 1);
        arb.changes().delete_tenant("a", None).unwrap();
        assert_eq!(arb.scheduler.holders(0), 0, "its session's turn ended");
        assert!(release_turn(&arb, "a", ga.turn_id).is_err());
        assert_eq!(arb.scheduler.usage("a"), TurnUsage::default());
        assert_eq!(arb.scheduler.core.lock().tenants_counted(), 0);
        // Created again under the name: it starts with no usage.
        let (a, _ea) = session(&arb, "a");
        assert_eq!(arb.views().tenant("a").unwrap().turns, TurnUsage::default());
        let ga = arb
            .turns()
            .acquire("a", a, 0, Duration::ZERO)
            .await
            .unwrap();
        release_turn(&arb, "a", ga.turn_id).unwrap();
        assert_eq!(arb.views().tenant("a").unwrap().turns.turns, 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_kept_slot_goes_to_the_waiter_when_its_window_ends_without_a_tick() {
        // Anticipation: a tenant still owed compute keeps the slot it gave back for its
        // session's next request; if none comes, the shell's timer (not the ticker, which
        // this arbiter does not run) gives the slot to the waiter when the window ends.
        let window = Duration::from_millis(300);
        let arb = arbiter(TurnConfig {
            anticipation: window,
            ..slots(60_000)
        });
        let (a, _ea) = session(&arb, "a");
        let (b, _eb) = session(&arb, "b");
        // b has used the device for a while; a has used nothing: a is owed.
        let gb = arb
            .turns()
            .acquire("b", b, 0, Duration::ZERO)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        release_turn(&arb, "b", gb.turn_id).unwrap();
        let ask_b = |arb: &Arc<Arbiter>| {
            let arb = arb.clone();
            tokio::spawn(async move {
                arb.turns()
                    .acquire("b", b, 0, Duration::from_secs(30))
                    .await
            })
        };
        // Round one: a gives its turn back with b waiting, asks again in the window and
        // gets the kept slot, ahead of b.
        let ga = arb
            .turns()
            .acquire("a", a, 0, Duration::ZERO)
            .await
            .unwrap();
        let wb = ask_b(&arb);
        waiting(&arb, 1).await;
        let end = release_turn(&arb, "a", ga.turn_id).unwrap();
        let until = end.kept_until.expect("a is owed: its slot is kept");
        assert!(!end.handed_off);
        let ga = arb.turns().acquire("a", a, 0, Duration::ZERO).await;
        if Instant::now() < until {
            let ga = ga.expect("the kept slot is a's in its window");
            assert_eq!(arb.scheduler.device_state(0), (Some("a".into()), 1));
            // Round two: a gives it back again and does not ask: the timer hands it on.
            let end = release_turn(&arb, "a", ga.turn_id).unwrap();
            assert!(end.kept_until.is_some(), "a is still owed");
        } else if let Ok(ga) = ga {
            // A loaded machine ran past the window before the ask: a got the slot as the
            // tenant owed most; it gives it back (kept once more, for the timer to end).
            release_turn(&arb, "a", ga.turn_id).unwrap();
        }
        let gb = tokio::time::timeout(Duration::from_secs(20), wb)
            .await
            .expect("the window's timer gave b the slot")
            .unwrap()
            .unwrap();
        assert!(Instant::now() >= until, "not before a's window ended");
        assert_eq!(arb.scheduler.device_state(0), (Some("b".into()), 0));
        release_turn(&arb, "b", gb.turn_id).unwrap();
        assert_eq!(arb.scheduler.holders(0), 0);
        assert_eq!(arb.outbox.turn_replies_len(), 0);
    }
}
