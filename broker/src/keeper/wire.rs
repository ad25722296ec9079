//! The keeper's socket: a Unix `SOCK_SEQPACKET` socket (message boundaries kept, each
//! message with at most one descriptor attached in `SCM_RIGHTS`, but for a dump's
//! [`Message::Entries`], up to [`MAX_BATCH`]), and the JSON messages that cross it. A message written before its writer dies is still read by the peer
//! (the kernel queues it at the receiver), so what the broker wrote before a SIGKILL
//! reaches the keeper.

use rustix::net::sockopt::Timeout;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use serde::{Deserialize, Serialize};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// The largest message either side sends or accepts.
pub const MAX_MESSAGE: usize = 64 << 10;

/// The most entries (and descriptors: the kernel passes at most 253 per message) in one
/// [`Message::Entries`].
pub const MAX_BATCH: usize = 250;

/// One record of a dump's [`Message::Entries`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchEntry {
    pub key: String,
    pub record: serde_json::Value,
    pub has_fd: bool,
}

/// One message between the broker and the keeper.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Message {
    /// Broker to keeper: keep `record` under `key` (with the descriptor sent along, if
    /// any), replacing what was kept under it.
    Put {
        key: String,
        record: serde_json::Value,
    },
    /// Broker to keeper: drop what is kept under `key` (its descriptor closes).
    Remove { key: String },
    /// Broker to keeper: send everything kept ([`Message::Entry`] each, or with `batch`
    /// [`Message::Entries`] of up to that many, then [`Message::End`]); the keeper keeps
    /// its own copies. A keeper that knows no `batch` (an earlier version) reads this as
    /// a plain dump and answers entry by entry.
    Dump {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        batch: Option<u32>,
    },
    /// Keeper to broker: one kept record (its descriptor attached, if it has one).
    Entry {
        key: String,
        record: serde_json::Value,
        has_fd: bool,
    },
    /// Keeper to broker: kept records, the descriptors of those with `has_fd` attached
    /// in their order (a dump asked for with `batch`: thousands of records cross in a few
    /// dozen messages instead of one each).
    Entries { entries: Vec<BatchEntry> },
    /// Keeper to broker: the dump is complete.
    End { count: u64 },
    /// Broker to keeper: the broker gave up on this keeper (a write missed its deadline)
    /// and no longer tells it anything: drop every record and descriptor, which would
    /// otherwise go stale (blocks freed since would stay allocated).
    Forget,
}

fn sockaddr(path: &Path) -> io::Result<SocketAddrUnix> {
    SocketAddrUnix::new(path).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {}: {e}", path.display()),
        )
    })
}

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Connects to the keeper listening at `path` (blocking while its backlog is full).
pub fn connect(path: &Path) -> io::Result<OwnedFd> {
    let addr = sockaddr(path)?;
    loop {
        // A Unix socket whose connect a signal cut is left unconnected: a new one asks again.
        let sock = seqpacket()?;
        match rustix::net::connect(&sock, &addr) {
            Ok(()) => return Ok(sock),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Binds and listens at `path` (a stale socket file nobody answers on is replaced; a
/// live one is refused), readable and writable by the owner only.
pub fn bind(path: &Path) -> io::Result<OwnedFd> {
    if path.exists() {
        if connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("a keeper already listens on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let sock = seqpacket()?;
    rustix::net::bind(&sock, &sockaddr(path)?)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    rustix::net::listen(&sock, 4)?;
    Ok(sock)
}

/// Accepts one connection (blocking).
pub fn accept(listener: &OwnedFd) -> io::Result<OwnedFd> {
    loop {
        match rustix::net::accept_with(listener, SocketFlags::CLOEXEC) {
            Ok(conn) => return Ok(conn),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// The uid of the process at the other end (`SO_PEERCRED`). Read with libc, not
/// `rustix::net::sockopt::socket_peercred`: rustix's `UCred` holds a non-zero pid, and the
/// kernel says pid 0 of a peer outside this process's pid namespace.
pub fn peer_uid(sock: &OwnedFd) -> io::Result<u32> {
    // SAFETY: an all-zero ucred is valid.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: valid out pointers of the right size.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Sets how long a receive may wait (`None`: forever).
pub fn set_receive_timeout(sock: &OwnedFd, t: Option<std::time::Duration>) -> io::Result<()> {
    set_timeout(sock, Timeout::Recv, t)
}

/// Bounds how long a send may wait for room in the peer's queue (`None`: forever); past
/// it the send fails with `WouldBlock` and sends nothing (a message goes whole or not).
pub fn set_send_timeout(sock: &OwnedFd, t: Option<std::time::Duration>) -> io::Result<()> {
    set_timeout(sock, Timeout::Send, t)
}

fn set_timeout(sock: &OwnedFd, which: Timeout, t: Option<std::time::Duration>) -> io::Result<()> {
    // A zero wait means forever to the kernel (rustix refuses it): said as `None`.
    let t = t.filter(|t| !t.is_zero());
    Ok(rustix::net::sockopt::set_socket_timeout(sock, which, t)?)
}

/// Sends `msg` with `fd` attached (if any), whole or not at all.
pub fn send(sock: &OwnedFd, msg: &Message, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let payload = serde_json::to_vec(msg).map_err(io::Error::other)?;
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    send_raw(sock, &payload, &fds)
}

/// Sends the JSON message `payload` with `fds` attached (at most [`MAX_BATCH`]).
pub fn send_raw(sock: &OwnedFd, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_BATCH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} descriptors on one keeper message", fds.len()),
        ));
    }
    if payload.len() > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("keeper message of {} bytes", payload.len()),
        ));
    }
    // A kept change (one descriptor at most, written under the state lock) allocates
    // nothing; a dump's batch does.
    let mut one = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut many;
    let space: &mut [MaybeUninit<u8>] = if fds.len() <= 1 {
        &mut one
    } else {
        many = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
        &mut many
    };
    let mut control = SendAncillaryBuffer::new(space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other(
            "no room for a keeper message's descriptors",
        ));
    }
    let iov = [io::IoSlice::new(payload)];
    loop {
        match rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(n) if n == payload.len() => return Ok(()),
            Ok(_) => return Err(io::Error::other("short keeper message")),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives one message and the descriptor attached to it; `None` at the end of the
/// connection. A message that does not parse, or was cut, is an `InvalidData` error
/// (its descriptors are closed).
pub fn recv(sock: &OwnedFd) -> io::Result<Option<(Message, Option<OwnedFd>)>> {
    recv_into(sock, &mut Vec::new())
}

/// [`recv`] into `buf`, which is kept for the next message (a dump of thousands of
/// messages allocates and zeroes the largest message's room once, not each time).
pub fn recv_into(
    sock: &OwnedFd,
    buf: &mut Vec<u8>,
) -> io::Result<Option<(Message, Option<OwnedFd>)>> {
    match recv_many(sock, buf)? {
        None => Ok(None),
        Some((msg, mut fds)) => {
            if fds.len() > 1 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} descriptors on one message", fds.len()),
                ));
            }
            Ok(Some((msg, fds.pop())))
        }
    }
}

