//! Shared blocks: when a published lease (or one whose descriptor another process
//! fetched) ends, its block is held, counted as its tenant's quarantined bytes, until the
//! last importer and every such process let go; imports end (or linger while their
//! process may map the memory). The publication table itself is `crate::sharing`; the
//! requests (publish, import, release) are the shell's `arbiter/sharing.rs`.
//!
//! The core reads no `/proc`: a process outside a lease's session that fetched its
//! descriptor (a **recipient**), and an importing session's peer, count as alive when the
//! lease or import ends. The block is held (the import lingers) for them and
//! `Effect::CheckGone` names them; after the unlock the shell reads `/proc` and hands those
//! certainly gone to [`State::holders_checked`] (a check that cannot decide says alive). A
//! lease held only for unchecked recipients is **parked** ([`Unchecked`]): when they all
//! turn out gone it ends the way it was ending (cache, free, or its own quarantine), so the
//! outcome is the one a look under the lock would have given, and memory never reaches
//! another tenant while a process that may map it lives.

use super::{Ending, Quarantined, State};
use crate::effects::{Counted, Effect, Effects, Watch};
use crate::memory::{Handle, MemoryKind, SharedFd};
use crate::pool::Block;
use crate::session::Peer;
use crate::sharing::{Held, Import, Publication, Waiters};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::SystemTime;
use uuid::Uuid;

/// A publication the shell prepared for a live lease that has none: it checked the lease
/// (its tenant's, a device lease), the name (free) and the limits, and made the descriptor
/// importers get (read-only where the OS can enforce it).
#[derive(Debug)]
pub struct NewPublication {
    pub lease: Uuid,
    pub publisher: String,
    pub name: String,
    pub readers: BTreeSet<String>,
    pub published_at: SystemTime,
    pub fd: SharedFd,
    pub enforced: bool,
    /// Its descriptor's place in the descriptor budget (a memfd's reopen), if it has one
    /// of its own.
    pub fd_counted: Option<crate::fd_budget::FdHeld>,
}

/// A lease that just ended, as [`State::shared_lease_ended`] reads it.
#[derive(Debug)]
pub(super) struct EndedLease {
    pub id: Uuid,
    pub tenant: String,
    pub device: u32,
    pub ending: Ending,
    /// When the process that may map it (`ending.holder()`) started, if known.
    pub holder_start: Option<u64>,
    /// Where that process runs, if known.
    pub holder_place: Option<std::sync::Arc<crate::process_place::Place>>,
    /// The process reservation it was drawn from.
    pub reservation: Option<Uuid>,
    /// Its holder had been asked for it back (its reclaim record goes with it).
    pub reclaim: bool,
}

/// A memory kind as records name it.
pub(super) fn kind_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::CudaVmm => "cuda-vmm",
        MemoryKind::HostMemfd => "host-memfd",
    }
}

/// What processes counted alive without a look may map: an ended lease's held block, or a
/// lingering import (`Effect::CheckGone`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holding {
    Lease(Uuid),
    Import(Uuid),
}

/// A lease held only because processes outside its session had its descriptor, none
/// looked at yet: how it ends if they are all gone.
#[derive(Debug)]
pub struct Unchecked {
    /// How it was ending (its own process may still map it: `Ending::Quarantine`).
    ending: Ending,
    /// The process reservation it was drawn from: its bytes go back into the room (or
    /// are lost to it) once the look decided.
    reservation: Option<Uuid>,
    /// The recipients counted alive.
    recipients: BTreeSet<u32>,
}

/// How the core learns whether a host memfd still carries only the seals it was made
/// with: a holder may add seals to a memfd it has, so only the kernel knows. The core
/// does no I/O; the shell gives it the look (`sharing::untouched`, a `fcntl` and a `fstat`) when
/// it makes the core, and the core's tests give it one they control.
#[derive(Clone)]
pub struct SealCheck(Arc<UntouchedLook>);

/// The look itself: a memfd and the size it was made with -> untouched?
type UntouchedLook = dyn Fn(&SharedFd, u64) -> bool + Send + Sync;

impl SealCheck {
    /// The look `untouched` answers: true when the memfd's seals are its creation seals
    /// and it still has the size (the second argument) it was made with.
    pub fn new(untouched: impl Fn(&SharedFd, u64) -> bool + Send + Sync + 'static) -> Self {
        SealCheck(Arc::new(untouched))
    }
}

impl Default for SealCheck {
    /// No look at all: every host memfd counts as touched (freed, never cached), which is
    /// never wrong, only slower. The shell always gives the real look.
    fn default() -> Self {
        SealCheck::new(|_, _| false)
    }
}

impl std::fmt::Debug for SealCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealCheck")
    }
}

/// What [`State::add_recipient`] made of a descriptor going to another process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipient {
    /// Recorded (or recorded already): the descriptor may go.
    Added,
    /// The lease or import ended (or was let go): nothing may go.
    Gone,
    /// It reached as many other processes as a record names: nothing may go.
    Full,
}

