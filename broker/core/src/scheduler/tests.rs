//! Unit tests of the turn core, driven directly with a clock the test moves: no runtime,
//! no channel, no sleep. A [`Harness`] takes the effects after every call and keeps the
//! answers by waiter and the events by session, as the shell would deliver them.

use super::*;
use std::collections::HashMap;

/// The core, its clock, and what it asked the shell to deliver.
struct Harness {
    s: Turns,
    now: Instant,
    wall: SystemTime,
    answers: HashMap<TurnWaiterId, BrokerResult<TurnGrant>>,
    events: HashMap<Uuid, VecDeque<SessionEvent>>,
    wakes: Vec<Instant>,
}

fn who(tenant: &str, weight: u32) -> Requester {
    Requester {
        tenant: tenant.into(),
        session: Uuid::new_v4(),
        weight,
    }
}

fn cfg(quantum_ms: u64, grace_ms: u64, slots: u32, anticipation_ms: u64) -> TurnConfig {
    TurnConfig {
        quantum: Duration::from_millis(quantum_ms),
        grace: Duration::from_millis(grace_ms),
        slots,
        anticipation: Duration::from_millis(anticipation_ms),
    }
}

impl Harness {
    fn new(c: TurnConfig) -> Harness {
        Harness {
            s: Turns::new(1, c),
            now: Instant::now(),
            wall: SystemTime::now(),
            answers: HashMap::new(),
            events: HashMap::new(),
            wakes: Vec::new(),
        }
    }

    /// Takes the effects of the last call, as the shell delivers them.
    fn drain(&mut self) {
        self.s.check_invariant().unwrap();
        for e in self.s.take_effects() {
            match e {
                TurnEffect::Reply { to, result } => {
                    assert!(
                        self.answers.insert(to, result).is_none(),
                        "waiter {to} answered twice"
                    );
                }
                TurnEffect::Notify { session, event } => {
                    self.events.entry(session).or_default().push_back(event)
                }
                TurnEffect::WakeAt(at) => self.wakes.push(at),
            }
        }
    }

    fn advance(&mut self, ms: u64) {
        self.now += Duration::from_millis(ms);
        self.wall += Duration::from_millis(ms);
    }

    fn request(&mut self, who: &Requester) -> BrokerResult<TurnWaiterId> {
        self.request_capped(who, usize::MAX)
    }

    fn request_capped(&mut self, who: &Requester, max: usize) -> BrokerResult<TurnWaiterId> {
        let r = self.s.request(0, who.clone(), max, self.now);
        self.drain();
        r
    }

    /// The grant waiter `id` got (taken: a second look finds none).
    fn granted(&mut self, id: TurnWaiterId) -> Option<TurnGrant> {
        match self.answers.remove(&id) {
            Some(Ok(g)) => Some(g),
            Some(Err(e)) => panic!("waiter {id} refused: {e}"),
            None => None,
        }
    }

    fn release(&mut self, tenant: &str, turn: Uuid) -> BrokerResult<TurnEnd> {
        let now = self.now;
        self.release_received(tenant, turn, now)
    }

    fn release_received(
        &mut self,
        tenant: &str,
        turn: Uuid,
        received: Instant,
    ) -> BrokerResult<TurnEnd> {
        let r = self.s.release(tenant, turn, received, self.now);
        self.drain();
        r
    }

    fn tick(&mut self) {
        self.s.tick(self.now, self.wall);
        self.drain();
    }

    fn cancel(&mut self, id: TurnWaiterId) -> bool {
        let r = self.s.cancel(0, id);
        self.drain();
        r
    }

    fn end_session(&mut self, session: Uuid) {
        self.s.end_session(session, self.now);
        self.drain();
    }

    fn expire_kept(&mut self) {
        self.s.expire_kept(self.now);
        self.drain();
    }

    fn next_event(&mut self, session: Uuid) -> Option<SessionEvent> {
        self.events.get_mut(&session).and_then(|q| q.pop_front())
    }

    fn set_compute(&mut self, tenant: &str, ms: u64) {
        self.s.usage.insert(
            tenant.into(),
            TurnUsage {
                turns: 1,
                compute: Duration::from_millis(ms),
                overrun: Duration::ZERO,
            },
        );
    }
}

fn sched(quantum_ms: u64) -> Harness {
    Harness::new(cfg(quantum_ms, quantum_ms, 1, 0))
}

fn sched_slots(slots: u32) -> Harness {
    Harness::new(cfg(10_000, 10_000, slots, 0))
}

