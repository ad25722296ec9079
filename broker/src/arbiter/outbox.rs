//! The outbox: the shell's ends of the channels the core's messages travel on, so the core
//! (`gpu_broker_core::state`) holds no tokio types. The core names a session by its id; here each
//! open session's event channel (its **mailbox**) is kept by that id, opened under the state
//! lock (its guard is an argument of [`Outbox::open`]) in the hold that opened the session,
//! so no event for it can run before its mailbox is there. A transition asks for
//! an event with `Effect::Notify { session, .. }` and for the channel's end with
//! `Effect::Hangup`; the lock guard (`effects.rs`) resolves both while the state lock is
//! still held, so an event decided before a session ended always reaches its stream, and
//! sends after the lock is released.
//!
//! Waiting requests' **reply channels** are kept here too, by the waiter id the core knows
//! them by (`queue::WaiterId`). A channel is registered under the state lock (its guard is
//! an argument of [`Outbox::register_reply`]), in the same hold that queued the request, so
//! it is in place before any `Effect::Reply` for it can run (they run after the lock is
//! released). `Effect::Reply` takes it out and answers; an
//! id with no channel (its future was dropped: `WaiterGuard` forgot it) or a closed one
//! means the caller is gone, and the shell gives back whatever was granted.
//!
//! Waiting compute-turn requests' reply channels likewise (by the turn core's waiter id,
//! `scheduler::TurnWaiterId`): registered under the scheduler's lock (its guard,
//! `turns::TurnsHeld`, is an argument of [`Outbox::register_turn_reply`]) in the hold that
//! queued the request, taken out by the delivery of its `TurnEffect::Reply`
//! (`Executor::execute_turns`, `effects.rs`) after that lock is released.
//!
//! Leaf locks (one per table): taken under the state lock (or the scheduler's) or without
//! it, never holding another.

use super::queue::{Granted, WaiterId};
use crate::error::BrokerResult;
use crate::id_map::IdMap;
use crate::scheduler::{TurnGrant, TurnWaiterId};
use crate::session::SessionEvent;
use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;
use uuid::Uuid;

/// What a waiting request's future receives.
pub(crate) type Answer = BrokerResult<Granted>;

/// Every open session's event channel, by session id, and every waiting request's reply
/// channel, by waiter id.
#[derive(Default)]
pub(crate) struct Outbox {
    mailboxes: Mutex<IdMap<Uuid, UnboundedSender<SessionEvent>>>,
    replies: Replies<Answer>,
    turn_replies: Replies<TurnAnswer>,
}

/// What a waiting turn request's future receives.
pub(crate) type TurnAnswer = BrokerResult<TurnGrant>;

/// Reply channels by waiter id (the memory queue's and the turn core's ids are both
/// `u64`, each counted by its own core), answering `A`.
struct Replies<A> {
    channels: Mutex<IdMap<u64, oneshot::Sender<A>>>,
    /// Channels ever registered (tests: which requests got one).
    #[cfg(test)]
    registered: std::sync::atomic::AtomicUsize,
}

impl<A> Default for Replies<A> {
    fn default() -> Self {
        Replies {
            channels: Mutex::new(IdMap::default()),
            #[cfg(test)]
            registered: Default::default(),
        }
    }
}

impl<A> Replies<A> {
    fn register(&self, id: u64) -> oneshot::Receiver<A> {
        let (tx, rx) = oneshot::channel();
        self.channels.lock().insert(id, tx);
        #[cfg(test)]
        self.registered
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        rx
    }

    fn forget(&self, id: u64) -> bool {
        self.channels.lock().remove(&id).is_some()
    }

    /// Gives the answer back when nobody receives it.
    fn reply(&self, id: u64, answer: A) -> Option<A> {
        let tx = self.channels.lock().remove(&id);
        match tx {
            Some(tx) => tx.send(answer).err(),
            None => Some(answer),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.channels.lock().len()
    }
}

impl Outbox {
    /// Session `id` opens: its events go to `tx`. Only under the state lock (`_held`), in
    /// the hold that opened (or resumed) the session, so its mailbox is in place before
    /// any transition can tell it something.
    pub fn open(
        &self,
        _held: &super::effects::Locked<'_>,
        id: Uuid,
        tx: UnboundedSender<SessionEvent>,
    ) {
        self.mailboxes.lock().insert(id, tx);
    }

    /// Session `id` ended: its channel is dropped here (its stream ends once every event
    /// already sent is read, and no sender taken out before the close remains).
    pub fn close(&self, id: &Uuid) {
        let tx = self.mailboxes.lock().remove(id);
        drop(tx);
    }

    /// A sender to session `id`'s stream, if it is open (the lock guard finds it before
    /// the unlock and sends after it).
    pub fn sender(&self, id: &Uuid) -> Option<UnboundedSender<SessionEvent>> {
        self.mailboxes.lock().get(id).cloned()
    }

