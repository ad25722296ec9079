//! A restart's take-back of shared leases (after the leases and sessions, before the
//! keeper is re-armed): each kept publication of a lease taken back is published again
//! with the same id and name, its importers' descriptor made again from the lease's block
//! (a memfd is sealed already: reopened read-only again); a block held for importers
//! (taken back with the other kept memory) gets its publication back the same way; each
//! kept lingering import whose processes live, and each kept import of a session taken
//! back, is recorded again; a held block nobody imports any more is let go. What is not
//! taken back leaves the keeper. The core's side is `core/src/state/adopt_shared.rs`.

use super::adopt::Liveness;
use super::Restart;
use crate::arbiter::state::{
    AdoptedHeldPublication, AdoptedImport, AdoptedLingering, NewPublication,
};
use crate::device::{Handle, MemoryKind, SharedFd};
use crate::keeper::records::{
    self, from_unix_ms, HeldRecord, ImportRecord, LingeringRecord, PublicationRecord,
};
use std::collections::BTreeSet;
use uuid::Uuid;

impl Restart<'_> {
    /// Takes back kept publications (of leases, then of the held blocks `held` taken
    /// back), then kept lingering imports and kept imports; returns those not taken back,
    /// with why (the caller removes them from the keeper), and the held blocks let go.
    pub(super) fn adopt_shared(
        &self,
        publications: Vec<PublicationRecord>,
        held: Vec<HeldRecord>,
        lingerings: Vec<LingeringRecord>,
        imports: Vec<ImportRecord>,
        alive: &mut Liveness,
    ) -> Vec<(String, &'static str)> {
        let mut refused = Vec::new();
        for r in publications {
            if let Err(why) = self.adopt_publication(&r) {
                tracing::debug!(publication = %r.id, lease = %r.lease, publisher = %r.publisher, why, "kept publication not taken back");
                refused.push((r.key(), why));
            }
        }
        // Made before the lock that takes them back: a held block's publication holds
        // for its imports only, so it comes back in the same hold as they do.
        let mut held_pubs = Vec::new();
        for h in &held {
            match self.held_publication(h) {
                Ok(Some(p)) => held_pubs.push(p),
                Ok(None) => {}
                Err(why) => {
                    tracing::debug!(lease = %h.lease, tenant = %h.tenant, why, "the publication of a kept held block not taken back")
                }
            }
        }
        let mut lingering = Vec::new();
        for r in lingerings {
            match lingering_of(&r, alive) {
                Ok(a) => lingering.push((r, a)),
                Err(why) => refused.push((r.key(), why)),
            }
        }
        // Read before the lock: which of their recipients still live.
        let imports: Vec<_> = imports
            .into_iter()
            .map(|r| {
                let recipients = alive.recipients(&r.recipients);
                (r, recipients)
            })
            .collect();
        let mut st = self.arb.lock();
        for (lease, p) in held_pubs {
            if st.adopt_held_publication(lease, p).is_err() {
                tracing::debug!(%lease, "the publication of a kept held block not taken back: its id is taken");
            }
        }
        // Before the imports: a crash between a lingering record's write and its import
        // record's removal left both, and the lingering one is the later.
        for (r, a) in lingering {
            if st.adopt_lingering(a).is_err() {
                tracing::debug!(import = %r.id, tenant = %r.tenant, "kept lingering import let go");
                refused.push((
                    r.key(),
                    "its processes are gone, or its publication was not taken back",
                ));
            }
        }
        for (r, recipients) in imports {
            let parsed = (
                r.id.parse::<Uuid>(),
                r.publication.parse::<Uuid>(),
                r.session.parse::<Uuid>(),
            );
            let (Ok(id), Ok(publication), Ok(session)) = parsed else {
                refused.push((r.key(), "unreadable id"));
                continue;
            };
            let a = AdoptedImport {
                id,
                publication,
                tenant: r.tenant.clone(),
                session,
                pid: r.pid,
                created: from_unix_ms(r.created_unix_ms),
                recipients,
            };
            if let Err(why) = st.adopt_import(a) {
                tracing::debug!(import = %r.id, tenant = %r.tenant, ?why, "kept import not taken back");
                refused.push((r.key(), "its session or publication was not taken back"));
            }
        }
        for lease in st.settle_adopted_held() {
            refused.push((records::held_key(&lease), "nobody imports it any more"));
        }
        refused
    }

    /// The descriptor importers of `kind` memory get, made again from the block's `fd`
    /// (a memfd's read-only reopen, counted against the budget) and whether read-only is
    /// enforced.
    #[allow(clippy::type_complexity)]
    fn importer_fd_again(
        &self,
        kind: MemoryKind,
        fd: &SharedFd,
        size: u64,
    ) -> Result<(SharedFd, bool, Option<crate::fd_budget::FdHeld>), &'static str> {
        let fd_counted = match kind {
            // A memfd's importers get a reopen of it: one descriptor more.
            MemoryKind::HostMemfd => Some(
                self.arb
                    .fds
                    .take_held(0)
                    .map_err(|_| "out of descriptors")?,
            ),
            MemoryKind::CudaVmm => None,
        };
        let (ro, enforced) = crate::sharing::importer_fd(kind, fd, size)
            .map_err(|_| "its memory could not be sealed read-only again")?;
        Ok((ro, enforced, fd_counted))
    }

    /// The publication of held block `h` taken back, made again (unpublished, found by
    /// id), with its block's id; None when it had none.
    fn held_publication(
        &self,
        h: &HeldRecord,
    ) -> Result<Option<(Uuid, AdoptedHeldPublication)>, &'static str> {
        let Some(p) = &h.publication else {
            return Ok(None);
        };
        let (Ok(lease), Ok(id)) = (h.lease.parse::<Uuid>(), p.id.parse::<Uuid>()) else {
            return Err("unreadable id");
        };
        let (kind, fd, size) = {
            let st = self.arb.lock();
            let held = st
                .shared()
                .held
                .get(&lease)
                .ok_or("its block was not taken back")?;
            let Handle::Fd { kind, fd, size, .. } = &held.block.handle;
            (*kind, fd.clone(), *size)
        };
        let (fd, enforced, fd_counted) = self.importer_fd_again(kind, &fd, size)?;
        let a = AdoptedHeldPublication {
            id,
            readers: p.readers.iter().cloned().collect(),
            published_at: from_unix_ms(p.published_unix_ms),
            fd,
            enforced,
            fd_counted,
        };
        Ok(Some((lease, a)))
    }

    /// Publishes the lease of kept publication `r` again, when that lease was taken back.
    fn adopt_publication(&self, r: &PublicationRecord) -> Result<(), &'static str> {
        let (Ok(id), Ok(lease)) = (r.id.parse::<Uuid>(), r.lease.parse::<Uuid>()) else {
            return Err("unreadable id");
        };
        let (kind, fd, size) = {
            let st = self.arb.lock();
            let l = st
                .leases()
                .get(&lease)
                .filter(|l| l.tenant == r.publisher)
                .ok_or("its lease was not taken back")?;
            let Handle::Fd { kind, fd, size, .. } = &l.block.handle;
            (*kind, fd.clone(), *size)
        };
        let (ro, enforced, fd_counted) = self.importer_fd_again(kind, &fd, size)?;
        let new = NewPublication {
            lease,
            publisher: r.publisher.clone(),
            name: r.name.clone().unwrap_or_default(),
            readers: r.readers.iter().cloned().collect::<BTreeSet<_>>(),
            published_at: from_unix_ms(r.published_unix_ms),
            fd: ro,
            enforced,
            fd_counted,
        };
        self.arb
            .lock()
            .adopt_publication(id, r.name.clone(), new)
            .map_err(|_| "its lease has another publication, or its name is taken")
    }
}

