//! Whether anyone at all still holds a memory file the broker let go of: a memfd lives
//! while any process maps it or holds a descriptor of it, whoever that is (a process the
//! broker recorded, a child that read the descriptor off its parent's connection, one it
//! was passed to). The kernel says so without a look at any process: a file handle taken
//! before the broker closed its descriptor (`name_to_handle_at`) opens again
//! (`open_by_handle_at`) only while the file lives, and fails with `ESTALE` once the last
//! holder let go. Opening by handle takes CAP_DAC_READ_SEARCH; without it the answer is
//! unknown and the broker falls back to looking at the processes it recorded
//! (`memfd_holders.rs`).

use gpu_broker_core::kept::FileHandleRecord;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// Longest file handle asked for (tmpfs's is 12 bytes).
const MAX_HANDLE_BYTES: usize = 64;

/// A memory file's handle: names it, holds nothing of it.
#[derive(Clone, Debug)]
pub struct FileHandle {
    handle_type: i32,
    bytes: Vec<u8>,
}

impl FileHandle {
    /// The handle of the file `fd` is open on; `None` where the filesystem gives none.
    pub fn of(fd: impl AsFd) -> Option<FileHandle> {
        let mut buf = Header::new(MAX_HANDLE_BYTES);
        let mut mount_id = 0;
        // SAFETY: the buffer is a file_handle header with MAX_HANDLE_BYTES after it, as
        // handle_bytes says; the path is empty with AT_EMPTY_PATH (the descriptor itself).
        let r = unsafe {
            libc::name_to_handle_at(
                fd.as_fd().as_raw_fd(),
                c"".as_ptr(),
                buf.as_mut_ptr(),
                &mut mount_id,
                libc::AT_EMPTY_PATH,
            )
        };
        if r != 0 {
            return None;
        }
        let (handle_type, bytes) = buf.parts();
        Some(FileHandle { handle_type, bytes })
    }

    /// As a record keeps it (a restarted broker asks the kernel with it again).
    pub fn record(&self) -> FileHandleRecord {
        FileHandleRecord {
            handle_type: self.handle_type,
            bytes: self.bytes.clone(),
        }
    }

    /// The handle a record kept; `None` for one no filesystem gives (empty, too long).
    pub fn from_record(r: &FileHandleRecord) -> Option<FileHandle> {
        (!r.bytes.is_empty() && r.bytes.len() <= MAX_HANDLE_BYTES).then(|| FileHandle {
            handle_type: r.handle_type,
            bytes: r.bytes.clone(),
        })
    }
}

/// A `struct file_handle` and its bytes, in one buffer of `u32`s (the header's alignment).
struct Header(Vec<u32>);

impl Header {
    fn new(bytes: usize) -> Header {
        let mut v = vec![0u32; 2 + bytes.div_ceil(4)];
        v[0] = bytes as u32;
        Header(v)
    }

    fn of(h: &FileHandle) -> Header {
        let mut buf = Header::new(h.bytes.len());
        buf.0[1] = h.handle_type as u32;
        for (i, b) in h.bytes.iter().enumerate() {
            let word = &mut buf.0[2 + i / 4];
            let mut le = word.to_ne_bytes();
            le[i % 4] = *b;
            *word = u32::from_ne_bytes(le);
        }
        buf
    }

    fn as_mut_ptr(&mut self) -> *mut libc::file_handle {
        self.0.as_mut_ptr().cast()
    }

    fn parts(&self) -> (i32, Vec<u8>) {
        let len = (self.0[0] as usize).min(MAX_HANDLE_BYTES);
        let bytes = self.0[2..]
            .iter()
            .flat_map(|w| w.to_ne_bytes())
            .take(len)
            .collect();
        (self.0[1] as i32, bytes)
    }
}

/// What the kernel said of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alive {
    /// Some process still holds it.
    Yes,
    /// Nobody does: its memory went back.
    No,
    /// The broker may not ask (no CAP_DAC_READ_SEARCH), or the kernel would not say.
    Unknown,
}

/// Asks the kernel whether memory files live. Holds one empty memfd of its own, which
/// names the filesystem every memfd lives on (the kernel's one internal shm mount, so any
/// process's memfd, a previous broker's too, is opened on it); not named `gpu-broker-*`
/// as the memory objects are: it holds no memory.
#[derive(Debug)]
pub struct Prober {
    mount: OwnedFd,
}

impl Prober {
    pub fn new() -> std::io::Result<Prober> {
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kept-memory-probe".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        Ok(Prober {
            mount: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Does the file of `handle` still live? Opening it by handle (a path-only open, closed
    /// at once) succeeds only while some process holds it.
    pub fn alive(&self, handle: &FileHandle) -> Alive {
        match self.open(handle) {
            Ok(_) => Alive::Yes,
            Err(alive) => alive,
        }
    }

    /// The file of `handle`, opened path-only while it lives (a holder while open: the
    /// caller closes it at once); else what the kernel said.
    pub fn open(&self, handle: &FileHandle) -> Result<OwnedFd, Alive> {
        let mut buf = Header::of(handle);
        // SAFETY: a file_handle header and its bytes, as name_to_handle_at made them.
        let fd = unsafe {
            libc::open_by_handle_at(
                self.mount.as_raw_fd(),
                buf.as_mut_ptr(),
                libc::O_PATH | libc::O_CLOEXEC,
            )
        };
        if fd >= 0 {
            // SAFETY: a fresh descriptor we own.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ESTALE) => Err(Alive::No),
            _ => Err(Alive::Unknown),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> OwnedFd {
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"alive-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 1 << 16) }, 0);
        fd
    }

    fn may_ask() -> bool {
        // SAFETY: geteuid cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    /// A memfd lives while a descriptor or a mapping of it is held, and is gone once
    /// neither is; the probe's own open does not keep it.
    #[test]
    fn a_memfd_lives_while_held_and_not_after() {
        let prober = Prober::new().unwrap();
        let fd = memfd();
        let handle = FileHandle::of(&fd).expect("memfds have handles");
        if !may_ask() {
            assert_eq!(prober.alive(&handle), Alive::Unknown);
            return;
        }
        assert_eq!(prober.alive(&handle), Alive::Yes, "a descriptor");
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
        assert_eq!(prober.alive(&handle), Alive::Yes, "a mapping alone");
        assert_eq!(prober.alive(&handle), Alive::Yes, "still, after a probe");
        // SAFETY: unmapping what was mapped above.
        unsafe { libc::munmap(at, 1 << 16) };
        assert_eq!(prober.alive(&handle), Alive::No, "let go of");
        // Another memfd made now is not the one let go of.
        let other = memfd();
        assert_eq!(prober.alive(&handle), Alive::No);
        assert_eq!(prober.alive(&FileHandle::of(&other).unwrap()), Alive::Yes);
    }
}
