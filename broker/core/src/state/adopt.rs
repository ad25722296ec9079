//! Adoption: a restarted broker takes back what the keeper held for it. A session whose
//! peer process still lives opens again (waiting for its worker to resume it), and each of
//! its leases comes back with the same id, bytes, tenant and memory, charged to its tenant
//! and counted on its device (a claim session's drawn from the claim's reservation again).
//! Nothing is pushed for the keeper: it holds them already.

use super::State;
use crate::effects::Watch;
use crate::error::{BrokerError, BrokerResult, Missing};
use crate::lease::{Lease, LeaseState, LeaseView, LiveMark};
use crate::ledger::Tier;
use crate::pool::Block;
use crate::session::Session;
use std::time::SystemTime;
use uuid::Uuid;

/// A kept lease to take back (from its record).
#[derive(Clone, Debug)]
pub struct Adopted {
    pub id: Uuid,
    pub tenant: String,
    pub session: Uuid,
    pub device: u32,
    pub requested_bytes: u64,
    pub label: String,
    pub reclaimable: bool,
    pub created: SystemTime,
    pub priority: i32,
    /// The process reservation it was drawn from (taken back before it), if any.
    pub reservation: Option<Uuid>,
    /// Processes outside its session that fetched its descriptor and still live (the
    /// shell looked), with their start times: its memory is held for them when it ends.
    pub recipients: std::collections::BTreeMap<u32, Option<u64>>,
}

/// Why a kept lease was not taken back (its block is handed back to be let go).
#[derive(Debug)]
pub enum NotAdopted {
    /// Its session was not taken back (its holder died meanwhile), or is another tenant's.
    Session,
    /// No such device in this broker.
    Device,
    /// Its tenant no longer exists.
    Tenant,
    /// An import's publication was not taken back (or no longer lets its tenant read it).
    Publication,
}

impl State {
    /// Opens `s` again as its previous broker had it (no session limit: it was open
    /// already); its peer process is watched. Refused when its tenant is gone or a
    /// session of that id is open.
    pub fn adopt_session(&mut self, s: Session) -> BrokerResult<()> {
        if self.ledger.get(&s.tenant).is_none() {
            return Err(BrokerError::NotFound(Missing::TenantGone(s.tenant.clone())));
        }
        if self.sessions.get(&s.id).is_some() {
            return Err(BrokerError::InvalidArgument(format!(
                "session {} is open already",
                s.id
            )));
        }
        if let Some(pid) = s.peer.pid {
            self.fx.watch(Watch::Session { session: s.id, pid });
        }
        self.sessions.insert(s);
        Ok(())
    }

    /// Takes back lease `a` on `block` (its device tier memory): charged to its tenant
    /// beyond its quota if that shrank meanwhile (the memory is in use), counted on its
    /// device. Gives the block back when the lease cannot be taken back.
    pub fn adopt_lease(
        &mut self,
        a: Adopted,
        block: Block,
    ) -> Result<LeaseView, (NotAdopted, Block)> {
        let ok = self
            .sessions
            .get(&a.session)
            .is_some_and(|s| s.tenant == a.tenant);
        if !ok {
            return Err((NotAdopted::Session, block));
        }
        if a.device as usize >= self.pools.len() {
            return Err((NotAdopted::Device, block));
        }
        let bytes = block.bytes();
        // A lease of a claim's session was drawn from the claim's reservation (restored
        // from the store before adoption): drawn from it again, not charged beside it.
        // Likewise a lease its process drew from the session's process reservation (taken
        // back before its leases).
        let drawn = self
            .sessions
            .get(&a.session)
            .and_then(|s| s.token_id.as_deref())
            .and_then(|t| self.reservations.bound_to(t))
            .or_else(|| a.reservation.and_then(|r| self.reservations.get(&r)))
            .filter(|r| r.tenant == a.tenant && r.device == a.device && r.room() >= bytes)
            .map(|r| r.id);
        if let Some(rid) = drawn {
            self.draw(rid, &a.tenant, bytes);
        }
        if self.ledger.adopt(&a.tenant, a.device, bytes).is_err() {
            if let Some(rid) = drawn {
                self.lease_left_reservation(rid, bytes, true);
            }
            return Err((NotAdopted::Tenant, block));
        }
        self.pools[a.device as usize].adopt(bytes);
        // Who else got its descriptor before the restart is not all kept (importers that
        // let go, processes past the record's bound): such a block is freed when the lease
        // ends, never cached for its tenant's next lease, so nobody who may still map it
        // sees later bytes. Those its record names and that live hold it when it ends.
        self.sealing.insert(a.id);
        if !a.recipients.is_empty() {
            self.shared.recipients.insert(a.id, a.recipients);
        }
        let seq = self.next_seq();
        let lease = Lease {
            id: a.id,
            tenant: a.tenant,
            session: a.session,
            device: a.device,
            tier: Tier::Device,
            requested_bytes: a.requested_bytes,
            label: a.label,
            reclaimable: a.reclaimable,
            created: a.created,
            state: LeaseState::Active,
            priority: a.priority,
            seq,
            block,
            reservation: drawn,
            live: LiveMark::default(),
        };
        Ok(self.insert_lease_kept(lease))
    }
}

