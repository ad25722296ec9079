//! Fetching the file descriptor of an fd lease from the broker's ticket server (protocol in
//! `docs/protocol.md`): connect to the ticket socket, send the ticket bytes, receive one
//! byte with exactly one descriptor in `SCM_RIGHTS`. The broker hands it only to the
//! process the ticket was issued to; a refused ticket gets the connection closed with
//! nothing sent ([`ClientError::TicketRefused`]); a ticket whose lease ended before it was
//! redeemed gets "lease ended" ([`ClientError::LeaseEnded`]).
//!
//! **Finding the socket.** `socket_path` is the path as the broker knows it. A worker that
//! sees the broker's socket directory elsewhere (a container mounting `/run/gpu-broker` at
//! another path) finds the same file name next to the socket it dialled: [`candidates`]
//! tries the broker's path first, then that sibling.
//!
//! **Kept connections.** A connection that brought a descriptor is kept for this process's
//! next ticket (`ticket_channel.rs`): the broker serves ticket after ticket on it, each
//! checked as on a fresh connection, so a lease costs no connect, accept or close. Every
//! step waits on the async runtime (no blocking system call), so concurrent fetches of one
//! process do not wait for each other.
//!
//! Every descriptor received is close-on-exec and owned ([`OwnedFd`]): dropping it closes
//! it, so nothing leaks on any error path.

use std::io::ErrorKind;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use gpu_broker_proto::ticket::{BUSY_REPLY, FD_REPLY, LEASE_ENDED_REPLY, REFUSED_REPLY};
use gpu_broker_proto::v1 as pb;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};

use crate::error::ClientError;

/// How long a ticket exchange may take.
const TIMEOUT: Duration = Duration::from_secs(10);
/// Longest pause between presentations to a busy ticket socket.
const MAX_BUSY_PAUSE: Duration = Duration::from_millis(50);

/// What the memory behind an fd handle is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    /// CUDA VMM memory: import it (`cuda` feature: [`crate::Lease::map_cuda`]).
    CudaVmm,
    /// A memfd: [`crate::Lease::map`] it.
    HostMemfd,
    /// A kind this client does not know.
    Unknown,
}

impl From<i32> for MemoryKind {
    fn from(v: i32) -> Self {
        match pb::MemoryKind::try_from(v) {
            Ok(pb::MemoryKind::CudaVmm) => MemoryKind::CudaVmm,
            Ok(pb::MemoryKind::HostMemfd) => MemoryKind::HostMemfd,
            _ => MemoryKind::Unknown,
        }
    }
}

/// An fd handle as the broker sent it.
#[derive(Clone, PartialEq, Eq, Serialize)]
pub struct FdInfo {
    /// The ticket socket as the broker knows it (empty in listings).
    pub socket_path: PathBuf,
    /// The single-use ticket (empty in listings). Never serialized.
    #[serde(skip)]
    pub ticket: Vec<u8>,
    pub memory_kind: MemoryKind,
    /// Identifies the memory object behind the descriptor.
    pub block_id: u64,
    /// Size of the memory object.
    pub size: u64,
    /// How long the ticket was valid for when issued.
    pub ticket_ttl_ms: u64,
    /// This process retained the block when it released an earlier lease of it: no
    /// ticket came, its descriptor and mapping are reused (`crate::retained`).
    pub retained: bool,
    /// The descriptor came with the grant on this process's descriptor channel
    /// (`crate::descriptor_channel`): no ticket came.
    pub pushed: bool,
}

impl std::fmt::Debug for FdInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdInfo")
            .field("socket_path", &self.socket_path)
            .field("ticket", &format_args!("<{} bytes>", self.ticket.len()))
            .field("memory_kind", &self.memory_kind)
            .field("block_id", &self.block_id)
            .field("size", &self.size)
            .finish()
    }
}

impl From<pb::FdHandle> for FdInfo {
    fn from(h: pb::FdHandle) -> Self {
        FdInfo {
            socket_path: PathBuf::from(h.socket_path),
            ticket: h.ticket,
            memory_kind: MemoryKind::from(h.memory_kind),
            block_id: h.block_id,
            size: h.size,
            ticket_ttl_ms: h.ticket_ttl_ms,
            retained: h.retained,
            pushed: h.pushed,
        }
    }
}