impl State {
    /// Does the block carry only the seals it was made with (host memory: asks the
    /// [`SealCheck`] the shell gave), so it may be cached for its tenant's next lease?
    pub fn pristine(&self, block: &Block) -> bool {
        match &block.handle {
            Handle::Fd {
                kind: MemoryKind::HostMemfd,
                fd,
                size,
                ..
            } => (self.seals.0)(fd, *size),
            _ => true,
        }
    }

    /// Publishes a live lease that has no publication under a name; returns the new
    /// publication's id (`None`, nothing changed, when the lease is not live or not the
    /// publisher's, already has a publication, or the name is taken). The lease's memory
    /// stays charged once, to its tenant.
    pub fn publish(&mut self, new: NewPublication) -> Option<Uuid> {
        let name = Some(new.name.clone());
        let id = self.insert_publication(Uuid::new_v4(), new, name)?;
        self.keep_publication(id);
        Some(id)
    }

    /// Adds publication `id` of live lease `new.lease` under `name` (None: unpublished);
    /// `None`, nothing changed, when the lease is not live or not the publisher's, it has
    /// a publication, the id is taken or the name is.
    pub(super) fn insert_publication(
        &mut self,
        id: Uuid,
        new: NewPublication,
        name: Option<String>,
    ) -> Option<Uuid> {
        let key = name.clone().map(|n| (new.publisher.clone(), n));
        if self.shared.by_lease.contains_key(&new.lease)
            || self.shared.pubs.contains_key(&id)
            || key
                .as_ref()
                .is_some_and(|k| self.shared.by_name.contains_key(k))
        {
            return None;
        }
        let l = self
            .leases
            .get(&new.lease)
            .filter(|l| l.tenant == new.publisher)?;
        let Handle::Fd {
            kind,
            block_id,
            size,
            ..
        } = &l.block.handle;
        let (kind, block_id, size, device, bytes) = (*kind, *block_id, *size, l.device, l.bytes());
        let seq = self.shared.next_seq();
        if let Some(key) = key {
            self.shared.by_name.insert(key, id);
        }
        self.shared.by_lease.insert(new.lease, id);
        self.shared.pubs.insert(
            id,
            Publication {
                id,
                seq,
                publisher: new.publisher,
                name,
                lease: new.lease,
                lease_live: true,
                device,
                bytes,
                kind,
                readers: new.readers,
                published_at: new.published_at,
                fd: new.fd,
                block_id,
                size,
                enforced: new.enforced,
                imports: Default::default(),
                fd_counted: new.fd_counted,
            },
        );
        Some(id)
    }

    /// Publishes an unpublished publication of a live lease again, under `name` for
    /// `readers` (the shell checked the name is free). False when there is no such
    /// publication, it is named, or its lease ended.
    pub fn publish_again(
        &mut self,
        id: Uuid,
        name: &str,
        readers: BTreeSet<String>,
        now: SystemTime,
    ) -> bool {
        let Some(p) = self.shared.pubs.get_mut(&id) else {
            return false;
        };
        let key = (p.publisher.clone(), name.to_string());
        if p.name.is_some() || !p.lease_live || self.shared.by_name.contains_key(&key) {
            return false;
        }
        p.name = Some(name.to_string());
        p.readers = readers;
        p.published_at = now;
        self.shared.by_name.insert(key, id);
        self.keep_publication(id);
        true
    }

    /// Takes `publisher`'s `name` away (live imports keep the memory); returns the
    /// publication's id, `None` when it has no such name.
    pub fn unpublish(&mut self, publisher: &str, name: &str) -> Option<Uuid> {
        let id = self
            .shared
            .by_name
            .remove(&(publisher.to_string(), name.to_string()))?;
        if let Some(p) = self.shared.pubs.get_mut(&id) {
            p.name = None;
        }
        self.keep_publication(id);
        Some(id)
    }

    /// Pushes publication `id` for the keeper while its lease lives (a publication of
    /// an ended lease is not kept: its memory is held here only).
    fn keep_publication(&mut self, id: Uuid) {
        if let Some(record) = self.publication_record(id) {
            self.keep(|| crate::effects::Keep::Publication(record));
        }
    }

    /// Publication `id`'s record, while its lease lives.
    pub(super) fn publication_record(&self, id: Uuid) -> Option<crate::kept::PublicationRecord> {
        let p = self.shared.pubs.get(&id).filter(|p| p.lease_live)?;
        Some(crate::kept::PublicationRecord {
            v: crate::kept::RECORD_VERSION,
            id: id.to_string(),
            lease: p.lease.to_string(),
            publisher: p.publisher.clone(),
            name: p.name.clone(),
            readers: p.readers.iter().cloned().collect(),
            published_unix_ms: crate::kept::unix_ms(p.published_at),
        })
    }

