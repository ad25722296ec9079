//! A keeper that comes back after it was lost (`keeper/link.rs`): one thread per broker
//! with a keeper process watches the connection (a keeper that died or was restarted
//! closes its end: declared lost at once, not at the next write), and once the keeper is
//! lost reconnects with a backoff. A keeper that answers again (a new one on the socket,
//! or the stalled one reading again) is told to forget what it held, then filled again
//! under the state lock with every live session, lease, quarantine, drain, publication,
//! kept import, process reservation and reclaim request
//! ([`State::kept_now`](gpu_broker_core::state::State::kept_now)), so it holds exactly the
//! broker's state, and keeping goes on as before. Counted by `keeper_lost_total` and
//! `keeper_relinked_total`.

use super::Restart;
use crate::arbiter::Arbiter;
use crate::keeper::{KeeperLink, Place};
use std::sync::Weak;
use std::time::{Duration, Instant};

/// How long one look at the connection waits (and how soon the thread ends once its
/// arbiter is gone).
const WATCH_EVERY: Duration = Duration::from_millis(250);
/// The first wait before a reconnect, doubled after each failure up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Restart<'_> {
    /// Starts the thread that watches the keeper and reconnects to it (see the module
    /// documentation). It holds the arbiter weakly and ends soon after it.
    pub(super) fn spawn_relink(&self) {
        let me = self.arb.me();
        let spawned = std::thread::Builder::new()
            .name("keeper-relink".into())
            .spawn(move || relink_loop(me));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot watch the keeper: a lost keeper will not be reconnected");
        }
    }

    /// Fills the keeper `link` reconnected to with everything live, under the state lock
    /// (no change can come between); how many records were written.
    fn refill(&self, place: &dyn Place, link: &KeeperLink) -> Option<usize> {
        let st = self.arb.lock();
        if !link.resume() {
            return None;
        }
        let changes = st.kept_now();
        let mut written = changes.len();
        for k in changes {
            self.write_kept(place, k);
        }
        let avail = self.arb.avail.read();
        for d in avail.draining() {
            let drain = avail.device(d).and_then(|s| s.drain.as_ref());
            self.write_drain(place, d, drain);
            written += 1;
        }
        drop(avail);
        if link.is_broken() {
            // Lost again while it was filled: counted as the loss it is.
            self.arb.metrics.count_keeper_lost();
        }
        drop(st);
        Some(written)
    }
}

/// The relink thread's loop: watch while the keeper is kept, reconnect while it is lost.
fn relink_loop(me: Weak<Arbiter>) {
    let mut backoff = BACKOFF_MIN;
    let mut failures = 0u32;
    loop {
        let Some(place) = me
            .upgrade()
            .and_then(|a| a.restart_state.keeper.get().cloned())
        else {
            return;
        };
        let Some(link) = place.as_keeper() else {
            return;
        };
        if !link.is_broken() {
            if link.watch(WATCH_EVERY) {
                let Some(arb) = me.upgrade() else { return };
                // Under the lock, as a write's loss is: counted once.
                let st = arb.lock();
                if link.lose_closed() {
                    arb.metrics.count_keeper_lost();
                }
                drop(st);
            }
            continue;
        }
        #[allow(
            clippy::disallowed_methods,
            reason = "the keeper-relink thread is its own: it waits between reconnects"
        )]
        std::thread::sleep(backoff);
        if me.strong_count() == 0 {
            return;
        }
        let t = Instant::now();
        let outcome = link.reconnect();
        let Some(arb) = me.upgrade() else { return };
        match outcome.map(|()| arb.restart().refill(&*place, link)) {
            Ok(Some(records)) if !link.is_broken() => {
                tracing::warn!(records, took = ?t.elapsed(), failures, "the keeper is back: told to forget what it held and given every live record again; leases are kept again");
                arb.metrics.count_keeper_relinked();
                backoff = BACKOFF_MIN;
                failures = 0;
            }
            Ok(_) => {
                failures += 1;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
            Err(e) => {
                failures += 1;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                // Once, then now and then: a keeper that stays away is no news each time.
                if failures == 1 || failures.is_multiple_of(60) {
                    tracing::warn!(error = %e, failures, next_in = ?backoff, "the lost keeper does not answer yet");
                } else {
                    tracing::debug!(error = %e, failures, "the lost keeper does not answer yet");
                }
            }
        }
    }
}
