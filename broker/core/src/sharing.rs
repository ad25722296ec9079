//! Shared read-only leases: the table of publications and their imports, and the
//! read-only descriptors importers get. A tenant **publishes** one of its device leases
//! under a name (names are per tenant) for a list of reader tenants (its own by default);
//! sessions of those tenants **import** it and receive a descriptor through the ticket
//! socket. The memory stays charged once, to the publisher; importers are not charged.
//!
//! Life: a publication is importable while it is published (until `UnpublishLease`, or the
//! publisher's lease ends: released, revoked, or its session ended). Its memory lives while
//! the publisher's lease does **or** any import still holds it. When the publisher's lease
//! ends first, its block is **held** here (counted as the publisher's quarantined bytes, so
//! the byte states stay `leased + reserved + quarantined + cached`) until the last import
//! lets go; then it is freed. A published block never returns to the cache: other tenants
//! had its descriptor, and a memfd stays write-sealed.
//!
//! An import ends when its holder releases it (it promises it unmapped), when its session
//! ends and its process is gone, or, for a session that ended while its process lives,
//! when that process exits (the import **lingers** until then, as a lease's quarantine
//! does). A process outside the session that fetched the descriptor with a renewed ticket
//! is tracked too ([`Recipients`]): its lease's (or import's) memory is held until it exits.
//!
//! Read-only: for memfd memory the broker seals the object against writes
//! (`F_SEAL_FUTURE_WRITE`, then `F_SEAL_SEAL`) when it is first published, and hands
//! importers a descriptor reopened `O_RDONLY`. The seal is what holds: a read-only
//! descriptor alone can be reopened read-write through `/proc/self/fd`, a sealed object
//! refuses `write(2)`, writable shared mappings and `mprotect` to writable for every
//! descriptor. Mappings the publisher made before publishing keep writing. CUDA VMM memory
//! has no such control: see `docs/security.md`.

use crate::id_map::{IdMap, IdSet};
use crate::memory::{MemoryKind, SharedFd};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Instant, SystemTime};
use uuid::Uuid;

/// Longest publication name, in bytes.
pub const MAX_NAME: usize = 256;
/// Most reader tenants one publication may name.
pub const MAX_READERS: usize = 256;
/// Most live imports of one publication.
pub const MAX_IMPORTS: usize = 1024;
/// Most publications (published or still imported) one tenant may have.
pub const MAX_PUBLICATIONS_PER_TENANT: usize = 1024;
/// Most imports one session may hold.
pub const MAX_IMPORTS_PER_SESSION: usize = 1024;
/// Most imports one tenant may have, live or lingering: imports are not charged, and a
/// lingering one outlives its session (it is what its process may still map).
pub const MAX_IMPORTS_PER_TENANT: usize = 4096;

/// Processes that may still map memory whose holder let go, and whether a timeout runs
/// for a holder whose pid is unknown. Each has a watcher the arbiter's shell keeps
/// (`arbiter::effects::Watch`); this is only what is waited on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Waiters {
    pub pids: BTreeSet<u32>,
    pub timeout: bool,
}

impl Waiters {
    /// Nobody left who may map it.
    pub fn is_empty(&self) -> bool {
        self.pids.is_empty() && !self.timeout
    }
}

/// One import of a publication.
#[derive(Debug)]
pub struct Import {
    pub id: Uuid,
    pub tenant: String,
    pub session: Uuid,
    /// The importing process (when the kernel showed it).
    pub pid: Option<u32>,
    /// When `pid` started (its session's record): a kept lingering import names it.
    pub pid_start: Option<u64>,
    /// Where `pid` runs (its session's record): the block keeps it once it lets go.
    pub place: Option<std::sync::Arc<crate::process_place::Place>>,
    pub created: SystemTime,
    /// Set once its holder let go (released, or its session ended) while processes that
    /// may map it live: the import ends when they are gone.
    pub lingering: Option<Waiters>,
    /// When those of its lingering waiters that fetched its descriptor started (where
    /// known): its record names them, so a restarted broker tells each from a later
    /// process given its pid.
    pub recipient_starts: BTreeMap<u32, u64>,
    /// Its record is with the keeper (once its descriptor reached a process, until it
    /// ended: an `import/` record while its holder has it, a `lingering/` one after).
    pub kept: bool,
}

