//! The wait queue: requests that did not fit yet. Order of service: higher priority
//! first; within a priority, the tenant holding the least goes first (so no tenant starves
//! another by sending more requests); within a tenant, first come first served.
//!
//! Plain data of the core: a waiter is known by its [`WaiterId`]; the channel its answer
//! goes back on is the shell's (`arbiter/outbox.rs`). What the queue grants, refuses or
//! asks back is decided by `State::run_queue` (`state/queue.rs`).

use crate::error::BrokerResult;
use crate::lease::LeaseView;
use crate::ledger::Ledger;
use std::collections::BTreeMap;
use std::time::Instant;
use uuid::Uuid;

/// A waiting (or just granted) request, as the core knows it: the shell answers it by
/// this id (`Effect::Reply`).
pub type WaiterId = u64;

/// What a waiting request asked for.
#[derive(Clone, Debug)]
pub struct Ask {
    pub tenant: String,
    pub session: Uuid,
    /// Rounded size.
    pub bytes: u64,
    pub requested_bytes: u64,
    pub device: Option<u32>,
    pub label: String,
    pub reclaimable: bool,
    /// A process reservation rather than a lease (`reservations.rs`).
    pub process: Option<crate::reservations::ProcessAsk>,
    /// The process reservation a lease of a reserved process draws its bytes from.
    pub draw: Option<Uuid>,
}

impl Ask {
    /// Can the tenant take this now? Quota enforcement (`Ledger`): a lease is checked
    /// against the byte and lease-count limits, a process reservation against bytes only.
    pub fn check_charge(&self, ledger: &Ledger) -> BrokerResult<()> {
        if self.process.is_some() {
            ledger.check_process_charge(&self.tenant, self.bytes)
        } else {
            ledger.check_charge(&self.tenant, self.bytes, crate::ledger::Tier::Device)
        }
    }
}

/// What a granted request gets.
#[derive(Debug)]
pub enum Granted {
    Lease(LeaseView),
    Process(crate::reservations::ReservationView),
}

/// A request in the queue.
#[derive(Debug)]
pub struct Waiter {
    pub id: WaiterId,
    pub ask: Ask,
    pub priority: i32,
    /// When it was queued (its age decides overtaking: `overtaking.rs`).
    pub since: Instant,
    /// Reclaim was already requested on this waiter's behalf.
    pub reclaim_sent: bool,
}

/// Every waiting request, by arrival order.
#[derive(Debug, Default)]
pub struct WaitQueue {
    waiters: BTreeMap<u64, Waiter>,
    next_id: u64,
}

impl WaitQueue {
    /// A new waiter id (also for a request granted without queueing).
    pub fn next_id(&mut self) -> WaiterId {
        self.next_id += 1;
        self.next_id
    }

    /// Adds a request queued at `since`; returns its id.
    pub fn push(&mut self, ask: Ask, priority: i32, since: Instant) -> WaiterId {
        let id = self.next_id();
        self.waiters.insert(
            id,
            Waiter {
                id,
                ask,
                priority,
                since,
                reclaim_sent: false,
            },
        );
        id
    }

    pub fn remove(&mut self, id: u64) -> Option<Waiter> {
        self.waiters.remove(&id)
    }

    pub fn get(&self, id: u64) -> Option<&Waiter> {
        self.waiters.get(&id)
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut Waiter> {
        self.waiters.get_mut(&id)
    }

    pub fn contains(&self, id: u64) -> bool {
        self.waiters.contains_key(&id)
    }

    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.waiters.values()
    }

    /// Removes the waiters of a session (it ended).
    pub fn remove_session(&mut self, session: Uuid) -> Vec<Waiter> {
        let ids: Vec<u64> = self
            .waiters
            .values()
            .filter(|w| w.ask.session == session)
            .map(|w| w.id)
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Where `tenant`'s first waiter stands in the order of service (1: next); 0 when it
    /// has none waiting.
    pub fn position_of(&self, tenant: &str, ledger: &Ledger) -> u32 {
        // One pass, no sort (it runs under the state lock for every GetUsage): the
        // tenant's first waiter's rank, then how many rank before it.
        let held = |t: &str| {
            ledger
                .get(t)
                .map(|t| t.usage.committed_bytes())
                .unwrap_or(0)
        };
        let rank = |w: &Waiter| (std::cmp::Reverse(w.priority), held(&w.ask.tenant), w.id);
        let Some(first) = self
            .waiters
            .values()
            .filter(|w| w.ask.tenant == tenant)
            .map(rank)
            .min()
        else {
            return 0;
        };
        self.waiters.values().filter(|w| rank(w) < first).count() as u32 + 1
    }

    /// Waiter ids in order of service, given what each tenant holds now.
    pub fn order(&self, ledger: &Ledger) -> Vec<u64> {
        let held = |t: &str| {
            ledger
                .get(t)
                .map(|t| t.usage.committed_bytes())
                .unwrap_or(0)
        };
        let mut v: Vec<(i32, u64, u64)> = self
            .waiters
            .values()
            .map(|w| (w.priority, held(&w.ask.tenant), w.id))
            .collect();
        v.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        v.into_iter().map(|(_, _, id)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Quota;

    fn ask(tenant: &str) -> Ask {
        Ask {
            tenant: tenant.into(),
            session: Uuid::nil(),
            bytes: 1,
            requested_bytes: 1,
            device: None,
            label: String::new(),
            reclaimable: false,
            process: None,
            draw: None,
        }
    }

    #[test]
    fn priority_then_least_holding_tenant_then_fifo() {
        let mut l = Ledger::new();
        for t in ["a", "b", "c"] {
            l.set_quota(
                t,
                Quota {
                    limit_bytes: 100,
                    ..Quota::default()
                },
            )
            .unwrap();
        }
        l.reserve("a", 0, 50).unwrap();
        let mut q = WaitQueue::default();
        let now = Instant::now();
        let a1 = q.push(ask("a"), 0, now);
        let a2 = q.push(ask("a"), 0, now);
        let b1 = q.push(ask("b"), 0, now);
        let c1 = q.push(ask("c"), 5, now);
        assert_eq!(q.order(&l), vec![c1, b1, a1, a2]);
        // A tenant's position is its first waiter's in that order.
        assert_eq!(q.position_of("c", &l), 1);
        assert_eq!(q.position_of("b", &l), 2);
        assert_eq!(q.position_of("a", &l), 3);
        assert_eq!(q.position_of("nobody", &l), 0);
    }

    #[test]
    fn ids_are_never_reused() {
        let mut q = WaitQueue::default();
        let now = Instant::now();
        let a = q.push(ask("a"), 0, now);
        assert!(q.remove(a).is_some());
        let lone = q.next_id();
        let b = q.push(ask("a"), 0, now);
        assert!(a < lone && lone < b);
        assert!(!q.contains(a) && !q.contains(lone) && q.contains(b));
    }
}