fn anticipating(ms: u64) -> Harness {
    Harness::new(cfg(10_000, 10_000, 1, ms))
}

#[test]
fn a_tenant_can_queue_only_so_many_turn_requests() {
    let mut s = sched(1000);
    s.request(&who("h", 1)).unwrap();
    for _ in 0..3 {
        s.request_capped(&who("flood", 1), 3).unwrap();
    }
    let err = s
        .request_capped(&who("flood", 1), 3)
        .expect_err("the fourth is refused");
    assert!(matches!(err, BrokerError::QueueFull { .. }), "{err:?}");
    // Another tenant is not affected.
    assert!(s.request_capped(&who("other", 1), 3).is_ok());
}

#[test]
fn one_turn_at_a_time_then_the_next_waiter() {
    let mut s = sched(1000);
    let pa = s.request(&who("a", 1)).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    let ga = s.granted(pa).expect("a granted at once");
    assert!(s.granted(pb).is_none(), "b waits");
    assert_eq!(s.s.device_state(0), (Some("a".into()), 1));
    assert!(matches!(
        s.release("b", ga.turn_id),
        Err(BrokerError::NotFound(_))
    ));
    s.release("a", ga.turn_id).unwrap();
    assert!(s.granted(pb).is_some(), "b granted on release");
    assert_eq!(s.s.usage("a").turns, 1);
}

#[test]
fn weighted_fair_share_picks_the_tenant_with_least_time_per_weight() {
    let mut s = sched(1000);
    // Both used 40 ms of compute; heavy has 4x the weight, so it goes first.
    s.set_compute("a", 40);
    s.set_compute("heavy", 40);
    let px = s.request(&who("x", 1)).unwrap();
    let gx = s.granted(px).unwrap();
    let pa = s.request(&who("a", 1)).unwrap();
    let ph = s.request(&who("heavy", 4)).unwrap();
    s.release("x", gx.turn_id).unwrap();
    assert!(s.granted(ph).is_some(), "heavier weight first");
    assert!(s.granted(pa).is_none());
}

#[test]
fn fifo_within_a_tenant() {
    let mut s = sched(1000);
    let p0 = s.request(&who("t", 1)).unwrap();
    let g0 = s.granted(p0).unwrap();
    let p1 = s.request(&who("t", 1)).unwrap();
    let p2 = s.request(&who("t", 1)).unwrap();
    s.release("t", g0.turn_id).unwrap();
    assert!(s.granted(p1).is_some());
    assert!(s.granted(p2).is_none());
}

