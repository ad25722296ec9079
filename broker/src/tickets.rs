//! Lease tickets and the ticket server: how a worker gets the file descriptor of an fd
//! lease. A grant (or `RenewLeaseTicket`) mints a **ticket**: 32 random bytes, single use,
//! valid for the configured TTL, bound to the lease and to the credentials of the process
//! that asked (uid always; pid when the kernel shows it). The worker connects to the
//! broker's ticket socket (a Unix stream socket), sends the ticket bytes and receives one
//! byte of data carrying exactly one descriptor in `SCM_RIGHTS`. A wrong, reused, expired
//! or foreign ticket gets nothing: the connection is closed, the attempt logged and counted
//! (`gpu_broker_ticket_refusals_total{reason}`), the lease untouched. Ending a lease drops
//! its tickets. The wire protocol is in `docs/protocol.md`.

use crate::device::SharedFd;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Length of every ticket, in bytes.
pub const TICKET_LEN: usize = 32;
/// Most unredeemed tickets one lease may have (older ones are dropped first).
const MAX_PER_LEASE: usize = 16;
/// Most ticket connections served at once.
const MAX_CONNECTIONS: usize = 256;
/// Most ticket connections one peer uid may have open at once (root and the broker's own
/// user may use a reserve beyond it): the socket is open to every local user, and one of
/// them must not take every slot from the others.
const MAX_CONNECTIONS_PER_UID: usize = 32;
/// Slots beyond the per-uid cap for root and the broker's own user.
const PRIVILEGED_RESERVE: usize = 16;
/// A connection must send its ticket within this time.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The one byte (with no descriptor) a connection over a limit gets before it is closed:
/// its ticket was not looked at, so the client may present it again after a pause.
pub const BUSY_REPLY: u8 = 0x00;
/// The byte that carries the descriptor of a redeemed ticket.
pub const FD_REPLY: u8 = 0x01;

/// A ticket's bytes.
pub type Ticket = [u8; TICKET_LEN];

/// Who may redeem a ticket: the uid of the session, and the pid of the process that asked
/// for the ticket when the kernel showed one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Binding {
    pub uid: u32,
    pub pid: Option<u32>,
}

/// Why a ticket was refused: the metrics own the reasons (the labels of the refusal
/// counter), so the metrics need not import the ticket server.
pub use crate::metrics::TicketRefusal as Refusal;

struct Entry {
    lease: Uuid,
    binding: Binding,
    expires: Instant,
    fd: SharedFd,
}

#[derive(Default)]
struct Inner {
    by_ticket: HashMap<Ticket, Entry>,
    by_lease: HashMap<Uuid, Vec<Ticket>>,
}

/// Every unredeemed ticket, and where the ticket server listens.
pub struct TicketTable {
    inner: Mutex<Inner>,
    ttl: Mutex<Duration>,
    socket: Mutex<Option<PathBuf>>,
}

impl Default for TicketTable {
    fn default() -> Self {
        TicketTable {
            inner: Mutex::new(Inner::default()),
            ttl: Mutex::new(Duration::from_secs(30)),
            socket: Mutex::new(None),
        }
    }
}

impl TicketTable {
    /// Sets the TTL of tickets minted from now on.
    pub fn set_ttl(&self, ttl: Duration) {
        *self.ttl.lock() = ttl.max(Duration::from_millis(1));
    }

    pub fn ttl(&self) -> Duration {
        *self.ttl.lock()
    }

    /// Records where the ticket server listens (fd leases are served only once it does).
    pub fn set_socket(&self, path: &Path) {
        *self.socket.lock() = Some(path.to_path_buf());
    }

    /// The ticket socket, if a ticket server runs.
    pub fn socket(&self) -> Option<PathBuf> {
        self.socket.lock().clone()
    }

    /// Mints a ticket for `lease` that delivers `fd` to a process matching `binding`.
    pub fn mint(&self, lease: Uuid, binding: Binding, fd: SharedFd) -> Ticket {
        let ticket: Ticket = rand::random();
        let now = Instant::now();
        let expires = now + self.ttl();
        let mut inner = self.inner.lock();
        inner.purge_expired(now);
        let list = inner.by_lease.entry(lease).or_default();
        list.push(ticket);
        let dropped = if list.len() > MAX_PER_LEASE {
            Some(list.remove(0))
        } else {
            None
        };
        if let Some(old) = dropped {
            inner.by_ticket.remove(&old);
        }
        inner.by_ticket.insert(
            ticket,
            Entry {
                lease,
                binding,
                expires,
                fd,
            },
        );
        ticket
    }

    /// Drops every ticket of a lease (it ended).
    pub fn forget_lease(&self, lease: Uuid) {
        let mut inner = self.inner.lock();
        if let Some(list) = inner.by_lease.remove(&lease) {
            for t in list {
                inner.by_ticket.remove(&t);
            }
        }
    }

    /// Unredeemed tickets (all leases).
    pub fn outstanding(&self) -> usize {
        self.inner.lock().by_ticket.len()
    }