impl State {
    /// Takes back host-tier lease `a` on `block` (its memfd, made again by the host
    /// tier): charged to its tenant's host bytes beyond a limit that shrank meanwhile.
    /// Gives the block back when its session is gone or its tenant is.
    pub fn adopt_host_lease(
        &mut self,
        a: Adopted,
        block: Block,
    ) -> Result<LeaseView, (NotAdopted, Block)> {
        let ok = self
            .sessions
            .get(&a.session)
            .is_some_and(|s| s.tenant == a.tenant);
        if !ok {
            return Err((NotAdopted::Session, block));
        }
        if self.ledger.adopt_host(&a.tenant, block.bytes()).is_err() {
            return Err((NotAdopted::Tenant, block));
        }
        let seq = self.next_seq();
        let lease = Lease {
            id: a.id,
            tenant: a.tenant,
            session: a.session,
            device: 0,
            tier: Tier::Host,
            requested_bytes: a.requested_bytes,
            label: a.label,
            reclaimable: a.reclaimable,
            created: a.created,
            state: LeaseState::Active,
            priority: a.priority,
            seq,
            block,
            reservation: None,
            live: LiveMark::default(),
        };
        Ok(self.insert_lease_kept(lease))
    }
}

/// A kept quarantine to take back (from its record).
#[derive(Clone, Debug)]
pub struct AdoptedQuarantine {
    /// The ended lease's id.
    pub lease: Uuid,
    pub tenant: String,
    pub device: u32,
    pub pid: Option<u32>,
    /// When `pid` started (the record's, checked against the process by the shell).
    pub pid_start: Option<u64>,
    pub destroy: bool,
    /// The session whose process retained it (`retained.rs`).
    pub retained_by: Option<Uuid>,
}

impl State {
    /// Pushes quarantine `id` (just made) for the keeper: its memory stays counted across
    /// a restart while its process lives.
    pub(super) fn keep_quarantine(&mut self, id: Uuid) {
        if !self.keeping {
            return;
        }
        if let Some(k) = self.quarantine_kept(id) {
            self.keep(|| k);
        }
    }

    /// Takes back quarantined memory `a` on `block`: counted to its tenant and on its
    /// device as quarantined again, lifted when its process exits (watched). Gives the
    /// block back when its tenant or device is gone.
    pub fn adopt_quarantine(
        &mut self,
        a: AdoptedQuarantine,
        block: Block,
    ) -> Result<(), (NotAdopted, Block)> {
        if a.device as usize >= self.pools.len() {
            return Err((NotAdopted::Device, block));
        }
        if self.ledger.get(&a.tenant).is_none() {
            return Err((NotAdopted::Tenant, block));
        }
        // Never beside a live lease of that id (the shell takes back one of them).
        if self.quarantine.contains_key(&a.lease) || self.leases.get(&a.lease).is_some() {
            return Err((NotAdopted::Session, block));
        }
        let bytes = block.bytes();
        let pool = &mut self.pools[a.device as usize];
        pool.adopt(bytes);
        pool.release_to_quarantine(bytes);
        self.ledger.add_quarantine(&a.tenant, a.device, bytes);
        self.quarantine.insert(
            a.lease,
            super::Quarantined {
                tenant: a.tenant,
                device: a.device,
                block,
                pid: a.pid,
                pid_start: a.pid_start,
                place: None,
                since: self.clock.now,
                destroy: a.destroy,
                // Still its process's retained block: that process's client lets go of
                // its retained blocks on the resume, and its word frees it (else it would
                // stay counted until the process exits).
                retained_by: a.retained_by,
                asked_back: false,
            },
        );
        if let Some(session) = a.retained_by {
            self.retained.entry(session).or_default().insert(a.lease);
        }
        self.fx.watch(Watch::Quarantine {
            lease: a.lease,
            pid: a.pid,
        });
        Ok(())
    }
}
