//! How long the arbiter's state lock is held, counted by threshold: every hold, and the
//! holds longer than 100 us, 1 ms and 10 ms (`gpu_broker_state_lock_holds_total{longer_than}`).
//! Admission waits for the lock, so a long hold is a stall of every acquire behind it;
//! operators (and the bench's admin-reads phase) read these counters to see whether
//! listings, usage reads or scrapes stall admission. Recording is one or two relaxed atomic
//! adds per hold (`arbiter/effects.rs`, when the guard is dropped).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The thresholds, by label: a hold is counted under each one it exceeds.
pub const THRESHOLDS: [(&str, Duration); 4] = [
    ("0", Duration::ZERO),
    ("100us", Duration::from_micros(100)),
    ("1ms", Duration::from_millis(1)),
    ("10ms", Duration::from_millis(10)),
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LongerThan {
    longer_than: &'static str,
}

/// Counts of state-lock holds by threshold.
#[derive(Debug, Default)]
pub struct LockHolds {
    counts: [AtomicU64; THRESHOLDS.len()],
}

impl LockHolds {
    /// The lock was held for `held`.
    pub fn record(&self, held: Duration) {
        for (i, (_, t)) in THRESHOLDS.iter().enumerate() {
            if i > 0 && held <= *t {
                break;
            }
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Holds counted so far under each threshold, in [`THRESHOLDS`] order.
    pub fn counts(&self) -> [u64; THRESHOLDS.len()] {
        std::array::from_fn(|i| self.counts[i].load(Ordering::Relaxed))
    }

    pub(crate) fn register(&self, reg: &mut Registry) {
        let fam = Family::<LongerThan, Counter>::default();
        for ((longer_than, _), n) in THRESHOLDS.iter().zip(self.counts()) {
            fam.get_or_create(&LongerThan { longer_than }).inc_by(n);
        }
        reg.register(
            "state_lock_holds",
            "Holds of the arbiter's state lock (admission waits for it), by how long they exceeded",
            fam,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_counts_under_every_threshold_it_exceeds() {
        let h = LockHolds::default();
        h.record(Duration::from_micros(5));
        h.record(Duration::from_micros(150));
        h.record(Duration::from_millis(2));
        h.record(Duration::from_millis(1));
        h.record(Duration::from_millis(30));
        assert_eq!(h.counts(), [5, 4, 2, 1]);
        let mut reg = Registry::default();
        h.register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains("state_lock_holds_total{longer_than=\"1ms\"} 2"),
            "{text}"
        );
    }
}