/// A published lease.
#[derive(Debug)]
pub struct Publication {
    pub id: Uuid,
    /// Order of creation (listings page by it).
    pub seq: u64,
    pub publisher: String,
    /// `None` once unpublished.
    pub name: Option<String>,
    /// The publisher's lease (its id also keys the held block once it ended).
    pub lease: Uuid,
    /// Is the publisher's lease still live?
    pub lease_live: bool,
    pub device: u32,
    pub bytes: u64,
    pub kind: MemoryKind,
    /// Tenants whose sessions may import it (the publisher's always may).
    pub readers: BTreeSet<String>,
    pub published_at: SystemTime,
    /// What importers receive (read-only for memfd memory).
    pub fd: SharedFd,
    pub block_id: u64,
    pub size: u64,
    /// Does the OS enforce read-only for importers (memfd seals)?
    pub enforced: bool,
    pub imports: BTreeMap<Uuid, Import>,
    /// `fd`'s place in the descriptor budget while it is the publication's own (a memfd's
    /// reopen): given back when the publication goes.
    pub fd_counted: Option<crate::fd_budget::FdHeld>,
}

impl Publication {
    /// May a session of `tenant` import it?
    pub fn readable_by(&self, tenant: &str) -> bool {
        self.name.is_some() && (tenant == self.publisher || self.readers.contains(tenant))
    }

    /// Is it worth listing (importable, or memory still imported)?
    pub fn listed(&self) -> bool {
        self.name.is_some() || !self.imports.is_empty()
    }
}

/// A block whose lease ended while processes other than its session's may still map it
/// (importers of its publication, recipients of renewed tickets, a publisher's live
/// process). Counted as its tenant's quarantined bytes until every one of them let go.
#[derive(Debug)]
pub struct Held {
    pub tenant: String,
    pub device: u32,
    pub block: crate::pool::Block,
    pub since: Instant,
    /// The publication whose imports keep it (until they all ended).
    pub publication: Option<Uuid>,
    pub waiters: Waiters,
    /// Free it when lifted (published blocks, a forced destroy); else cache it.
    pub destroy: bool,
    /// The lease's own process when its session ended while it lives (it may map it too).
    pub holder: Option<u32>,
    /// When `holder` started (its session's record, taken when the lease ended).
    pub holder_start: Option<u64>,
    /// Where `holder` runs (its session's record): the block keeps it when lifted.
    pub holder_place: Option<std::sync::Arc<crate::process_place::Place>>,
    /// When each of the waiters outside the lease's session that fetched its descriptor
    /// started, where known (kept with its record).
    pub recipient_starts: BTreeMap<u32, u64>,
    /// Its record (and a copy of its descriptor) is with the keeper: from its lease's end
    /// until it is let go.
    pub kept: bool,
}

/// Processes outside a lease's (or import's) session that redeemed a ticket of it, each
/// with its start time when the shell could read it (a later process of the pid is not it).
pub type Recipients = HashMap<Uuid, BTreeMap<u32, Option<u64>>>;

/// The start times known of `recipients` (a process whose start was not read has none).
pub fn starts_of(recipients: &BTreeMap<u32, Option<u64>>) -> BTreeMap<u32, u64> {
    recipients
        .iter()
        .filter_map(|(&p, &s)| Some((p, s?)))
        .collect()
}

/// Every publication, import and held block (lives in the arbiter's state).
#[derive(Debug, Default)]
pub struct SharedTable {
    pub pubs: HashMap<Uuid, Publication>,
    /// (publisher, name) -> publication, for published ones.
    pub by_name: HashMap<(String, String), Uuid>,
    /// Publisher's live lease -> publication.
    pub by_lease: HashMap<Uuid, Uuid>,
    /// Import -> publication.
    pub by_import: HashMap<Uuid, Uuid>,
    /// Live (not lingering) imports of each session: its end and its cap read them here,
    /// not in a scan of every import. Kept by [`SharedTable::add_import`],
    /// [`SharedTable::let_go`] and [`SharedTable::remove_import`].
    by_session: IdMap<Uuid, IdSet<Uuid>>,
    /// Imports (live and lingering) of each tenant, for its cap.
    of_tenant: HashMap<String, usize>,
    /// Held blocks, by the id of the lease they belonged to.
    pub held: HashMap<Uuid, Held>,
    pub recipients: Recipients,
    /// The last publication's `seq`.
    pub last_seq: u64,
}

