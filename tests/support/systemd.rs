//! A stand-in for systemd's side of a `Type=notify` unit with a file-descriptor store: a
//! Unix datagram notify socket that reads the broker's messages with their `SCM_RIGHTS`
//! descriptors, keeps those sent with `FDSTORE=1` under their `FDNAME` (one copy of a
//! file, as systemd), drops a name on `FDSTOREREMOVE=1`, and hands the store to the next
//! start at descriptors 3.. with `LISTEN_FDS`, `LISTEN_FDNAMES` and `LISTEN_PID` (the
//! child's own pid) — see [`crate::Broker::start_under`].

use anyhow::{bail, Result};
use parking_lot::Mutex;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the fake manager holds and saw.
#[derive(Default)]
struct Seen {
    store: Vec<(String, OwnedFd)>,
    /// Every message's text, in order.
    messages: Vec<String>,
    /// The last sync mark read back.
    synced: u64,
}

/// The fake manager; its reader thread stops when it is dropped.
pub struct FakeSystemd {
    pub socket: PathBuf,
    /// `$FDSTORE` (`FileDescriptorStoreMax=`).
    pub capacity: usize,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    marks: Mutex<u64>,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for FakeSystemd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FakeSystemd({})", self.socket.display())
    }
}

/// Receives one datagram and its descriptors (close-on-exec).
fn recv(sock: &UnixDatagram) -> io::Result<(String, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; 64 << 10];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(16 * std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: a zeroed msghdr; every pointer set below outlives the recvmsg call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_control = control.as_mut_ptr().cast();
    m.msg_controllen = space as _;
    // SAFETY: a valid socket and message buffers.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut m, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `control`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&m);
        while !c.is_null() {
            if ((*c).cmsg_level, (*c).cmsg_type) == (libc::SOL_SOCKET, libc::SCM_RIGHTS) {
                let data = libc::CMSG_DATA(c);
                let len = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&m, c);
        }
    }
    Ok((
        String::from_utf8_lossy(&buf[..n as usize]).into_owned(),
        fds,
    ))
}

fn same_file(a: &OwnedFd, b: &OwnedFd) -> bool {
    let st = |fd: &OwnedFd| {
        // SAFETY: an all-zero stat is valid; fstat fills it.
        let mut s: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and out pointer.
        (unsafe { libc::fstat(fd.as_raw_fd(), &mut s) } == 0).then_some((s.st_dev, s.st_ino))
    };
    st(a).is_some() && st(a) == st(b)
}

impl Seen {
    /// Applies one message as systemd does.
    fn apply(&mut self, text: String, fds: Vec<OwnedFd>) {
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
                .map(str::to_string)
        };
        if let Some(mark) = field("X_SYNC") {
            self.synced = mark.parse().unwrap_or(0);
            return;
        }
        let name = field("FDNAME").unwrap_or_else(|| "stored".into());
        if field("FDSTORE").as_deref() == Some("1") {
            for fd in fds {
                if !self.store.iter().any(|(_, s)| same_file(s, &fd)) {
                    self.store.push((name.clone(), fd));
                }
            }
        } else if field("FDSTOREREMOVE").as_deref() == Some("1") {
            self.store.retain(|(n, _)| *n != name);
        }
        self.messages.push(text);
    }
}

