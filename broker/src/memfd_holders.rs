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

/// A memory file as the broker looks for it after letting go of it: its id, which
/// processes' entries show, and its handle, by which the kernel says whether anyone at
/// all still holds it (`memfd_alive.rs`; `None` where the filesystem gives none).
#[derive(Clone, Debug)]
pub struct MemFile {
    pub id: FileId,
    pub handle: Option<crate::memfd_alive::FileHandle>,
}

impl MemFile {
    /// The file `fd` is open on.
    pub fn of(fd: impl AsFd) -> std::io::Result<MemFile> {
        Ok(MemFile {
            id: FileId::of(fd.as_fd())?,
            handle: crate::memfd_alive::FileHandle::of(fd),
        })
    }
}

/// How long one process's entries may be read: a holder with a huge descriptor table or
/// address space could otherwise hold the device thread for seconds at each free. A
/// process not read through by then counts as holding (its tenant keeps the charge).
const READ_DEADLINE: std::time::Duration = std::time::Duration::from_millis(50);

/// What a look at some processes found of a file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holders {
    /// Those that map it or hold a descriptor of it.
    pub holding: Vec<u32>,
    /// Those not read through (past [`READ_DEADLINE`] or [`MAX_MAPS_BYTES`]): they may
    /// hold it; looked at again later.
    pub unknown: Vec<u32>,
}

/// Which of `pids` map `file` or hold a descriptor of it, and which could not be read
/// through. A process gone, or one whose `/proc` entries cannot be read, does not hold
/// it as far as anyone can tell (a warning says when the broker cannot read them: the
/// check is then blind).
pub fn holding(file: FileId, pids: &[u32]) -> Holders {
    holding_within(file, pids, READ_DEADLINE)
}

/// [`holding`] with each process's entries read for at most `deadline`.
fn holding_within(file: FileId, pids: &[u32], deadline: std::time::Duration) -> Holders {
    let mut found = Holders::default();
    for &pid in pids {
        let until = std::time::Instant::now() + deadline;
        match (maps(file, pid, until), has_fd(file, pid, until)) {
            (Held::Yes, _) | (_, Held::Yes) => found.holding.push(pid),
            (Held::Unknown, _) | (_, Held::Unknown) => found.unknown.push(pid),
            (Held::No, Held::No) => {}
        }
    }
    found
}

/// What a process's entries say of a file.
#[derive(Debug, PartialEq, Eq)]
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
            warn_blind(pid);
            None
        }
        Err(_) => None,
    }
}

/// Most bytes of a process's `/proc/PID/maps` read (about 200,000 mappings): the kernel
/// makes the text as it is read, so a process with millions of mappings could otherwise
/// hold the reader for seconds and its memory for the text. One not read through by then
/// counts as unknown (holding; looked at again later).
const MAX_MAPS_BYTES: usize = 16 << 20;

/// Does `pid` map `file`?
fn maps(file: FileId, pid: u32, until: std::time::Instant) -> Held {
    let opened = std::fs::File::open(format!("/proc/{pid}/maps"));
    if let Err(e) = &opened {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            warn_blind(pid);
        }
    }
    let Ok(source) = opened else {
        return Held::No;
    };
    maps_in(file, source, until, MAX_MAPS_BYTES)
}

/// Does the `/proc/PID/maps` text `source` show a mapping of `file`? Read a chunk at a
/// time (the kernel makes one chunk per read), at most `max_bytes` and until `until`:
/// past either the answer is unknown. A read error is "no" (the process went away).
fn maps_in(
    file: FileId,
    mut source: impl std::io::Read,
    until: std::time::Instant,
    max_bytes: usize,
) -> Held {
    const CHUNK: usize = 64 << 10;
    let mut buf = vec![0u8; CHUNK];
    // Bytes of a line cut by the chunk's end, kept for the next chunk.
    let mut carried = 0;
    // Inside a line longer than a chunk (a path of thousands of bytes: not a memfd's,
    // whose name is short), skipped to its end.
    let mut skipping = false;
    let mut read = 0usize;
    loop {
        if read >= max_bytes || std::time::Instant::now() > until {
            return Held::Unknown;
        }
        let n = match source.read(&mut buf[carried..]) {
            Ok(0) => return Held::No,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // The process is gone; any other error says nothing about what it maps.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Held::No,
            Err(_) => return Held::Unknown,
        };
        read += n;
        let filled = carried + n;
        let mut start = 0;
        while let Some(end) = buf[start..filled].iter().position(|&b| b == b'\n') {
            let line = &buf[start..start + end];
            start += end + 1;
            if std::mem::take(&mut skipping) {
                continue;
            }
            if maps_line(line).is_some_and(|(dev, ino)| file.is_mapping(dev, ino)) {
                return Held::Yes;
            }
        }
        if start == 0 && filled == buf.len() {
            skipping = true;
            carried = 0;
        } else {
            buf.copy_within(start..filled, 0);
            carried = filled - start;
        }
    }
}