    /// Redeems `ticket` for a peer with `uid` and `pid`: the lease and its descriptor, once.
    /// A foreign peer does not use the ticket up (its rightful holder may still redeem it).
    pub fn redeem(
        &self,
        ticket: &[u8],
        uid: u32,
        pid: Option<u32>,
    ) -> Result<(Uuid, SharedFd), Refusal> {
        let key: Ticket = ticket.try_into().map_err(|_| Refusal::Malformed)?;
        let now = Instant::now();
        let mut inner = self.inner.lock();
        let Some(e) = inner.by_ticket.get(&key) else {
            return Err(Refusal::Unknown);
        };
        if e.expires <= now {
            inner.remove(&key);
            return Err(Refusal::Expired);
        }
        let pid_ok = match e.binding.pid {
            Some(want) => pid == Some(want),
            None => true,
        };
        if e.binding.uid != uid || !pid_ok {
            return Err(Refusal::Foreign);
        }
        let e = inner.remove(&key).ok_or(Refusal::Unknown)?;
        Ok((e.lease, e.fd))
    }
}

impl Inner {
    fn remove(&mut self, key: &Ticket) -> Option<Entry> {
        let e = self.by_ticket.remove(key)?;
        if let Some(list) = self.by_lease.get_mut(&e.lease) {
            list.retain(|t| t != key);
            if list.is_empty() {
                self.by_lease.remove(&e.lease);
            }
        }
        Some(e)
    }

    fn purge_expired(&mut self, now: Instant) {
        let old: Vec<Ticket> = self
            .by_ticket
            .iter()
            .filter(|(_, e)| e.expires <= now)
            .map(|(t, _)| *t)
            .collect();
        for t in old {
            self.remove(&t);
        }
    }
}

/// Binds the ticket socket at `path` (replacing a stale file; refusing one a live process
/// serves) with mode 0666: any local process may connect, only a ticket's holder gets an fd.
pub async fn bind(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("another broker serves tickets on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
}

/// Serves the tickets of `arb` on `listener` until `stop` is cancelled.
pub async fn serve(
    listener: UnixListener,
    arb: Arc<crate::arbiter::Arbiter>,
    stop: CancellationToken,
) {
    let conns = crate::listener::ConnTracker::new(crate::listener::Limits {
        max_connections: MAX_CONNECTIONS,
        max_connections_per_uid: MAX_CONNECTIONS_PER_UID,
        admin_reserve: PRIVILEGED_RESERVE,
        ..crate::listener::Limits::default()
    });
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "ticket socket accept failed; backing off");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Over a limit (in all, or of this peer's uid): say "busy" and close at once; the
        // ticket is untouched and the client presents it again after a pause.
        // Read once (a system call) and handed on.
        let cred = stream.peer_cred().ok();
        let uid = cred.map(|c| c.uid());
        let permit = match conns.admit(uid) {
            Ok(p) => p,
            Err(cap) => {
                tracing::debug!(?uid, ?cap, "too many ticket connections; one told busy");
                arb.metrics().ticket_refused("busy");
                let _ = stream.try_write(&[BUSY_REPLY]);
                continue;
            }
        };
        let arb = arb.clone();
        tokio::spawn(async move {
            serve_one(stream, cred, &arb).await;
            drop(permit);
        });
    }
}

async fn serve_one(
    mut stream: UnixStream,
    cred: Option<tokio::net::unix::UCred>,
    arb: &crate::arbiter::Arbiter,
) {
    let table = arb.tickets();
    let uid = cred.map(|c| c.uid());
    let pid = cred
        .and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok())
        .filter(|&p| p != 0);
    let mut buf = [0u8; TICKET_LEN];
    let read = tokio::time::timeout(READ_TIMEOUT, stream.read_exact(&mut buf)).await;
    let result = match (read, uid) {
        (Ok(Ok(_)), Some(uid)) => table.redeem(&buf, uid, pid),
        _ => Err(Refusal::Malformed),
    };
    match result {
        // The recipient is recorded before the descriptor leaves, so there is no moment
        // when a process outside the session maps memory the broker no longer counts.
        Ok((lease, _)) if !arb.fd_delivering(lease, pid) => {
            arb.metrics().ticket_refused("lease_gone");
            tracing::debug!(%lease, ?uid, ?pid, "ticket of a lease that just ended; closed");
        }
        Ok((lease, fd)) => match send_fd(&stream, &fd).await {
            Ok(()) => {
                arb.metrics().ticket_redeemed();
                tracing::debug!(%lease, ?uid, ?pid, "lease fd delivered");
            }
            Err(e) => tracing::warn!(%lease, error = %e, "sending a lease fd failed"),
        },
        Err(r) => {
            arb.metrics().ticket_refused(r.as_str());
            tracing::warn!(
                reason = r.as_str(),
                ?uid,
                ?pid,
                "ticket refused; connection closed"
            );
        }
    }
}

