//! How long the arbiter's state lock is held, counted by threshold: every hold, and the
//! holds longer than 100 us, 1 ms and 10 ms
//! (`gpu_broker_state_lock_holds_total{longer_than, clock}`), by the wall clock (what
//! acquires behind the hold wait) and, with `--lock-hold-cpu-clock`, by the holding
//! thread's CPU clock as well (the work done under the lock; a hold whose thread the OS
//! preempted is long by the wall clock only). Admission waits for the lock, so a long hold
//! is a stall of every acquire behind it; operators (and the bench's admin-reads phase)
//! read these counters to see whether listings, usage reads or scrapes stall admission.
//!
//! Recording is a wall-clock read (the vDSO's, no system call) and one or two relaxed
//! atomic adds per hold (`arbiter/effects.rs`, when the guard is dropped). The thread's
//! CPU clock is a system call (the vDSO does not serve it), and a hold's CPU time needs a
//! reading at every take (four system calls a pooled acquire and release): measured side
//! by side it cost up to ~5% of the broker's CPU a lease, so it is counted only when
//! asked for ([`LockHolds::new`]; the `clock="cpu"` series is absent
//! otherwise). Then the closing read is made only for holds longer than 100 us by the
//! wall clock: a thread cannot use more CPU time than the wall time that passed, so a
//! shorter hold is under every CPU threshold above zero as well
//! ([`LockHolds::record_hold`]).
//!
//! It also counts the takes that found the lock held, by how long they waited for it
//! (`gpu_broker_state_lock_waits_total{longer_than}`; "0": every such take): what an
//! acquire loses to others' holds, including a holder re-taking the lock at once. A take
//! that finds the lock free costs no clock read.

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
    clock: &'static str,
}

/// Counts of state-lock holds by threshold, by the wall clock and (if asked for) by the
/// thread's CPU clock.
#[derive(Debug, Default)]
pub struct LockHolds {
    /// Holds are counted by the thread's CPU clock too (the `cpu` counts and series).
    cpu_clock: bool,
    wall: [AtomicU64; THRESHOLDS.len()],
    cpu: [AtomicU64; THRESHOLDS.len()],
    /// Takes that found the lock held, by how long they waited.
    waits: [AtomicU64; THRESHOLDS.len()],
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WaitedLongerThan {
    longer_than: &'static str,
}

/// The calling thread's CPU time (zero if the clock cannot be read).
pub fn thread_cpu_now() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a plain clock read into a timespec we own.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn bump(counts: &[AtomicU64; THRESHOLDS.len()], held: Duration) {
    for (i, (_, t)) in THRESHOLDS.iter().enumerate() {
        if i > 0 && held <= *t {
            break;
        }
        counts[i].fetch_add(1, Ordering::Relaxed);
    }
}

impl LockHolds {
    /// Counts by the wall clock, and by the holding thread's CPU clock too if `cpu_clock`
    /// (its caller then reads that clock at every take: [`thread_cpu_now`]).
    pub fn new(cpu_clock: bool) -> LockHolds {
        LockHolds {
            cpu_clock,
            ..LockHolds::default()
        }
    }

    /// Are holds counted by the thread's CPU clock (is it to be read at every take)?
    pub fn cpu_clock(&self) -> bool {
        self.cpu_clock
    }

    /// A hold of `wall` by the wall clock, counted by the wall clock only (the CPU clock
    /// is not counted, or was not read at the take).
    pub fn record_wall(&self, wall: Duration) {
        bump(&self.wall, wall);
    }

    /// The lock was held for `wall` by the wall clock and `cpu` of the holding thread's
    /// CPU time.
    pub fn record(&self, wall: Duration, cpu: Duration) {
        bump(&self.wall, wall);
        bump(&self.cpu, cpu);
    }

    /// A take of the lock found it held and waited `waited` for it.
    pub fn record_wait(&self, waited: Duration) {
        bump(&self.waits, waited);
    }

    /// Takes that waited, counted so far under each threshold (in [`THRESHOLDS`] order).
    pub fn wait_counts(&self) -> [u64; THRESHOLDS.len()] {
        std::array::from_fn(|i| self.waits[i].load(Ordering::Relaxed))
    }

    /// Counts a hold of `wall` by the wall clock; `cpu` reads how much CPU time the holding
    /// thread used in it, and is called only when `wall` exceeds the first threshold above
    /// zero (the CPU time of a thread in an interval is at most the interval's length, so
    /// a hold that short counts under the zero CPU threshold only, as it would if read).
    pub fn record_hold(&self, wall: Duration, cpu: impl FnOnce() -> Duration) {
        let cpu = if wall <= THRESHOLDS[1].1 { wall } else { cpu() };
        self.record(wall, cpu);
    }