    /// Import `import`'s descriptor is about to reach a process: from now on it is kept
    /// (once), so a restarted broker takes it back with its session. An import whose
    /// descriptor never left the broker is nobody's mapping: not kept.
    pub fn import_delivered(&mut self, import: Uuid) {
        let Some(p) = self.shared.of_import(&import) else {
            return;
        };
        let publication = p.id;
        let Some(i) = p.imports.get(&import) else {
            return;
        };
        if i.kept || i.lingering.is_some() || !self.keeping {
            return;
        }
        let record = self.import_record(publication, i);
        if let Some(i) = self
            .shared
            .pubs
            .get_mut(&publication)
            .and_then(|p| p.imports.get_mut(&import))
        {
            i.kept = true;
        }
        self.keep(|| crate::effects::Keep::Import(record));
    }

    /// Session `session` of `tenant` (process `pid`) imports publication `publication`
    /// (the shell checked it may, and the limits); returns the import's id. `None` when the
    /// publication or the session is gone. Importers are not charged.
    pub fn import(
        &mut self,
        publication: Uuid,
        tenant: &str,
        session: Uuid,
        pid: Option<u32>,
    ) -> Option<Uuid> {
        if self
            .sessions
            .get(&session)
            .is_none_or(|s| s.tenant != tenant)
        {
            return None;
        }
        let id = Uuid::new_v4();
        let import = Import {
            id,
            tenant: tenant.to_string(),
            session,
            pid,
            pid_start: self.start_of(session, pid),
            place: self.place_of(session, pid),
            created: self.clock.wall,
            lingering: None,
            recipient_starts: BTreeMap::new(),
            kept: false,
        };
        self.shared.add_import(publication, import).then_some(id)
    }

    /// A lease's (or an import's) descriptor went to `pid`, a process outside its session:
    /// it may map the memory until it exits (counted when the lease or import ends).
    /// [`Recipient::Gone`] when there is no such live lease or import;
    /// [`Recipient::Full`] when [`crate::pool::Reached::MAX`] other processes have it
    /// already (every record names them all, and a record stays bounded).
    pub fn add_recipient(&mut self, id: Uuid, pid: u32, start: Option<u64>) -> Recipient {
        if self.leases.get(&id).is_none() && !self.shared.by_import.contains_key(&id) {
            return Recipient::Gone;
        }
        let set = self.shared.recipients.entry(id).or_default();
        if !set.contains_key(&pid) && set.len() >= crate::pool::Reached::MAX {
            return Recipient::Full;
        }
        let changed = set.insert(pid, start) != Some(start);
        // A live lease's record names them, so a restarted broker holds its memory for
        // them too: rewritten only when what it names changes.
        if changed && self.keeping {
            let k = match self.leases.get(&id) {
                Some(l) => Some(self.lease_kept(l)),
                // A kept import's (a lingering one's names them among its waiters).
                None => self.shared.of_import(&id).and_then(|p| {
                    let i = p
                        .imports
                        .get(&id)
                        .filter(|i| i.kept && i.lingering.is_none())?;
                    Some(crate::effects::Keep::Import(self.import_record(p.id, i)))
                }),
            };
            if let Some(k) = k {
                self.keep(|| k);
            }
        }
        Recipient::Added
    }

    /// The processes outside live lease `id`'s session that fetched its descriptor, as
    /// its record names them (at most [`crate::pool::Reached::MAX`]).
    pub(super) fn recipients_record(&self, id: Uuid) -> Vec<crate::kept::ProcessRecord> {
        self.shared
            .recipients
            .get(&id)
            .into_iter()
            .flatten()
            .take(crate::pool::Reached::MAX)
            .map(|(&pid, &start)| crate::kept::ProcessRecord { pid, start })
            .collect()
    }

    /// The shared table's indexes agree with it and with the leases and sessions (part of
    /// [`State::check_invariant`]).
    pub fn check_shared(&self) -> Result<(), String> {
        let t = &self.shared;
        for ((publisher, name), id) in &t.by_name {
            match t.pubs.get(id) {
                Some(p) if &p.publisher == publisher && p.name.as_deref() == Some(name) => {}
                _ => {
                    return Err(format!(
                        "name {publisher:?}/{name:?} points at {id} wrongly"
                    ))
                }
            }
        }
        let mut imports = 0;
        for (id, p) in &t.pubs {
            if let Some(n) = &p.name {
                if t.by_name.get(&(p.publisher.clone(), n.clone())) != Some(id) {
                    return Err(format!("publication {id} named {n:?} is not found by it"));
                }
            }
            if t.by_lease.get(&p.lease) != Some(id) {
                return Err(format!("publication {id} is not found by its lease"));
            }
            if p.lease_live {
                match self.leases.get(&p.lease) {
                    Some(l) if l.tenant == p.publisher && l.bytes() == p.bytes => {}
                    _ => return Err(format!("publication {id}: its live lease is not")),
                }
            } else {
                // Its lease ended: kept only while imported, its block held for them.
                if p.imports.is_empty() || p.name.is_some() {
                    return Err(format!(
                        "publication {id} of an ended lease is kept for nothing"
                    ));
                }
                match t.held.get(&p.lease) {
                    Some(h) if h.publication == Some(*id) => {}
                    _ => {
                        return Err(format!(
                            "publication {id}: its ended lease's block is not held for it"
                        ))
                    }
                }
            }
            for (i, import) in &p.imports {
                imports += 1;
                if t.by_import.get(i) != Some(id) {
                    return Err(format!("import {i} is not found by its id"));
                }
                if import.lingering.is_none() && self.sessions.get(&import.session).is_none() {
                    return Err(format!("import {i} is held by a session that ended"));
                }
            }
        }
        t.check_import_indexes()?;
        if t.by_lease.len() != t.pubs.len() || t.by_import.len() != imports {
            return Err(format!(
                "{} publications by lease and {} imports by id, for {} and {imports}",
                t.by_lease.len(),
                t.by_import.len(),
                t.pubs.len()
            ));
        }
        for (lease, h) in &t.held {
            if let Some(p) = h.publication {
                match t.pubs.get(&p) {
                    Some(p) if p.lease == *lease && !p.lease_live => {}
                    _ => return Err(format!("held block {lease} names publication {p} wrongly")),
                }
            }
            if self.leases.get(lease).is_some() {
                return Err(format!("block of live lease {lease} is held"));
            }
        }
        if let Some(id) = t
            .recipients
            .keys()
            .find(|id| self.leases.get(id).is_none() && !t.by_import.contains_key(id))
        {
            return Err(format!(
                "recipients kept for {id}, neither a lease nor an import"
            ));
        }
        if let Some(id) = self.sealing.iter().find(|id| self.leases.get(id).is_none()) {
            return Err(format!("lease {id} marked sealing is not live"));
        }
        Ok(())
    }

