//! The broker's descriptor budget. Every block holds a descriptor from its allocation to
//! its free (an exported CUDA object, a memfd), a published memfd one more (its importers'
//! read-only reopen), and every watched process a pidfd. These are counted against the
//! process's descriptor limit (`RLIMIT_NOFILE`, read when the arbiter starts) less a
//! reserve kept for what a client cannot be refused without harm: accepting connections
//! (`--max-connections`), the operators, the listeners, the state file, the ticket and
//! metrics connections, the runtime's own. A new block that would eat into the reserve is
//! refused ([`BrokerError::OutOfDescriptors`]), so many small leases end in a clear
//! refusal, not in a broker that cannot accept a connection. Also the limit itself: read,
//! and raised to the hard limit at start.
//!
//! Known slack: a block's count is given back at its free, while a ticket minted for it
//! may keep the descriptor open until the ticket is redeemed or expires (bounded by the
//! per-lease ticket cap and the ticket TTL); and the reserve is at most half the limit, so
//! under a limit below twice `--max-connections` + 512 a full broker can still run out
//! (raise `LimitNOFILE`, as the shipped unit does).

use crate::error::BrokerError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Descriptors kept beyond the connections: the listeners, the state file, the metrics
/// (64) and ticket (272) connections, the runtime's and the drivers' own.
pub const RESERVE_BEYOND_CONNECTIONS: usize = 512;

/// The reserve to keep with `max_connections` connections allowed: those and
/// [`RESERVE_BEYOND_CONNECTIONS`], but never more than half the limit (a broker under a
/// small limit still grants leases).
pub fn reserve_for(max_connections: usize) -> usize {
    (max_connections + RESERVE_BEYOND_CONNECTIONS).min(nofile_limit() / 2)
}

/// `--max-connections 0`: half of the descriptor limit, 32 to 4096.
pub fn default_max_connections() -> usize {
    (nofile_limit() / 2).clamp(32, 4096)
}

/// The soft `RLIMIT_NOFILE` of this process.
pub fn nofile_limit() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    usize::try_from(r.rlim_cur).unwrap_or(usize::MAX)
}

/// Raises the soft descriptor limit to the hard one (systemd's soft default is 1024);
/// returns the soft limit now in force.
pub fn raise_nofile_limit() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &want);
        }
    }
    nofile_limit()
}

/// The descriptors the broker holds for memory, against its limit less the reserve.
#[derive(Debug)]
pub struct FdBudget {
    limit: usize,
    reserve: usize,
    /// Counted now: blocks, and published memfds' reopens.
    held: AtomicUsize,
    /// Refusals so far (the first and one in a thousand are logged).
    refused: AtomicUsize,
}

impl FdBudget {
    pub fn new(limit: usize, reserve: usize) -> Arc<FdBudget> {
        Arc::new(FdBudget {
            limit,
            reserve,
            held: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
        })
    }

    /// Counts one more descriptor, unless it and `others` (descriptors counted elsewhere:
    /// the watchers' pidfds) would eat into the reserve.
    pub fn take(&self, others: usize) -> Result<(), BrokerError> {
        let room = self.limit.saturating_sub(self.reserve);
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held + others < room).then_some(held + 1)
            })
            .map(drop)
            .map_err(|held| {
                let n = self.refused.fetch_add(1, Ordering::Relaxed);
                if n.is_multiple_of(1000) {
                    tracing::warn!(
                        held = held + others,
                        limit = self.limit,
                        reserve = self.reserve,
                        refusals = n + 1,
                        "out of descriptors for memory: new blocks are refused; raise the broker's descriptor limit (LimitNOFILE)"
                    );
                }
                BrokerError::OutOfDescriptors {
                    held: held + others,
                    limit: self.limit,
                    reserve: self.reserve,
                }
            })
    }

    /// [`FdBudget::take`], given back when the returned guard drops.
    pub fn take_held(self: &Arc<Self>, others: usize) -> Result<FdHeld, BrokerError> {
        self.take(others)?;
        Ok(FdHeld(self.clone()))
    }

    /// A descriptor counted already, as a guard that gives it back when dropped.
    pub fn adopt(self: &Arc<Self>) -> FdHeld {
        FdHeld(self.clone())
    }

    /// The descriptor limit read at start.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// One counted descriptor was closed (or is about to be). Giving back one that was
    /// never taken is a bookkeeping bug: caught in debug builds, saturated in release.
    pub fn give_back(&self) {
        let was = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| h.checked_sub(1));
        debug_assert!(
            was.is_ok(),
            "a descriptor given back that was never counted"
        );
    }

    /// Descriptors counted now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// One counted descriptor, given back when dropped (a publication's read-only reopen).
#[derive(Debug)]
pub struct FdHeld(Arc<FdBudget>);

impl Drop for FdHeld {
    fn drop(&mut self) {
        self.0.give_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_take_into_the_reserve_is_refused_with_the_numbers() {
        let b = FdBudget::new(10, 6);
        b.take(1).unwrap();
        b.take(1).unwrap();
        b.take(1).unwrap();
        // 3 held and 1 watched: the fifth would be the reserve's.
        match b.take(1) {
            Err(BrokerError::OutOfDescriptors {
                held,
                limit,
                reserve,
            }) => assert_eq!((held, limit, reserve), (4, 10, 6)),
            other => panic!("{other:?}"),
        }
        let held = b.take_held(0).unwrap();
        assert!(b.take(0).is_err());
        drop(held);
        b.give_back();
        assert_eq!(b.held(), 2);
        b.take(1).unwrap();
        b.give_back();
        b.give_back();
        b.give_back();
        assert_eq!(b.held(), 0);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "never counted")]
    fn giving_back_what_was_never_taken_is_caught() {
        let b = FdBudget::new(1024, 16);
        b.give_back();
    }

    #[test]
    fn the_reserve_keeps_at_most_half_the_limit() {
        assert!(reserve_for(usize::MAX / 4) <= nofile_limit() / 2);
        assert_eq!(
            reserve_for(0),
            RESERVE_BEYOND_CONNECTIONS.min(nofile_limit() / 2)
        );
    }
}
