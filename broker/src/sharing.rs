//! Read-only descriptors for shared leases: sealing a memfd against writes and reopening
//! it `O_RDONLY` for importers, and the look at a memfd's seals and size before it may go
//! back to a cache. The table of publications and imports is the core's
//! (`gpu_broker_core::sharing`, re-exported here).

pub use gpu_broker_core::sharing::*;

use crate::device::{MemoryKind, SharedFd};
use std::os::fd::{FromRawFd, OwnedFd};

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