    /// A publish is about to seal live lease `lease`'s memfd with no lock held: whatever
    /// happens to the publish, the block is freed, never cached, when the lease ends (a
    /// seal cannot be undone). False when there is no such live lease.
    pub fn mark_sealing(&mut self, lease: Uuid) -> bool {
        if self.leases.get(&lease).is_none() {
            return false;
        }
        self.sealing.insert(lease);
        true
    }

    /// Hook of [`State::end_lease`] (after the lease left the table and its charge became
    /// free): returns the block, how it ends, whether it must never be cached (it was
    /// published or sealed: a quarantine of it frees it) and the publication that ended
    /// with it (the caller keeps its end after the lease's), or `None` when it is held
    /// here because importers or other processes may still map it (then this settles the
    /// bytes drawn from its reservation, now or once its recipients were looked at, and
    /// keeps the lease's end: a block held for importers is kept before it, so its
    /// descriptor never leaves the keeper meanwhile).
    pub(super) fn shared_lease_ended(
        &mut self,
        e: EndedLease,
        block: Block,
    ) -> Option<(Block, Ending, bool, Option<Uuid>)> {
        let EndedLease {
            id: lease,
            ref tenant,
            device,
            ending,
            holder_start,
            holder_place,
            reservation,
            reclaim,
        } = e;
        let publication = self.shared.by_lease.get(&lease).copied();
        // A publish sealing it (with no lock held) may not have published it yet.
        let sealed = self.sealing.remove(&lease);
        // Every recipient counts as alive: the shell looks after the unlock.
        let recipient_starts = self.shared.recipients.remove(&lease).unwrap_or_default();
        let recipients: BTreeSet<u32> = recipient_starts.keys().copied().collect();
        if publication.is_none() && recipients.is_empty() {
            // A memfd its holder sealed (it may do so) is not looked at here: it can seal
            // it through a descriptor it kept after the release too, so the one look that
            // counts is where a cached block is handed out (`State::grant_waiter`), and a
            // release holds the lock no longer for a system call.
            let ending = match ending {
                Ending::Cache if sealed => Ending::Destroy,
                e => e,
            };
            return Some((block, ending, sealed, None));
        }
        let mut imported = false;
        if let Some(pid) = publication {
            if let Some(p) = self.shared.pubs.get_mut(&pid) {
                p.lease_live = false;
                imported = !p.imports.is_empty();
                if let Some(name) = p.name.take() {
                    self.shared.by_name.remove(&(p.publisher.clone(), name));
                }
            }
        }
        // A published block never returns to the cache: other tenants had its
        // descriptor, and a memfd stays sealed.
        let never_cached = publication.is_some() || sealed;
        let destroy = never_cached || ending == Ending::Destroy;
        if !imported && recipients.is_empty() {
            if let Some(pid) = publication {
                self.forget_publication(pid);
            }
            let ending = match ending {
                Ending::Cache if destroy => Ending::Destroy,
                e => e,
            };
            return Some((block, ending, never_cached, publication));
        }
        let bytes = block.bytes();
        self.pools[device as usize].release_to_quarantine(bytes);
        self.ledger.add_quarantine(tenant, device, bytes);
        let mut waiters = Waiters::default();
        let holder = ending.holder();
        match ending {
            Ending::Quarantine { pid: None } => waiters.timeout = true,
            e => waiters.pids.extend(e.holder()),
        }
        waiters.pids.extend(recipients.iter().copied());
        for &pid in &waiters.pids {
            self.fx.watch(Watch::Held {
                lease,
                pid: Some(pid),
            });
        }
        if waiters.timeout {
            self.fx.watch(Watch::Held { lease, pid: None });
        }
        if !recipients.is_empty() {
            self.fx.push(Effect::CheckGone {
                of: Holding::Lease(lease),
                pids: recipients.iter().copied().collect(),
            });
        }
        if imported {
            // Held for its importers whatever the look says.
            if let Some(r) = reservation {
                self.lease_left_reservation(r, bytes, false);
            }
        } else {
            self.unchecked.insert(
                lease,
                Unchecked {
                    ending,
                    reservation,
                    recipients,
                },
            );
        }
        tracing::info!(%lease, tenant, imported, waiting = waiters.pids.len(), "lease ended; its memory is held while others may map it");
        self.shared.held.insert(
            lease,
            Held {
                tenant: tenant.to_string(),
                device,
                block,
                since: self.clock.now,
                publication: imported.then_some(publication).flatten(),
                waiters,
                destroy,
                holder,
                holder_start,
                holder_place,
                recipient_starts: recipient_starts
                    .into_iter()
                    .filter_map(|(p, s)| Some((p, s?)))
                    .collect(),
                // Kept (below) while the keeper is: held for importers, or for processes
                // that fetched its descriptor, a restart holds it for them too.
                kept: self.keeping,
            },
        );
        if let Some(k) = self.held_kept(lease) {
            self.keep(|| k);
        }
        self.keep_lease_ended(lease, reclaim);
        if let Some(pid) = publication {
            // Its record goes: a held block's record carries it now.
            self.keep(|| crate::effects::Keep::PublicationEnded(pid));
            if !imported {
                self.forget_publication(pid);
            }
        }
        None
    }