#[test]
fn a_holder_past_its_quantum_is_asked_to_yield_then_loses_the_turn() {
    let mut s = sched(20);
    let (a, b) = (who("a", 1), who("b", 1));
    let pa = s.request(&a).unwrap();
    let ga = s.granted(pa).unwrap();
    s.advance(25);
    s.tick();
    assert!(
        s.next_event(a.session).is_none(),
        "nobody waits: no yield request"
    );
    let pb = s.request(&b).unwrap();
    s.tick();
    match s.next_event(a.session) {
        Some(SessionEvent::YieldRequested {
            turn_id,
            device,
            deadline,
        }) => {
            assert_eq!((turn_id, device), (ga.turn_id, 0));
            assert_eq!(deadline, s.wall + Duration::from_millis(20), "now + grace");
        }
        other => panic!("{other:?}"),
    }
    assert!(s.granted(pb).is_none(), "asked, not taken yet");
    s.advance(19);
    s.tick();
    assert!(s.next_event(a.session).is_none(), "within the grace");
    s.advance(1);
    s.tick();
    match s.next_event(a.session) {
        Some(SessionEvent::TurnRevoked {
            turn_id, reason, ..
        }) => {
            assert_eq!(turn_id, ga.turn_id);
            assert!(reason.contains("held 45 ms"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(s.granted(pb).is_some(), "the next waiter got the turn");
    assert!(s.next_event(b.session).is_none(), "nothing for b");
    let u = s.s.usage("a");
    // Contended from 25 ms (b came), past the quantum (20 ms) from then on: 20 ms.
    assert_eq!(u.overrun, Duration::from_millis(20), "{u:?}");
    assert_eq!(u.compute, Duration::from_millis(45), "{u:?}");
    assert!(matches!(
        s.release("a", ga.turn_id),
        Err(BrokerError::NotFound(_))
    ));
}

#[test]
fn a_late_tick_asks_before_it_takes() {
    // The tick runs only after quantum + grace have passed (a loaded machine): the
    // holder is still asked to yield first and keeps the whole grace.
    let mut s = sched(20);
    let a = who("a", 1);
    let pa = s.request(&a).unwrap();
    let ga = s.granted(pa).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    s.advance(60);
    s.tick();
    match s.next_event(a.session) {
        Some(SessionEvent::YieldRequested { turn_id, .. }) => assert_eq!(turn_id, ga.turn_id),
        other => panic!("asked first, not taken: {other:?}"),
    }
    assert!(
        s.granted(pb).is_none(),
        "the turn is not taken before the grace"
    );
    s.advance(25);
    s.tick();
    assert!(matches!(
        s.next_event(a.session),
        Some(SessionEvent::TurnRevoked { .. })
    ));
    assert!(s.granted(pb).is_some());
}

#[test]
fn an_ended_session_gives_its_turn_to_the_next() {
    let mut s = sched(1000);
    let a = who("a", 1);
    let pa = s.request(&a).unwrap();
    s.granted(pa).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    s.advance(7);
    s.end_session(a.session);
    assert!(s.granted(pb).is_some());
    assert_eq!(s.s.usage("a").compute, Duration::from_millis(7), "booked");
}

#[test]
fn an_ended_sessions_waiting_requests_are_answered_session_gone() {
    let mut s = sched_slots(1);
    let (a, b) = (who("a", 1), who("b", 1));
    let pa = s.request(&a).unwrap();
    let ga = s.granted(pa).unwrap();
    let pb = s.request(&b).unwrap();
    s.end_session(b.session);
    match s.answers.remove(&pb) {
        Some(Err(BrokerError::NotFound(crate::error::Missing::Session(id)))) => {
            assert_eq!(id, b.session)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.s.device_state(0), (Some("a".into()), 0));
    // Answered already: a cancel finds nothing, and a later release hands off to nobody.
    assert!(!s.cancel(pb));
    assert!(!s.release("a", ga.turn_id).unwrap().handed_off);
    assert!(s.answers.is_empty());
}

#[test]
fn a_cancelled_waiter_is_skipped() {
    let mut s = sched(1000);
    let pa = s.request(&who("a", 1)).unwrap();
    let ga = s.granted(pa).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    let pc = s.request(&who("c", 1)).unwrap();
    assert!(s.cancel(pb));
    assert!(!s.cancel(pb), "only once");
    s.release("a", ga.turn_id).unwrap();
    assert!(s.granted(pc).is_some());
    assert!(
        !s.answers.contains_key(&pb),
        "a cancelled waiter gets no answer"
    );
    assert!(matches!(
        s.s.request(9, who("d", 1), usize::MAX, s.now),
        Err(BrokerError::UnknownDevice { device: 9, .. })
    ));
    // A bad device is a bad request, also from a tenant at its waiting cap.
    assert!(matches!(
        s.s.request(9, who("d", 1), 0, s.now),
        Err(BrokerError::UnknownDevice { device: 9, .. })
    ));
}

#[test]
fn n_slots_admit_n_holders_then_the_next_waits_for_a_release() {
    let mut s = sched_slots(2);
    let pa = s.request(&who("a", 1)).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    let pc = s.request(&who("c", 1)).unwrap();
    let ga = s.granted(pa).expect("first slot");
    let gb = s.granted(pb).expect("second slot");
    assert!(ga.handoff_from.is_none() && gb.handoff_from.is_none());
    assert!(s.granted(pc).is_none(), "both slots taken");
    assert_eq!(s.s.holders(0), 2);
    assert_eq!(s.s.device_state(0), (Some("a".into()), 1));
    let received = s.now - Duration::from_millis(3);
    let end = s.release_received("b", gb.turn_id, received).unwrap();
    assert!(end.handed_off, "c was waiting: the slot went to it at once");
    let gc = s.granted(pc).expect("c takes the freed slot");
    assert_eq!(gc.handoff_from, Some(received));
    assert_eq!(s.s.holders(0), 2);
    let end = s.release("a", ga.turn_id).unwrap();
    assert!(!end.handed_off, "nobody waited");
    assert_eq!(s.s.holders(0), 1);
    assert_eq!(s.s.usage("b").turns, 1);
}

#[test]
fn a_session_holds_at_most_one_slot_of_a_device() {
    let mut s = sched_slots(4);
    let a = who("a", 1);
    let pa = s.request(&a).unwrap();
    s.granted(pa).unwrap();
    assert!(matches!(
        s.request(&a),
        Err(BrokerError::TurnAlreadyHeld { .. })
    ));
}

#[test]
fn two_waiting_requests_of_one_session_never_hold_two_slots() {
    // Both slots busy; one session queues two requests (two concurrent AcquireTurn).
    let mut s = sched_slots(2);
    let (x, y, a) = (who("x", 1), who("y", 1), who("a", 1));
    let gx = s.request(&x).unwrap();
    let gx = s.granted(gx).unwrap();
    let gy = s.request(&y).unwrap();
    let gy = s.granted(gy).unwrap();
    let p1 = s.request(&a).unwrap();
    let p2 = s.request(&a).unwrap();
    s.release("x", gx.turn_id).unwrap();
    let g1 = s.granted(p1).expect("the first of a's requests");
    s.release("y", gy.turn_id).unwrap();
    assert!(
        s.granted(p2).is_none(),
        "a holds a slot already: its second waits"
    );
    assert_eq!(s.s.holders(0), 1);
    s.release("a", g1.turn_id).unwrap();
    assert!(s.granted(p2).is_some(), "then it is a's turn again");
}

#[test]
fn a_release_returns_the_grant_of_the_next_waiter_among_its_effects() {
    let mut s = sched_slots(1);
    let pa = s.request(&who("a", 1)).unwrap();
    let ga = s.granted(pa).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    assert!(s.s.take_effects().is_empty());
    let received = s.now;
    s.advance(2);
    let end = s.s.release("a", ga.turn_id, received, s.now).unwrap();
    assert!(end.handed_off);
    assert_eq!(end.held, Duration::from_millis(2));
    let fx = s.s.take_effects();
    assert_eq!(fx.len(), 1, "{fx:?}");
    match &fx[0] {
        TurnEffect::Reply { to, result: Ok(g) } => {
            assert_eq!(*to, pb);
            assert_eq!(g.handoff_from, Some(received));
            assert_eq!(g.quantum, Duration::from_secs(10));
        }
        other => panic!("{other:?}"),
    }
}

/// A caller that went away while its turn's answer was on its way gives it back by its
/// waiter id at once (the same session may ask again right away); the delivery's own
/// give-back of the grant then finds nothing.
#[test]
fn a_grant_whose_caller_left_is_given_back_by_its_waiter_id() {
    let mut s = sched_slots(1);
    let pa = s.request(&who("a", 1)).unwrap();
    let ga = s.granted(pa).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    s.release_received("a", ga.turn_id, s.now).unwrap();
    let gb = s.granted(pb).unwrap();
    assert!(
        !s.s.give_back_unreceived(0, pa + 1000, s.now),
        "no such waiter"
    );
    assert!(s.s.give_back_unreceived(0, pb, s.now));
    assert_eq!(s.s.holders(0), 0, "the slot is free again");
    assert!(
        !s.s.give_back(&gb, s.now),
        "the delivery's give-back finds nothing"
    );
    assert!(!s.s.give_back_unreceived(0, pb, s.now), "only once");
    assert_eq!(s.s.usage("b"), TurnUsage::default(), "b never had it");
}

#[test]
fn a_grant_nobody_received_goes_to_the_next_waiter_and_books_nothing() {
    let mut s = sched_slots(1);
    let pa = s.request(&who("a", 1)).unwrap();
    let ga = s.granted(pa).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    let pc = s.request(&who("c", 1)).unwrap();
    let received = s.now;
    s.release_received("a", ga.turn_id, received).unwrap();
    // b's caller left as it was answered: the shell gives the grant back.
    let gb = s.granted(pb).unwrap();
    s.advance(5);
    assert!(s.s.give_back(&gb, s.now));
    s.drain();
    let gc = s.granted(pc).expect("c gets the slot");
    assert_eq!(gc.handoff_from, Some(received), "the same hand-off goes on");
    assert_eq!(s.s.usage("b"), TurnUsage::default(), "b never had it");
    assert!(!s.s.give_back(&gb, s.now), "only once");
    assert!(matches!(
        s.release("b", gb.turn_id),
        Err(BrokerError::NotFound(_))
    ));
}

/// Runs `rounds` turns of 10 ms with every tenant always waiting; returns each tenant's
/// share of the compute.
fn shares(slots: u32, weights: &[(&str, u32)], rounds: usize) -> Vec<f64> {
    shares_with(sched_slots(slots), weights, 2, rounds)
}

/// As [`shares`] with `per_tenant` sessions each, on scheduler `s`; a session asks again
/// right after it gives its turn back (the next round), as a worker's step loop does.
fn shares_with(
    mut s: Harness,
    weights: &[(&str, u32)],
    per_tenant: usize,
    rounds: usize,
) -> Vec<f64> {
    let mut sessions = Vec::new();
    for (t, w) in weights {
        for _ in 0..per_tenant {
            let r = who(t, *w);
            s.request(&r).unwrap();
            sessions.push(r);
        }
    }
    for _ in 0..rounds {
        // Every holder's turn grows by 10 ms; the oldest one gives its turn back and its
        // session asks again.
        s.advance(10);
        let (tenant, turn, session) = {
            let h = &s.s.devices[0].holders[0];
            (h.who.tenant.clone(), h.turn_id, h.who.session)
        };
        s.release(&tenant, turn).unwrap();
        let r = sessions
            .iter()
            .find(|r| r.session == session)
            .unwrap()
            .clone();
        s.request(&r).unwrap();
    }
    let total: f64 = weights
        .iter()
        .map(|(t, _)| s.s.usage(t).compute.as_secs_f64())
        .sum();
    weights
        .iter()
        .map(|(t, _)| s.s.usage(t).compute.as_secs_f64() / total)
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
    let mut s = Harness::new(cfg(20, 20, 2, 0));
    let (a, b, c) = (who("a", 1), who("b", 1), who("c", 1));
    let pa = s.request(&a).unwrap();
    let ga = s.granted(pa).unwrap();
    s.advance(25);
    let pb = s.request(&b).unwrap();
    s.granted(pb).unwrap();
    s.tick();
    assert!(
        s.next_event(a.session).is_none(),
        "a free slot was left: nobody waits"
    );
    let pc = s.request(&c).unwrap();
    s.tick();
    assert!(matches!(
        s.next_event(a.session),
        Some(SessionEvent::YieldRequested { .. })
    ));
    assert!(s.next_event(b.session).is_none(), "b is within its quantum");
    s.advance(25);
    s.tick();
    assert!(matches!(
        s.next_event(a.session),
        Some(SessionEvent::TurnRevoked { .. })
    ));
    assert!(s.granted(pc).is_some(), "c got a's slot");
    assert!(s.release("a", ga.turn_id).is_err());
    assert_eq!(s.s.holders(0), 2);
}

#[test]
fn a_holder_asked_to_yield_whose_waiters_left_is_asked_again_with_a_new_grace() {
    let mut s = sched(20);
    let a = who("a", 1);
    let pa = s.request(&a).unwrap();
    s.granted(pa).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    s.advance(20);
    s.tick();
    assert!(matches!(
        s.next_event(a.session),
        Some(SessionEvent::YieldRequested { .. })
    ));
    // b gives up; much later c comes: a is asked again and keeps a whole grace.
    assert!(s.cancel(pb));
    s.advance(500);
    let pc = s.request(&who("c", 1)).unwrap();
    s.tick();
    assert!(matches!(
        s.next_event(a.session),
        Some(SessionEvent::YieldRequested { .. })
    ));
    assert!(s.granted(pc).is_none(), "not taken without a new grace");
    s.advance(20);
    s.tick();
    assert!(matches!(
        s.next_event(a.session),
        Some(SessionEvent::TurnRevoked { .. })
    ));
    assert!(s.granted(pc).is_some());
    // Overrun counts only while someone waited past the quantum: nothing with b (it left
    // as the quantum ended), 20 ms with c.
    assert_eq!(s.s.usage("a").overrun, Duration::from_millis(20));
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
    let mut s = anticipating(30);
    let (h, l) = (who("heavy", 4), who("light", 1));
    let ph = s.request(&h).unwrap();
    let gh = s.granted(ph).unwrap();
    let pl = s.request(&l).unwrap();
    // light has used far more per weight: heavy is owed compute.
    s.set_compute("light", 5000);
    let end = s.release("heavy", gh.turn_id).unwrap();
    let until = end.kept_until.expect("kept for heavy");
    assert_eq!(until, s.now + Duration::from_millis(30));
    assert_eq!(
        s.wakes,
        vec![until],
        "the shell is woken when the window ends"
    );
    assert!(!end.handed_off);
    assert!(
        s.granted(pl).is_none(),
        "light waits while the slot is kept"
    );
    assert_eq!(s.s.holders(0), 0);
    // heavy asks again within the window: it gets the slot ahead of light.
    let ph = s.request(&h).unwrap();
    let gh = s.granted(ph).expect("the kept slot");
    assert!(s.granted(pl).is_none());
    // Again, but heavy does not come back: light gets the slot once the window ends.
    assert!(s.release("heavy", gh.turn_id).unwrap().kept_until.is_some());
    s.expire_kept();
    assert!(s.granted(pl).is_none(), "not before the window ends");
    s.advance(29);
    s.expire_kept();
    assert!(s.granted(pl).is_none(), "not before the window ends");
    s.advance(1);
    s.expire_kept();
    assert!(s.granted(pl).is_some(), "the next waiter after the window");
}

#[test]
fn a_tenant_ahead_of_its_share_keeps_nothing() {
    let mut s = anticipating(1000);
    let pa = s.request(&who("a", 1)).unwrap();
    let ga = s.granted(pa).unwrap();
    s.advance(2);
    let pb = s.request(&who("b", 1)).unwrap();
    // a used 2 ms, b nothing: b is owed, not a.
    let end = s.release("a", ga.turn_id).unwrap();
    assert_eq!(end.kept_until, None);
    assert!(s.wakes.is_empty());
    assert!(s.granted(pb).is_some());
}

#[test]
fn a_release_after_the_turn_was_taken_is_not_found_and_changes_nothing() {
    // Two slots held past quantum + grace while a third waits: both are taken, the third
    // gets one; the late releases find no turn and leave the new holder and the books as
    // they were.
    let mut s = Harness::new(cfg(100, 100, 2, 0));
    let (a, b, c) = (who("a", 1), who("b", 1), who("c", 1));
    let ga = s.request(&a).unwrap();
    let ga = s.granted(ga).unwrap();
    let gb = s.request(&b).unwrap();
    let gb = s.granted(gb).unwrap();
    s.advance(150);
    let pc = s.request(&c).unwrap();
    s.tick();
    s.advance(100);
    s.tick();
    for who in [&a, &b] {
        assert!(matches!(
            s.next_event(who.session),
            Some(SessionEvent::YieldRequested { .. })
        ));
        assert!(matches!(
            s.next_event(who.session),
            Some(SessionEvent::TurnRevoked { .. })
        ));
    }
    let gc = s.granted(pc).expect("c got a slot");
    let before = (s.s.usage("a"), s.s.usage("b"));
    assert!(matches!(
        s.release("a", ga.turn_id),
        Err(BrokerError::NotFound(crate::error::Missing::Turn(_)))
    ));
    assert!(s.release("b", gb.turn_id).is_err());
    assert_eq!((s.s.usage("a"), s.s.usage("b")), before);
    assert_eq!(before.0.turns, 1);
    assert_eq!(s.s.holders(0), 1);
    s.release("c", gc.turn_id).unwrap();
}

#[test]
fn a_forgotten_tenant_starts_afresh_and_its_counters_go() {
    // a used the device for 300 ms; deleted (sessions ended, then forgotten) and created
    // again under the name, it has no counters and comes before b, which used 100 ms.
    let mut s = sched(10_000);
    let a = who("a", 1);
    let pa = s.request(&a).unwrap();
    s.granted(pa).expect("free slot");
    s.advance(300);
    s.end_session(a.session);
    assert_eq!(s.s.usage("a").compute, Duration::from_millis(300));
    s.set_compute("b", 100);
    s.s.forget_tenant("a");
    s.drain();
    assert_eq!(s.s.usage("a"), TurnUsage::default());
    assert_eq!(s.s.tenants_counted(), 1, "only b is counted");
    // The new a and b wait behind a holder; the freed slot goes to the new a (0 ms).
    let h = who("h", 1);
    let ph = s.request(&h).unwrap();
    let gh = s.granted(ph).unwrap();
    let pb = s.request(&who("b", 1)).unwrap();
    let pa = s.request(&who("a", 1)).unwrap();
    s.release("h", gh.turn_id).unwrap();
    let ga = s.granted(pa).expect("the new a has used nothing");
    assert!(s.granted(pb).is_none());
    s.release("a", ga.turn_id).unwrap();
    let gb = s.granted(pb).expect("b next");
    s.release("b", gb.turn_id).unwrap();
    // Churn: tenants that take a turn and go leave no counters behind.
    for i in 0..50 {
        let t = who(&format!("churn{i}"), 1);
        let p = s.request(&t).unwrap();
        s.granted(p).expect("free slot");
        s.advance(1);
        s.end_session(t.session);
        assert_eq!(s.s.usage(&t.tenant).turns, 1, "booked");
        s.s.forget_tenant(&t.tenant);
    }
    assert_eq!(s.s.tenants_counted(), 3, "a, b and h");
}
