//! Adoption of shared leases: a restarted broker takes back the publications of the
//! leases it took back (same id and name, so importers and new importers find them), the
//! blocks of ended leases held for importers (counted to their tenant as quarantined,
//! with their publication), the imports of the sessions it took back (an import's
//! process died meanwhile: its session was not taken back, nor is the import), and the
//! lingering imports whose processes still live. Nothing is pushed for the keeper: it
//! holds them already. Importers are not charged; the publisher's lease (or held block)
//! is, as before.

use super::adopt::NotAdopted;
use super::shared::NewPublication;
use super::State;
use crate::effects::Watch;
use crate::memory::{Handle, SharedFd};
use crate::pool::Block;
use crate::sharing::{Held, Import, Publication, Waiters};
use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;
use uuid::Uuid;

/// A kept held block to take back (from its record): its processes are those still
/// alive (the shell looked).
#[derive(Clone, Debug)]
pub struct AdoptedHeld {
    /// The ended lease's id.
    pub lease: Uuid,
    pub tenant: String,
    pub device: u32,
    /// Processes that may still map it, with their start times when known.
    pub waiters: BTreeMap<u32, Option<u64>>,
    /// Those of `waiters` outside its lease's session that fetched its descriptor, by
    /// the start times their record gave.
    pub recipient_starts: BTreeMap<u32, u64>,
    pub timeout: bool,
    pub destroy: bool,
}

/// The publication of a held block taken back: importers find it by id.
#[derive(Debug)]
pub struct AdoptedHeldPublication {
    pub id: Uuid,
    pub readers: BTreeSet<String>,
    pub published_at: SystemTime,
    /// What importers receive (read-only for memfd memory), made again from the block.
    pub fd: SharedFd,
    pub enforced: bool,
    pub fd_counted: Option<crate::fd_budget::FdHeld>,
}

/// A kept lingering import to take back: its processes are those still alive.
#[derive(Clone, Debug)]
pub struct AdoptedLingering {
    pub import: AdoptedImport,
    pub pid_start: Option<u64>,
    pub waiters: BTreeSet<u32>,
    pub timeout: bool,
}

/// A kept import to take back (from its record).
#[derive(Clone, Debug)]
pub struct AdoptedImport {
    pub id: Uuid,
    pub publication: Uuid,
    pub tenant: String,
    pub session: Uuid,
    pub pid: Option<u32>,
    pub created: SystemTime,
    /// Processes outside its session that fetched its descriptor and still live (the
    /// shell looked): it lingers for them when it is let go (a lingering import's are
    /// among its waiters; here for their start times).
    pub recipients: BTreeMap<u32, Option<u64>>,
}

impl State {
    /// Takes back publication `id` of live lease `p.lease` under `name` (None: it was
    /// unpublished while imported; `p.name` is not read). Refused when the lease was not
    /// taken back or is another tenant's, or the id or the name is taken.
    pub fn adopt_publication(
        &mut self,
        id: Uuid,
        name: Option<String>,
        p: NewPublication,
    ) -> Result<(), NotAdopted> {
        let published_at = p.published_at;
        self.insert_publication(id, p, name)
            .ok_or(NotAdopted::Session)?;
        if let Some(p) = self.shared.pubs.get_mut(&id) {
            p.published_at = published_at;
        }
        Ok(())
    }

    /// Takes back import `a` of a publication taken back, held by a session taken back
    /// (of the import's tenant). Refused otherwise.
    pub fn adopt_import(&mut self, a: AdoptedImport) -> Result<(), NotAdopted> {
        let session_ok = self
            .sessions
            .get(&a.session)
            .is_some_and(|s| s.tenant == a.tenant);
        if !session_ok {
            return Err(NotAdopted::Session);
        }
        let readable = self
            .shared
            .pubs
            .get(&a.publication)
            .is_some_and(|p| p.publisher == a.tenant || p.readers.contains(&a.tenant));
        if !readable || self.shared.by_import.contains_key(&a.id) {
            return Err(NotAdopted::Publication);
        }
        let import = Import {
            id: a.id,
            tenant: a.tenant,
            session: a.session,
            pid: a.pid,
            pid_start: self.start_of(a.session, a.pid),
            place: self.place_of(a.session, a.pid),
            created: a.created,
            lingering: None,
            recipient_starts: BTreeMap::new(),
            kept: true,
        };
        if self.shared.add_import(a.publication, import) {
            if !a.recipients.is_empty() {
                self.shared.recipients.insert(a.id, a.recipients);
            }
            Ok(())
        } else {
            Err(NotAdopted::Publication)
        }
    }

