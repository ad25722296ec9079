//! A restart's take-back of shared leases (after the leases and sessions, before the
//! keeper is re-armed): each kept publication of a lease taken back is published again
//! with the same id and name, its importers' descriptor made again from the lease's block
//! (a memfd is sealed already: reopened read-only again); each kept import of a session
//! taken back is recorded again. What is not taken back leaves the keeper. The core's
//! side is `core/src/state/adopt_shared.rs`.

use super::state::{AdoptedImport, NewPublication};
use super::Arbiter;
use crate::device::{Handle, MemoryKind};
use crate::keeper::records::{ImportRecord, PublicationRecord};
use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};
use uuid::Uuid;

fn from_unix_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

impl Arbiter {
    /// Takes back kept publications, then kept imports; returns those not taken back,
    /// with why (the caller removes them from the keeper).
    pub(super) fn adopt_shared(
        &self,
        publications: Vec<PublicationRecord>,
        imports: Vec<ImportRecord>,
    ) -> Vec<(String, &'static str)> {
        let mut refused = Vec::new();
        for r in publications {
            if let Err(why) = self.adopt_publication(&r) {
                tracing::debug!(publication = %r.id, lease = %r.lease, publisher = %r.publisher, why, "kept publication not taken back");
                refused.push((r.key(), why));
            }
        }
        let mut st = self.lock();
        for r in imports {
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
            };
            if let Err(why) = st.adopt_import(a) {
                tracing::debug!(import = %r.id, tenant = %r.tenant, ?why, "kept import not taken back");
                refused.push((r.key(), "its session or publication was not taken back"));
            }
        }
        refused
    }

    /// Publishes the lease of kept publication `r` again, when that lease was taken back.
    fn adopt_publication(&self, r: &PublicationRecord) -> Result<(), &'static str> {
        let (Ok(id), Ok(lease)) = (r.id.parse::<Uuid>(), r.lease.parse::<Uuid>()) else {
            return Err("unreadable id");
        };
        let (kind, fd, size) = {
            let st = self.lock();
            let l = st
                .leases()
                .get(&lease)
                .filter(|l| l.tenant == r.publisher)
                .ok_or("its lease was not taken back")?;
            let Handle::Fd { kind, fd, size, .. } = &l.block.handle;
            (*kind, fd.clone(), *size)
        };
        let fd_counted = match kind {
            // A memfd's importers get a reopen of it: one descriptor more.
            MemoryKind::HostMemfd => Some(self.fds.take_held(0).map_err(|_| "out of descriptors")?),
            MemoryKind::CudaVmm => None,
        };
        let (ro, enforced) = crate::sharing::importer_fd(kind, &fd, size)
            .map_err(|_| "its memory could not be sealed read-only again")?;
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
        self.lock()
            .adopt_publication(id, r.name.clone(), new)
            .map_err(|_| "its lease has another publication, or its name is taken")
    }
}
