//! Adoption of shared leases: a restarted broker takes back the publications of the
//! leases it took back (same id and name, so importers and new importers find them) and
//! the imports of the sessions it took back (an import's process died meanwhile: its
//! session was not taken back, nor is the import). Nothing is pushed for the keeper: it
//! holds them already. Importers are not charged; the publisher's lease is, as before.

use super::adopt::NotAdopted;
use super::shared::NewPublication;
use super::State;
use crate::sharing::Import;
use std::time::SystemTime;
use uuid::Uuid;

/// A kept import to take back (from its record).
#[derive(Clone, Debug)]
pub struct AdoptedImport {
    pub id: Uuid,
    pub publication: Uuid,
    pub tenant: String,
    pub session: Uuid,
    pub pid: Option<u32>,
    pub created: SystemTime,
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
            created: a.created,
            lingering: None,
            kept: true,
        };
        if self.shared.add_import(a.publication, import) {
            Ok(())
        } else {
            Err(NotAdopted::Publication)
        }
    }
}