/// [`recv_into`] of a message that may carry up to [`MAX_BATCH`] descriptors (a dump's
/// [`Message::Entries`]), in the order they were attached.
pub fn recv_many(sock: &OwnedFd, buf: &mut Vec<u8>) -> io::Result<Option<(Message, Vec<OwnedFd>)>> {
    buf.resize(MAX_MESSAGE, 0);
    // Room for a batch's descriptors (the kernel passes at most 253): more than the
    // message may carry are refused below, but all are closed.
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_BATCH + 8))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        let mut iov = [io::IoSliceMut::new(buf)];
        match rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(got) => break got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let n = got.bytes;
    let fds: Vec<OwnedFd> = control
        .drain()
        .flat_map(|m| match m {
            RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
            _ => Vec::new(),
        })
        .collect();
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    // Dropping `fds` on the way out closes what arrived.
    if got
        .flags
        .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
    {
        return Err(bad("a keeper message was cut".into()));
    }
    if fds.len() > MAX_BATCH {
        return Err(bad(format!("{} descriptors on one message", fds.len())));
    }
    let msg: Message =
        serde_json::from_slice(&buf[..n]).map_err(|e| bad(format!("keeper message: {e}")))?;
    Ok(Some((msg, fds)))
}

/// Builds a dump's [`Message::Entries`] messages: entries are added until the next would
/// not fit in [`MAX_MESSAGE`] or [`MAX_BATCH`] is reached; then the message is sent.
pub struct BatchWriter<'a> {
    sock: &'a OwnedFd,
    most: usize,
    /// The message so far: `{"op":"entries","entries":[e1,e2`.
    payload: Vec<u8>,
    count: usize,
    fds: Vec<BorrowedFd<'a>>,
}

const BATCH_HEAD: &[u8] = br#"{"op":"entries","entries":["#;
const BATCH_TAIL: &[u8] = b"]}";