    /// Sends `event` to session `id`; a session that ended, or a worker that stopped
    /// listening, just misses it.
    pub fn send(&self, id: &Uuid, event: SessionEvent) {
        if let Some(tx) = self.sender(id) {
            let _ = tx.send(event);
        }
    }

    /// How many mailboxes are open (tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.mailboxes.lock().len()
    }

    /// A reply channel for waiter `id`; its receiver is the acquiring future's. Made only
    /// under the state lock (`_held`), in the hold that queued the waiter, so it is in place
    /// before any `Effect::Reply` for it runs.
    pub fn register_reply(
        &self,
        _held: &super::effects::Locked<'_>,
        id: WaiterId,
    ) -> oneshot::Receiver<Answer> {
        self.replies.register(id)
    }

    /// The caller of waiter `id` went away: its reply channel goes.
    pub fn forget_reply(&self, id: WaiterId) {
        self.replies.forget(id);
    }

    /// Answers waiter `id`; gives the answer back when nobody receives it (no channel, or
    /// its receiver was dropped).
    pub fn reply(&self, id: WaiterId, answer: Answer) -> Option<Answer> {
        self.replies.reply(id, answer)
    }

    /// How many reply channels are kept (tests: none may be left behind).
    #[cfg(test)]
    pub fn replies_len(&self) -> usize {
        self.replies.len()
    }

    /// How many reply channels were ever made for waiting requests (tests).
    #[cfg(test)]
    pub fn replies_registered(&self) -> usize {
        self.replies
            .registered
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A reply channel for turn waiter `id`; its receiver is the `AcquireTurn` future's.
    /// Made only under the turn core's lock (`_held`), in the hold that queued the waiter,
    /// so it is in place before the delivery of its `TurnEffect::Reply`.
    pub fn register_turn_reply(
        &self,
        _held: &super::turns::TurnsHeld<'_>,
        id: TurnWaiterId,
    ) -> oneshot::Receiver<TurnAnswer> {
        self.turn_replies.register(id)
    }

    /// The caller of turn waiter `id` went away: its reply channel goes. Returns whether
    /// it was still here (false: a delivery took it, or it was never registered).
    pub fn forget_turn_reply(&self, id: TurnWaiterId) -> bool {
        self.turn_replies.forget(id)
    }

    /// Answers turn waiter `id`; gives the answer back when nobody receives it (no
    /// channel, or its receiver was closed or dropped).
    pub fn reply_turn(&self, id: TurnWaiterId, answer: TurnAnswer) -> Option<TurnAnswer> {
        self.turn_replies.reply(id, answer)
    }

    /// How many turn reply channels are kept (tests: none may be left behind).
    #[cfg(test)]
    pub fn turn_replies_len(&self) -> usize {
        self.turn_replies.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::BrokerError;

    #[test]
    fn events_reach_an_open_mailbox_and_a_closed_one_ends_the_stream() {
        let o = Outbox::default();
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        o.mailboxes.lock().insert(a, tx);
        let e = |reason: &str| SessionEvent::ShuttingDown {
            reason: reason.into(),
            grace: std::time::Duration::ZERO,
        };
        o.send(&a, e("one"));
        // Another session's id reaches nothing.
        o.send(&b, e("not for a"));
        assert!(o.sender(&b).is_none());
        o.send(&a, e("two"));
        o.close(&a);
        o.send(&a, e("after the end"));
        assert_eq!(o.len(), 0);
        assert_eq!(rx.try_recv().unwrap(), e("one"));
        assert_eq!(rx.try_recv().unwrap(), e("two"));
        // Closed: the stream ends after what was sent before.
        assert_eq!(
            rx.try_recv(),
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected)
        );
    }

    #[test]
    fn an_answer_reaches_its_receiver_once() {
        let r = Outbox::default();
        let mut rx = r.replies.register(7);
        assert!(r.reply(7, Err(BrokerError::ShuttingDown)).is_none());
        assert!(matches!(rx.try_recv(), Ok(Err(BrokerError::ShuttingDown))));
        // Taken out: a second answer has nobody to go to.
        assert!(r.reply(7, Err(BrokerError::ShuttingDown)).is_some());
        assert_eq!(r.replies_len(), 0);
    }

    #[test]
    fn an_answer_for_a_gone_caller_comes_back() {
        let r = Outbox::default();
        let rx = r.replies.register(1);
        drop(rx);
        assert!(r.reply(1, Err(BrokerError::ShuttingDown)).is_some());
        let _rx = r.replies.register(2);
        r.forget_reply(2);
        assert!(r.reply(2, Err(BrokerError::ShuttingDown)).is_some());
        assert!(r.reply(3, Err(BrokerError::ShuttingDown)).is_some());
        assert_eq!(r.replies_len(), 0);
    }
}