impl SharedTable {
    /// The publication of a live or held lease.
    pub fn of_lease(&self, lease: &Uuid) -> Option<&Publication> {
        self.by_lease.get(lease).and_then(|p| self.pubs.get(p))
    }

    /// The publication an import belongs to.
    pub fn of_import(&self, import: &Uuid) -> Option<&Publication> {
        self.by_import.get(import).and_then(|p| self.pubs.get(p))
    }

    /// A published name of `publisher` that `reader` may import.
    pub fn visible(&self, publisher: &str, name: &str, reader: &str) -> Option<&Publication> {
        self.by_name
            .get(&(publisher.to_string(), name.to_string()))
            .and_then(|id| self.pubs.get(id))
            .filter(|p| p.readable_by(reader))
    }

    /// Publications `tenant` has (published or still imported).
    pub fn count_of(&self, tenant: &str) -> usize {
        self.pubs.values().filter(|p| p.publisher == tenant).count()
    }

    /// Imports a session holds (not those lingering after it let go).
    pub fn imports_of_session(&self, session: Uuid) -> Vec<Uuid> {
        self.by_session
            .get(&session)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }

    /// How many imports a session holds (not those lingering).
    pub fn count_of_session(&self, session: Uuid) -> usize {
        self.by_session.get(&session).map_or(0, |s| s.len())
    }

