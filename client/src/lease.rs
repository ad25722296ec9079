//! Leases: a grant of device (or host-fallback) memory to a session. [`LeaseRequest`]
//! builds an `AcquireLease` call; the broker answers with a [`Lease`], which knows how
//! to map its memory ([`Lease::map`] for `host_shm` handles) and gives the memory back
//! on [`Lease::release`] — or, failing that, when dropped (the release is then sent in
//! the background on the session's runtime). A lease keeps its [`Session`] alive, since
//! the broker takes back every lease of a session that ends. [`LeaseInfo`] is the plain
//! record the list calls return.
//!
//! A lease belongs to the broker session it was acquired on. When a reconnecting
//! session loses that broker session (see [`crate::reconnect`]) the lease is gone with
//! it: [`Lease::is_lost`] turns true, [`Lease::release`] fails with
//! [`ClientError::LeaseLost`] without calling the broker, and dropping it sends nothing,
//! so an old lease never touches the session that replaced its own.

use std::fmt;
use std::future::{Future, IntoFuture};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use gpu_broker_proto::v1 as pb;

use crate::error::ClientError;
pub use crate::fd::{FdInfo, MemoryKind};
use crate::generation::Generation;
pub use crate::lease_info::{LeaseHandle, LeaseInfo, LeaseState, Tier};
use crate::mapping::HostMapping;
use crate::session::Session;

/// Memory held by this process. Released by [`Lease::release`], or in the background
/// when dropped. Keeps its session open while it lives.
pub struct Lease {
    info: LeaseInfo,
    session: Session,
    /// The broker session it was acquired on.
    generation: Arc<Generation>,
    released: bool,
    /// The descriptor of an fd lease (closed when the lease goes).
    fd: Option<OwnedFd>,
    /// The lease's own mapping ([`Lease::mapped`]), kept with the descriptor when the
    /// block is retained (`retained.rs`).
    kept: Option<crate::retained::Kept>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("info", &self.info)
            .field("session", &self.session_id())
            .field("lost", &self.is_lost())
            .field("released", &self.released)
            .finish()
    }
}

impl Lease {
    pub(crate) fn new(info: LeaseInfo, session: Session, generation: Arc<Generation>) -> Self {
        Lease {
            info,
            session,
            generation,
            released: false,
            fd: None,
            kept: None,
        }
    }

