//! Shared read-only leases: publish one of your device leases under a name for other
//! tenants ([`Lease::publish`]), import what others published for you
//! ([`Session::import`]), list them ([`Client::list_shared`]). The publisher stays charged
//! for the memory, once; importers are not. An import ([`SharedImport`]) carries a
//! read-only descriptor fetched through the ticket socket like a lease's: for host memory
//! (memfd) the broker seals the object, so no importer can write it by any route; for
//! CUDA memory read-only is this client's own `cuMemSetAccess` (see `docs/security.md`).
//!
//! An import is released by [`SharedImport::release`] or, failing that, when dropped (in
//! the background, like a lease). It keeps its session open while it lives.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::SystemTime;

use serde::Serialize;

use gpu_broker_proto::v1 as pb;

use crate::client::Client;
use crate::error::ClientError;
use crate::fd::{FdInfo, MemoryKind};
use crate::lease::Lease;
use crate::lease_info::unix_ms;
use crate::session::Session;

/// One importer of a shared lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SharedImportInfo {
    pub import_id: String,
    pub tenant: String,
    pub session_id: String,
    /// The importing process (0: unknown).
    pub pid: u32,
    pub imported_unix_ms: i64,
    /// Its session ended while its process lives (it may still map the memory).
    pub lingering: bool,
}

/// A published lease as the broker reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SharedLeaseInfo {
    pub publication_id: String,
    pub publisher: String,
    /// Empty once unpublished.
    pub name: String,
    /// The publisher's lease; empty once it ended.
    pub lease_id: String,
    pub device: u32,
    pub device_uuid: String,
    pub bytes: u64,
    pub memory_kind: MemoryKind,
    /// Tenants that may import it (besides the publisher's own).
    pub tenants: Vec<String>,
    pub published: bool,
    pub published_unix_ms: i64,
    /// Does the operating system refuse importers' writes (memfd seals)?
    pub read_only_enforced: bool,
    /// Importers (listed to the publisher's tenant and operators only).
    pub imports: Vec<SharedImportInfo>,
    pub import_count: u32,
}

impl SharedLeaseInfo {
    /// When it was (last) published.
    pub fn published_at(&self) -> SystemTime {
        unix_ms(self.published_unix_ms)
    }
}

impl From<pb::SharedLease> for SharedLeaseInfo {
    fn from(s: pb::SharedLease) -> Self {
        SharedLeaseInfo {
            memory_kind: MemoryKind::from(s.memory_kind),
            publication_id: s.publication_id,
            publisher: s.publisher,
            name: s.name,
            lease_id: s.lease_id,
            device: s.device,
            device_uuid: s.device_uuid,
            bytes: s.bytes,
            tenants: s.tenants,
            published: s.published,
            published_unix_ms: s.published_unix_ms,
            read_only_enforced: s.read_only_enforced,
            imports: s
                .imports
                .into_iter()
                .map(|i| SharedImportInfo {
                    import_id: i.import_id,
                    tenant: i.tenant,
                    session_id: i.session_id,
                    pid: i.pid,
                    imported_unix_ms: i.imported_unix_ms,
                    lingering: i.lingering,
                })
                .collect(),
            import_count: s.import_count,
        }
    }
}

fn shared_of(s: Option<pb::SharedLease>, call: &str) -> Result<SharedLeaseInfo, ClientError> {
    s.map(SharedLeaseInfo::from)
        .ok_or_else(|| ClientError::Protocol(format!("{call} reply carries no shared lease")))
}

impl Lease {
    /// Publishes this device lease read-only under `name` for `tenants` (empty: your own
    /// tenant only). For host memory the broker seals it against writes from then on:
    /// mappings made before keep writing, new writable mappings fail (map it first).
    pub async fn publish(
        &self,
        name: &str,
        tenants: &[&str],
    ) -> Result<SharedLeaseInfo, ClientError> {
        let reply = self
            .session()
            .client()
            .raw()
            .publish_lease(pb::PublishLeaseRequest {
                lease_id: self.id().to_string(),
                name: name.to_string(),
                tenants: tenants.iter().map(|t| t.to_string()).collect(),
            })
            .await?
            .into_inner();
        shared_of(reply.shared, "PublishLease")
    }
}

impl Client {
    /// Takes your tenant's publication `name` away (live imports keep the memory).
    pub async fn unpublish(&self, name: &str) -> Result<SharedLeaseInfo, ClientError> {
        let reply = self
            .raw()
            .unpublish_lease(pb::UnpublishLeaseRequest {
                name: name.to_string(),
            })
            .await?
            .into_inner();
        shared_of(reply.shared, "UnpublishLease")
    }

    /// Your tenant's publications (with importers) and those published for it, oldest
    /// first (all pages).
    pub async fn list_shared(&self) -> Result<Vec<SharedLeaseInfo>, ClientError> {
        crate::paging::all_pages(|token| async move { self.list_shared_page(0, &token).await })
            .await
    }

