//! The lease table and the lease state machine. A lease is a grant of one whole device
//! allocation (or a host-fallback block) to one session:
//!
//! ```text
//! Active --reclaim requested--> ReclaimRequested --released--> (gone)
//!    |                                  | deadline missed / admin revoke
//!    +--released / session ended--> (gone)   +--> revoked: memory quarantined
//! ```

use crate::ledger::Tier;
use crate::pool::Block;
use std::collections::HashMap;
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
}

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
    pub handle: crate::device::Handle,
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
        }
    }
}

/// Every live lease, by id.
#[derive(Debug, Default)]
pub struct LeaseTable {
    leases: HashMap<Uuid, Lease>,
}

impl LeaseTable {
    pub fn insert(&mut self, lease: Lease) {
        self.leases.insert(lease.id, lease);
    }
    pub fn get(&self, id: &Uuid) -> Option<&Lease> {
        self.leases.get(id)
    }
    pub fn get_mut(&mut self, id: &Uuid) -> Option<&mut Lease> {
        self.leases.get_mut(id)
    }
    pub fn remove(&mut self, id: &Uuid) -> Option<Lease> {
        self.leases.remove(id)
    }
    pub fn iter(&self) -> impl Iterator<Item = &Lease> {
        self.leases.values()
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
