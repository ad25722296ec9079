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

use crate::device::{MemoryKind, SharedFd};
use crate::id_map::{IdMap, IdSet};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{FromRawFd, OwnedFd};
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
    pub created: SystemTime,
    /// Set once its holder let go (released, or its session ended) while processes that
    /// may map it live: the import ends when they are gone.
    pub lingering: Option<Waiters>,
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
}

/// Processes outside a lease's (or import's) session that redeemed a ticket of it.
pub type Recipients = HashMap<Uuid, BTreeSet<u32>>;

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

/// Why a memory object could not be made read-only.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("the lease's memory cannot be sealed read-only (its holder sealed it): {0}")]
    Seal(std::io::Error),
    #[error("reopening the lease's memory read-only failed: {0}")]
    Reopen(std::io::Error),
    #[error("the lease's memory is {now} bytes, not its {size}: its holder shrank it")]
    Shrunk { size: u64, now: u64 },
}

/// The descriptor importers of a publication get, and whether the OS enforces read-only
/// through it. memfd memory: the object is sealed against writes for every descriptor
/// (`F_SEAL_FUTURE_WRITE | F_SEAL_SHRINK | F_SEAL_SEAL`; sealing twice is fine), it must
/// still be `size` bytes (a holder may shrink a lease's memfd; importers must not map
/// past its end), and importers get an `O_RDONLY` reopen of it. CUDA VMM memory: the
/// exported descriptor itself (not enforced).
pub fn importer_fd(
    kind: MemoryKind,
    fd: &SharedFd,
    size: u64,
) -> Result<(SharedFd, bool), SealError> {
    match kind {
        MemoryKind::CudaVmm => Ok((fd.clone(), false)),
        MemoryKind::HostMemfd => {
            seal_read_only(fd).map_err(SealError::Seal)?;
            let f = std::fs::File::from(fd.0.try_clone().map_err(SealError::Seal)?);
            let now = f.metadata().map_err(SealError::Seal)?.len();
            if now != size {
                return Err(SealError::Shrunk { size, now });
            }
            let ro = reopen_read_only(fd).map_err(SealError::Reopen)?;
            Ok((SharedFd::new(ro), true))
        }
    }
}

/// Seals a memfd against writes through any descriptor from now on (mappings made before
/// keep writing), against shrinking (an importer could reopen it writable and truncate it
/// under the others) and against further seals. Such memory can no longer be revoked by
/// the broker's free (`Device::revoke`).
pub fn seal_read_only(fd: &SharedFd) -> std::io::Result<()> {
    const WANT: libc::c_int = libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own.
    let have = unsafe { libc::fcntl(fd.raw(), libc::F_GET_SEALS) };
    if have < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if have & WANT == WANT {
        return Ok(());
    }
    // SAFETY: fcntl on a descriptor we own.
    if unsafe { libc::fcntl(fd.raw(), libc::F_ADD_SEALS, WANT) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A new `O_RDONLY` open file description of the same object.
fn reopen_read_only(fd: &SharedFd) -> std::io::Result<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.raw()))
        .map_err(std::io::Error::other)?;
    // SAFETY: a valid NUL-terminated path; plain flags.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Are the seals of a host memfd still the ones it was created with (no holder added
/// any)? Only such an object may go back to the cache.
pub fn seals_untouched(fd: &SharedFd) -> bool {
    // SAFETY: fcntl on a descriptor we own.
    let have = unsafe { libc::fcntl(fd.raw(), libc::F_GET_SEALS) };
    have == crate::device::host::CREATION_SEALS
}

