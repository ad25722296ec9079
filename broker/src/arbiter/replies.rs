//! The shell's reply channels: the core knows a waiting request only by its
//! [`WaiterId`](super::queue::WaiterId); the channel its acquiring future waits on is kept
//! here, by that id. A channel is registered under the state lock, in the same hold that
//! queued the request, so it is in place before any `Effect::Reply` for it can run (they
//! run after the lock is released). `Effect::Reply` takes it out and answers; an id with
//! no channel (its future was dropped: `WaiterGuard` forgot it) or a closed one means
//! the caller is gone, and the shell gives back whatever was granted.
//!
//! A leaf lock: taken under the state lock or with no lock held, never holding another.

use super::queue::{Granted, WaiterId};
use crate::error::BrokerResult;
use std::collections::HashMap;
use tokio::sync::oneshot;

/// What a waiting request's future receives.
pub(crate) type Answer = BrokerResult<Granted>;

/// Reply channels by waiter id.
#[derive(Default)]
pub(crate) struct Replies(parking_lot::Mutex<HashMap<WaiterId, oneshot::Sender<Answer>>>);

impl Replies {
    /// A channel for waiter `id`; its receiver is the acquiring future's.
    pub fn register(&self, id: WaiterId) -> oneshot::Receiver<Answer> {
        let (tx, rx) = oneshot::channel();
        self.0.lock().insert(id, tx);
        rx
    }

    /// The caller of `id` went away: its channel goes.
    pub fn forget(&self, id: WaiterId) {
        self.0.lock().remove(&id);
    }

    /// Answers waiter `id`; gives the answer back when nobody receives it (no channel, or
    /// its receiver was dropped).
    pub fn send(&self, id: WaiterId, answer: Answer) -> Result<(), Answer> {
        let tx = self.0.lock().remove(&id);
        match tx {
            Some(tx) => tx.send(answer),
            None => Err(answer),
        }
    }

    /// How many channels are kept (tests: none may be left behind).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::BrokerError;

    #[test]
    fn an_answer_reaches_its_receiver_once() {
        let r = Replies::default();
        let mut rx = r.register(7);
        assert!(r.send(7, Err(BrokerError::ShuttingDown)).is_ok());
        assert!(matches!(rx.try_recv(), Ok(Err(BrokerError::ShuttingDown))));
        // Taken out: a second answer has nobody to go to.
        assert!(r.send(7, Err(BrokerError::ShuttingDown)).is_err());
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn an_answer_for_a_gone_caller_comes_back() {
        let r = Replies::default();
        let rx = r.register(1);
        drop(rx);
        assert!(r.send(1, Err(BrokerError::ShuttingDown)).is_err());
        let _rx = r.register(2);
        r.forget(2);
        assert!(r.send(2, Err(BrokerError::ShuttingDown)).is_err());
        assert!(r.send(3, Err(BrokerError::ShuttingDown)).is_err());
        assert_eq!(r.len(), 0);
    }
}
