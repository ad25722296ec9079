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
use std::path::PathBuf;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

use gpu_broker_proto::v1 as pb;

use crate::error::ClientError;
pub use crate::fd::{FdInfo, MemoryKind};
use crate::mapping::HostMapping;
use crate::session::Session;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// How to reach a lease's memory.
#[derive(Clone, PartialEq, Eq)]
pub enum LeaseHandle {
    /// Legacy (brokers started with `--legacy-ipc-handles`): the 64-byte
    /// `CUipcMemHandle`: open with `cuIpcOpenMemHandle` (`cuda` feature).
    CudaIpc([u8; 64]),
    /// Legacy (older brokers): a shared-memory file of the lease's size: [`Lease::map`] it.
    HostShm(PathBuf),
    /// A file descriptor from the broker's ticket server (the default): a memfd
    /// ([`Lease::map`]) or CUDA VMM memory (`Lease::map_cuda`, `cuda` feature). The
    /// [`Lease`] fetched it when it was granted.
    Fd(FdInfo),
    /// No handle, or a kind this client does not know yet.
    Unknown,
}

impl LeaseHandle {
    /// `"cuda_ipc"`, `"host_shm"`, `"fd"` or `"unknown"`.
    pub fn kind(&self) -> &'static str {
        match self {
            LeaseHandle::CudaIpc(_) => "cuda_ipc",
            LeaseHandle::HostShm(_) => "host_shm",
            LeaseHandle::Fd(_) => "fd",
            LeaseHandle::Unknown => "unknown",
        }
    }
}

impl fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseHandle::CudaIpc(h) => write!(f, "CudaIpc({})", hex(h)),
            LeaseHandle::HostShm(p) => f.debug_tuple("HostShm").field(p).finish(),
            LeaseHandle::Fd(i) => f.debug_tuple("Fd").field(i).finish(),
            LeaseHandle::Unknown => f.write_str("Unknown"),
        }
    }
}

/// Serialized as `{"cuda_ipc": "<hex>"}`, `{"host_shm": "<path>"}`,
/// `{"fd": {"memory_kind": .., "block_id": .., ..}}` (never the ticket) or `null`.
impl Serialize for LeaseHandle {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            LeaseHandle::CudaIpc(h) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("cuda_ipc", &hex(h))?;
                m.end()
            }
            LeaseHandle::HostShm(p) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("host_shm", p)?;
                m.end()
            }
            LeaseHandle::Fd(i) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("fd", i)?;
                m.end()
            }
            LeaseHandle::Unknown => s.serialize_none(),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl From<Option<pb::lease::Handle>> for LeaseHandle {
    fn from(h: Option<pb::lease::Handle>) -> Self {
        match h {
            Some(pb::lease::Handle::CudaIpc(bytes)) => match <[u8; 64]>::try_from(bytes.as_slice())
            {
                Ok(raw) => LeaseHandle::CudaIpc(raw),
                Err(_) => {
                    tracing::warn!(len = bytes.len(), "cuda_ipc handle is not 64 bytes");
                    LeaseHandle::Unknown
                }
            },
            Some(pb::lease::Handle::HostShm(path)) => LeaseHandle::HostShm(PathBuf::from(path)),
            Some(pb::lease::Handle::Fd(h)) => LeaseHandle::Fd(FdInfo::from(h)),
            None => LeaseHandle::Unknown,
        }
    }
}

/// Where a lease's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Device (GPU) memory, or the host backend's simulated device memory.
    Device,
    /// Host shared memory granted as a fallback.
    Host,
    /// Not set by the broker.
    Unknown,
}

impl Tier {
    /// `"device"`, `"host"` or `"unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Unknown => "unknown",
        }
    }
}

impl From<i32> for Tier {
    fn from(v: i32) -> Self {
        match pb::MemoryTier::try_from(v) {
            Ok(pb::MemoryTier::Device) => Tier::Device,
            Ok(pb::MemoryTier::Host) => Tier::Host,
            _ => Tier::Unknown,
        }
    }
}