    /// One page of [`Client::list_shared`]: `page_size` 0 is the broker's default;
    /// `page_token` empty for the first page, else the token the previous page returned.
    pub async fn list_shared_page(
        &self,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<SharedLeaseInfo>, Option<String>), ClientError> {
        let reply = self
            .raw()
            .list_shared_leases(pb::ListSharedLeasesRequest {
                page_size,
                page_token: page_token.to_string(),
            })
            .await?
            .into_inner();
        Ok((
            reply
                .shared
                .into_iter()
                .map(SharedLeaseInfo::from)
                .collect(),
            Some(reply.next_page_token).filter(|t| !t.is_empty()),
        ))
    }

    /// Lets go of an import by id (e.g. one a [`SharedImport::detach`]ed).
    pub async fn release_import(&self, import_id: &str) -> Result<(), ClientError> {
        self.raw()
            .release_import(pb::ReleaseImportRequest {
                import_id: import_id.to_string(),
            })
            .await?;
        Ok(())
    }
}

impl Session {
    /// Imports `publisher`'s shared lease `name` (published for your tenant) and fetches
    /// its read-only descriptor. `NotFound` when there is none for you.
    pub async fn import(&self, publisher: &str, name: &str) -> Result<SharedImport, ClientError> {
        let generation = self.generations().current();
        let reply = self
            .client()
            .raw()
            .import_lease(pb::ImportLeaseRequest {
                session_id: self.id().to_string(),
                publisher: publisher.to_string(),
                name: name.to_string(),
            })
            .await?
            .into_inner();
        let shared = shared_of(reply.shared, "ImportLease")?;
        let mut fd_info = FdInfo::from(reply.fd.ok_or_else(|| {
            ClientError::Protocol("ImportLease reply carries no descriptor".into())
        })?);
        let fetched = crate::fd::fetch(
            &fd_info.socket_path,
            &fd_info.ticket,
            self.client().dialled_socket(),
        )
        .await;
        fd_info.ticket.clear();
        let fd = match fetched {
            Ok(fd) => fd,
            Err(e) => {
                // A broker that died while handing the descriptor over may have kept the
                // import: it is let go once the restarted broker answers.
                let _ = self
                    .release_import_through_outage(&generation, &reply.import_id)
                    .await;
                return Err(e);
            }
        };
        Ok(SharedImport {
            id: reply.import_id,
            shared,
            fd_info,
            fd: Some(fd),
            session: self.clone(),
            generation,
            released: false,
        })
    }

    /// Lets go of import `id`, waiting out a broker outage (`Session::through_outage`: a
    /// restart with a keeper keeps the import, so the release goes through once the broker
    /// is back). `NOT_FOUND` after a retry is success: the restarted broker kept its end,
    /// or never kept it.
    async fn release_import_through_outage(
        &self,
        on: &crate::generation::Generation,
        id: &str,
    ) -> Result<(), ClientError> {
        let mut tries = 0;
        let r = self
            .through_outage(on, || {
                tries += 1;
                let client = self.client().clone();
                let id = id.to_string();
                async move {
                    match client.release_import(&id).await {
                        // A call on a connection the broker's death cut may end
                        // `CANCELLED`: an outage like the others.
                        Err(e) if e.code() == crate::error::Code::Cancelled => {
                            Err(ClientError::Unavailable(e.message().to_string().into()))
                        }
                        r => r,
                    }
                }
            })
            .await;
        match r {
            Err(e) if tries > 1 && e.code() == crate::error::Code::NotFound => Ok(()),
            r => r,
        }
    }
}

/// An imported shared lease: a read-only descriptor of someone's published memory.
pub struct SharedImport {
    id: String,
    shared: SharedLeaseInfo,
    fd_info: FdInfo,
    /// Closed by [`SharedImport::release`] or the drop, before either tells the broker.
    fd: Option<OwnedFd>,
    session: Session,
    /// The session's generation it was imported in (a release waits out an outage while
    /// that generation lives).
    generation: std::sync::Arc<crate::generation::Generation>,
    released: bool,
}

impl fmt::Debug for SharedImport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedImport")
            .field("id", &self.id)
            .field("shared", &self.shared)
            .field("fd", &self.fd_info)
            .finish()
    }
}

