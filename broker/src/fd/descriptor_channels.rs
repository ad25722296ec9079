//! Descriptor channels: the ticket connection a worker process keeps open so that the
//! broker sends the descriptor of each lease it grants that process with the grant (no
//! ticket, no redeem round trip). The ticket server (`ticket_server.rs`) opens one when a
//! connection's first bytes ask for it; the AcquireLease service sends on it
//! (`service/handles.rs`). This module owns the registry and the rules of sending:
//!
//! - a channel belongs to the process that connected it, as the kernel names it: pid and
//!   uid (`SO_PEERCRED`) and that process's start time, read while the process the kernel
//!   names (`SO_PEERPIDFD`) is alive, so a later process given the same pid never matches;
//! - a descriptor goes only to the channel whose pid, uid and start time are the lease's
//!   session's own process's (the caller asks for it and is that process): never to a
//!   channel of another pid, uid or start time;
//! - at most [`MAX_UNREAD`] descriptors wait unread on a channel (the kernel's count of
//!   the bytes the peer has not read, `SIOCOUTQ`, over one message's share): past it, or
//!   when a send would block, nothing is sent and the grant mints a ticket as before. A
//!   descriptor sent and never read is closed by the kernel when the connection closes.
//!
//! One channel per pid: a newer one of the same pid replaces (and closes) the older. At
//! most [`MAX_CHANNELS`] are open, [`MAX_CHANNELS_PER_UID`] of one uid: slots of their own,
//! beside the ticket connections' (the ticket server counts them).

use crate::id_map::IdMap;
use parking_lot::Mutex;
use rustix::net::SendFlags;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// Most descriptors sent on a channel and not yet read by its process. Enough for every
/// worker thread of a process to have a grant in flight; bounds what a process that never
/// reads can make the broker leave in the kernel's buffers.
pub const MAX_UNREAD: usize = 32;

/// Most descriptor channels open at once. Channels have their own slots, not the ticket
/// connections': a worker process keeps one for as long as it leases, so they must neither
/// take the slots of tickets being redeemed nor give way to them. Their descriptors are
/// part of the broker's reserve (`fd_budget.rs`). Enforced by the ticket server.
pub const MAX_CHANNELS: usize = 256;
/// Most descriptor channels of one peer uid (workers of one service user: many processes);
/// half the total, so one user cannot take every channel. A process beyond it is answered
/// "busy" and keeps redeeming tickets.
pub const MAX_CHANNELS_PER_UID: usize = 128;

/// The process a channel belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub pid: u32,
    pub uid: u32,
    /// When it started (`process::start_ticks`).
    pub start: u64,
}

/// One open channel.
pub struct Channel {
    owner: Owner,
    stream: tokio::net::UnixStream,
    /// One send at a time: the unread count and the send are one step.
    sending: Mutex<()>,
    /// When a descriptor was last sent (for the serving task's idle time).
    last_sent: Mutex<Instant>,
    /// Cancelled when the registry lets the channel go (replaced, or a send failed).
    ended: CancellationToken,
}

impl Channel {
    pub fn owner(&self) -> Owner {
        self.owner
    }

    /// The connection, for the serving task to wait on.
    pub fn stream(&self) -> &tokio::net::UnixStream {
        &self.stream
    }

    /// Resolves when the registry let the channel go.
    pub async fn ended(&self) {
        self.ended.cancelled().await
    }

    pub fn last_sent(&self) -> Instant {
        *self.last_sent.lock()
    }
}

/// Why a descriptor was not sent (the grant then mints a ticket).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotSent {
    /// No channel of that process (pid, uid and start time).
    NoChannel,
    /// [`MAX_UNREAD`] descriptors wait unread, or the socket's buffer is full.
    Full,
    /// The send failed: the channel is closed and forgotten.
    Closed,
}

/// Every open channel, by pid.
#[derive(Default)]
pub struct DescriptorChannels {
    by_pid: Mutex<IdMap<u32, Arc<Channel>>>,
    /// What one message of a given length adds to a socket's unread count (`SIOCOUTQ`
    /// counts the kernel's buffers, not bytes), measured once on a socket pair; `None`:
    /// the kernel does not say, and nothing is sent on channels.
    unit: OnceLock<Option<(usize, usize)>>,
}

impl DescriptorChannels {
    /// Makes `stream` the channel of `owner` (an earlier channel of the same pid is let go)
    /// and writes `answer` on it first: no descriptor can be sent on it before the answer,
    /// which the worker would read as the answer. `None` when the answer could not be
    /// written (the channel is forgotten again).
    pub fn open(
        &self,
        owner: Owner,
        stream: tokio::net::UnixStream,
        answer: u8,
    ) -> Option<Arc<Channel>> {
        let ch = Arc::new(Channel {
            owner,
            stream,
            sending: Mutex::new(()),
            last_sent: Mutex::new(Instant::now()),
            ended: CancellationToken::new(),
        });
        let sending = ch.sending.lock();
        if let Some(old) = self.by_pid.lock().insert(owner.pid, ch.clone()) {
            old.ended.cancel();
        }
        let answered = matches!(ch.stream.try_write(&[answer]), Ok(1));
        drop(sending);
        if !answered {
            self.close(&ch);
            return None;
        }
        Some(ch)
    }