    /// Held block `lease`'s record and a copy of its descriptor (while it is kept).
    pub(super) fn held_kept(&self, lease: Uuid) -> Option<crate::effects::Keep> {
        use crate::kept::{HeldPublicationRecord, HeldRecord, ProcessRecord};
        let h = self.shared.held.get(&lease).filter(|h| h.kept)?;
        let Handle::Fd {
            fd, block_id, kind, ..
        } = &h.block.handle;
        let publication = h
            .publication
            .and_then(|id| self.shared.pubs.get(&id))
            .map(|p| HeldPublicationRecord {
                id: p.id.to_string(),
                readers: p.readers.iter().cloned().collect(),
                published_unix_ms: crate::kept::unix_ms(p.published_at),
            });
        let record = HeldRecord {
            v: crate::kept::RECORD_VERSION,
            lease: lease.to_string(),
            tenant: h.tenant.clone(),
            device: h.device,
            bytes: h.block.bytes(),
            block_id: *block_id,
            kind: kind_name(*kind).into(),
            publication,
            waiters: h
                .waiters
                .pids
                .iter()
                .map(|&pid| ProcessRecord {
                    pid,
                    start: h.holder_start.filter(|_| Some(pid) == h.holder),
                })
                .collect(),
            recipients: h
                .waiters
                .pids
                .iter()
                .filter(|&&pid| Some(pid) != h.holder)
                .filter_map(|&pid| {
                    let start = *h.recipient_starts.get(&pid)?;
                    Some(ProcessRecord {
                        pid,
                        start: Some(start),
                    })
                })
                .collect(),
            reached: h.block.reached.records(),
            timeout: h.waiters.timeout,
            destroy: h.destroy,
            device_uuid: None,
        };
        Some(crate::effects::Keep::Held(record, fd.clone()))
    }

    /// Lingering import `import`'s record (while it is kept).
    pub(super) fn lingering_kept(&self, import: Uuid) -> Option<crate::kept::LingeringRecord> {
        let p = self.shared.of_import(&import)?;
        let i = p.imports.get(&import).filter(|i| i.kept)?;
        let w = i.lingering.as_ref()?;
        Some(crate::kept::LingeringRecord {
            v: crate::kept::RECORD_VERSION,
            id: import.to_string(),
            publication: p.id.to_string(),
            tenant: i.tenant.clone(),
            session: i.session.to_string(),
            pid: i.pid,
            created_unix_ms: crate::kept::unix_ms(i.created),
            waiters: w
                .pids
                .iter()
                .map(|&pid| crate::kept::ProcessRecord {
                    pid,
                    start: match Some(pid) == i.pid {
                        true => i.pid_start,
                        false => i.recipient_starts.get(&pid).copied(),
                    },
                })
                .collect(),
            timeout: w.timeout,
        })
    }

    /// Hook of `end_session`: the session's imports end (lingering while its process, or
    /// a process that fetched their descriptor, lives). `gone`: the shell found the peer
    /// gone before the lock; if not, the import lingers for it and the shell looks again.
    pub fn shared_session_ended(&mut self, session: Uuid, peer: &Peer, gone: bool) {
        let imports = self.shared.imports_of_session(session);
        if imports.is_empty() {
            return;
        }
        for id in imports {
            let device = self.shared.of_import(&id).map(|p| p.device).unwrap_or(0);
            let ending = match peer.pid {
                Some(_) if gone => Ending::Cache,
                Some(pid) => Ending::Quarantine { pid: Some(pid) },
                None if self.host_backed(device) => Ending::Destroy,
                None => Ending::Quarantine { pid: None },
            };
            self.import_let_go(id, ending);
        }
    }

