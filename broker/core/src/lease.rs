//! The lease table and the lease state machine (and why a lease was revoked). A lease is a grant of one whole device
//! allocation (or a host-fallback block) to one session:
//!
//! ```text
//! Active --reclaim requested--> ReclaimRequested --released--> (gone)
//!    |                                  | deadline missed / admin revoke
//!    +--released / session ended--> (gone)   +--> revoked: memory quarantined
//! ```

use crate::ledger::Tier;
use crate::pool::Block;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use uuid::Uuid;

/// Where a lease is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    Active,
    /// The holder was asked to release it by `deadline`.
    ReclaimRequested {
        deadline: Instant,
        deadline_wall: SystemTime,
    },
}

/// The revocation reason of a holder that missed its reclaim deadline.
pub const RECLAIM_DEADLINE_MISSED: &str = "reclaim deadline missed";

/// Why a lease was revoked: the core's `Revoke` says it, the metrics count by it (the
/// `reason` label of `revocations`). Kept with the lease record, below both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Revocation {
    /// An operator's `RevokeLease`.
    Operator,
    /// The holder missed its reclaim deadline.
    ReclaimDeadline,
}

/// A live lease.
#[derive(Debug)]
pub struct Lease {
    pub id: Uuid,
    pub tenant: String,
    pub session: Uuid,
    pub device: u32,
    pub tier: Tier,
    pub requested_bytes: u64,
    pub label: String,
    pub reclaimable: bool,
    pub created: SystemTime,
    pub state: LeaseState,
    /// Priority of the tenant when granted (reclaim order).
    pub priority: i32,
    /// Order of grant (newest reclaimed first).
    pub seq: u64,
    pub block: Block,
    /// The process reservation its bytes were drawn from (`reservations.rs`), if any.
    pub reservation: Option<Uuid>,
    /// Cleared when the lease leaves the table (`LeaseTable::remove`).
    pub live: LiveMark,
}

/// Whether a lease is still in the table, readable without the arbiter's lock: a ticket
/// for the lease's session's own process carries it (the daemon's `fd/tickets.rs`), so the
/// ticket server delivers that process's descriptor without taking the lock, and a ticket
/// minted or redeemed after the lease ended still delivers nothing. Cleared only by
/// `LeaseTable::remove`, under the lock; a clone shares the one flag.
#[derive(Clone, Debug)]
pub struct LiveMark(Arc<AtomicBool>);

/// A mark for a lease about to enter the table (the core's grants make them): live.
impl Default for LiveMark {
    fn default() -> Self {
        LiveMark(Arc::new(AtomicBool::new(true)))
    }
}