/// Where to look for the ticket socket: the broker's path, then the same file name next to
/// the broker socket this process dialled (when that differs).
pub fn candidates(socket_path: &Path, dialled: Option<&Path>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if !socket_path.as_os_str().is_empty() {
        out.push(socket_path.to_path_buf());
    }
    if let (Some(dir), Some(name)) = (dialled.and_then(Path::parent), socket_path.file_name()) {
        let sibling = dir.join(name);
        if !out.contains(&sibling) {
            out.push(sibling);
        }
    }
    out
}

/// What connecting to the ticket socket found.
enum Connected {
    /// A connection, and the path that answered.
    To(UnixStream, PathBuf),
    /// The socket's queue of connections not yet accepted is full: busy, as when the
    /// broker says so.
    Busy,
}

/// Connects to the first of `places` that answers, on the runtime: a blocking connect
/// would hold a runtime thread while the broker's accept queue is full.
async fn connect(places: &[PathBuf]) -> Result<Connected, ClientError> {
    let mut last = None;
    let mut busy = false;
    for p in places {
        match tokio::net::UnixStream::connect(p).await {
            Ok(s) => return Ok(Connected::To(s.into_std()?, p.clone())),
            Err(e) if e.kind() == ErrorKind::WouldBlock => busy = true,
            Err(e) => last = Some(format!("{}: {e}", p.display())),
        }
    }
    if busy {
        return Ok(Connected::Busy);
    }
    Err(ClientError::Io(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!(
            "cannot reach the broker's ticket socket ({})",
            last.unwrap_or_else(|| "no socket path".into())
        ),
    )))
}

/// Redeems `ticket` at the ticket socket and returns the descriptor, without blocking the
/// async runtime: every step waits on the runtime. A connection this process kept from
/// an earlier ticket is used first (`ticket_channel.rs`: one round trip, no connect);
/// a broker at its connection limit answers "busy" without looking at the ticket, and the
/// ticket is presented again after a pause (1 ms doubling to 50 ms, for up to 10 s).
pub async fn fetch(
    socket_path: &Path,
    ticket: &[u8],
    dialled: Option<&Path>,
) -> Result<OwnedFd, ClientError> {
    if ticket.is_empty() {
        return Err(ClientError::FailedPrecondition(
            "the handle carries no ticket (listings do not): ask for a new one".into(),
        ));
    }
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    let mut pause = Duration::from_millis(1);
    loop {
        let presented = tokio::time::timeout_at(deadline, present(socket_path, ticket, dialled))
            .await
            .map_err(|_| {
                ClientError::Unavailable(
                    format!("the broker's ticket socket did not answer within {TIMEOUT:?}").into(),
                )
            })?;
        if let Some(fd) = presented? {
            return Ok(fd);
        }
        if tokio::time::Instant::now() + pause > deadline {
            return Err(ClientError::Unavailable(
                format!("the broker's ticket socket stayed busy for {TIMEOUT:?}").into(),
            ));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_BUSY_PAUSE);
    }
}

/// Presents `ticket` once: the descriptor, or `None` when the broker said "busy" (or its
/// socket's accept queue was full). On a
/// kept connection first; where the broker closed that one before looking at the ticket,
/// on a fresh one.
async fn present(
    socket_path: &Path,
    ticket: &[u8],
    dialled: Option<&Path>,
) -> Result<Option<OwnedFd>, ClientError> {
    let places = candidates(socket_path, dialled);
    for place in &places {
        let Some(conn) = crate::ticket_channel::take(place) else {
            continue;
        };
        match exchange(conn, ticket).await? {
            (Received { len: 0, .. }, _) => crate::ticket_channel::closed_unused(place),
            (got, conn) => return answer(got, conn, place),
        }
    }
    let Connected::To(conn, place) = connect(&places).await? else {
        return Ok(None);
    };
    let (got, conn) = exchange(conn, ticket).await?;
    answer(got, conn, &place)
}