impl FakeSystemd {
    /// A fake manager whose store takes `capacity` descriptors.
    pub fn start(capacity: usize) -> Result<Arc<FakeSystemd>> {
        let dir = tempfile::Builder::new().prefix("gpb-systemd-").tempdir()?;
        let socket = dir.path().join("notify.sock");
        let sock = UnixDatagram::bind(&socket)?;
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (seen, stop) = (seen.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match recv(&sock) {
                        Ok((text, fds)) => seen.lock().apply(text, fds),
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock
                                    | io::ErrorKind::TimedOut
                                    | io::ErrorKind::Interrupted
                            ) => {}
                        Err(e) => panic!("fake systemd: {e}"),
                    }
                }
            });
        }
        Ok(Arc::new(FakeSystemd {
            socket,
            capacity,
            seen,
            stop,
            marks: Mutex::new(0),
            _dir: dir,
        }))
    }

    /// Waits until every message sent so far has been applied (as systemd reads the
    /// notify socket before it handles the process's exit).
    pub fn sync(&self) -> Result<()> {
        let mark = {
            let mut m = self.marks.lock();
            *m += 1;
            *m
        };
        let s = UnixDatagram::unbound()?;
        s.send_to(format!("X_SYNC={mark}\n").as_bytes(), &self.socket)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.seen.lock().synced < mark {
            if Instant::now() > deadline {
                bail!("the fake systemd did not read its socket");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// The names in the store, in the order stored (after a [`FakeSystemd::sync`]).
    pub fn names(&self) -> Vec<String> {
        let _ = self.sync();
        let seen = self.seen.lock();
        seen.store.iter().map(|(n, _)| n.clone()).collect()
    }

    /// How many lease memory objects (memfds of the broker's blocks) the store holds.
    pub fn memfds(&self) -> usize {
        let _ = self.sync();
        let seen = self.seen.lock();
        seen.store
            .iter()
            .filter(|(_, fd)| {
                std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                    .is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:gpu-broker"))
            })
            .count()
    }

    /// Every message read so far.
    pub fn messages(&self) -> Vec<String> {
        let _ = self.sync();
        self.seen.lock().messages.clone()
    }

    /// Copies of the stored descriptors (close-on-exec, numbered above 3 + their count so
    /// that placing them at 3.. in a child never overwrites one not yet placed), with
    /// their names.
    pub fn handed(&self) -> Result<Vec<(String, OwnedFd)>> {
        self.sync()?;
        let seen = self.seen.lock();
        let floor = 3 + seen.store.len() as i32;
        seen.store
            .iter()
            .map(|(n, fd)| {
                // SAFETY: dups a descriptor the store owns.
                let raw = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, floor) };
                if raw < 0 {
                    bail!("dup: {}", io::Error::last_os_error());
                }
                // SAFETY: a fresh descriptor nobody else owns.
                Ok((n.clone(), unsafe { OwnedFd::from_raw_fd(raw) }))
            })
            .collect()
    }

    /// Sets up `cmd` (a `gpu-broker`) as systemd starts the unit: the notify socket, the
    /// store's size, and the store at descriptors 3.. with their names; `LISTEN_PID` is
    /// the child's own (set by a `sh` that then becomes the broker). Returns the copies
    /// that must stay open until the child is spawned.
    pub fn prepare(
        &self,
        broker: &std::path::Path,
        args: &[String],
    ) -> Result<(std::process::Command, Vec<OwnedFd>)> {
        use std::os::unix::process::CommandExt;
        let handed = self.handed()?;
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c")
            .arg(r#"LISTEN_PID=$$; export LISTEN_PID; exec "$0" "$@""#)
            .arg(broker)
            .args(args)
            .env("NOTIFY_SOCKET", &self.socket)
            .env("FDSTORE", self.capacity.to_string())
            .env_remove("LISTEN_PID")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_FDNAMES");
        if !handed.is_empty() {
            let names: Vec<&str> = handed.iter().map(|(n, _)| n.as_str()).collect();
            cmd.env("LISTEN_FDS", handed.len().to_string())
                .env("LISTEN_FDNAMES", names.join(":"));
        }
        let raws: Vec<RawFd> = handed.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        // SAFETY: only dup2 between fork and exec (async-signal-safe); every source is
        // numbered above every target.
        unsafe {
            cmd.pre_exec(move || {
                for (i, raw) in raws.iter().enumerate() {
                    if libc::dup2(*raw, 3 + i as i32) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok((cmd, handed.into_iter().map(|(_, fd)| fd).collect()))
    }
}

impl Drop for FakeSystemd {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