impl LiveMark {
    /// Is the lease still in the table?
    pub fn is_live(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn clear(&self) {
        self.0.store(false, Ordering::Release);
    }

    /// Clears the mark as the lease's removal would (tests of its readers).
    #[cfg(any(test, feature = "testing"))]
    pub fn end_for_test(&self) {
        self.clear();
    }
}

/// Two marks are equal when they are one lease's.
impl PartialEq for LiveMark {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for LiveMark {}

impl Lease {
    pub fn bytes(&self) -> u64 {
        self.block.bytes()
    }
}

/// A copy of a lease's public fields, handed to the service layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    pub id: Uuid,
    pub tenant: String,
    pub session: Uuid,
    pub device: u32,
    pub tier: Tier,
    pub bytes: u64,
    pub requested_bytes: u64,
    pub label: String,
    pub reclaimable: bool,
    pub created: SystemTime,
    pub reclaim_deadline: Option<SystemTime>,
    pub borrowed: bool,
    /// The lease was taken away (the view returned by a revocation).
    pub revoked: bool,
    pub handle: crate::memory::Handle,
    /// The lease's mark (whether it is still in the table).
    pub live: LiveMark,
}

impl Lease {
    /// The public view; `borrowed` says whether it lies beyond the tenant's guarantee.
    pub fn view(&self, borrowed: bool) -> LeaseView {
        LeaseView {
            id: self.id,
            tenant: self.tenant.clone(),
            session: self.session,
            device: self.device,
            tier: self.tier,
            bytes: self.bytes(),
            requested_bytes: self.requested_bytes,
            label: self.label.clone(),
            reclaimable: self.reclaimable,
            created: self.created,
            reclaim_deadline: match self.state {
                LeaseState::ReclaimRequested { deadline_wall, .. } => Some(deadline_wall),
                LeaseState::Active => None,
            },
            borrowed,
            revoked: false,
            handle: self.block.handle.clone(),
            live: self.live.clone(),
        }
    }
}

/// Every live lease, by id, with two indexes for listings in grant order: by sequence
/// number, and each tenant's sequence numbers. A page of a listing then costs what the
/// page holds, not the number of live leases (`arbiter/listing.rs`).
#[derive(Debug, Default)]
pub struct LeaseTable {
    leases: crate::id_map::IdMap<Uuid, Lease>,
    by_seq: BTreeMap<u64, Uuid>,
    by_tenant: HashMap<String, BTreeSet<u64>>,
}

impl LeaseTable {
    pub fn insert(&mut self, lease: Lease) {
        self.remove(&lease.id);
        self.by_seq.insert(lease.seq, lease.id);
        self.by_tenant
            .entry(lease.tenant.clone())
            .or_default()
            .insert(lease.seq);
        self.leases.insert(lease.id, lease);
    }
    pub fn get(&self, id: &Uuid) -> Option<&Lease> {
        self.leases.get(id)
    }
    /// (A lease's id, tenant and sequence number never change: the indexes stay true.)
    pub fn get_mut(&mut self, id: &Uuid) -> Option<&mut Lease> {
        self.leases.get_mut(id)
    }
    pub fn remove(&mut self, id: &Uuid) -> Option<Lease> {
        let l = self.leases.remove(id)?;
        l.live.clear();
        self.unindex(&l);
        Some(l)
    }
    fn unindex(&mut self, l: &Lease) {
        self.by_seq.remove(&l.seq);
        if let Some(seqs) = self.by_tenant.get_mut(&l.tenant) {
            seqs.remove(&l.seq);
            if seqs.is_empty() {
                self.by_tenant.remove(&l.tenant);
            }
        }
    }
    pub fn iter(&self) -> impl Iterator<Item = &Lease> {
        self.leases.values()
    }
    /// Are the indexes exactly the table? (`State::check_invariant`.)
    pub fn check_indexes(&self) -> Result<(), String> {
        let in_tenants: usize = self.by_tenant.values().map(|s| s.len()).sum();
        if self.by_seq.len() != self.leases.len() || in_tenants != self.leases.len() {
            return Err(format!(
                "lease indexes: {} leases, {} by sequence, {} by tenant",
                self.leases.len(),
                self.by_seq.len(),
                in_tenants
            ));
        }
        for l in self.leases.values() {
            let by_tenant = self
                .by_tenant
                .get(&l.tenant)
                .is_some_and(|s| s.contains(&l.seq));
            if self.by_seq.get(&l.seq) != Some(&l.id) || !by_tenant {
                return Err(format!("lease {} (seq {}) is not indexed", l.id, l.seq));
            }
        }
        Ok(())
    }
    /// Up to `size` leases (of `tenant`, or all) granted after sequence number `after`, in
    /// grant order, and whether more follow.
    pub fn page_after(&self, tenant: Option<&str>, after: u64, size: usize) -> (Vec<&Lease>, bool) {
        use std::ops::Bound::{Excluded, Unbounded};
        let range = (Excluded(after), Unbounded);
        let mut seqs: Box<dyn Iterator<Item = u64> + '_> = match tenant {
            None => Box::new(self.by_seq.range(range).map(|(s, _)| *s)),
            Some(t) => match self.by_tenant.get(t) {
                Some(set) => Box::new(set.range(range).copied()),
                None => Box::new(std::iter::empty()),
            },
        };
        let page: Vec<&Lease> = seqs
            .by_ref()
            .filter_map(|s| self.by_seq.get(&s).and_then(|id| self.leases.get(id)))
            .take(size)
            .collect();
        (page, seqs.next().is_some())
    }
    pub fn len(&self) -> usize {
        self.leases.len()
    }
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }
    /// Lease ids, e.g. to end them all at shutdown.
    pub fn ids(&self) -> Vec<Uuid> {
        self.leases.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease's mark is the one its views carry, and leaving the table (release,
    /// revocation, a session's end: every ending removes it) clears it.
    #[test]
    fn leaving_the_table_clears_the_mark_its_views_share() {
        let mut t = LeaseTable::default();
        let block = Block {
            alloc: crate::memory::Allocation {
                id: 1,
                bytes: 4096,
                addr: 0,
                path: None,
            },
            handle: crate::memory::Handle::Fd {
                kind: crate::memory::MemoryKind::HostMemfd,
                fd: crate::memory::SharedFd::new(std::fs::File::open("/dev/null").unwrap().into()),
                block_id: 1,
                size: 4096,
            },
            last_tenant: None,
            reached: Default::default(),
        };
        let lease = Lease {
            id: Uuid::new_v4(),
            tenant: "a".into(),
            session: Uuid::new_v4(),
            device: 0,
            tier: Tier::Device,
            requested_bytes: 4096,
            label: String::new(),
            reclaimable: false,
            created: SystemTime::now(),
            state: LeaseState::Active,
            priority: 0,
            seq: 1,
            block,
            reservation: None,
            live: LiveMark::default(),
        };
        let id = lease.id;
        let view = lease.view(false);
        t.insert(lease);
        assert!(view.live.is_live());
        let gone = t.remove(&id).unwrap();
        assert!(!view.live.is_live() && !gone.live.is_live());
        assert!(t.remove(&id).is_none());
    }
}