impl SharedImport {
    /// Id of the import (for [`Client::release_import`]).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// What was imported.
    pub fn info(&self) -> &SharedLeaseInfo {
        &self.shared
    }

    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.shared.bytes
    }

    /// The memory behind the descriptor.
    pub fn memory_kind(&self) -> MemoryKind {
        self.fd_info.memory_kind
    }

    /// The read-only descriptor (valid while the import lives; do not close it).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd
            .as_ref()
            .expect("open until the import is released")
            .as_fd()
    }

    /// Maps host memory (a memfd) read-only, `MAP_SHARED`: it sees the publisher's
    /// writes. `NotMappable` for CUDA memory.
    pub fn map(&self) -> Result<ReadOnlyMapping<'_>, ClientError> {
        if self.fd_info.memory_kind != MemoryKind::HostMemfd {
            return Err(ClientError::NotMappable);
        }
        let len = usize::try_from(self.shared.bytes).map_err(|_| {
            ClientError::Protocol("a shared lease too large for this address space".into())
        })?;
        // SAFETY: a memfd the broker sized to at least `bytes` and sealed against
        // shrinking, mapped read-only; other processes' writes are the module's aliasing
        // rule (shared memory).
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(&self.fd())? };
        Ok(ReadOnlyMapping {
            map,
            _import: std::marker::PhantomData,
        })
    }

    /// Maps CUDA VMM memory read-only in this process (feature `cuda`): import, reserve,
    /// map, and `cuMemSetAccess` with read access only. Drop it before releasing.
    #[cfg(feature = "cuda")]
    pub fn map_cuda(&self) -> Result<crate::cuda::CudaMapping, ClientError> {
        if self.fd_info.memory_kind != MemoryKind::CudaVmm {
            return Err(ClientError::NotMappable);
        }
        crate::cuda::map_vmm_read_only(
            self.fd(),
            crate::cuda::local_ordinal(self.shared.device, &self.shared.device_uuid),
            self.shared.bytes,
            self.fd_info.size,
        )
        .map_err(|e| ClientError::Cuda(e.to_string()))
    }

    /// Maps CUDA VMM memory read-write (feature `cuda`): for a lease the importer's own
    /// tenant published to be written by both sides (CUDA tensors shared between its
    /// processes). Nothing in the broker enforces read-only for CUDA memory
    /// (`docs/security.md`); this is the importer's choice. Drop it before releasing.
    #[cfg(feature = "cuda")]
    pub fn map_cuda_writable(&self) -> Result<crate::cuda::CudaMapping, ClientError> {
        if self.fd_info.memory_kind != MemoryKind::CudaVmm {
            return Err(ClientError::NotMappable);
        }
        crate::cuda::map_vmm_import(
            self.fd(),
            crate::cuda::local_ordinal(self.shared.device, &self.shared.device_uuid),
            self.shared.bytes,
            self.fd_info.size,
        )
        .map_err(|e| ClientError::Cuda(e.to_string()))
    }

    /// Lets go of the import now (unmap it first).
    pub async fn release(mut self) -> Result<(), ClientError> {
        self.released = true;
        // Closed before the broker hears of it (a release promises it: a descriptor still
        // here when the broker frees the block is memory this process kept, and charged so).
        self.fd = None;
        self.session
            .release_import_through_outage(&self.generation, &self.id)
            .await
    }

    /// Stops tracking it without releasing: the broker keeps it until released by id or
    /// the session ends.
    pub fn detach(mut self) -> String {
        self.released = true;
        std::mem::take(&mut self.id)
    }
}

impl Drop for SharedImport {
    fn drop(&mut self) {
        // The descriptor closes before the broker can hear of the release.
        self.fd = None;
        if self.released {
            return;
        }
        let session = self.session.clone();
        let generation = self.generation.clone();
        let id = std::mem::take(&mut self.id);
        self.session.spawn(async move {
            if let Err(e) = session
                .release_import_through_outage(&generation, &id)
                .await
            {
                tracing::debug!(import = id, error = %e, "release of a dropped import failed");
            }
        });
    }
}

/// A read-only `MAP_SHARED` mapping of an imported host-memory lease.
#[derive(Debug)]
pub struct ReadOnlyMapping<'a> {
    map: memmap2::Mmap,
    _import: std::marker::PhantomData<&'a SharedImport>,
}

impl std::ops::Deref for ReadOnlyMapping<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl ReadOnlyMapping<'_> {
    /// Start of the mapping.
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }
}

/// Operators' view: every shared lease with its importers (`Admin.ListSharedLeases`).
impl crate::admin::AdminClient {
    /// Every shared lease (of one publishing tenant, if given), oldest first (all pages).
    pub async fn list_shared(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<SharedLeaseInfo>, ClientError> {
        self.list_shared_paged(tenant, 0).await
    }

    /// [`AdminClient::list_shared`] asking for pages of `page_size` (0: the broker's
    /// default).
    pub async fn list_shared_paged(
        &self,
        tenant: Option<&str>,
        page_size: u32,
    ) -> Result<Vec<SharedLeaseInfo>, ClientError> {
        crate::paging::all_pages(|token| async move {
            self.list_shared_page(tenant, page_size, &token).await
        })
        .await
    }

    /// One page of shared leases (see [`AdminClient::list_tenants_page`] for the paging).
    pub async fn list_shared_page(
        &self,
        tenant: Option<&str>,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<SharedLeaseInfo>, Option<String>), ClientError> {
        let reply = self
            .raw()
            .list_shared_leases(pb::AdminListSharedLeasesRequest {
                tenant: tenant.unwrap_or_default().to_string(),
                page_size,
                page_token: page_token.to_string(),
            })
            .await?
            .into_inner();
        Ok((
            reply
                .shared
                .into_iter()
                .map(SharedLeaseInfo::from)
                .collect(),
            Some(reply.next_page_token).filter(|t| !t.is_empty()),
        ))
    }
}
