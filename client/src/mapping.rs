//! Mapping a host-memory lease into this process. An fd lease of kind `HOST_MEMFD` (the
//! host backend, host-fallback leases) carries a memfd the broker sized to the lease; a
//! legacy `host_shm` handle of an older broker names a file. [`HostMapping`] maps either
//! read-write, `MAP_SHARED`, so every process mapping the same lease sees the same bytes. The mapping borrows its
//! [`Lease`](crate::Lease), so it cannot outlive it: close the mapping, then release
//! the lease — the order the broker relies on before it scrubs and reuses memory.
//!
//! The bytes are shared with other processes; `&mut [u8]` access is sound only as long
//! as no other process writes the same bytes at the same time (coordinate as you would
//! for any shared memory).

use std::fs::OpenOptions;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};

use memmap2::{MmapMut, MmapOptions};
use std::os::fd::{AsRawFd, BorrowedFd};

use crate::error::ClientError;

/// A read-write `MAP_SHARED` mapping of a lease's shared-memory file; unmapped on drop.
#[derive(Debug)]
pub struct HostMapping<'a> {
    map: MmapMut,
    path: Option<PathBuf>,
    _lease: PhantomData<&'a ()>,
}

impl HostMapping<'static> {
    /// Maps `len` bytes of the file at `path`, starting at `offset`. Fails with
    /// `Protocol` when the file is shorter than `offset + len` (touching pages past its
    /// end would raise `SIGBUS`) and with `Io` when it cannot be opened or mapped.
    pub fn open(path: impl AsRef<Path>, offset: u64, len: u64) -> Result<Self, ClientError> {
        Self::open_bound(path.as_ref(), offset, len)
    }
}

impl<'a> HostMapping<'a> {
    pub(crate) fn open_bound(path: &Path, offset: u64, len: u64) -> Result<Self, ClientError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| {
                ClientError::Io(std::io::Error::new(
                    e.kind(),
                    format!("cannot open {}: {e}", path.display()),
                ))
            })?;
        let file_len = file.metadata()?.len();
        let end = offset.checked_add(len).ok_or_else(|| {
            ClientError::Protocol(format!("lease offset {offset} + size {len} overflows"))
        })?;
        if end > file_len {
            return Err(ClientError::Protocol(format!(
                "shared-memory file {} is {file_len} bytes, the lease needs {end}",
                path.display()
            )));
        }
        let len = usize::try_from(len).map_err(|_| {
            ClientError::Protocol(format!(
                "lease of {len} bytes does not fit this address space"
            ))
        })?;
        // SAFETY: the file is a shared-memory segment created for this lease and sized to
        // cover `offset + len` (checked above). Other processes may map it too; that is
        // its purpose, and the module docs state the resulting aliasing rule.
        let map =
            unsafe { MmapOptions::new().offset(offset).len(len).map_mut(&file) }.map_err(|e| {
                ClientError::Io(std::io::Error::new(
                    e.kind(),
                    format!("cannot map {}: {e}", path.display()),
                ))
            })?;
        Ok(HostMapping {
            map,
            path: Some(path.to_path_buf()),
            _lease: PhantomData,
        })
    }

    /// Maps `len` bytes at `offset` of a memory object given as a descriptor (an fd
    /// lease's memfd). The descriptor may be closed afterwards: the mapping keeps the
    /// memory. Fails with `Protocol` when the object is shorter than `offset + len`.
    pub fn from_fd(fd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<Self, ClientError> {
        let file_len = object_len(fd)?;
        let end = offset.checked_add(len).ok_or_else(|| {
            ClientError::Protocol(format!("lease offset {offset} + size {len} overflows"))
        })?;
        if end > file_len {
            return Err(ClientError::Protocol(format!(
                "the lease's memory object is {file_len} bytes, the lease needs {end}"
            )));
        }
        let len = usize::try_from(len).map_err(|_| {
            ClientError::Protocol(format!(
                "lease of {len} bytes does not fit this address space"
            ))
        })?;
        // SAFETY: the descriptor is the lease's memory object, sized to cover `offset +
        // len` (checked above); sharing it with other mappings is its purpose (module docs).
        let map = unsafe {
            MmapOptions::new()
                .offset(offset)
                .len(len)
                .map_mut(fd.as_raw_fd())
        }?;
        Ok(HostMapping {
            map,
            path: None,
            _lease: PhantomData,
        })
    }

    /// The mapped bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    /// The mapped bytes, writable; writes are visible to every mapping of the file.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }

    /// Start of the mapping, writable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Mapped length in bytes (the lease's granted size).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True for a zero-length mapping.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The shared-memory file behind the mapping (legacy `host_shm` handles and
    /// [`HostMapping::open`]); `None` for a descriptor's mapping.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Flushes writes to the file (`msync`); not needed for other mappings to see them.
    pub fn flush(&self) -> Result<(), ClientError> {
        Ok(self.map.flush()?)
    }
}

impl Deref for HostMapping<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl DerefMut for HostMapping<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// Size of the object behind `fd` (`fstat`).
fn object_len(fd: BorrowedFd<'_>) -> Result<u64, ClientError> {
    // SAFETY: a zeroed stat buffer filled by fstat on a descriptor we borrow.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor and out pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(ClientError::Io(std::io::Error::last_os_error()));
    }
    Ok(u64::try_from(st.st_size).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(len: u64) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lease.shm");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(len).unwrap();
        (dir, path)
    }

    #[test]
    fn two_mappings_share_bytes() {
        let (_dir, path) = temp_file(1 << 20);
        let mut a = HostMapping::open(&path, 0, 1 << 20).unwrap();
        let b = HostMapping::open(&path, 0, 1 << 20).unwrap();
        assert_eq!(a.len(), 1 << 20);
        assert!(b.iter().all(|&x| x == 0));
        a.as_mut_slice()[..5].copy_from_slice(b"hello");
        a[(1 << 20) - 1] = 0xAB;
        assert_eq!(&b.as_slice()[..5], b"hello");
        assert_eq!(b[(1 << 20) - 1], 0xAB);
        a.flush().unwrap();
        drop(a);
        drop(b);
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(&on_disk[..5], b"hello");
    }

    #[test]
    fn offset_mapping_sees_the_right_window() {
        let (_dir, path) = temp_file(3 * 4096);
        let mut whole = HostMapping::open(&path, 0, 3 * 4096).unwrap();
        whole[4096 + 10] = 7;
        whole[2 * 4096 + 1] = 9;
        // Unaligned offsets work too (memmap2 aligns the mapping down internally).
        let window = HostMapping::open(&path, 4096 + 10, 4096).unwrap();
        assert_eq!(window[0], 7);
        assert_eq!(window[4096 - 9], 9);
        assert_eq!(window.path(), Some(path.as_path()));
    }

    #[test]
    fn short_file_is_refused() {
        let (_dir, path) = temp_file(4096);
        let err = HostMapping::open(&path, 0, 8192).unwrap_err();
        assert!(matches!(err, ClientError::Protocol(_)), "{err}");
        let err = HostMapping::open(&path, u64::MAX, 2).unwrap_err();
        assert!(matches!(err, ClientError::Protocol(_)), "{err}");
    }

    #[test]
    fn missing_file_is_io() {
        let dir = tempfile::tempdir().unwrap();
        let err = HostMapping::open(dir.path().join("gone"), 0, 1).unwrap_err();
        assert!(matches!(err, ClientError::Io(_)), "{err}");
        assert!(err.to_string().contains("gone"));
    }
}