    /// An import's process let go by word only and may keep its import of the block
    /// after the block's free (`stranded.rs`): the block remembers it, with its tenant
    /// when that is not the publisher's (memory kept by another tenant's importer alone
    /// is charged to that tenant: `Reached::answers_for`).
    fn import_reached(&mut self, import: Uuid) {
        let Some(p) = self
            .shared
            .by_import
            .get(&import)
            .and_then(|id| self.shared.pubs.get(id))
        else {
            return;
        };
        let Some((pid, tenant, place)) = p.imports.get(&import).and_then(|i| {
            let tenant = (i.tenant != p.publisher).then(|| i.tenant.clone());
            Some((i.pid?, tenant, i.place.clone()))
        }) else {
            return;
        };
        let (lease, live) = (p.lease, p.lease_live);
        let block = if live {
            self.leases.get_mut(&lease).map(|l| &mut l.block)
        } else {
            self.shared.held.get_mut(&lease).map(|h| &mut h.block)
        };
        let Some(b) = block else { return };
        let new = match tenant {
            Some(t) => b.reached.add_of(pid, &t, place),
            None => b.reached.add(pid, place),
        };
        // The block's record names it from now, so a free after a restart checks for it.
        if new && self.keeping {
            let k = match live {
                true => self.leases.get(&lease).map(|l| self.lease_kept(l)),
                false => self.held_kept(lease),
            };
            if let Some(k) = k {
                self.keep(|| k);
            }
        }
    }

    /// An import's holder let go (`ending` says whether its process may still map it).
    /// Processes that may map it count as alive; the shell looks at them after the unlock.
    pub fn import_let_go(&mut self, import: Uuid, ending: Ending) {
        if matches!(ending, Ending::Cache | Ending::Destroy) {
            self.import_reached(import);
        }
        self.wake_queue();
        self.fx.push(Effect::ForgetTickets { lease: import });
        let recipients = self.shared.recipients.remove(&import).unwrap_or_default();
        let starts = crate::sharing::starts_of(&recipients);
        let mut waiters = Waiters::default();
        if let Ending::Quarantine { pid } = ending {
            match pid {
                Some(p) => {
                    waiters.pids.insert(p);
                }
                None => waiters.timeout = true,
            }
        }
        waiters.pids.extend(recipients.into_keys());
        let lingers = !waiters.is_empty();
        if let Some(i) = self
            .shared
            .by_import
            .get(&import)
            .and_then(|p| self.shared.pubs.get_mut(p))
            .and_then(|p| p.imports.get_mut(&import))
            .filter(|i| i.kept && i.lingering.is_none())
        {
            // Its holder let go: kept on as lingering while processes may map it (written
            // before the import's record goes, so a crash between keeps one of them).
            if lingers {
                i.lingering = Some(waiters.clone());
                i.recipient_starts = starts.clone();
                if let Some(r) = self.lingering_kept(import) {
                    self.keep(|| crate::effects::Keep::Lingering(r));
                }
            } else {
                i.kept = false;
            }
            self.keep(|| crate::effects::Keep::ImportEnded(import));
        }
        if !lingers {
            self.end_import(import);
            return;
        }
        let Some(pid) = self.shared.by_import.get(&import).copied() else {
            return;
        };
        for &p in &waiters.pids {
            self.fx.watch(Watch::Import {
                import,
                pid: Some(p),
            });
        }
        if waiters.timeout {
            self.fx.watch(Watch::Import { import, pid: None });
        }
        if !waiters.pids.is_empty() {
            self.fx.push(Effect::CheckGone {
                of: Holding::Import(import),
                pids: waiters.pids.iter().copied().collect(),
            });
        }
        if let Some(i) = self
            .shared
            .pubs
            .get_mut(&pid)
            .and_then(|p| p.imports.get_mut(&import))
        {
            tracing::info!(%import, pids = ?waiters.pids, "import let go while processes may map it; lingering");
            i.lingering = Some(waiters);
            i.recipient_starts = starts;
            let session = i.session;
            self.shared.let_go(session, import);
        }
    }

    /// An import is over: nobody it was given to may map the memory any more.
    fn end_import(&mut self, import: Uuid) {
        self.fx.push(Effect::ForgetTickets { lease: import });
        self.shared.recipients.remove(&import);
        let Some(pid) = self.shared.by_import.get(&import).copied() else {
            return;
        };
        if self
            .shared
            .remove_import(import)
            .is_some_and(|i| i.kept && i.lingering.is_some())
        {
            self.keep(|| crate::effects::Keep::LingeringEnded(import));
        }
        let Some(p) = self.shared.pubs.get_mut(&pid) else {
            return;
        };
        tracing::debug!(%import, "import ended");
        if p.imports.is_empty() && !p.lease_live {
            let lease = p.lease;
            self.forget_publication(pid);
            if let Some(h) = self.shared.held.get_mut(&lease) {
                h.publication = None;
            }
            self.maybe_lift(lease);
        }
    }