/// Sends one byte with `fd` in `SCM_RIGHTS`.
async fn send_fd(stream: &UnixStream, fd: &SharedFd) -> std::io::Result<()> {
    loop {
        stream.writable().await?;
        match stream.try_io(tokio::io::Interest::WRITABLE, || {
            send_with_fd(stream.as_raw_fd(), fd.raw())
        }) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// `sendmsg` of the byte [`FD_REPLY`] with one descriptor attached.
pub fn send_with_fd(sock: RawFd, fd: RawFd) -> std::io::Result<()> {
    let mut byte = [FD_REPLY];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: zeroed msghdr is a valid starting point; every pointer set below outlives
    // the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer has room for one header with one fd (CMSG_SPACE).
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: a valid socket and message.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n == 1 {
        Ok(())
    } else if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Err(std::io::Error::other("short sendmsg"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> SharedFd {
        SharedFd::new(crate::device::host::memfd("t", 4096).unwrap())
    }

    const ME: Binding = Binding {
        uid: 1000,
        pid: Some(42),
    };

    #[test]
    fn a_ticket_redeems_once_for_its_binding_only() {
        let t = TicketTable::default();
        let lease = Uuid::new_v4();
        let f = fd();
        let k = t.mint(lease, ME, f.clone());
        assert_eq!(t.redeem(&k, 1001, Some(42)).unwrap_err(), Refusal::Foreign);
        assert_eq!(t.redeem(&k, 1000, Some(43)).unwrap_err(), Refusal::Foreign);
        assert_eq!(t.redeem(&k, 1000, None).unwrap_err(), Refusal::Foreign);
        let (l, got) = t.redeem(&k, 1000, Some(42)).unwrap();
        assert_eq!((l, got), (lease, f));
        assert_eq!(t.redeem(&k, 1000, Some(42)).unwrap_err(), Refusal::Unknown);
        assert_eq!(
            t.redeem(&[0u8; 32], 1000, Some(42)).unwrap_err(),
            Refusal::Unknown
        );
        assert_eq!(
            t.redeem(&k[..5], 1000, Some(42)).unwrap_err(),
            Refusal::Malformed
        );
        assert_eq!(t.outstanding(), 0);
    }

    #[test]
    fn unknown_pid_binding_checks_uid_only() {
        let t = TicketTable::default();
        let k = t.mint(Uuid::new_v4(), Binding { uid: 7, pid: None }, fd());
        assert_eq!(t.redeem(&k, 8, Some(1)).unwrap_err(), Refusal::Foreign);
        assert!(t.redeem(&k, 7, Some(1)).is_ok());
    }

    #[test]
    fn expired_and_forgotten_tickets_are_refused() {
        let t = TicketTable::default();
        t.set_ttl(Duration::from_millis(1));
        let k = t.mint(Uuid::new_v4(), ME, fd());
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(t.redeem(&k, 1000, Some(42)).unwrap_err(), Refusal::Expired);
        t.set_ttl(Duration::from_secs(30));
        let lease = Uuid::new_v4();
        let k = t.mint(lease, ME, fd());
        t.forget_lease(lease);
        assert_eq!(t.redeem(&k, 1000, Some(42)).unwrap_err(), Refusal::Unknown);
        assert_eq!(t.outstanding(), 0);
    }

    #[tokio::test]
    async fn one_uid_cannot_take_every_ticket_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sock");
        let listener = bind(&path).await.unwrap();
        let arb =
            crate::arbiter::host_arbiter(16 << 20, 1, crate::arbiter::ArbiterConfig::default());
        let stop = CancellationToken::new();
        tokio::spawn(serve(listener, arb, stop.clone()));
        // This process is the broker's own user: the cap plus the reserve.
        let cap = MAX_CONNECTIONS_PER_UID + PRIVILEGED_RESERVE;
        let mut held = Vec::new();
        for _ in 0..cap {
            held.push(UnixStream::connect(&path).await.unwrap());
        }
        // One more from the same uid is told "busy" (no descriptor) and closed at once...
        let mut extra = UnixStream::connect(&path).await.unwrap();
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(30), extra.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((n, b[0]), (1, BUSY_REPLY));
        let n = tokio::time::timeout(Duration::from_secs(30), extra.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n, 0, "closed after the busy byte");
        // ...while the ones it holds are still open (not closed by their read timeout).
        let mut open = 0;
        for s in &held {
            match s.try_read(&mut b) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => open += 1,
                _ => {}
            }
        }
        assert_eq!(
            open, cap,
            "the held connections were still waiting for tickets"
        );
        stop.cancel();
    }

    #[test]
    fn a_lease_keeps_a_bounded_number_of_tickets() {
        let t = TicketTable::default();
        let lease = Uuid::new_v4();
        let f = fd();
        let first = t.mint(lease, ME, f.clone());
        for _ in 0..MAX_PER_LEASE {
            t.mint(lease, ME, f.clone());
        }
        assert_eq!(t.outstanding(), MAX_PER_LEASE);
        assert_eq!(
            t.redeem(&first, 1000, Some(42)).unwrap_err(),
            Refusal::Unknown
        );
    }
}