    /// The lease's own host mapping of its memory (a memfd fd lease), made on the first
    /// call and kept while the lease lives; a lease granted from a block this process
    /// retained ([`Session::retain_mappings`]) has it already. Unmapped when the lease is
    /// released (or kept with the block when retained).
    pub fn mapped(&mut self) -> Result<&mut HostMapping<'static>, ClientError> {
        if !matches!(self.kept, Some(crate::retained::Kept::Host(_))) {
            self.kept = Some(crate::retained::Kept::Host(self.map_unbound()?));
        }
        match &mut self.kept {
            Some(crate::retained::Kept::Host(m)) => Ok(m),
            _ => Err(ClientError::NotMappable),
        }
    }

    /// The lease's own CUDA mapping (feature `cuda`), made on the first call and kept
    /// while the lease lives, as [`Lease::mapped`] keeps a host one.
    #[cfg(feature = "cuda")]
    pub fn mapped_cuda(&mut self) -> Result<&crate::cuda::CudaMapping, ClientError> {
        if !matches!(self.kept, Some(crate::retained::Kept::Cuda(_))) {
            self.kept = Some(crate::retained::Kept::Cuda(self.map_cuda()?));
        }
        match &self.kept {
            Some(crate::retained::Kept::Cuda(m)) => Ok(m),
            _ => Err(ClientError::NotMappable),
        }
    }

    /// The lease's file descriptor (fd leases only), valid while the lease lives. Map it,
    /// import it, or `dup` it for another library; do not close it.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// A new descriptor of this fd lease, fetched with a new ticket (e.g. to hand to a
    /// child process: send it with `SCM_RIGHTS`, or let the child fetch its own with
    /// [`crate::Client::lease_fd`]). The caller owns (and closes) it.
    pub async fn fetch_fd(&self) -> Result<OwnedFd, ClientError> {
        if self.is_lost() {
            return Err(self.lost_error());
        }
        Ok(self.session.client().lease_fd(&self.info.lease_id).await?.1)
    }

    /// UUID of the lease.
    pub fn id(&self) -> &str {
        &self.info.lease_id
    }

    /// Device index the memory lives on.
    pub fn device(&self) -> u32 {
        self.info.device
    }

    /// UUID of the device the memory lives on (`GPU-...`; empty for host-fallback memory).
    /// Unlike the index, it names the same card in every process, whatever its
    /// `CUDA_VISIBLE_DEVICES`.
    pub fn device_uuid(&self) -> &str {
        &self.info.device_uuid
    }

    /// Granted size in bytes (the request rounded up to the allocation granularity).
    pub fn bytes(&self) -> u64 {
        self.info.bytes
    }

    /// Size asked for.
    pub fn requested_bytes(&self) -> u64 {
        self.info.requested_bytes
    }

    /// Offset of the lease inside the exported allocation (0 today).
    pub fn offset(&self) -> u64 {
        self.info.offset
    }

    /// Device or host-fallback memory.
    pub fn tier(&self) -> Tier {
        self.info.tier
    }

    /// How to map the memory.
    pub fn handle(&self) -> &LeaseHandle {
        &self.info.handle
    }

    /// Label given at acquire time.
    pub fn label(&self) -> &str {
        &self.info.label
    }

    /// Everything the broker said about the lease when granting it.
    pub fn info(&self) -> &LeaseInfo {
        &self.info
    }

    /// The session holding the lease.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Id of the broker session the lease was acquired on (with reconnection it can
    /// differ from [`Session::id`], which follows the current one).
    pub fn session_id(&self) -> &str {
        self.generation.id()
    }

    /// True once the broker session the lease was acquired on is lost (reconnecting
    /// sessions only): the memory is gone and the lease cannot be released.
    pub fn is_lost(&self) -> bool {
        !self.session.generations().is_live(&self.generation)
    }

    fn lost_error(&self) -> ClientError {
        ClientError::LeaseLost {
            lease_id: self.info.lease_id.clone(),
            session_id: self.session_id().to_string(),
        }
    }

    /// Maps a host-memory lease (an fd lease of a memfd, or a legacy `host_shm` file)
    /// read-write (`MAP_SHARED`); the mapping borrows the lease and must be dropped before
    /// the lease is released. `NotMappable` for other handles (CUDA memory).
    /// A lost lease ([`Lease::is_lost`]) fails with [`ClientError::LeaseLost`].
    pub fn map(&self) -> Result<HostMapping<'_>, ClientError> {
        self.map_unbound()
    }

    /// Like [`Lease::map`], but the mapping does not borrow the lease (for wrappers that
    /// keep both in one place, e.g. the Python package): the caller must drop the mapping
    /// before releasing the lease.
    pub fn map_unbound(&self) -> Result<HostMapping<'static>, ClientError> {
        if self.is_lost() {
            return Err(self.lost_error());
        }
        match &self.info.handle {
            LeaseHandle::HostShm(path) => {
                HostMapping::open_bound(path, self.info.offset, self.info.bytes)
            }
            LeaseHandle::Fd(i) if i.memory_kind == MemoryKind::HostMemfd => {
                let fd = self.fd.as_ref().ok_or_else(|| {
                    ClientError::Protocol("fd lease without its descriptor".into())
                })?;
                HostMapping::from_fd(fd.as_fd(), self.info.offset, self.info.bytes)
            }
            _ => Err(ClientError::NotMappable),
        }
    }

    /// Is this host memory that [`Lease::map`] can map (a memfd or a legacy file)?
    pub fn is_host_mappable(&self) -> bool {
        match &self.info.handle {
            LeaseHandle::HostShm(_) => true,
            LeaseHandle::Fd(i) => i.memory_kind == MemoryKind::HostMemfd,
            _ => false,
        }
    }

    /// Maps CUDA memory of this lease in this process (feature `cuda`): imports a VMM fd
    /// lease (cached per block while mapped). A device pointer in the device's primary
    /// context, `bytes()` long. Drop the mapping before releasing the
    /// lease. `NotMappable` for other handles; driver failures are `ClientError::Cuda`.
    /// A lost lease ([`Lease::is_lost`]) fails with [`ClientError::LeaseLost`].
    #[cfg(feature = "cuda")]
    pub fn map_cuda(&self) -> Result<crate::cuda::CudaMapping, ClientError> {
        if self.is_lost() {
            return Err(self.lost_error());
        }
        // The broker's device index is not this process's CUDA ordinal when their
        // CUDA_VISIBLE_DEVICES differ (`gpu-brokerctl run` narrows it): match by UUID.
        let ordinal = crate::cuda::local_ordinal(self.info.device, &self.info.device_uuid);
        match &self.info.handle {
            LeaseHandle::Fd(i) if i.memory_kind == MemoryKind::CudaVmm => {
                let fd = self.fd.as_ref().ok_or_else(|| {
                    ClientError::Protocol("fd lease without its descriptor".into())
                })?;
                crate::cuda::map_vmm(fd.as_fd(), ordinal, self.info.bytes, i.size, i.block_id)
                    .map_err(|e| ClientError::Cuda(e.to_string()))
            }
            _ => Err(ClientError::NotMappable),
        }
    }

    /// Gives the memory back now. Close every mapping of it first. A lease whose broker
    /// session was lost fails with [`ClientError::LeaseLost`] and sends nothing. When the
    /// session retains mappings ([`Session::retain_mappings`]) the broker may hold the
    /// block for this process, its descriptor and the lease's own mapping kept here.
    pub async fn release(self) -> Result<(), ClientError> {
        self.release_with(true).await
    }

    /// [`Lease::release`], never retaining the block (its memory is given back for
    /// others, e.g. a sleep or a reclaim).
    pub async fn release_unretained(self) -> Result<(), ClientError> {
        self.release_with(false).await
    }

    /// Hands the lease the range a [`crate::Resident`] mapped it at: kept with the block
    /// when it is retained, else unmapped before the release.
    pub(crate) fn keep_range(&mut self, range: crate::address_range::Range) {
        self.kept = Some(crate::retained::Kept::Range(range));
    }

    /// The mapped range a retained block came back with, if any.
    pub(crate) fn take_range(&mut self) -> Option<crate::address_range::Range> {
        match self.kept.take() {
            Some(crate::retained::Kept::Range(r)) => Some(r),
            other => {
                self.kept = other;
                None
            }
        }
    }

    /// Closes the lease's own mapping, if any ([`Lease::mapped`], or one a retained block
    /// came back with).
    pub(crate) fn drop_mapping(&mut self) {
        self.kept = None;
    }

    async fn release_with(mut self, allow_retain: bool) -> Result<(), ClientError> {
        self.released = true;
        let retain = allow_retain
            && self.session.retained().enabled()
            && self.fd.is_some()
            && self.info.tier == Tier::Device;
        if !retain {
            // Unmapped and closed before the broker hears of it (a release promises it: a
            // mapping or descriptor still here when the broker frees the block is memory
            // this process kept, and charged so).
            self.kept = None;
            self.fd = None;
        }
        let Some(releasing) = Releasing::begin(&self, retain) else {
            return Err(self.lost_error());
        };
        let client = self.session.client();
        let id = &self.info.lease_id;
        let mut tries = 0;
        let request = pb::ReleaseLeaseRequest {
            lease_id: id.clone(),
            retain_mapping: retain,
            may_decline: true,
        };
        let on_line = match retain {
            true => {
                let session = self.generation.id();
                match self.session.lease_line().release(session, &request).await {
                    Ok(reply) => reply,
                    // The broker may have retained it or not: unmapped, closed, then a
                    // plain release ends it either way (a retained block let go).
                    Err(e) => {
                        self.kept = None;
                        self.fd = None;
                        releasing.unmapped();
                        let plain = self
                            .session
                            .through_outage(&self.generation, || client.release_lease(id))
                            .await;
                        return match plain {
                            // The broker stayed away: that, not the line, is what to say.
                            Err(p) if p.code() == crate::error::Code::Unavailable => Err(p),
                            Err(p) if p.code() != crate::error::Code::NotFound => Err(e),
                            _ => Ok(()),
                        };
                    }
                }
            }
            false => None,
        };
        let r = match on_line {
            Some(reply) => Ok(reply),
            None => {
                self.session
                    .through_outage(&self.generation, || {
                        tries += 1;
                        let request = request.clone();
                        async move { Ok(client.raw().release_lease(request).await?.into_inner()) }
                    })
                    .await
            }
        };
        let declined = matches!(&r, Ok(reply) if reply.declined);
        // What the retained block pushes over the bound is let go before this returns: a
        // lease asked for next is not refused for memory this process no longer keeps.
        let over = match &r {
            Ok(reply) if reply.retained => self.retain(),
            _ => Vec::new(),
        };
        self.kept = None;
        self.fd = None;
        self.session.let_go_now(over).await;
        let r = r.map(drop);
        if declined {
            // Still ours: released now that the mapping and descriptor are gone.
            let request = pb::ReleaseLeaseRequest {
                lease_id: self.info.lease_id.clone(),
                retain_mapping: false,
                may_decline: false,
            };
            let client = self.session.client();
            let r = self
                .session
                .through_outage(&self.generation, || {
                    let request = request.clone();
                    async move { Ok(client.raw().release_lease(request).await?.into_inner()) }
                })
                .await;
            return match r {
                // Ended meanwhile (a restart between the two calls ended it): gone, as asked.
                Err(e) if e.code() == crate::error::Code::NotFound => Ok(()),
                r => r.map(drop),
            };
        }
        match r {
            // Tried again after an outage: the restarted broker ended it already (it was
            // no longer named when the session resumed).
            Err(e) if tries > 1 && e.code() == crate::error::Code::NotFound => Ok(()),
            r => r,
        }
    }

    /// The broker holds the released block for this process: its descriptor and mapping
    /// go to the session's cache; returns what is then over its bound, to let go.
    fn retain(&mut self) -> Vec<crate::retained::Entry> {
        let (Some(fd), LeaseHandle::Fd(i)) = (self.fd.take(), &self.info.handle) else {
            return Vec::new();
        };
        // Its next lease may come on the session's lease line, on the same socket.
        let dialled = self.session.client().dialled_socket();
        let places = crate::fd::candidates(&i.socket_path, dialled);
        self.session.lease_line().remember(places);
        self.session.retained().put(crate::retained::Entry {
            ended: self.info.lease_id.clone(),
            block_id: i.block_id,
            bytes: self.info.bytes,
            fd,
            mapping: self.kept.take(),
        })
    }

    /// Stops tracking the lease without releasing it: the broker keeps it until it is
    /// released by id ([`crate::Client::release_lease`]), revoked, or the session ends.
    /// A detached lease is not listed in [`crate::SessionEvent::Reconnected`].
    pub fn detach(mut self) -> LeaseInfo {
        self.released = true;
        self.session
            .generations()
            .untrack(&self.generation, &self.info.lease_id);
        self.info.clone()
    }
}

