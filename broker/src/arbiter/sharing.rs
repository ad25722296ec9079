//! The arbiter's side of shared read-only leases (`crate::sharing` has the table and the
//! rules): publish, unpublish, import, release an import ([`Sharing`], reached by
//! [`Arbiter::sharing`]; the listing is a view: `listing.rs`); and the hook the ticket
//! server calls ([`Arbiter::fd_delivering`]); the lease and session endings' hooks are the
//! core's (`State::shared_lease_ended`, `State::shared_session_ended`). The shell
//! validates (names, readers, limits, who may see what), seals a memfd for its importers
//! (with no lock held: it checks again after), and calls the core's transitions
//! (`state/shared.rs`: `publish`, `publish_again`, `unpublish`, `import`, `import_let_go`,
//! `add_recipient`) under the state lock, so the bytes of a shared block are always in
//! exactly one state: leased (the publisher's lease lives), or quarantined (held for
//! importers or other processes that may map it); the table's indexes are checked with the
//! invariant.

use super::state::{NewPublication, Recipient};
use super::Ending;
use super::{lease_not_found, session_not_found, Arbiter, State};
use crate::device::{Handle, MemoryKind, SharedFd};
use crate::error::{BrokerError, BrokerResult, Missing, SharingCap};
use crate::ledger::Tier;
use crate::session::Peer;
use crate::sharing::{
    self, SharedView, MAX_IMPORTS, MAX_IMPORTS_PER_SESSION, MAX_IMPORTS_PER_TENANT, MAX_NAME,
    MAX_PUBLICATIONS_PER_TENANT, MAX_READERS,
};
use std::collections::BTreeSet;
use uuid::Uuid;

/// What an importer needs to fetch its descriptor.
#[derive(Clone, Debug)]
pub struct ImportGrant {
    pub id: Uuid,
    pub shared: SharedView,
    pub fd: SharedFd,
    pub kind: MemoryKind,
    pub block_id: u64,
    pub size: u64,
}

/// The caller's `NOT_FOUND` for a name it may not see (the same whether the publication
/// does not exist or is not published for it: names of other tenants do not leak).
fn not_visible(publisher: &str, name: &str) -> BrokerError {
    BrokerError::NotFound(Missing::SharedLease {
        publisher: publisher.to_string(),
        name: name.to_string(),
    })
}

fn import_not_found(id: Uuid) -> BrokerError {
    BrokerError::NotFound(Missing::Import(id))
}

fn check_name(name: &str) -> BrokerResult<()> {
    if name.is_empty() {
        return Err(BrokerError::InvalidArgument(
            "a shared lease needs a name".into(),
        ));
    }
    crate::bounds::check("name", name, MAX_NAME)
}

/// How a lease may be published.
enum Publishable {
    /// Its publication, unpublished, gets the name.
    Again(Uuid),
    /// A new publication: its memory (`size` bytes) needs a descriptor for importers first.
    New {
        kind: MemoryKind,
        fd: SharedFd,
        size: u64,
    },
}

/// Whether `tenant` may publish `lease` under `name` now, and how (or why not).
fn publishable(st: &State, tenant: &str, lease: Uuid, name: &str) -> BrokerResult<Publishable> {
    let l = match st.leases().get(&lease) {
        Some(l) if l.tenant == tenant => l,
        _ => return Err(lease_not_found(lease)),
    };
    if l.tier != Tier::Device {
        return Err(BrokerError::HostLeaseNotShareable { lease });
    }
    if st
        .shared()
        .by_name
        .contains_key(&(tenant.to_string(), name.to_string()))
    {
        return Err(BrokerError::SharedNameTaken {
            tenant: tenant.to_string(),
            name: name.to_string(),
        });
    }
    if let Some(p) = st.shared().of_lease(&lease) {
        return match &p.name {
            Some(n) => Err(BrokerError::AlreadyPublished {
                lease,
                name: n.clone(),
            }),
            None => Ok(Publishable::Again(p.id)),
        };
    }
    if st.shared().count_of(tenant) >= MAX_PUBLICATIONS_PER_TENANT {
        return Err(BrokerError::SharingLimit {
            what: SharingCap::PublicationsOfTenant,
            max: MAX_PUBLICATIONS_PER_TENANT,
        });
    }
    let Handle::Fd { kind, fd, size, .. } = &l.block.handle;
    Ok(Publishable::New {
        kind: *kind,
        fd: fd.clone(),
        size: *size,
    })
}

/// Names publication `id` of `lease` again (`publishable` said so under this lock).
fn publish_again(
    st: &mut State,
    id: Uuid,
    lease: Uuid,
    name: &str,
    readers: BTreeSet<String>,
) -> BrokerResult<SharedView> {
    let now = st.clock().wall;
    if !st.publish_again(id, name, readers, now) {
        return Err(BrokerError::Internal(
            "publication index out of step".into(),
        ));
    }
    tracing::info!(%lease, name, "lease published again");
    Ok(st.shared().pubs[&id].view(true))
}