/// What the broker's answer means; a connection that brought a descriptor is kept.
fn answer(got: Received, conn: UnixStream, place: &Path) -> Result<Option<OwnedFd>, ClientError> {
    match got {
        Received {
            len: 1,
            byte: FD_REPLY,
            fd: Some(fd),
        } => {
            crate::ticket_channel::give_back(place, conn);
            Ok(Some(fd))
        }
        Received {
            len: 1,
            byte: BUSY_REPLY,
            fd: None,
        } => Ok(None),
        Received {
            len: 1,
            byte: LEASE_ENDED_REPLY,
            fd: None,
        } => Err(ClientError::LeaseEnded(
            "the lease ended (reclaimed, revoked, released or its session ended) before its \
             memory was fetched; ask for a new lease"
                .into(),
        )),
        Received {
            len: 0, fd: None, ..
        }
        | Received {
            len: 1,
            byte: REFUSED_REPLY,
            fd: None,
        } => Err(ClientError::TicketRefused(
            "the broker closed the connection (wrong, used, expired or foreign ticket)".into(),
        )),
        Received { fd, .. } => {
            drop(fd);
            Err(ClientError::Protocol(
                "the ticket server sent no descriptor with its reply".into(),
            ))
        }
    }
}

/// Writes `ticket` on `conn` and receives the answer, waiting on the runtime. A broker
/// that closed the connection (busy before the ticket was written, or a kept connection it
/// let go) reads as an answer of no bytes, or its busy byte.
async fn exchange(conn: UnixStream, ticket: &[u8]) -> Result<(Received, UnixStream), ClientError> {
    use tokio::io::AsyncWriteExt;
    conn.set_nonblocking(true)?;
    let mut s = tokio::net::UnixStream::from_std(conn)?;
    match s.write_all(ticket).await {
        Err(e) if !matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {
            return Err(e.into())
        }
        _ => {}
    }
    let got = loop {
        s.readable().await?;
        match s.try_io(tokio::io::Interest::READABLE, || recv_with_fd(s.as_fd())) {
            Ok(got) => break got,
            Err(e) if e.kind() == ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                break Received {
                    len: 0,
                    byte: 0,
                    fd: None,
                }
            }
            Err(e) => return Err(e.into()),
        }
    };
    Ok((got, s.into_std()?))
}

/// What one `recvmsg` on a ticket connection brought.
pub struct Received {
    /// Bytes of data read (0: the broker closed the connection).
    pub len: usize,
    /// The data byte, when `len` is 1.
    pub byte: u8,
    /// The first descriptor that came with it (extras are closed).
    pub fd: Option<OwnedFd>,
}

/// `recvmsg` of up to one byte and one descriptor (`MSG_CMSG_CLOEXEC`). Any extra
/// descriptors are closed; an answer whose descriptors the kernel cut fails
/// (`InvalidData`), the ones that arrived closed.
pub fn recv_with_fd(sock: BorrowedFd<'_>) -> std::io::Result<Received> {
    let mut byte = [0u8; 1];
    let (len, mut fds) = recv_fds(sock, &mut byte, RecvFlags::empty())?;
    // Extra descriptors drop (close) here.
    let first = (!fds.is_empty()).then(|| fds.swap_remove(0));
    Ok(Received {
        len,
        byte: byte[0],
        fd: first,
    })
}

