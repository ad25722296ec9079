//! The broker's descriptor budget: the count of descriptors it holds for memory (a block's
//! exported object or memfd, a publication's read-only reopen, a watched process's pidfd)
//! against its limit less a reserve. A new one that would eat into the reserve is refused
//! ([`BrokerError::OutOfDescriptors`]). The limit itself (`RLIMIT_NOFILE`) is read by the
//! daemon (`gpu_broker::fd_budget`) and passed in.

use crate::error::BrokerError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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
}