    /// Forgets `ch` (its serving task ended), unless a newer channel replaced it.
    pub fn close(&self, ch: &Arc<Channel>) {
        ch.ended.cancel();
        let mut by_pid = self.by_pid.lock();
        if by_pid
            .get(&ch.owner.pid)
            .is_some_and(|c| Arc::ptr_eq(c, ch))
        {
            by_pid.remove(&ch.owner.pid);
        }
    }

    /// Channels open.
    pub fn len(&self) -> usize {
        self.by_pid.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sends `msg` with descriptor `fd` on the channel of `to` (its pid, uid and start
    /// time all match), unless [`MAX_UNREAD`] messages wait unread on it.
    pub fn send(&self, to: Owner, msg: &[u8], fd: BorrowedFd<'_>) -> Result<(), NotSent> {
        let ch = self
            .by_pid
            .lock()
            .get(&to.pid)
            .filter(|c| c.owner == to)
            .cloned()
            .ok_or(NotSent::NoChannel)?;
        let Some(unit) = self.unit_of(msg.len()) else {
            return Err(NotSent::NoChannel);
        };
        let _one = ch.sending.lock();
        let queued = unread_bytes(ch.stream.as_raw_fd()).map_err(|_| NotSent::Closed)?;
        if queued.div_ceil(unit) >= MAX_UNREAD {
            return Err(NotSent::Full);
        }
        match send_with_fd(ch.stream.as_fd(), msg, fd, SendFlags::DONTWAIT) {
            Ok(()) => {
                *ch.last_sent.lock() = Instant::now();
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Err(NotSent::Full),
            Err(_) => {
                drop(_one);
                self.close(&ch);
                Err(NotSent::Closed)
            }
        }
    }

    /// The unread count one message of `len` bytes adds, measured on the first call.
    fn unit_of(&self, len: usize) -> Option<usize> {
        match *self
            .unit
            .get_or_init(|| measure_unit(len).map(|u| (len, u)))
        {
            Some((l, u)) if l == len && u > 0 => Some(u),
            _ => None,
        }
    }
}

/// The process that connected `sock` (pid and uid from `SO_PEERCRED`), with its start
/// time, read while that very process lives: the kernel's pidfd of the connecting process
/// (`SO_PEERPIDFD`) must still show it alive after the read, so the time is not that of a
/// later process given the same pid. On a kernel without `SO_PEERPIDFD` (before 6.5) the
/// start time is read as a session's is.
pub fn owner_of(sock: RawFd, pid: u32, uid: u32) -> Option<Owner> {
    if pid == 0 {
        return None;
    }
    let pidfd = peer_pidfd(sock);
    let start = crate::process::start_ticks(pid)?;
    match pidfd {
        Ok(fd) if exited(fd.as_raw_fd()) => None,
        Ok(_) => Some(Owner { pid, uid, start }),
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => Some(Owner { pid, uid, start }),
        Err(_) => None,
    }
}

/// `SO_PEERPIDFD`: a pidfd of the process that connected (Linux 6.5; asm-generic value).
const SO_PEERPIDFD: libc::c_int = 77;

fn peer_pidfd(sock: RawFd) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt of an int into a local on a valid socket.
    let rc = unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 || fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor the kernel gave us, owned by nobody else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Has the process of `pidfd` exited (its pidfd is readable then)?
fn exited(pidfd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll of one valid descriptor, not waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n != 0
}

/// What the peer of `sock` has not read yet, in the kernel's unit (`SIOCOUTQ`).
fn unread_bytes(sock: RawFd) -> std::io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one int into a local.
    let rc = unsafe { libc::ioctl(sock, libc::TIOCOUTQ, &mut n) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Sends one message of `len` bytes with a descriptor on a fresh socket pair nobody reads
/// and asks the kernel what it counts unread: every message of that length counts the same.
fn measure_unit(len: usize) -> Option<usize> {
    let (a, _b) = std::os::unix::net::UnixStream::pair().ok()?;
    // As on a ticket connection (credentials are attached to what it sends).
    crate::fd::ticket_read::pass_credentials(&a).ok()?;
    let null = std::fs::File::open("/dev/null").ok()?;
    send_with_fd(
        a.as_fd(),
        &vec![0u8; len],
        null.as_fd(),
        SendFlags::DONTWAIT,
    )
    .ok()?;
    unread_bytes(a.as_raw_fd()).ok().filter(|&u| u > 0)
}

/// `sendmsg` of `msg` with one descriptor attached (all of it, or an error), never
/// raising `SIGPIPE` (`flags` and `MSG_NOSIGNAL`).
pub fn send_with_fd(
    sock: BorrowedFd<'_>,
    msg: &[u8],
    fd: BorrowedFd<'_>,
    flags: SendFlags,
) -> std::io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for a descriptor"));
    }
    let iov = [std::io::IoSlice::new(msg)];
    let n = rustix::net::sendmsg(sock, &iov, &mut control, flags | SendFlags::NOSIGNAL)?;
    if n == msg.len() {
        Ok(())
    } else {
        Err(std::io::Error::other("short sendmsg"))
    }
}