/// The shared read-only leases of one arbiter ([`Arbiter::sharing`]); it keeps no fields
/// (the publications live in the state, `state/shared.rs`).
pub struct Sharing<'a> {
    pub(super) arb: &'a Arbiter,
}

impl Sharing<'_> {
    /// Publishes `lease` of `tenant` under `name` for `readers` (empty: the tenant's own).
    pub(crate) fn publish(
        &self,
        tenant: &str,
        lease: Uuid,
        name: &str,
        readers: &[String],
    ) -> BrokerResult<SharedView> {
        check_name(name)?;
        if readers.len() > MAX_READERS {
            return Err(BrokerError::TooManyReaders {
                readers: readers.len(),
                max: MAX_READERS,
            });
        }
        for r in readers {
            if r.is_empty() {
                return Err(BrokerError::InvalidArgument(
                    "an empty tenant name among the readers".into(),
                ));
            }
            crate::bounds::check("reader tenant", r, crate::bounds::MAX_TEXT_BYTES)?;
        }
        let mut set: BTreeSet<String> = readers.iter().cloned().collect();
        set.remove(tenant);
        let (kind, fd, size, fd_counted) = {
            let mut st = self.arb.lock();
            match publishable(&st, tenant, lease, name)? {
                Publishable::Again(id) => return publish_again(&mut st, id, lease, name, set),
                Publishable::New { kind, fd, size } => {
                    // A memfd's importers get a reopen of it: one descriptor more.
                    let mut counted = None;
                    if kind == MemoryKind::HostMemfd {
                        counted = Some(self.arb.fds.take_held(self.arb.watchers.processes())?);
                        // Marked before the seal: if the lease ends meanwhile, its
                        // block is freed, never cached sealed.
                        st.mark_sealing(lease);
                    }
                    (kind, fd, size, counted)
                }
            }
        };
        // Sealed and reopened read-only (through `/proc/self/fd`) with no lock held; a
        // memfd sealed for a publish that then loses a race is never cached (marked
        // above).
        // Tried twice: a publish of the same lease racing this one may add the seals
        // between this one's look and its add (the add then fails on `F_SEAL_SEAL`); the
        // second try finds them in place, and the look under the lock below says which of
        // the two publishes won. A seal that fails twice failed for its own reason.
        let (ro, enforced) = sharing::importer_fd(kind, &fd, size)
            .or_else(|_| sharing::importer_fd(kind, &fd, size))
            .map_err(|e| BrokerError::SealFailed {
                lease,
                cause: e.to_string(),
            })?;
        let mut st = self.arb.lock();
        // Again: the lock was let go meanwhile.
        let now = st.clock().wall;
        let id = match publishable(&st, tenant, lease, name)? {
            Publishable::Again(id) => return publish_again(&mut st, id, lease, name, set),
            Publishable::New { .. } => st
                .publish(NewPublication {
                    lease,
                    publisher: tenant.to_string(),
                    name: name.to_string(),
                    readers: set,
                    published_at: now,
                    fd: ro,
                    enforced,
                    fd_counted,
                })
                .ok_or_else(|| BrokerError::Internal("publication index out of step".into()))?,
        };
        tracing::info!(%lease, tenant, name, "lease published");
        let view = st.shared().pubs[&id].view(true);
        drop(st);
        self.arb.crash.pass("after", "publish");
        Ok(view)
    }

    /// Takes `name` of `tenant` away; live imports keep the memory.
    pub(crate) fn unpublish(&self, tenant: &str, name: &str) -> BrokerResult<SharedView> {
        check_name(name)?;
        let mut st = self.arb.lock();
        let id = st
            .unpublish(tenant, name)
            .ok_or_else(|| not_visible(tenant, name))?;
        let view = match st.shared().pubs.get(&id) {
            Some(p) => p.view(true),
            None => return Err(not_visible(tenant, name)),
        };
        tracing::info!(
            tenant,
            name,
            imports = view.import_count,
            "lease unpublished"
        );
        Ok(view)
    }

    /// Imports `publisher`'s `name` into `session` of `tenant`.
    pub(crate) fn import(
        &self,
        tenant: &str,
        session: Uuid,
        publisher: &str,
        name: &str,
    ) -> BrokerResult<ImportGrant> {
        check_name(name)?;
        crate::bounds::check("publisher", publisher, crate::bounds::MAX_TEXT_BYTES)?;
        let mut st = self.arb.lock();
        let pid = match st.sessions().get(&session) {
            Some(s) if s.tenant == tenant => {
                s.last_seen.touch();
                s.peer.pid
            }
            _ => return Err(session_not_found(session)),
        };
        let held = st.shared().count_of_session(session);
        let of_tenant = st.shared().imports_of_tenant(tenant);
        let p = st
            .shared()
            .visible(publisher, name, tenant)
            .ok_or_else(|| not_visible(publisher, name))?;
        if held >= MAX_IMPORTS_PER_SESSION {
            return Err(BrokerError::SharingLimit {
                what: SharingCap::ImportsOfSession,
                max: MAX_IMPORTS_PER_SESSION,
            });
        }
        if of_tenant >= MAX_IMPORTS_PER_TENANT {
            return Err(BrokerError::SharingLimit {
                what: SharingCap::ImportsOfTenant,
                max: MAX_IMPORTS_PER_TENANT,
            });
        }
        if p.imports.len() >= MAX_IMPORTS {
            return Err(BrokerError::SharingLimit {
                what: SharingCap::ImportsOfPublication,
                max: MAX_IMPORTS,
            });
        }
        let pub_id = p.id;
        let id = st
            .import(pub_id, tenant, session, pid)
            .ok_or_else(|| BrokerError::Internal("publication vanished".into()))?;
        let p = &st.shared().pubs[&pub_id];
        let grant = ImportGrant {
            id,
            shared: p.view(tenant == p.publisher),
            fd: p.fd.clone(),
            kind: p.kind,
            block_id: p.block_id,
            size: p.size,
        };
        tracing::info!(import = %id, tenant, publisher, name, "shared lease imported");
        drop(st);
        self.arb.crash.pass("after", "import");
        Ok(grant)
    }

    /// The holder lets go of an import (it promises it unmapped it).
    pub(crate) fn release_import(&self, tenant: &str, import: Uuid) -> BrokerResult<()> {
        let mut st = self.arb.lock();
        match st
            .shared()
            .of_import(&import)
            .and_then(|p| p.imports.get(&import))
        {
            Some(i) if i.tenant == tenant && i.lingering.is_none() => {}
            _ => return Err(import_not_found(import)),
        }
        st.import_let_go(import, Ending::Cache);
        drop(st);
        self.arb.crash.pass("after", "release-import");
        Ok(())
    }

    /// A live import of `tenant` (for a renewed ticket) with its session's peer.
    pub(crate) fn own_import(
        &self,
        tenant: &str,
        import: Uuid,
    ) -> BrokerResult<(ImportGrant, Peer)> {
        let st = self.arb.lock();
        let p = st
            .shared()
            .of_import(&import)
            .ok_or_else(|| import_not_found(import))?;
        let i = match p.imports.get(&import) {
            Some(i) if i.tenant == tenant && i.lingering.is_none() => i,
            _ => return Err(import_not_found(import)),
        };
        let peer = st
            .sessions()
            .get(&i.session)
            .map(|s| s.peer)
            .unwrap_or_default();
        Ok((
            ImportGrant {
                id: import,
                shared: p.view(tenant == p.publisher),
                fd: p.fd.clone(),
                kind: p.kind,
                block_id: p.block_id,
                size: p.size,
            },
            peer,
        ))
    }
}