impl<'a> BatchWriter<'a> {
    /// Batches of at most `most` entries (at most [`MAX_BATCH`]).
    pub fn new(sock: &'a OwnedFd, most: usize) -> BatchWriter<'a> {
        BatchWriter {
            sock,
            most: most.clamp(1, MAX_BATCH),
            payload: BATCH_HEAD.to_vec(),
            count: 0,
            fds: Vec::new(),
        }
    }

    /// Adds one record (sending the batch before it when it would not fit).
    pub fn add(&mut self, entry: &BatchEntry, fd: Option<BorrowedFd<'a>>) -> io::Result<()> {
        let e = serde_json::to_vec(entry).map_err(io::Error::other)?;
        if BATCH_HEAD.len() + e.len() + BATCH_TAIL.len() > MAX_MESSAGE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a kept record of {} bytes", e.len()),
            ));
        }
        let room = self.payload.len() + 1 + e.len() + BATCH_TAIL.len();
        if self.count == self.most || room > MAX_MESSAGE {
            self.flush()?;
        }
        if self.count > 0 {
            self.payload.push(b',');
        }
        self.payload.extend_from_slice(&e);
        self.fds.extend(fd);
        self.count += 1;
        Ok(())
    }

    /// Sends what is batched (nothing when empty).
    pub fn flush(&mut self) -> io::Result<()> {
        if self.count == 0 {
            return Ok(());
        }
        self.payload.extend_from_slice(BATCH_TAIL);
        send_raw(self.sock, &self.payload, &self.fds)?;
        self.payload.truncate(BATCH_HEAD.len());
        self.fds.clear();
        self.count = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, FromRawFd};

    /// A connected pair of the keeper's kind of socket.
    fn pair() -> (OwnedFd, OwnedFd) {
        rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    }

    /// A pipe's ends, close-on-exec and without waits.
    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut ends = [0; 2];
        // SAFETY: pipe2 into a two-element array; checked below.
        let rc = unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        assert_eq!(rc, 0);
        // SAFETY: fresh descriptors this test owns.
        unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) }
    }

    /// Whether every write end of `r`'s pipe is closed (a read sees its end).
    fn writers_closed(r: &OwnedFd) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: a read into a one-byte buffer from a descriptor the test owns.
        (unsafe { libc::read(r.as_raw_fd(), b.as_mut_ptr().cast(), 1) }) == 0
    }

    /// The socket setup: a keeper's socket is the owner's only, a connection is
    /// accepted with the connector's uid, a receive waits no longer than it was told
    /// (zero: forever, as before), and a path the kernel cannot hold is refused by name.
    #[test]
    fn a_keeper_socket_is_set_up_private_with_bounded_waits() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        let listener = bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let client = connect(&path).unwrap();
        let conn = accept(&listener).unwrap();
        // SAFETY: getuid cannot fail.
        assert_eq!(peer_uid(&conn).unwrap(), unsafe { libc::getuid() });
        set_receive_timeout(&conn, Some(std::time::Duration::ZERO)).unwrap();
        set_receive_timeout(&conn, Some(std::time::Duration::from_millis(50))).unwrap();
        let t = std::time::Instant::now();
        let e = recv(&conn).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(t.elapsed() >= std::time::Duration::from_millis(40));
        set_send_timeout(&client, Some(std::time::Duration::from_millis(50))).unwrap();
        send(&client, &Message::Forget, None).unwrap();
        assert_eq!(recv(&conn).unwrap().unwrap().0, Message::Forget);
        let long = dir.path().join("x".repeat(200));
        assert_eq!(bind(&long).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(
            connect(&long).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    /// A message and its descriptors cross whole, in order, each close-on-exec.
    #[test]
    fn a_batch_crosses_with_its_descriptors_in_order() {
        let (a, b) = pair();
        let pipes: Vec<(OwnedFd, OwnedFd)> = (0..3).map(|_| pipe()).collect();
        let mut w = BatchWriter::new(&a, MAX_BATCH);
        for (i, (_, wr)) in pipes.iter().enumerate() {
            let e = BatchEntry {
                key: format!("lease/{i}"),
                record: serde_json::json!({"v": 1}),
                has_fd: true,
            };
            w.add(&e, Some(wr.as_fd())).unwrap();
        }
        w.flush().unwrap();
        let (msg, fds) = recv_many(&b, &mut Vec::new()).unwrap().unwrap();
        let Message::Entries { entries } = msg else {
            panic!("{msg:?}")
        };
        assert_eq!(entries.len(), 3);
        assert_eq!(fds.len(), 3);
        for (i, fd) in fds.iter().enumerate() {
            // SAFETY: fcntl on a descriptor the test owns.
            let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
            assert!(flags & libc::FD_CLOEXEC != 0, "close-on-exec");
            // Written on the received end, read on pipe i's.
            // SAFETY: a one-byte write from a live buffer.
            assert_eq!(
                unsafe { libc::write(fd.as_raw_fd(), [i as u8].as_ptr().cast(), 1) },
                1
            );
            let mut b = [0u8; 1];
            // SAFETY: a one-byte read into a live buffer.
            let n = unsafe { libc::read(pipes[i].0.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
            assert_eq!((n, b[0]), (1, i as u8), "descriptor {i} in its place");
        }
        drop(a);
        assert!(recv(&b).unwrap().is_none(), "the end of the connection");
    }

    /// A message longer than [`MAX_MESSAGE`] is cut by the receive: refused, and the
    /// descriptor that came with it closed.
    #[test]
    fn a_cut_message_is_refused_and_its_descriptor_closed() {
        let (a, b) = pair();
        let (r, w) = pipe();
        let long = vec![b' '; MAX_MESSAGE + 1];
        {
            use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [w.as_fd()];
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
            let iov = [io::IoSlice::new(&long)];
            rustix::net::sendmsg(&a, &iov, &mut control, SendFlags::empty()).unwrap();
        }
        drop(w);
        let e = recv(&b).expect_err("a cut message is refused");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(writers_closed(&r), "the descriptor that came is closed");
        // Too many descriptors for one message are refused before anything is sent.
        let fds = vec![r.as_fd(); MAX_BATCH + 1];
        let e = send_raw(&a, b"{}", &fds).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