/// The device `(major, minor)` and inode of a `/proc/PID/maps` line
/// (`start-end perms offset MM:mm inode [path]`, device numbers in hex).
fn maps_line(line: &[u8]) -> Option<((i32, i32), u64)> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty()).skip(3);
    let dev = std::str::from_utf8(fields.next()?).ok()?;
    let ino = std::str::from_utf8(fields.next()?).ok()?;
    let (major, minor) = dev.split_once(':')?;
    let dev = (
        i32::from_str_radix(major, 16).ok()?,
        i32::from_str_radix(minor, 16).ok()?,
    );
    Some((dev, ino.parse().ok()?))
}

fn warn_blind(pid: u32) {
    tracing::warn!(pid, "cannot read the process's /proc entries (the broker needs CAP_SYS_PTRACE): a memfd it keeps is not seen");
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
    use std::time::Duration;

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
        // The test binary's own maps and descriptor table are large and read under a
        // loaded machine: a deadline that cannot pass, so only the answer is tested here.
        let holding = |file, pids: &[u32]| holding_within(file, pids, Duration::from_secs(60));
        let held = |pids: &[u32]| holding(file, pids).holding;
        assert_eq!(held(&[me]), vec![me], "a descriptor");
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
        assert_eq!(held(&[me]), vec![me], "a mapping alone");
        // SAFETY: unmapping what was mapped above.
        unsafe { libc::munmap(at, 1 << 16) };
        assert_eq!(holding(file, &[me]), Holders::default(), "let go of");
        // Another file is not this one; a pid that names no process holds nothing.
        let other = memfd();
        assert_eq!(
            holding(FileId::of(&other).unwrap(), &[u32::MAX]),
            Holders::default()
        );
    }

    /// A maps text that never ends (a process with millions of mappings).
    struct Endless(&'static [u8], usize);
    impl std::io::Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let mut n = 0;
            while n < buf.len() {
                buf[n] = self.0[self.1 % self.0.len()];
                self.1 += 1;
                n += 1;
            }
            Ok(n)
        }
    }

    const FILE: FileId = FileId {
        dev: (0x1 << 8) | 0x2f,
        ino: 4242,
    };
    const LINE: &[u8] =
        b"7f0000000000-7f0000200000 rw-s 00000000 00:01 99 /memfd:other (deleted)\n";
    const HIT: &[u8] =
        b"7f0000200000-7f0000400000 rw-s 00000000 01:2f 4242   /memfd:lease (deleted)\n";

    fn far() -> std::time::Instant {
        std::time::Instant::now() + std::time::Duration::from_secs(60)
    }

    /// A mapping of the file is found wherever its line falls against the reads' chunks;
    /// other files' lines are not it.
    #[test]
    fn a_maps_text_is_read_line_by_line_across_chunks() {
        let mut text = LINE.repeat(2000);
        text.extend_from_slice(HIT);
        text.extend_from_slice(&LINE.repeat(10));
        assert_eq!(maps_in(FILE, &text[..], far(), usize::MAX), Held::Yes);
        let miss = LINE.repeat(3000);
        assert_eq!(maps_in(FILE, &miss[..], far(), usize::MAX), Held::No);
        assert_eq!(maps_line(HIT), Some(((1, 0x2f), 4242)));
    }

    /// The read of a process's maps is bounded: a text that never ends is given up after
    /// the byte bound (or the deadline) and answers "unknown", not "no" and not never.
    #[test]
    fn an_endless_maps_text_is_unknown_after_the_bound() {
        let started = std::time::Instant::now();
        assert_eq!(
            maps_in(FILE, Endless(LINE, 0), far(), 4 << 20),
            Held::Unknown
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
        // The deadline bounds it too.
        assert_eq!(
            maps_in(
                FILE,
                Endless(LINE, 0),
                std::time::Instant::now(),
                usize::MAX
            ),
            Held::Unknown
        );
        // The shipped bound is what the kernel makes for some 200,000 mappings.
        assert!(MAX_MAPS_BYTES / LINE.len() > 150_000);
    }

    /// A line longer than a read's chunk (a long path) is skipped to its end: its tail
    /// cannot pass for a mapping of the file.
    #[test]
    fn the_tail_of_an_overlong_line_is_not_read_as_a_mapping() {
        let mut text = b"7f0000000000-7f0000200000 r--p 00000000 08:01 5 /".to_vec();
        text.extend_from_slice(&vec![b'a'; 70_000]);
        // What would match, were it a line of its own.
        text.extend_from_slice(b" x x x 01:2f 4242\n");
        text.extend_from_slice(LINE);
        assert_eq!(maps_in(FILE, &text[..], far(), usize::MAX), Held::No);
        text.extend_from_slice(HIT);
        assert_eq!(maps_in(FILE, &text[..], far(), usize::MAX), Held::Yes);
    }
}