impl Arbiter {
    /// The ticket server is about to deliver the descriptor of lease or import `id` to
    /// `pid`: a process other than the holder's session process is tracked first, so memory
    /// it may map stays counted until it exits, even if the holder lets go the moment the
    /// descriptor arrives. Anything but [`Recipient::Added`]: deliver nothing (the lease or
    /// import is gone, or as many other processes as a record names have it).
    pub(crate) fn fd_delivering(&self, id: Uuid, pid: Option<u32>) -> Recipient {
        let mut st = self.lock();
        let Some(session) = delivering_session(&st, id) else {
            return Recipient::Gone;
        };
        // An import is kept once its descriptor leaves the broker (before it does).
        st.import_delivered(id);
        let Some(pid) = pid else {
            return Recipient::Added;
        };
        if st.sessions().get(&session).and_then(|s| s.peer.pid) == Some(pid) {
            return Recipient::Added;
        }
        drop(st);
        // Read with no lock held: its start time, kept with the lease's record so that a
        // restarted broker tells it from a later process of the pid.
        let start = crate::process::start_ticks(pid);
        tracing::debug!(%id, pid, "a lease descriptor goes to a process outside its session");
        let mut st = self.lock();
        // Ended (or let go) meanwhile: nothing is delivered.
        if delivering_session(&st, id) != Some(session) {
            return Recipient::Gone;
        }
        st.add_recipient(id, pid, start)
    }
}

/// The session of live lease or import `id` whose descriptor may go out: none for a
/// lingering import (its holder let go; memory held for processes that may still map
/// it), which delivers nothing more: a new recipient would not be waited for.
fn delivering_session(st: &State, id: Uuid) -> Option<Uuid> {
    match st.leases().get(&id) {
        Some(l) => Some(l.session),
        None => st
            .shared()
            .of_import(&id)
            .and_then(|p| p.imports.get(&id))
            .filter(|i| i.lingering.is_none())
            .map(|i| i.session),
    }
}