    /// Holds counted so far under each threshold (in [`THRESHOLDS`] order), by the wall
    /// clock and by the CPU clock.
    pub fn counts(&self) -> ([u64; THRESHOLDS.len()], [u64; THRESHOLDS.len()]) {
        (
            std::array::from_fn(|i| self.wall[i].load(Ordering::Relaxed)),
            std::array::from_fn(|i| self.cpu[i].load(Ordering::Relaxed)),
        )
    }

    pub(crate) fn register(&self, reg: &mut Registry) {
        let fam = Family::<LongerThan, Counter>::default();
        let (wall, cpu) = self.counts();
        let clocks = [("wall", wall), ("cpu", cpu)];
        let counted = if self.cpu_clock {
            &clocks[..]
        } else {
            &clocks[..1]
        };
        for &(clock, counts) in counted {
            for ((longer_than, _), n) in THRESHOLDS.iter().zip(counts) {
                fam.get_or_create(&LongerThan { longer_than, clock })
                    .inc_by(n);
            }
        }
        reg.register(
            "state_lock_holds",
            "Holds of the arbiter's state lock (admission waits for it), by how long they exceeded",
            fam,
        );
        let waits = Family::<WaitedLongerThan, Counter>::default();
        for ((longer_than, _), n) in THRESHOLDS.iter().zip(self.wait_counts()) {
            waits
                .get_or_create(&WaitedLongerThan { longer_than })
                .inc_by(n);
        }
        reg.register(
            "state_lock_waits",
            "Takes of the arbiter's state lock that found it held, by how long they waited",
            waits,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_counts_under_every_threshold_it_exceeds() {
        let h = LockHolds::new(true);
        let us = Duration::from_micros;
        h.record(us(5), us(5));
        h.record(us(150), us(20));
        h.record(us(2000), us(1500));
        h.record(us(1000), us(900));
        h.record(us(30_000), us(200));
        assert_eq!(h.counts(), ([5, 4, 2, 1], [5, 3, 1, 0]));
        let mut reg = Registry::default();
        h.register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains("state_lock_holds_total{longer_than=\"1ms\",clock=\"wall\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("state_lock_holds_total{longer_than=\"1ms\",clock=\"cpu\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn without_the_cpu_clock_holds_count_by_the_wall_clock_and_no_cpu_series_is_exported() {
        let h = LockHolds::new(false);
        assert!(!h.cpu_clock());
        let us = Duration::from_micros;
        h.record_wall(us(5));
        h.record_wall(us(150));
        h.record_wall(us(2000));
        assert_eq!(h.counts(), ([3, 2, 1, 0], [0; 4]));
        let mut reg = Registry::default();
        h.register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains("state_lock_holds_total{longer_than=\"1ms\",clock=\"wall\"} 1"),
            "{text}"
        );
        assert!(!text.contains("clock=\"cpu\""), "{text}");
        assert!(LockHolds::new(true).cpu_clock());
    }

    #[test]
    fn a_wait_counts_under_every_threshold_it_exceeds() {
        let h = LockHolds::default();
        let us = Duration::from_micros;
        h.record_wait(us(3));
        h.record_wait(us(250));
        h.record_wait(us(1500));
        assert_eq!(h.wait_counts(), [3, 2, 1, 0]);
        let mut reg = Registry::default();
        h.register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains("state_lock_waits_total{longer_than=\"100us\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn the_cpu_clock_is_read_only_for_holds_longer_than_the_first_threshold() {
        let h = LockHolds::new(true);
        let us = Duration::from_micros;
        let reads = std::cell::Cell::new(0);
        let read = |d: Duration| {
            reads.set(reads.get() + 1);
            d
        };
        h.record_hold(us(99), || read(us(99)));
        h.record_hold(us(100), || read(us(100)));
        h.record_hold(us(150), || read(us(20)));
        h.record_hold(us(2000), || read(us(1500)));
        assert_eq!(reads.get(), 2);
        assert_eq!(h.counts(), ([4, 2, 1, 0], [4, 1, 1, 0]));
    }

    #[test]
    fn the_thread_cpu_clock_moves_with_work_not_with_sleep() {
        let t0 = thread_cpu_now();
        std::thread::sleep(Duration::from_millis(50));
        let slept = thread_cpu_now() - t0;
        let t1 = thread_cpu_now();
        let mut x = 0u64;
        while thread_cpu_now() - t1 < Duration::from_millis(5) {
            x = x.wrapping_add(1);
        }
        assert!(x > 0);
        assert!(slept < Duration::from_millis(50), "{slept:?}");
    }
}