/// Where a lease is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Held.
    Active,
    /// The broker asked the holder to give it back before a deadline.
    ReclaimRequested,
    /// Taken away; the memory stays quarantined until the holder lets go of it.
    Revoked,
    /// Not set by the broker.
    Unknown,
}

impl LeaseState {
    /// `"active"`, `"reclaim_requested"`, `"revoked"` or `"unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Active => "active",
            LeaseState::ReclaimRequested => "reclaim_requested",
            LeaseState::Revoked => "revoked",
            LeaseState::Unknown => "unknown",
        }
    }
}

impl From<i32> for LeaseState {
    fn from(v: i32) -> Self {
        match pb::LeaseState::try_from(v) {
            Ok(pb::LeaseState::Active) => LeaseState::Active,
            Ok(pb::LeaseState::ReclaimRequested) => LeaseState::ReclaimRequested,
            Ok(pb::LeaseState::Revoked) => LeaseState::Revoked,
            _ => LeaseState::Unknown,
        }
    }
}

/// Everything the broker reports about a lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaseInfo {
    /// UUID of the lease.
    pub lease_id: String,
    /// Device index.
    pub device: u32,
    /// Granted size (the request rounded up to the allocation granularity).
    pub bytes: u64,
    /// Size asked for.
    pub requested_bytes: u64,
    /// Offset of the lease inside the exported allocation.
    pub offset: u64,
    /// Free-form label given at acquire time.
    pub label: String,
    /// Session holding the lease.
    pub session_id: String,
    /// Tenant holding the lease.
    pub tenant: String,
    /// Life-cycle state.
    pub state: LeaseState,
    /// Device or host memory.
    pub tier: Tier,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: i64,
    /// The holder agreed to give it back on request.
    pub reclaimable: bool,
    /// Deadline of a pending reclaim request, milliseconds since the Unix epoch.
    pub reclaim_deadline_unix_ms: Option<i64>,
    /// Taken beyond the tenant's guarantee.
    pub borrowed: bool,
    /// How to map the memory.
    pub handle: LeaseHandle,
    /// UUID of the device (`GPU-...` / `HOST-...`; empty for host-fallback memory or an
    /// older broker).
    pub device_uuid: String,
}

impl LeaseInfo {
    /// Creation time.
    pub fn created(&self) -> SystemTime {
        unix_ms(self.created_unix_ms)
    }
}

pub(crate) fn unix_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl From<pb::Lease> for LeaseInfo {
    fn from(l: pb::Lease) -> Self {
        LeaseInfo {
            state: LeaseState::from(l.state),
            tier: Tier::from(l.tier),
            handle: LeaseHandle::from(l.handle),
            reclaim_deadline_unix_ms: (l.reclaim_deadline_unix_ms != 0)
                .then_some(l.reclaim_deadline_unix_ms),
            lease_id: l.lease_id,
            device: l.device,
            bytes: l.bytes,
            requested_bytes: l.requested_bytes,
            offset: l.offset,
            label: l.label,
            session_id: l.session_id,
            tenant: l.tenant,
            created_unix_ms: l.created_unix_ms,
            reclaimable: l.reclaimable,
            borrowed: l.borrowed,
            device_uuid: l.device_uuid,
        }
    }
}