/// One `recvmsg` into `buf` with room for a few descriptors (so extras are received and
/// closed rather than left in flight), close-on-exec, retried when interrupted: the bytes
/// read and the descriptors that came, in order. Descriptors cut by the kernel (more than
/// the room) fail it with `InvalidData`, those that arrived closed.
pub(crate) fn recv_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    flags: RecvFlags,
) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        let mut iov = [std::io::IoSliceMut::new(buf)];
        match rustix::net::recvmsg(
            sock,
            &mut iov,
            &mut control,
            flags | RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(got) => break got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let fds: Vec<OwnedFd> = control
        .drain()
        .flat_map(|m| match m {
            RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
            _ => Vec::new(),
        })
        .collect();
    if got.flags.contains(ReturnFlags::CTRUNC) {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("descriptors cut off a message ({} arrived)", fds.len()),
        ));
    }
    Ok((got.bytes, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd};
    use tokio::io::AsyncReadExt;

    /// A fetch waits on the runtime, not in a system call: on a current-thread runtime, a
    /// ticket server that is a task of that same runtime still gets to answer.
    #[tokio::test(flavor = "current_thread")]
    async fn a_fetch_lets_the_other_tasks_of_its_runtime_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut t = [0u8; 4];
            s.read_exact(&mut t).await.unwrap();
            let f = std::fs::File::open("/dev/null").unwrap();
            s.writable().await.unwrap();
            send_one(&s, &f);
        });
        let got = tokio::time::timeout(Duration::from_secs(5), fetch(&path, b"good", None)).await;
        let fd = got.expect("the fetch held the runtime").unwrap();
        assert!(fd.as_raw_fd() >= 0);
        server.await.unwrap();
    }

    /// A ticket socket whose accept queue is full (a broker too busy to accept) holds no
    /// runtime thread: the fetch waits on the runtime as for a "busy" answer, and the
    /// runtime's timers still run.
    #[test]
    fn a_full_accept_queue_does_not_hold_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("full.sock");
        // SAFETY: plain socket calls on descriptors this test owns; the path fits.
        let (listener, queued) = unsafe {
            let mut addr: libc::sockaddr_un = std::mem::zeroed();
            addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (d, s) in addr
                .sun_path
                .iter_mut()
                .zip(path.as_os_str().as_encoded_bytes())
            {
                *d = *s as libc::c_char;
            }
            let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            let l = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            assert_eq!(
                libc::bind(l, (&addr as *const libc::sockaddr_un).cast(), len),
                0
            );
            assert_eq!(libc::listen(l, 0), 0);
            let l = OwnedFd::from_raw_fd(l);
            // Connections nobody accepts, until the queue is full.
            let mut queued = Vec::new();
            loop {
                let c = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0);
                let c = OwnedFd::from_raw_fd(c);
                if libc::connect(
                    c.as_raw_fd(),
                    (&addr as *const libc::sockaddr_un).cast(),
                    len,
                ) != 0
                {
                    break;
                }
                queued.push(c);
                assert!(queued.len() < 10_000, "the queue never filled");
            }
            (l, queued)
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let r = rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(300), fetch(&p, b"good", None)).await
            });
            let _ = tx.send(r.is_err());
        });
        let timed_out = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the fetch held its runtime's thread in connect");
        assert!(timed_out, "the fetch should still be waiting for room");
        drop((listener, queued));
    }

    /// The second ticket of this process goes over the connection that brought the
    /// first descriptor: the server sees one connection, two tickets.
    #[tokio::test(flavor = "current_thread")]
    async fn the_next_ticket_goes_over_the_kept_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            for _ in 0..2 {
                let mut t = [0u8; 4];
                s.read_exact(&mut t).await.unwrap();
                got.push(t);
                let f = std::fs::File::open("/dev/null").unwrap();
                s.writable().await.unwrap();
                send_one(&s, &f);
            }
            got
        });
        fetch(&path, b"one!", None).await.unwrap();
        fetch(&path, b"two!", None).await.unwrap();
        assert_eq!(server.await.unwrap(), [*b"one!", *b"two!"]);
    }

    /// A kept connection the broker let go (closed before reading the ticket) costs a
    /// fresh connection, not an error; a refusal on a kept connection is a refusal, and
    /// the ticket is not presented again.
    #[tokio::test(flavor = "current_thread")]
    async fn a_let_go_kept_connection_is_replaced_and_a_kept_refusal_is_final() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let give = |s: &tokio::net::UnixStream| {
                let f = std::fs::File::open("/dev/null").unwrap();
                send_one(s, &f);
            };
            let mut t = [0u8; 4];
            // First connection: a descriptor, then closed unread (the broker let it go).
            let (mut s, _) = listener.accept().await.unwrap();
            s.read_exact(&mut t).await.unwrap();
            give(&s);
            drop(s);
            // Second: a descriptor; then its next ticket is refused.
            let (mut s, _) = listener.accept().await.unwrap();
            s.read_exact(&mut t).await.unwrap();
            give(&s);
            s.read_exact(&mut t).await.unwrap();
            s.write_all(&[REFUSED_REPLY]).await.unwrap();
            drop(s);
            // No third presentation of the refused ticket.
            tokio::time::timeout(Duration::from_millis(300), listener.accept())
                .await
                .is_err()
        });
        use tokio::io::AsyncWriteExt;
        fetch(&path, b"one!", None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        fetch(&path, b"two!", None).await.unwrap();
        let e = fetch(&path, b"bad!", None).await.unwrap_err();
        assert!(matches!(e, ClientError::TicketRefused(_)), "{e}");
        assert!(
            server.await.unwrap(),
            "the refused ticket was presented again"
        );
    }

    #[test]
    fn candidates_try_the_brokers_path_then_the_sibling_of_the_dialled_socket() {
        let c = candidates(
            Path::new("/run/gpu-broker/broker.tickets.sock"),
            Some(Path::new("/mnt/broker/broker.sock")),
        );
        assert_eq!(
            c,
            vec![
                PathBuf::from("/run/gpu-broker/broker.tickets.sock"),
                PathBuf::from("/mnt/broker/broker.tickets.sock")
            ]
        );
        let same = candidates(
            Path::new("/run/b/t.sock"),
            Some(Path::new("/run/b/broker.sock")),
        );
        assert_eq!(same, vec![PathBuf::from("/run/b/t.sock")]);
        assert!(candidates(Path::new(""), None).is_empty());
    }

    #[tokio::test]
    async fn busy_is_retried_a_closed_connection_is_a_refusal_and_a_descriptor_arrives_cloexec() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            // First connection: "busy" (the ticket not read). Second: refused (closed after
            // reading). Third: gets a descriptor.
            for answer in ["busy", "refuse", "give", "ended"] {
                let (mut s, _) = listener.accept().unwrap();
                if answer == "busy" {
                    s.write_all(&[BUSY_REPLY]).unwrap();
                    continue;
                }
                let mut t = [0u8; 4];
                s.read_exact(&mut t).unwrap();
                if answer == "give" {
                    let f = std::fs::File::open("/dev/null").unwrap();
                    send_one(&s, &f);
                }
                if answer == "ended" {
                    s.write_all(&[LEASE_ENDED_REPLY]).unwrap();
                }
            }
        });
        let e = fetch(&path, b"nope", None).await.unwrap_err();
        assert!(matches!(e, ClientError::TicketRefused(_)), "{e}");
        let fd = fetch(&path, b"good", None).await.unwrap();
        // SAFETY: fcntl on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert!(flags & libc::FD_CLOEXEC != 0);
        let e = fetch(&path, b"gone", None).await.unwrap_err();
        assert!(matches!(e, ClientError::LeaseEnded(_)), "{e}");
        assert_eq!(e.code(), Code::NotFound);
        assert!(e.to_string().contains("lease ended"), "{e}");
        server.join().unwrap();
        let e = fetch(&path, b"", None).await.unwrap_err();
        assert!(matches!(e, ClientError::FailedPrecondition(_)), "{e}");
    }

    /// An answer with more descriptors than there is room for (the kernel cut them, which
    /// no broker sends) fails, and the descriptors that did arrive are closed: the only
    /// write end of a pipe sent 16 times is closed everywhere once the receive returns.
    #[test]
    fn an_answer_whose_descriptors_were_cut_fails_and_closes_what_arrived() {
        let (mine, broker) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut ends = [0; 2];
        // SAFETY: pipe2 into a two-element array; checked below.
        let rc = unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        assert_eq!(rc, 0);
        // SAFETY: fresh descriptors this test owns.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
        {
            use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [std::os::fd::AsFd::as_fd(&w); 16];
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
            let iov = [std::io::IoSlice::new(&[FD_REPLY])];
            let sent = rustix::net::sendmsg(&broker, &iov, &mut control, SendFlags::empty());
            assert_eq!(sent.unwrap(), 1);
        }
        drop(w);
        let e = recv_with_fd(mine.as_fd())
            .err()
            .expect("a cut answer fails");
        assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
        let mut b = [0u8; 1];
        // SAFETY: a read into a one-byte buffer from a descriptor this test owns.
        let n = unsafe { libc::read(r.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
        assert_eq!(n, 0, "a write end that arrived is still open");
    }

    /// Sends one byte with `fd` attached, as the broker's ticket server does.
    fn send_one(sock: impl std::os::fd::AsFd, fd: impl std::os::fd::AsFd) {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [fd.as_fd()];
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        let iov = [std::io::IoSlice::new(&[1u8])];
        let sent = rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::empty());
        assert_eq!(sent.unwrap(), 1);
    }
}