/// A release under way, named in a resume until it is over however it ends (a cancelled
/// one included): a restart that cuts it keeps a retaining one's lease (still mapped: the
/// release goes on after the resume) and ends a plain one's into the cache (unmapped).
struct Releasing {
    session: Session,
    generation: Arc<Generation>,
    id: String,
}

impl Releasing {
    /// Its mapping is gone after all: a resume names it let go.
    fn unmapped(&self) {
        self.session
            .generations()
            .release_unmapped(&self.generation, &self.id);
    }

    /// `None`: the lease's session is no longer the live one.
    fn begin(lease: &Lease, retaining: bool) -> Option<Releasing> {
        let id = &lease.info.lease_id;
        lease
            .session
            .generations()
            .begin_release(&lease.generation, id, retaining)
            .then(|| Releasing {
                session: lease.session.clone(),
                generation: lease.generation.clone(),
                id: id.clone(),
            })
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        self.session
            .generations()
            .end_release(&self.generation, &self.id);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Its own mapping and descriptor close before the broker can hear of the release.
        self.kept = None;
        self.fd = None;
        if self.released {
            return;
        }
        let Some(releasing) = Releasing::begin(self, false) else {
            tracing::debug!(
                lease_id = self.info.lease_id,
                session_id = self.session_id(),
                "dropped lease was lost with its session; nothing to release"
            );
            return;
        };
        let lease_id = std::mem::take(&mut self.info.lease_id);
        let generation = self.generation.clone();
        // The guard's session clone moves into the task: the session outlives the release,
        // which waits out a broker restart as an explicit one does.
        self.session.spawn(async move {
            let session = &releasing.session;
            let client = session.client();
            let released = session
                .through_outage(&generation, || client.release_lease(&lease_id))
                .await;
            if let Err(e) = released {
                tracing::debug!(lease_id, error = %e, "release of a dropped lease failed");
            }
            drop(releasing);
        });
    }
}