/// Kept lingering import `r` as the core takes it back: its processes still alive.
fn lingering_of(
    r: &LingeringRecord,
    alive: &mut Liveness,
) -> Result<AdoptedLingering, &'static str> {
    let parsed = (
        r.id.parse::<Uuid>(),
        r.publication.parse::<Uuid>(),
        r.session.parse::<Uuid>(),
    );
    let (Ok(id), Ok(publication), Ok(session)) = parsed else {
        return Err("unreadable id");
    };
    // Pid 0 (a process in another pid namespace) is waited for, as before the restart.
    let waiters = alive.recipients(&r.waiters);
    let pid_start = waiters
        .iter()
        .find(|(p, _)| Some(**p) == r.pid)
        .and_then(|(_, s)| *s);
    let a = AdoptedLingering {
        import: AdoptedImport {
            id,
            publication,
            tenant: r.tenant.clone(),
            session,
            pid: r.pid,
            created: from_unix_ms(r.created_unix_ms),
            // A lingering import's are its other waiters: their start times stay with it
            // (its record is written again for a new keeper).
            recipients: waiters
                .iter()
                .filter(|(p, _)| Some(**p) != r.pid)
                .map(|(&p, &s)| (p, s))
                .collect(),
        },
        pid_start,
        waiters: waiters.into_keys().collect(),
        timeout: r.timeout,
    };
    Ok(a)
}