    /// Takes back held block `a` on `block`: counted to its tenant and on its device as
    /// quarantined again, watched for its processes; its publication and imports come
    /// next ([`State::adopt_held_publication`], [`State::adopt_lingering`],
    /// [`State::adopt_import`]), then [`State::settle_adopted_held`] lets it go if nobody
    /// holds it. Gives the block back when its tenant or device is gone, or a lease of
    /// that id is live (the shell takes back one of them).
    pub fn adopt_held(&mut self, a: AdoptedHeld, block: Block) -> Result<(), (NotAdopted, Block)> {
        if a.device as usize >= self.pools.len() {
            return Err((NotAdopted::Device, block));
        }
        if self.ledger.get(&a.tenant).is_none() {
            return Err((NotAdopted::Tenant, block));
        }
        if self.leases.get(&a.lease).is_some()
            || self.quarantine.contains_key(&a.lease)
            || self.shared.held.contains_key(&a.lease)
        {
            return Err((NotAdopted::Session, block));
        }
        let bytes = block.bytes();
        let pool = &mut self.pools[a.device as usize];
        pool.adopt(bytes);
        pool.release_to_quarantine(bytes);
        self.ledger.add_quarantine(&a.tenant, a.device, bytes);
        for &pid in a.waiters.keys() {
            self.fx.watch(Watch::Held {
                lease: a.lease,
                pid: Some(pid),
            });
        }
        if a.timeout {
            self.fx.watch(Watch::Held {
                lease: a.lease,
                pid: None,
            });
        }
        // One known start is the lease's own process's (recipients' are kept apart).
        let holder = a
            .waiters
            .iter()
            .filter(|(p, _)| !a.recipient_starts.contains_key(p))
            .find_map(|(&p, s)| s.map(|s| (p, s)));
        self.shared.held.insert(
            a.lease,
            Held {
                tenant: a.tenant,
                device: a.device,
                block,
                since: self.clock.now,
                publication: None,
                waiters: Waiters {
                    pids: a.waiters.keys().copied().collect(),
                    timeout: a.timeout,
                },
                destroy: a.destroy,
                holder: holder.map(|h| h.0),
                holder_start: holder.map(|h| h.1),
                holder_place: None,
                recipient_starts: a.recipient_starts,
                kept: true,
            },
        );
        Ok(())
    }

    /// Takes back publication `p` of held block `lease` (unpublished: its name went with
    /// the lease). Refused when the block was not taken back, has a publication, or the id
    /// is taken.
    pub fn adopt_held_publication(
        &mut self,
        lease: Uuid,
        p: AdoptedHeldPublication,
    ) -> Result<(), NotAdopted> {
        if self.shared.pubs.contains_key(&p.id) || self.shared.by_lease.contains_key(&lease) {
            return Err(NotAdopted::Publication);
        }
        let Some(h) = self.shared.held.get_mut(&lease) else {
            return Err(NotAdopted::Publication);
        };
        let Handle::Fd {
            kind,
            block_id,
            size,
            ..
        } = &h.block.handle;
        let (kind, block_id, size) = (*kind, *block_id, *size);
        h.publication = Some(p.id);
        let (publisher, device, bytes) = (h.tenant.clone(), h.device, h.block.bytes());
        let seq = self.shared.next_seq();
        self.shared.by_lease.insert(lease, p.id);
        self.shared.pubs.insert(
            p.id,
            Publication {
                id: p.id,
                seq,
                publisher,
                name: None,
                lease,
                lease_live: false,
                device,
                bytes,
                kind,
                readers: p.readers,
                published_at: p.published_at,
                fd: p.fd,
                block_id,
                size,
                enforced: p.enforced,
                imports: Default::default(),
                fd_counted: p.fd_counted,
            },
        );
        Ok(())
    }

    /// Takes back lingering import `a` of a publication taken back (its session ended
    /// before the restart): it ends once its processes (those alive now) are gone.
    pub fn adopt_lingering(&mut self, a: AdoptedLingering) -> Result<(), NotAdopted> {
        let i = a.import;
        let readable = self
            .shared
            .pubs
            .get(&i.publication)
            .is_some_and(|p| p.publisher == i.tenant || p.readers.contains(&i.tenant));
        if !readable || self.shared.by_import.contains_key(&i.id) {
            return Err(NotAdopted::Publication);
        }
        if a.waiters.is_empty() && !a.timeout {
            return Err(NotAdopted::Session);
        }
        for &pid in &a.waiters {
            self.fx.watch(Watch::Import {
                import: i.id,
                pid: Some(pid),
            });
        }
        if a.timeout {
            self.fx.watch(Watch::Import {
                import: i.id,
                pid: None,
            });
        }
        let import = Import {
            id: i.id,
            tenant: i.tenant,
            session: i.session,
            pid: i.pid,
            pid_start: a.pid_start,
            place: None,
            created: i.created,
            lingering: Some(Waiters {
                pids: a.waiters,
                timeout: a.timeout,
            }),
            recipient_starts: crate::sharing::starts_of(&i.recipients),
            kept: true,
        };
        if self.shared.add_import(i.publication, import) {
            Ok(())
        } else {
            Err(NotAdopted::Publication)
        }
    }

    /// After the take-back of held blocks and imports: a held block's publication that
    /// no import was taken back for is dropped, and a held block nobody may map any more
    /// is let go (freed). Returns those let go (their records leave the keeper).
    pub fn settle_adopted_held(&mut self) -> Vec<Uuid> {
        let unimported: Vec<(Uuid, Uuid)> = self
            .shared
            .pubs
            .values()
            .filter(|p| !p.lease_live && p.imports.is_empty())
            .map(|p| (p.id, p.lease))
            .collect();
        for (id, lease) in unimported {
            if let Some(p) = self.shared.remove_publication(id) {
                self.shared.by_lease.remove(&p.lease);
            }
            if let Some(h) = self.shared.held.get_mut(&lease) {
                h.publication = None;
            }
        }
        let idle: Vec<Uuid> = self
            .shared
            .held
            .iter()
            .filter(|(_, h)| h.kept && h.publication.is_none() && h.waiters.is_empty())
            .map(|(l, _)| *l)
            .collect();
        idle.into_iter().filter(|l| self.maybe_lift(*l)).collect()
    }
}