/// A pending `AcquireLease`: set options, then `.send().await` (or just `.await`).
#[must_use = "a lease request does nothing until sent"]
#[derive(Debug, Clone)]
pub struct LeaseRequest<'s> {
    session: &'s Session,
    bytes: u64,
    device: Option<u32>,
    wait: Option<Duration>,
    label: String,
    reclaimable: bool,
    fallback_host: bool,
    accept: Vec<pb::HandleKind>,
    host_tier: bool,
}

/// What a lease request accepts unless told otherwise: fd handles (the only kind brokers
/// serve).
const DEFAULT_ACCEPT: [pb::HandleKind; 1] = [pb::HandleKind::Fd];

impl<'s> LeaseRequest<'s> {
    pub(crate) fn new(session: &'s Session, bytes: u64) -> Self {
        LeaseRequest {
            session,
            bytes,
            device: None,
            wait: None,
            label: String::new(),
            reclaimable: false,
            fallback_host: false,
            accept: DEFAULT_ACCEPT.to_vec(),
            host_tier: false,
        }
    }

    /// The handle kinds this worker can use (default: fd). A broker
    /// that can serve none of them answers `FAILED_PRECONDITION`.
    pub fn accept_handles(mut self, kinds: &[pb::HandleKind]) -> Self {
        self.accept = kinds.to_vec();
        self
    }