    /// How many imports `tenant` has, lingering ones too.
    pub fn imports_of_tenant(&self, tenant: &str) -> usize {
        self.of_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Adds an import of publication `publication` (indexed by id, session and tenant);
    /// false when there is no such publication.
    pub fn add_import(&mut self, publication: Uuid, import: Import) -> bool {
        let Some(p) = self.pubs.get_mut(&publication) else {
            return false;
        };
        self.by_import.insert(import.id, publication);
        if import.lingering.is_none() {
            self.by_session
                .entry(import.session)
                .or_default()
                .insert(import.id);
        }
        *self.of_tenant.entry(import.tenant.clone()).or_default() += 1;
        p.imports.insert(import.id, import);
        true
    }

    /// An import's session let go of it (it lingers, or is about to end).
    pub fn let_go(&mut self, session: Uuid, import: Uuid) {
        if let Some(s) = self.by_session.get_mut(&session) {
            s.remove(&import);
            if s.is_empty() {
                self.by_session.remove(&session);
            }
        }
    }

    /// Takes an import out of its publication and every index (its publication stays).
    pub fn remove_import(&mut self, import: Uuid) -> Option<Import> {
        let publication = self.by_import.remove(&import)?;
        let i = self.pubs.get_mut(&publication)?.imports.remove(&import)?;
        self.unindex(&i);
        Some(i)
    }

    /// Takes a publication out of the table (not `by_name` nor `by_lease`), with its
    /// imports.
    pub fn remove_publication(&mut self, id: Uuid) -> Option<Publication> {
        let p = self.pubs.remove(&id)?;
        for i in p.imports.values() {
            self.by_import.remove(&i.id);
            self.unindex(i);
        }
        Some(p)
    }

    /// Forgets a removed import in the session and tenant indexes.
    fn unindex(&mut self, i: &Import) {
        self.let_go(i.session, i.id);
        if let Some(n) = self.of_tenant.get_mut(&i.tenant) {
            *n -= 1;
            if *n == 0 {
                self.of_tenant.remove(&i.tenant);
            }
        }
    }

    /// The session and tenant indexes agree with a scan of every import (part of the
    /// invariant).
    pub fn check_import_indexes(&self) -> Result<(), String> {
        let mut by_session: IdMap<Uuid, IdSet<Uuid>> = IdMap::default();
        let mut of_tenant: HashMap<String, usize> = HashMap::new();
        for i in self.pubs.values().flat_map(|p| p.imports.values()) {
            if i.lingering.is_none() {
                by_session.entry(i.session).or_default().insert(i.id);
            }
            *of_tenant.entry(i.tenant.clone()).or_default() += 1;
        }
        if by_session != self.by_session {
            return Err("the imports by session disagree with the imports".into());
        }
        if of_tenant != self.of_tenant {
            return Err(format!(
                "imports by tenant {:?}, counted {of_tenant:?}",
                self.of_tenant
            ));
        }
        Ok(())
    }

    /// The `seq` of a new publication.
    pub fn next_seq(&mut self) -> u64 {
        self.last_seq += 1;
        self.last_seq
    }

    /// Bytes held here (they are counted as quarantined).
    pub fn held_bytes(&self) -> u64 {
        self.held.values().map(|h| h.block.bytes()).sum()
    }

    /// The held blocks as operators see them beside the quarantine (`ListQuarantined`):
    /// why each is held and every process that may still map it. `now` pairs a monotonic
    /// and a wall clock reading taken together.
    pub fn held_views(&self, now: (Instant, SystemTime)) -> Vec<crate::views::QuarantineView> {
        use crate::views::{HoldReason, QuarantineView};
        self.held
            .iter()
            .map(|(lease, h)| {
                let mut holders: BTreeSet<u32> = h.waiters.pids.iter().copied().collect();
                let publication = h.publication.and_then(|id| self.pubs.get(&id));
                if let Some(p) = publication {
                    for i in p.imports.values() {
                        holders.extend(i.pid);
                        if let Some(w) = &i.lingering {
                            holders.extend(w.pids.iter().copied());
                        }
                    }
                }
                let reason = if publication.is_some() {
                    HoldReason::Importers
                } else if self.recipients_of(h) {
                    HoldReason::Recipients
                } else {
                    HoldReason::Holder
                };
                QuarantineView {
                    lease: *lease,
                    tenant: h.tenant.clone(),
                    device: h.device,
                    bytes: h.block.bytes(),
                    pid: h.holder.filter(|p| h.waiters.pids.contains(p)),
                    since: now.1 - now.0.saturating_duration_since(h.since),
                    reason,
                    holders: holders.into_iter().collect(),
                    publication: publication.map(|p| (p.id, p.imports.len())),
                }
            })
            .collect()
    }

    /// Is a held block waiting for processes other than its lease's own?
    fn recipients_of(&self, h: &Held) -> bool {
        h.waiters.pids.iter().any(|p| Some(*p) != h.holder)
    }
}

/// A publication as the service layer shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedView {
    pub id: Uuid,
    pub publisher: String,
    pub name: Option<String>,
    /// The publisher's lease while it lives.
    pub lease: Option<Uuid>,
    pub device: u32,
    pub bytes: u64,
    pub kind: MemoryKind,
    pub readers: Vec<String>,
    pub published_at: SystemTime,
    pub enforced: bool,
    /// Withheld (empty) for viewers other than the publisher's tenant and operators.
    pub imports: Vec<ImportView>,
    pub import_count: usize,
}

/// One import as the service layer shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportView {
    pub id: Uuid,
    pub tenant: String,
    pub session: Uuid,
    pub pid: Option<u32>,
    pub created: SystemTime,
    pub lingering: bool,
}

impl Publication {
    /// Its view; `with_imports` lists the importers.
    pub fn view(&self, with_imports: bool) -> SharedView {
        SharedView {
            id: self.id,
            publisher: self.publisher.clone(),
            name: self.name.clone(),
            lease: self.lease_live.then_some(self.lease),
            device: self.device,
            bytes: self.bytes,
            kind: self.kind,
            readers: self.readers.iter().cloned().collect(),
            published_at: self.published_at,
            enforced: self.enforced,
            imports: if with_imports {
                self.imports
                    .values()
                    .map(|i| ImportView {
                        id: i.id,
                        tenant: i.tenant.clone(),
                        session: i.session,
                        pid: i.pid,
                        created: i.created,
                        lingering: i.lingering.is_some(),
                    })
                    .collect()
            } else {
                Vec::new()
            },
            import_count: self.imports.len(),
        }
    }
}