    /// Drops a publication whose lease ended and that nobody imports.
    fn forget_publication(&mut self, id: Uuid) {
        if let Some(p) = self.shared.remove_publication(id) {
            self.shared.by_lease.remove(&p.lease);
            if let Some(n) = p.name {
                self.shared.by_name.remove(&(p.publisher, n));
            }
            for (&i, import) in &p.imports {
                if let Some(w) = &import.lingering {
                    unwatch_import(&mut self.fx, i, w);
                }
                match (import.kept, import.lingering.is_some()) {
                    (true, true) => self.keep(|| crate::effects::Keep::LingeringEnded(i)),
                    (true, false) => self.keep(|| crate::effects::Keep::ImportEnded(i)),
                    _ => {}
                }
            }
        }
    }

    /// Frees (or caches) a held block once nobody may map it.
    pub(super) fn maybe_lift(&mut self, lease: Uuid) -> bool {
        let done = self
            .shared
            .held
            .get(&lease)
            .is_some_and(|h| h.publication.is_none() && h.waiters.is_empty());
        if !done {
            return false;
        }
        let Some(h) = self.shared.held.remove(&lease) else {
            return false;
        };
        if h.kept {
            self.keep(|| crate::effects::Keep::HeldLetGo(lease));
        }
        let bytes = h.block.bytes();
        // Parked, and its recipients' watchers were quicker than the look: the bytes are
        // back (below), so are those drawn from a reservation.
        let parked = self.unchecked.remove(&lease);
        self.ledger.remove_quarantine(&h.tenant, h.device, bytes);
        let destroy = h.destroy || !self.pristine(&h.block);
        let pool = &mut self.pools[h.device as usize];
        if destroy {
            pool.unquarantine_destroyed(bytes);
            self.fx.free(h.device, h.block);
        } else {
            pool.unquarantine_to_cache(h.block);
        }
        if let Some(r) = parked.and_then(|u| u.reservation) {
            self.lease_left_reservation(r, bytes, true);
        }
        tracing::info!(%lease, tenant = %h.tenant, held_for = ?self.clock.now.saturating_duration_since(h.since), "held memory let go by everyone");
        true
    }

    /// The second half of a look at processes counted alive under the lock
    /// (`Effect::CheckGone`): `gone` are those the shell found certainly gone. An import
    /// ends once nobody may map it; a held block is let go likewise; a parked lease whose
    /// recipients are all gone ends as it was ending (cached, freed, or quarantined for its
    /// own process), else it stays held for those alive. True when memory came back (the
    /// queue then runs after the hold).
    pub fn holders_checked(&mut self, of: Holding, gone: &[u32]) -> bool {
        let back = self.check_holders(of, gone);
        if back {
            self.wake_queue();
        }
        back
    }

    /// [`State::holders_checked`], but for the queue.
    fn check_holders(&mut self, of: Holding, gone: &[u32]) -> bool {
        let lease = match of {
            Holding::Import(import) => {
                let mut ended = false;
                for &p in gone {
                    ended |= self.import_waiter_gone(import, Some(p));
                }
                return ended;
            }
            Holding::Lease(lease) => lease,
        };
        let Some(parked) = self.unchecked.remove(&lease) else {
            // Held for importers (or already let go): each gone process is a waiter gone.
            let mut back = false;
            for &p in gone {
                back |= self.held_waiter_gone(lease, Some(p));
            }
            return back;
        };
        let Some(h) = self.shared.held.get_mut(&lease) else {
            return false;
        };
        for &p in gone.iter().filter(|p| parked.recipients.contains(p)) {
            h.waiters.pids.remove(&p);
            self.fx.unwatch(Watch::Held {
                lease,
                pid: Some(p),
            });
        }
        let bytes = h.block.bytes();
        let still_held =
            h.publication.is_some() || parked.recipients.iter().any(|p| h.waiters.pids.contains(p));
        if still_held {
            if let Some(r) = parked.reservation {
                self.lease_left_reservation(r, bytes, false);
            }
            return false;
        }
        let Some(h) = self.shared.held.remove(&lease) else {
            return false;
        };
        // Its record goes after its quarantine's is kept (below): a crash between leaves
        // both, and a restart takes back the quarantine.
        let kept = h.kept;
        // Its own process (or the timeout) no longer waits here, but in its quarantine.
        unwatch_held(&mut self.fx, lease, &h.waiters);
        let ending = match parked.ending {
            Ending::Cache if h.destroy || !self.pristine(&h.block) => Ending::Destroy,
            e => e,
        };
        let pool = &mut self.pools[h.device as usize];
        match ending {
            Ending::Cache => {
                self.ledger.remove_quarantine(&h.tenant, h.device, bytes);
                pool.unquarantine_to_cache(h.block);
            }
            Ending::Destroy => {
                self.ledger.remove_quarantine(&h.tenant, h.device, bytes);
                pool.unquarantine_destroyed(bytes);
                self.fx.free(h.device, h.block);
            }
            Ending::Quarantine { .. } | Ending::Retained { .. } => {
                let pid = ending.holder();
                // Its bytes stay quarantined, now in the lease's own quarantine.
                self.fx.count(Counted::Quarantined);
                self.quarantine.insert(
                    lease,
                    Quarantined {
                        tenant: h.tenant,
                        device: h.device,
                        block: h.block,
                        pid,
                        pid_start: h.holder_start.filter(|_| pid == h.holder),
                        place: h.holder_place.filter(|_| pid == h.holder),
                        since: h.since,
                        destroy: h.destroy,
                        retained_by: None,
                        asked_back: false,
                    },
                );
                self.fx.watch(Watch::Quarantine { lease, pid });
                self.keep_quarantine(lease);
            }
        }
        if kept {
            self.keep(|| crate::effects::Keep::HeldLetGo(lease));
        }
        let back = !ending.held();
        if let Some(r) = parked.reservation {
            self.lease_left_reservation(r, bytes, back);
        }
        tracing::debug!(%lease, ?ending, "the processes that had its descriptor are gone");
        back
    }