    /// Asks for this device (default: wherever it fits best).
    pub fn device(mut self, device: u32) -> Self {
        self.device = Some(device);
        self
    }

    /// Waits in the queue up to this long when memory is short (default: do not wait).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Label shown to operators.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// Agrees to give the lease back on a `ReclaimRequested` event.
    pub fn reclaimable(mut self, reclaimable: bool) -> Self {
        self.reclaimable = reclaimable;
        self
    }

    /// Accepts host shared memory when device memory cannot be granted within the wait.
    pub fn fallback_host(mut self, fallback_host: bool) -> Self {
        self.fallback_host = fallback_host;
        self
    }

    /// Asks for host memory (the broker's host tier) instead of device memory, under the
    /// tenant's host limit (e.g. to keep a sleeping lease's contents).
    pub fn host_tier(mut self, host_tier: bool) -> Self {
        self.host_tier = host_tier;
        self
    }

    /// The gRPC request this builder sends.
    pub fn to_proto(&self) -> pb::AcquireLeaseRequest {
        pb::AcquireLeaseRequest {
            session_id: self.session.id(),
            bytes: self.bytes,
            device: self.device,
            wait_ms: self
                .wait
                .map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX)),
            label: self.label.clone(),
            reclaimable: self.reclaimable,
            fallback: if self.fallback_host {
                pb::Fallback::Host as i32
            } else {
                pb::Fallback::None as i32
            },
            accept_handles: self.accept.iter().map(|k| *k as i32).collect(),
            host_tier: self.host_tier,
            push_descriptor: false,
        }
    }

    /// Sends the request. On a reconnecting session that is between broker sessions it
    /// fails at once with `UNAVAILABLE`; so does a grant that arrives after its session
    /// was lost (the lease died with it).
    pub async fn send(self) -> Result<Lease, ClientError> {
        let mut request = self.to_proto();
        let generations = self.session.generations();
        let (mut generation, mut connected) = generations.snapshot();
        if !connected && generations.resuming() {
            // The broker restarted and the session is being resumed: wait for it.
            generations.settled(self.session.outage_wait()).await;
            (generation, connected) = generations.snapshot();
        }
        let session_id = generation.id();
        if !connected {
            return Err(ClientError::Unavailable(
                format!("session {session_id} was lost; reconnecting").into(),
            ));
        }
        request.session_id = session_id.to_string();
        // With a descriptor channel open, the descriptor may come with the grant.
        request.push_descriptor = crate::descriptor_channel::wanted();
        let client = self.session.client();
        // A block this process retained: its grant on the session's lease line, else gRPC.
        let on_line = match !request.host_tier && self.session.retained().fits(self.bytes) {
            true => match self
                .session
                .lease_line()
                .acquire(session_id, &request)
                .await
            {
                Ok(granted) => granted,
                // The broker may have granted one of the retained blocks, whose mapping is
                // then a lease this process does not know: every one is let go (unmapped,
                // closed, confirmed); such a lease stays its session's until it ends, as
                // one whose gRPC answer was lost.
                Err(e) => {
                    let kept = self.session.retained().take_all();
                    self.session.let_go_now(kept).await;
                    return Err(e);
                }
            },
            false => None,
        };
        let response = match on_line {
            Some(r) => r,
            None => {
                self.session
                    .through_outage(&generation, || {
                        let request = request.clone();
                        async move { Ok(client.raw().acquire_lease(request).await?.into_inner()) }
                    })
                    .await?
            }
        };
        let lease = response
            .lease
            .ok_or_else(|| ClientError::Protocol("AcquireLease reply carries no lease".into()))?;
        let info = LeaseInfo::from(lease);
        if !generations.track(&generation, &info.lease_id) {
            return Err(ClientError::Unavailable(
                format!(
                "session {session_id} was lost while lease {} was being granted; the lease is gone",
                info.lease_id
            )
                .into(),
            ));
        }
        let mut lease = Lease::new(info, self.session.clone(), generation.clone());
        if let LeaseHandle::Fd(i) = &lease.info.handle {
            if i.retained {
                // A block this process retained: its descriptor and mapping are here.
                if let Some(e) = self.session.retained().take_block(i.block_id) {
                    lease.fd = Some(e.fd);
                    lease.kept = e.mapping;
                    return Ok(lease);
                }
                // Let go meanwhile (past the bound): fetch a descriptor as for any lease.
                match client.lease_fd(&lease.info.lease_id).await {
                    Ok((_, fd)) => lease.fd = Some(fd),
                    Err(e) => {
                        let _ = lease.release().await;
                        return Err(e);
                    }
                }
                return Ok(lease);
            }
            let dialled = self.session.client().dialled_socket();
            let places = crate::fd::candidates(&i.socket_path, dialled);
            if i.pushed {
                // Sent before the reply: already on this process's descriptor channel.
                let key = uuid::Uuid::parse_str(&lease.info.lease_id)
                    .map(|u| *u.as_bytes())
                    .unwrap_or_default();
                let fd = match crate::descriptor_channel::take(&places, &key) {
                    Some(fd) => Ok(fd),
                    // Not there (the channel was lost): a descriptor with a new ticket.
                    None => client
                        .lease_fd(&lease.info.lease_id)
                        .await
                        .map(|(_, fd)| fd),
                };
                match fd {
                    Ok(fd) => lease.fd = Some(fd),
                    Err(e) => {
                        let _ = lease.release().await;
                        return Err(e);
                    }
                }
                return Ok(lease);
            }
            match crate::fd::fetch(&i.socket_path, &i.ticket, dialled).await {
                Ok(fd) => lease.fd = Some(fd),
                Err(e) => {
                    // Nobody can map it: give it back.
                    let _ = lease.release().await;
                    return Err(e);
                }
            }
            // The next grants' descriptors may come with them.
            crate::descriptor_channel::ensure_open(&places).await;
            if let LeaseHandle::Fd(i) = &mut lease.info.handle {
                i.ticket.clear();
            }
        }
        Ok(lease)
    }
}

impl<'s> IntoFuture for LeaseRequest<'s> {
    type Output = Result<Lease, ClientError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 's>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.send())
    }
}

/// Leases are requested through a session; the code lives here so that the session
/// handle (`session.rs`) does not depend on the leases built on it.
impl Session {
    /// Acquires `bytes` with default options (any device, no wait, device memory only).
    pub async fn lease(&self, bytes: u64) -> Result<Lease, ClientError> {
        self.lease_request(bytes).send().await
    }

    /// A lease request to refine: `.device(1).wait(d).label("kv").reclaimable(true)
    /// .fallback_host(true).send().await`.
    pub fn lease_request(&self, bytes: u64) -> LeaseRequest<'_> {
        LeaseRequest::new(self, bytes)
    }
}
