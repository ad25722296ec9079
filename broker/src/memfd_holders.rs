//! Which processes still hold a memory file: a mapping of it (`/proc/PID/maps`) or a
//! descriptor of it (`/proc/PID/fd`). The broker asks this after freeing a memfd it could
//! not revoke (sealed against shrinking: by a publication, or by its holder), of the
//! processes its descriptor reached: the memory then lives on with them, and is charged
//! to a tenant until they exit (`core/src/state/stranded.rs`). A file is named by its
//! device and inode, as `fstat` gives them; nothing else can open a memfd, so a process
//! that shows it was handed it (or is a child of one that was).

use std::os::fd::{AsFd, AsRawFd};

/// A file as the kernel names it: its device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    /// The file `fd` is open on.
    pub fn of(fd: impl AsFd) -> std::io::Result<FileId> {
        // SAFETY: a zeroed stat is a valid buffer for fstat to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor borrowed for the call.
        if unsafe { libc::fstat(fd.as_fd().as_raw_fd(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(FileId {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }

    /// Is a mapping of `(major, minor)` and `inode` (a `/proc/PID/maps` line) this file?
    fn is_mapping(&self, dev: (i32, i32), inode: u64) -> bool {
        let (major, minor) = dev;
        inode == self.ino
            && u64::from(libc::major(self.dev)) == major as u64
            && u64::from(libc::minor(self.dev)) == minor as u64
    }
}

/// How long one process's entries may be read: a holder with a huge descriptor table or
/// address space could otherwise hold the device thread for seconds at each free. A
/// process not read through by then counts as holding (its tenant keeps the charge).
const READ_DEADLINE: std::time::Duration = std::time::Duration::from_millis(50);

/// Those of `pids` that map `file` or hold a descriptor of it. A process gone, or one
/// whose `/proc` entries cannot be read, does not hold it as far as anyone can tell (a
/// warning says when the broker cannot read them: the check is then blind).
pub fn holding(file: FileId, pids: &[u32]) -> Vec<u32> {
    pids.iter()
        .copied()
        .filter(|&pid| {
            let until = std::time::Instant::now() + READ_DEADLINE;
            !matches!(maps(file, pid, until), Held::No)
                || !matches!(has_fd(file, pid, until), Held::No)
        })
        .collect()
}

/// What a process's entries say of a file.
enum Held {
    No,
    Yes,
    /// Not read through before the deadline.
    Unknown,
}

/// What a `/proc` read gave, or none (the process gone, or its entries unreadable: said,
/// since the check is then blind).
fn readable<T>(pid: u32, read: procfs::ProcResult<T>) -> Option<T> {
    match read {
        Ok(t) => Some(t),
        Err(procfs::ProcError::PermissionDenied(_)) => {
            tracing::warn!(pid, "cannot read the process's /proc entries (the broker needs CAP_SYS_PTRACE): a memfd it keeps is not seen");
            None
        }
        Err(_) => None,
    }
}

/// Does `pid` map `file`?
fn maps(file: FileId, pid: u32, until: std::time::Instant) -> Held {
    let p = procfs::process::Process::new(pid as i32);
    let Some(maps) = readable(pid, p.and_then(|p| p.maps())) else {
        return Held::No;
    };
    for m in maps {
        if file.is_mapping(m.dev, m.inode) {
            return Held::Yes;
        }
        if std::time::Instant::now() > until {
            return Held::Unknown;
        }
    }
    Held::No
}

/// Does `pid` hold a descriptor of `file`? Only memfds are looked at (by `fstat` through
/// the link): a `stat` of any other target would ask its filesystem, which a holder can
/// make hang (FUSE, a dead NFS server).
fn has_fd(file: FileId, pid: u32, until: std::time::Instant) -> Held {
    use procfs::process::FDTarget;
    let p = procfs::process::Process::new(pid as i32);
    let Some(fds) = readable(pid, p.and_then(|p| p.fd())) else {
        return Held::No;
    };
    for f in fds.flatten() {
        if std::time::Instant::now() > until {
            return Held::Unknown;
        }
        let memfd = match &f.target {
            FDTarget::Path(path) => path.as_os_str().as_encoded_bytes().starts_with(b"/memfd:"),
            FDTarget::MemFD(_) => true,
            _ => false,
        };
        if !memfd {
            continue;
        }
        use std::os::unix::fs::MetadataExt;
        if std::fs::metadata(format!("/proc/{pid}/fd/{}", f.fd))
            .is_ok_and(|m| m.dev() == file.dev && m.ino() == file.ino)
        {
            return Held::Yes;
        }
    }
    Held::No
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> std::os::fd::OwnedFd {
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"holders-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 1 << 16) }, 0);
        fd
    }

    /// A process holding a memfd's descriptor, or only a mapping of it, is found; one
    /// that let go of both is not.
    #[test]
    fn a_descriptor_or_a_mapping_is_found_and_nothing_else() {
        let me = std::process::id();
        let fd = memfd();
        let file = FileId::of(&fd).unwrap();
        assert_eq!(holding(file, &[me]), vec![me], "a descriptor");
        // SAFETY: a shared mapping of our own memfd, unmapped below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                1 << 16,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        drop(fd);
        assert_eq!(holding(file, &[me]), vec![me], "a mapping alone");
        // SAFETY: unmapping what was mapped above.
        unsafe { libc::munmap(at, 1 << 16) };
        assert!(holding(file, &[me]).is_empty(), "let go of");
        // Another file is not this one; a pid that names no process holds nothing.
        let other = memfd();
        assert!(holding(FileId::of(&other).unwrap(), &[u32::MAX]).is_empty());
    }
}