/// Memory held by this process. Released by [`Lease::release`], or in the background
/// when dropped. Keeps its session open while it lives.
pub struct Lease {
    info: LeaseInfo,
    session: Session,
    /// The session generation (broker session) it was acquired on.
    generation: usize,
    released: bool,
    /// The descriptor of an fd lease (closed when the lease goes).
    fd: Option<OwnedFd>,
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
    pub(crate) fn new(info: LeaseInfo, session: Session, generation: usize) -> Self {
        Lease {
            info,
            session,
            generation,
            released: false,
            fd: None,
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
        self.session.shared().id_of(self.generation)
    }

    /// True once the broker session the lease was acquired on is lost (reconnecting
    /// sessions only): the memory is gone and the lease cannot be released.
    pub fn is_lost(&self) -> bool {
        !self.session.shared().is_live(self.generation)
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
    /// lease (cached per block while mapped) or opens a legacy `cuda_ipc` handle. A device
    /// pointer in the device's primary context, `bytes()` long. Drop the mapping before releasing the
    /// lease. `NotMappable` for other handles; driver failures are `ClientError::Cuda`.
    /// A lost lease ([`Lease::is_lost`]) fails with [`ClientError::LeaseLost`].
    #[cfg(feature = "cuda")]
    pub fn map_cuda(&self) -> Result<crate::cuda::CudaMapping, ClientError> {
        if self.is_lost() {
            return Err(self.lost_error());
        }
        match &self.info.handle {
            LeaseHandle::CudaIpc(handle) => {
                crate::cuda::map_lease(handle, self.info.device, self.info.bytes)
                    .map_err(|e| ClientError::Cuda(e.to_string()))
            }
            LeaseHandle::Fd(i) if i.memory_kind == MemoryKind::CudaVmm => {
                let fd = self.fd.as_ref().ok_or_else(|| {
                    ClientError::Protocol("fd lease without its descriptor".into())
                })?;
                crate::cuda::map_vmm(
                    fd.as_fd(),
                    self.info.device,
                    self.info.bytes,
                    i.size,
                    i.block_id,
                )
                .map_err(|e| ClientError::Cuda(e.to_string()))
            }
            _ => Err(ClientError::NotMappable),
        }
    }

    /// Gives the memory back now. Close every mapping of it first. A lease whose broker
    /// session was lost fails with [`ClientError::LeaseLost`] and sends nothing.
    pub async fn release(mut self) -> Result<(), ClientError> {
        self.released = true;
        if !self
            .session
            .shared()
            .untrack(self.generation, &self.info.lease_id)
        {
            return Err(self.lost_error());
        }
        self.session
            .client()
            .release_lease(&self.info.lease_id)
            .await
    }

    /// Stops tracking the lease without releasing it: the broker keeps it until it is
    /// released by id ([`crate::Client::release_lease`]), revoked, or the session ends.
    /// A detached lease is not listed in [`crate::SessionEvent::Reconnected`].
    pub fn detach(mut self) -> LeaseInfo {
        self.released = true;
        self.session
            .shared()
            .untrack(self.generation, &self.info.lease_id);
        self.info.clone()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if !self
            .session
            .shared()
            .untrack(self.generation, &self.info.lease_id)
        {
            tracing::debug!(
                lease_id = self.info.lease_id,
                session_id = self.session_id(),
                "dropped lease was lost with its session; nothing to release"
            );
            return;
        }
        let client = self.session.client().clone();
        let session = self.session.clone();
        let lease_id = std::mem::take(&mut self.info.lease_id);
        // The session clone moves into the task: the session outlives the release.
        self.session.spawn(async move {
            if let Err(e) = client.release_lease(&lease_id).await {
                tracing::debug!(lease_id, error = %e, "release of a dropped lease failed");
            }
            drop(session);
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
}

/// What a lease request accepts unless told otherwise: fd handles, and legacy CUDA IPC
/// handles from a broker whose operator enabled them.
const DEFAULT_ACCEPT: [pb::HandleKind; 2] = [pb::HandleKind::Fd, pb::HandleKind::CudaIpc];

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
        }
    }

    /// The handle kinds this worker can use (default: fd and legacy CUDA IPC). A broker
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

    /// The gRPC request this builder sends.
    pub fn to_proto(&self) -> pb::AcquireLeaseRequest {
        pb::AcquireLeaseRequest {
            session_id: self.session.id().to_string(),
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
        }
    }

    /// Sends the request. On a reconnecting session that is between broker sessions it
    /// fails at once with `UNAVAILABLE`; so does a grant that arrives after its session
    /// was lost (the lease died with it).
    pub async fn send(self) -> Result<Lease, ClientError> {
        let mut request = self.to_proto();
        let shared = self.session.shared();
        let (generation, session_id, connected) = shared.snapshot();
        if !connected {
            return Err(ClientError::Unavailable(format!(
                "session {session_id} was lost; reconnecting"
            )));
        }
        request.session_id = session_id.to_string();
        let response = self
            .session
            .client()
            .raw()
            .acquire_lease(request)
            .await?
            .into_inner();
        let lease = response
            .lease
            .ok_or_else(|| ClientError::Protocol("AcquireLease reply carries no lease".into()))?;
        let info = LeaseInfo::from(lease);
        if !shared.track(generation, &info.lease_id) {
            return Err(ClientError::Unavailable(format!(
                "session {session_id} was lost while lease {} was being granted; the lease is gone",
                info.lease_id
            )));
        }
        let mut lease = Lease::new(info, self.session.clone(), generation);
        if let LeaseHandle::Fd(i) = &lease.info.handle {
            let dialled = self.session.client().dialled_socket();
            match crate::fd::fetch(&i.socket_path, &i.ticket, dialled) {
                Ok(fd) => lease.fd = Some(fd),
                Err(e) => {
                    // Nobody can map it: give it back.
                    let _ = lease.release().await;
                    return Err(e);
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn proto_lease(handle: Option<pb::lease::Handle>) -> pb::Lease {
        pb::Lease {
            lease_id: "0b6e".into(),
            device: 1,
            bytes: 4 << 20,
            requested_bytes: 3 << 20,
            state: pb::LeaseState::Active as i32,
            tier: pb::MemoryTier::Host as i32,
            created_unix_ms: 1_700_000_000_000,
            handle,
            ..Default::default()
        }
    }

    #[test]
    fn converts_handles() {
        let ipc = LeaseInfo::from(proto_lease(Some(pb::lease::Handle::CudaIpc(vec![7; 64]))));
        assert_eq!(ipc.handle, LeaseHandle::CudaIpc([7; 64]));
        assert_eq!(ipc.handle.kind(), "cuda_ipc");
        let short = LeaseInfo::from(proto_lease(Some(pb::lease::Handle::CudaIpc(vec![7; 10]))));
        assert_eq!(short.handle, LeaseHandle::Unknown);
        let shm = LeaseInfo::from(proto_lease(Some(pb::lease::Handle::HostShm(
            "/dev/shm/x".into(),
        ))));
        assert_eq!(shm.handle, LeaseHandle::HostShm("/dev/shm/x".into()));
        assert_eq!(
            LeaseInfo::from(proto_lease(None)).handle,
            LeaseHandle::Unknown
        );
    }

    #[test]
    fn converts_fields() {
        let info = LeaseInfo::from(proto_lease(None));
        assert_eq!(info.tier, Tier::Host);
        assert_eq!(info.state, LeaseState::Active);
        assert_eq!(info.reclaim_deadline_unix_ms, None);
        assert_eq!(info.bytes, 4 << 20);
        assert_eq!(
            info.created(),
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_000)
        );
        assert_eq!(Tier::from(0), Tier::Unknown);
        assert_eq!(Tier::from(99), Tier::Unknown);
        assert_eq!(LeaseState::from(3), LeaseState::Revoked);
    }

    #[test]
    fn serializes_to_json() {
        let mut info = LeaseInfo::from(proto_lease(Some(pb::lease::Handle::CudaIpc(vec![
            0xab;
            64
        ]))));
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["tier"], "host");
        assert_eq!(json["state"], "active");
        assert_eq!(json["handle"]["cuda_ipc"], "ab".repeat(64));
        info.handle = LeaseHandle::HostShm("/dev/shm/a".into());
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["handle"]["host_shm"], "/dev/shm/a");
        info.handle = LeaseHandle::Unknown;
        assert!(serde_json::to_value(&info).unwrap()["handle"].is_null());
    }
}
