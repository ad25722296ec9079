//! Which kept ticket connections give way when a connection is turned away at a cap
//! (`ticket_server.rs`). A connection kept open for its process's next ticket holds a
//! slot; when a newcomer finds no slot, kept ones close so that they never keep a process
//! out. Only those that hold the slot the newcomer lacked: a uid at its own cap closes its
//! own kept connections and nobody else's (any local user can reach its cap at will, and
//! must not make every other worker pay a connect per ticket); the total cap, which takes
//! many uids to reach, closes every kept connection.

use crate::listener::Refusal;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::Notify;

/// The signals kept connections wait on: one for all, one per uid that keeps any.
#[derive(Default)]
pub struct Pressure {
    everyone: Notify,
    uids: Mutex<HashMap<u32, Uid>>,
}

/// A uid's signal and how many kept connections wait on it (forgotten at none).
struct Uid {
    notify: Arc<Notify>,
    kept: usize,
}

/// A kept connection of one uid, waiting to be told to give way.
pub struct Kept {
    pressure: Arc<Pressure>,
    uid: Option<u32>,
    own: Option<Arc<Notify>>,
}

impl Pressure {
    /// A kept connection of `uid` (None: no uid known; only the total cap moves it).
    pub fn keep(self: &Arc<Self>, uid: Option<u32>) -> Kept {
        let own = uid.map(|u| {
            let mut uids = self.uids.lock();
            let e = uids.entry(u).or_insert_with(|| Uid {
                notify: Arc::default(),
                kept: 0,
            });
            e.kept += 1;
            e.notify.clone()
        });
        Kept {
            pressure: self.clone(),
            uid,
            own,
        }
    }

    /// A connection of `uid` was turned away at `cap`: the kept connections holding the
    /// slot it lacked give way.
    pub fn turned_away(&self, uid: Option<u32>, cap: Refusal) {
        match (cap, uid) {
            (Refusal::PerUid, Some(u)) => {
                let notify = self.uids.lock().get(&u).map(|e| e.notify.clone());
                if let Some(n) = notify {
                    n.notify_waiters();
                }
            }
            _ => self.everyone.notify_waiters(),
        }
    }
}

impl Kept {
    /// Resolves when this connection should give its slot back.
    pub async fn give_way(&self) {
        match &self.own {
            Some(own) => tokio::select! {
                _ = self.pressure.everyone.notified() => {}
                _ = own.notified() => {}
            },
            None => self.pressure.everyone.notified().await,
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let Some(u) = self.uid else { return };
        let mut uids = self.pressure.uids.lock();
        if let Some(e) = uids.get_mut(&u) {
            e.kept -= 1;
            if e.kept == 0 {
                uids.remove(&u);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    /// Whether `kept` is told to give way by `act` (its wait registered before).
    async fn moved_by(kept: &Kept, act: impl FnOnce()) -> bool {
        let wait = kept.give_way();
        tokio::pin!(wait);
        assert!((&mut wait).now_or_never().is_none(), "nothing happened yet");
        act();
        (&mut wait).now_or_never().is_some()
    }

    #[tokio::test]
    async fn a_uid_at_its_cap_moves_its_own_kept_connections_only() {
        let p = Arc::new(Pressure::default());
        let mine = p.keep(Some(1));
        let theirs = p.keep(Some(2));
        let unknown = p.keep(None);
        assert!(moved_by(&mine, || p.turned_away(Some(1), Refusal::PerUid)).await);
        assert!(!moved_by(&theirs, || p.turned_away(Some(1), Refusal::PerUid)).await);
        assert!(!moved_by(&unknown, || p.turned_away(Some(1), Refusal::PerUid)).await);
        // The total cap: everyone gives way.
        assert!(moved_by(&theirs, || p.turned_away(Some(1), Refusal::Total)).await);
        assert!(moved_by(&unknown, || p.turned_away(Some(1), Refusal::Total)).await);
        // Forgotten with its last kept connection.
        drop(mine);
        assert!(!p.uids.lock().contains_key(&1));
        assert!(p.uids.lock().contains_key(&2));
    }
}