/// May a host memfd go back to its tenant's cache: its seals untouched and still `size`
/// bytes? A holder may shrink its own memfd (it is not sealed against that, so that the
/// broker can revoke it); a shrunk one would fault the next lease's mapping.
pub fn untouched(fd: &SharedFd, size: u64) -> bool {
    // SAFETY: fstat of a descriptor we own into a zeroed stat.
    let len = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd.raw(), &mut st) == 0).then_some(st.st_size as u64)
    };
    seals_untouched(fd) && len == Some(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_memfd_its_holder_shrank_is_not_untouched() {
        let len = 2u64 << 20;
        let fd = memfd(len);
        assert!(untouched(&fd, len));
        // SAFETY: ftruncate of a descriptor we own.
        assert_eq!(unsafe { libc::ftruncate(fd.raw(), 4096) }, 0);
        assert!(seals_untouched(&fd), "shrinking adds no seal");
        assert!(
            !untouched(&fd, len),
            "but it is not the size it was made with"
        );
    }

    fn memfd(bytes: u64) -> SharedFd {
        SharedFd::new(crate::device::host::memfd("t", bytes).unwrap())
    }

    fn map(fd: i32, prot: libc::c_int, len: usize) -> *mut libc::c_void {
        // SAFETY: mapping a valid descriptor; the result is checked by the callers.
        unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) }
    }

    #[test]
    fn importers_cannot_write_a_published_memfd_by_any_route() {
        let len = 1 << 20;
        let fd = memfd(len as u64);
        // The publisher maps it before publishing and writes.
        let before = map(fd.raw(), libc::PROT_READ | libc::PROT_WRITE, len);
        assert_ne!(before, libc::MAP_FAILED);
        // SAFETY: `before` maps `len` writable bytes.
        unsafe { std::ptr::write_bytes(before.cast::<u8>(), 7, 16) };
        assert!(seals_untouched(&fd));
        let (ro, enforced) = importer_fd(MemoryKind::HostMemfd, &fd, len as u64).unwrap();
        assert!(enforced);
        assert!(!seals_untouched(&fd));
        // write(2) through the importer's descriptor.
        // SAFETY: plain syscalls on valid descriptors and buffers.
        unsafe {
            assert_eq!(libc::write(ro.raw(), [1u8].as_ptr().cast(), 1), -1);
            // A writable shared mapping.
            assert_eq!(
                map(ro.raw(), libc::PROT_READ | libc::PROT_WRITE, len),
                libc::MAP_FAILED
            );
            // Reopened read-write through /proc: the seal still refuses writes.
            let path = std::ffi::CString::new(format!("/proc/self/fd/{}", ro.raw())).unwrap();
            let rw = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            assert!(rw >= 0, "reopening read-write works; the seal must hold");
            let rw = OwnedFd::from_raw_fd(rw);
            assert_eq!(
                libc::pwrite(rw.as_raw_fd(), [1u8].as_ptr().cast(), 1, 0),
                -1
            );
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EPERM)
            );
            assert_eq!(
                map(rw.as_raw_fd(), libc::PROT_READ | libc::PROT_WRITE, len),
                libc::MAP_FAILED
            );
            // A read-only mapping cannot be made writable.
            let r = map(rw.as_raw_fd(), libc::PROT_READ, len);
            assert_ne!(r, libc::MAP_FAILED);
            assert_ne!(
                libc::mprotect(r, len, libc::PROT_READ | libc::PROT_WRITE),
                0
            );
            // Nor the seals changed, nor the size.
            assert_ne!(
                libc::fcntl(rw.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE),
                0
            );
            assert_ne!(libc::ftruncate(rw.as_raw_fd(), 0), 0);
            // It reads what the publisher wrote, and the publisher's earlier mapping still
            // writes.
            assert_eq!(*r.cast::<u8>(), 7);
            *before.cast::<u8>() = 9;
            assert_eq!(*r.cast::<u8>(), 9);
            libc::munmap(r, len);
            libc::munmap(before, len);
        }
        // Publishing again (after an unpublish) seals nothing new and still works.
        let (again, _) = importer_fd(MemoryKind::HostMemfd, &fd, len as u64).unwrap();
        assert_ne!(again, ro);
    }

    #[test]
    fn a_holder_sealed_memfd_cannot_be_published_and_is_not_pristine() {
        let fd = memfd(4096);
        // SAFETY: fcntl on a valid descriptor.
        assert_eq!(
            unsafe { libc::fcntl(fd.raw(), libc::F_ADD_SEALS, libc::F_SEAL_SEAL) },
            0
        );
        assert!(!seals_untouched(&fd));
        assert!(matches!(
            importer_fd(MemoryKind::HostMemfd, &fd, 4096),
            Err(SealError::Seal(_))
        ));
    }

    /// A holder may shrink its own lease's memfd (so that the broker's free can truncate
    /// it), but such memory is not published: importers would map past its end.
    #[test]
    fn a_memfd_its_holder_shrank_is_not_published() {
        let fd = memfd(1 << 20);
        // SAFETY: ftruncate on a valid descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.raw(), 4096) }, 0);
        assert!(matches!(
            importer_fd(MemoryKind::HostMemfd, &fd, 1 << 20),
            Err(SealError::Shrunk {
                size: 1048576,
                now: 4096
            })
        ));
    }
}
