//! The outbox: the shell's ends of the channels the core's messages travel on, so the core
//! (`arbiter/state/`) holds no tokio types. The core names a session by its id; here each
//! open session's event channel (its **mailbox**) is kept by that id. A transition asks for
//! an event with `Effect::Notify { session, .. }` and for the channel's end with
//! `Effect::Hangup`; the lock guard (`effects.rs`) resolves both while the state lock is
//! still held, so an event decided before a session ended always reaches its stream, and
//! sends after the lock is released.
//!
//! A leaf lock: taken under the state lock or without it, never holding another.

use crate::session::SessionEvent;
use parking_lot::Mutex;
use std::collections::HashMap;
use tokio::sync::mpsc::UnboundedSender;
use uuid::Uuid;

/// Every open session's event channel, by session id.
#[derive(Default)]
pub(crate) struct Outbox {
    mailboxes: Mutex<HashMap<Uuid, UnboundedSender<SessionEvent>>>,
}

impl Outbox {
    /// Session `id` opens: its events go to `tx`.
    pub fn open(&self, id: Uuid, tx: UnboundedSender<SessionEvent>) {
        self.mailboxes.lock().insert(id, tx);
    }

    /// Session `id` ended: its channel is dropped here (its stream ends once every event
    /// already sent is read, and no other sender, such as a turn holder's, remains).
    pub fn close(&self, id: &Uuid) {
        let tx = self.mailboxes.lock().remove(id);
        drop(tx);
    }

    /// A sender to session `id`'s stream (for a component that sends on its own: the
    /// compute-turn scheduler), if it is open.
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_reach_an_open_mailbox_and_a_closed_one_ends_the_stream() {
        let o = Outbox::default();
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        o.open(a, tx);
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
}
