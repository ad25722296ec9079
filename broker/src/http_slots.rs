//! The metrics listener's connection slots. Its probes (`/healthz`, `/readyz`) arrive on
//! the same address as anyone who can reach it, and nothing tells a probe from another peer
//! before its request is read; so a full listener does not refuse a new connection: it
//! closes the one that has waited longest for a request (none sent yet, half of one, or
//! idle after an answer) and gives its slot to the new one. A connection whose request is
//! being answered is never closed for another; only when every slot is answering is a new
//! connection refused. Idle connections held by anyone thus cannot keep a probe out: it
//! connects, sends its request at once and is answered before its slot is the oldest idle.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The slots of one listener.
#[derive(Debug)]
pub struct HttpSlots {
    max: usize,
    inner: Mutex<Inner>,
    evicted: AtomicU64,
    /// Evicted connections not closed yet, and their closing told.
    closing: AtomicUsize,
    closed: Notify,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    conns: HashMap<u64, Entry>,
}

#[derive(Debug)]
struct Entry {
    /// Since when it waits for a request; `None` while one is being answered.
    idle_since: Option<Instant>,
    evict: CancellationToken,
}

/// A connection's slot: given back when dropped. Its connection must close once
/// [`Slot::evicted`] is cancelled (its slot went to a newer connection).
#[derive(Debug)]
pub struct Slot {
    slots: Arc<HttpSlots>,
    id: u64,
    evicted: CancellationToken,
}

impl HttpSlots {
    pub fn new(max: usize) -> Arc<HttpSlots> {
        Arc::new(HttpSlots {
            max: max.max(1),
            inner: Mutex::default(),
            evicted: AtomicU64::new(0),
            closing: AtomicUsize::new(0),
            closed: Notify::new(),
        })
    }

    /// A slot for a new connection, taken from the longest idle one when all are held;
    /// `None` when every slot is answering a request.
    pub fn admit(self: &Arc<Self>) -> Option<Slot> {
        let mut inner = self.inner.lock();
        if inner.conns.len() >= self.max {
            let (&oldest, _) = inner
                .conns
                .iter()
                .filter_map(|(id, e)| e.idle_since.map(|t| (id, (t, *id))))
                .min_by_key(|&(_, key)| key)?;
            if let Some(e) = inner.conns.remove(&oldest) {
                self.closing.fetch_add(1, Ordering::Relaxed);
                e.evict.cancel();
            }
            let n = self.evicted.fetch_add(1, Ordering::Relaxed);
            // The first and then one in a thousand.
            if n.is_multiple_of(1000) {
                tracing::warn!(
                    max = self.max,
                    evicted_so_far = n + 1,
                    "metrics listener full: closed the connection idle the longest"
                );
            }
        }
        let id = inner.next;
        inner.next += 1;
        let evicted = CancellationToken::new();
        inner.conns.insert(
            id,
            Entry {
                idle_since: Some(Instant::now()),
                evict: evicted.clone(),
            },
        );
        Some(Slot {
            slots: self.clone(),
            id,
            evicted,
        })
    }

    /// Connections holding a slot now.
    pub fn open(&self) -> usize {
        self.inner.lock().conns.len()
    }

    /// Connections closed so far to give their slot to a newer one.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Waits (up to `at_most`) until the evicted connections have closed, so that a stream
    /// of new connections cannot pile up descriptors faster than the evicted ones go.
    pub async fn settle(&self, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, async {
            loop {
                // Created before the look: told of any close after it.
                let closed = self.closed.notified();
                if self.closing.load(Ordering::Relaxed) == 0 {
                    return;
                }
                closed.await;
            }
        })
        .await;
    }

    fn mark(&self, id: u64, idle_since: Option<Instant>) {
        if let Some(e) = self.inner.lock().conns.get_mut(&id) {
            e.idle_since = idle_since;
        }
    }
}

impl Slot {
    /// A request is being answered: the slot is not given away meanwhile.
    pub fn busy(&self) {
        self.slots.mark(self.id, None);
    }

    /// The answer is handed over: the connection waits for its next request.
    pub fn idle(&self) {
        self.slots.mark(self.id, Some(Instant::now()));
    }

    /// Cancelled when the slot went to a newer connection.
    pub fn evicted(&self) -> &CancellationToken {
        &self.evicted
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.slots.inner.lock().conns.remove(&self.id).is_none() {
            // Evicted: its connection is closed now.
            self.slots.closing.fetch_sub(1, Ordering::Relaxed);
            self.slots.closed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_listener_gives_the_longest_idle_slot_to_a_new_connection() {
        let s = HttpSlots::new(3);
        let a = s.admit().unwrap();
        let b = s.admit().unwrap();
        let c = s.admit().unwrap();
        // `a` answers a request; `b` became idle before `c` did.
        a.busy();
        std::thread::sleep(std::time::Duration::from_millis(2));
        c.idle();
        let d = s.admit().expect("an idle slot is taken");
        assert!(b.evicted().is_cancelled(), "the longest idle goes");
        assert!(!a.evicted().is_cancelled() && !c.evicted().is_cancelled());
        assert_eq!((s.open(), s.evicted()), (3, 1));
        // Dropping the evicted slot frees nothing twice.
        assert_eq!(s.closing.load(Ordering::Relaxed), 1);
        drop(b);
        assert_eq!(s.open(), 3);
        assert_eq!(s.closing.load(Ordering::Relaxed), 0);
        let e = s.admit().unwrap();
        assert!(c.evicted().is_cancelled(), "then the next longest idle");
        // Only answering slots left with `a` busy and `d`, `e` idle: `d` goes next; with
        // every slot answering a new connection is refused.
        d.busy();
        e.busy();
        drop(c);
        assert!(s.admit().is_none(), "every slot answers a request");
        assert_eq!(s.open(), 3);
        a.idle();
        assert!(s.admit().is_some());
        assert!(a.evicted().is_cancelled());
    }

    #[tokio::test]
    async fn settle_waits_for_the_evicted_connection_to_close() {
        let s = HttpSlots::new(1);
        let a = s.admit().unwrap();
        let _b = s.admit().unwrap();
        let t0 = Instant::now();
        s.settle(Duration::from_millis(50)).await;
        assert!(t0.elapsed() >= Duration::from_millis(50), "waited for `a`");
        let closer = tokio::spawn(async move {
            a.evicted().cancelled().await;
            drop(a);
        });
        s.settle(Duration::from_secs(10)).await;
        assert_eq!(s.closing.load(Ordering::Relaxed), 0);
        closer.await.unwrap();
    }

    #[test]
    fn a_closed_connection_gives_its_slot_back() {
        let s = HttpSlots::new(1);
        let a = s.admit().unwrap();
        drop(a);
        assert_eq!(s.open(), 0);
        let b = s.admit().unwrap();
        assert!(!b.evicted().is_cancelled());
        assert_eq!(s.evicted(), 0);
    }
}