    /// A held block's waiter (process `pid`, or with `None` the timeout) is gone; the
    /// block is let go once nobody may map it. True when memory came back (the queue then
    /// runs after the hold).
    pub fn held_waiter_gone(&mut self, lease: Uuid, pid: Option<u32>) -> bool {
        if let Some(h) = self.shared.held.get_mut(&lease) {
            match pid {
                Some(p) => {
                    h.waiters.pids.remove(&p);
                }
                None => h.waiters.timeout = false,
            }
        }
        self.fx.unwatch(Watch::Held { lease, pid });
        let back = self.maybe_lift(lease);
        if back {
            self.wake_queue();
        }
        back
    }

    /// A lingering import's waiter (process `pid`, or with `None` the timeout) is gone;
    /// the import ends once nobody may map it. True when it ended (the queue then runs
    /// after the hold).
    pub fn import_waiter_gone(&mut self, import: Uuid, pid: Option<u32>) -> bool {
        self.fx.unwatch(Watch::Import { import, pid });
        let Some(p) = self.shared.by_import.get(&import).copied() else {
            return false;
        };
        let Some(w) = self
            .shared
            .pubs
            .get_mut(&p)
            .and_then(|p| p.imports.get_mut(&import))
            .and_then(|i| i.lingering.as_mut())
        else {
            return false;
        };
        match pid {
            Some(p) => {
                w.pids.remove(&p);
            }
            None => w.timeout = false,
        }
        if w.is_empty() {
            self.end_import(import);
            self.wake_queue();
            return true;
        }
        false
    }

    /// How many ended leases wait for the shell's look at their recipients (tests: none
    /// once the effects ran).
    #[cfg(any(test, feature = "testing"))]
    pub fn unlooked(&self) -> usize {
        self.unchecked.len()
    }

    /// Shutdown, once every held block was freed: no publication, import or recipient is
    /// left (their memory is gone).
    pub fn forget_all_shared(&mut self) {
        let pubs: Vec<Uuid> = self.shared.pubs.keys().copied().collect();
        for id in pubs {
            self.forget_publication(id);
        }
        self.shared.recipients.clear();
    }

    /// Shutdown: a held block is freed, whoever may still map it.
    pub fn free_held(&mut self, lease: Uuid) {
        if let Some(h) = self.shared.held.remove(&lease) {
            if h.kept {
                self.keep(|| crate::effects::Keep::HeldLetGo(lease));
            }
            self.unchecked.remove(&lease);
            unwatch_held(&mut self.fx, lease, &h.waiters);
            self.pools[h.device as usize].unquarantine_destroyed(h.block.bytes());
            self.ledger
                .remove_quarantine(&h.tenant, h.device, h.block.bytes());
            self.fx.free(h.device, h.block);
        }
    }
}

/// Import `i`'s record (of publication `publication`).
impl State {
    /// Import `i` of `publication`'s record, with the processes outside its session that
    /// fetched its descriptor.
    pub(super) fn import_record(&self, publication: Uuid, i: &Import) -> crate::kept::ImportRecord {
        crate::kept::ImportRecord {
            v: crate::kept::RECORD_VERSION,
            id: i.id.to_string(),
            publication: publication.to_string(),
            tenant: i.tenant.clone(),
            session: i.session.to_string(),
            pid: i.pid,
            created_unix_ms: crate::kept::unix_ms(i.created),
            recipients: self.recipients_record(i.id),
        }
    }
}

/// Stops the watchers of a lingering import's waiters.
fn unwatch_import(fx: &mut Effects, import: Uuid, w: &Waiters) {
    for &pid in &w.pids {
        fx.unwatch(Watch::Import {
            import,
            pid: Some(pid),
        });
    }
    if w.timeout {
        fx.unwatch(Watch::Import { import, pid: None });
    }
}

/// Stops the watchers of a held block's waiters (it is freed without them).
fn unwatch_held(fx: &mut Effects, lease: Uuid, w: &Waiters) {
    for &pid in &w.pids {
        fx.unwatch(Watch::Held {
            lease,
            pid: Some(pid),
        });
    }
    if w.timeout {
        fx.unwatch(Watch::Held { lease, pid: None });
    }
}
