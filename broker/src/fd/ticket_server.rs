//! The ticket server: the Unix stream socket where a worker presents a lease ticket
//! (`tickets.rs` has the table and the protocol's bytes) and receives the lease's
//! descriptor in `SCM_RIGHTS`. Above the arbiter: it asks it before a descriptor goes to a
//! process other than the lease's session's own, or to an import's holder
//! ([`Arbiter::fd_delivering`]); the session's own process is sent its lease's descriptor
//! without that look (the ticket table refuses a ticket whose lease left the lease table).
//! Who that is the kernel says of each process that wrote the ticket (`ticket_read.rs`),
//! not only of the one that connected: a descriptor asked for over a connection its
//! writer did not make (a child on its parent's socket) goes through that look too.
//! A connection that was handed a descriptor stays open for the same process's next
//! ticket (checked as the first was), until idle or until a connection is turned away at
//! a limit its slot counts under (`ticket_pressure.rs`). Connections are capped in all and per peer uid; one over a cap is told "busy"
//! and closed, its ticket untouched.
//! A connection whose first bytes are `CHANNEL_HELLO` becomes its process's descriptor
//! channel (`descriptor_channels.rs`: the grant sends the lease's descriptor on it, keyed
//! by the lease id), if the process that connected wrote them itself; it closes when idle
//! for [`CHANNEL_IDLE`] or when the worker writes anything on it. Channels have their own
//! caps ([`MAX_CHANNELS`], [`MAX_CHANNELS_PER_UID`]), not the ticket connections' (their
//! slot is given back when the connection becomes a channel), and never give way to a
//! ticket connection turned away; one over a channel cap is told "busy" and closed.
//! A connection whose first bytes are `LINE_HELLO` becomes a session's lease line
//! (`lease_line.rs`), with slots of its own as well.

use crate::arbiter::{Arbiter, Recipient};
use crate::device::SharedFd;
use crate::fd::descriptor_channels::{
    DescriptorChannels, NotSent, Owner, MAX_CHANNELS, MAX_CHANNELS_PER_UID,
};
use crate::fd::ticket_pressure::Pressure;
use crate::fd::tickets::{Redeemed, Refusal, TICKET_LEN};
use crate::listener::{ConnPermit, ConnTracker};
use crate::metrics::TOO_MANY_RECIPIENTS;
use gpu_broker_proto::ticket::{
    BUSY_REPLY, CHANNEL_HELLO, CHANNEL_OPEN_REPLY, FD_REPLY, LEASE_ENDED_REPLY, LINE_HELLO,
    PUSHED_FD, PUSHED_LEN, REFUSED_REPLY,
};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

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
/// How long a connection that was handed a descriptor waits for its next ticket: a worker
/// leasing again soon keeps its connection; an idle one gives its slot back.
const KEPT_IDLE: Duration = Duration::from_secs(1);
/// How long a descriptor channel stays open with nothing sent on it: a process leasing
/// now and then keeps it; an idle one gives its slot back (it opens another when it leases).
const CHANNEL_IDLE: Duration = Duration::from_secs(30);
/// Binds the ticket socket at `path` (replacing a stale file; refusing one a live process
/// serves) with mode 0666: any local process may connect, only a ticket's holder gets an fd.
pub async fn bind(path: &Path) -> std::io::Result<UnixListener> {
    use crate::listener::BindError;
    let listener = crate::listener::bind_unix(path, 0o666)
        .await
        .map_err(|e| match e {
            BindError::InUse(path) => std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("another broker serves tickets on {}", path.display()),
            ),
            BindError::Io { source, .. } => source,
            e @ BindError::NotASocket(_) => {
                std::io::Error::new(std::io::ErrorKind::AlreadyExists, e.to_string())
            }
        })?;
    // Every accepted connection inherits it: the kernel names each writer of a ticket.
    crate::fd::ticket_read::pass_credentials(&listener)?;
    Ok(listener)
}

/// Serves the tickets of `arb` on `listener` until `stop` is cancelled.
pub async fn serve(listener: UnixListener, arb: Arc<Arbiter>, stop: CancellationToken) {
    serve_with_channels(listener, arb, stop, MAX_CHANNELS, MAX_CHANNELS_PER_UID).await
}

/// [`serve`], with at most `channels` descriptor channels open, `channels_per_uid` of one uid.
async fn serve_with_channels(
    listener: UnixListener,
    arb: Arc<Arbiter>,
    stop: CancellationToken,
    channels: usize,
    channels_per_uid: usize,
) {
    use crate::listener::{ConnTracker, Limits};
    let conns = ConnTracker::new(Limits {
        max_connections: MAX_CONNECTIONS,
        max_connections_per_uid: MAX_CONNECTIONS_PER_UID,
        admin_reserve: PRIVILEGED_RESERVE,
        ..Limits::default()
    });
    let channel_slots = ConnTracker::new(Limits {
        max_connections: channels,
        max_connections_per_uid: channels_per_uid,
        admin_reserve: 0,
        ..Limits::default()
    });
    let lines = Arc::new(crate::fd::lease_line::Lines::new(ConnTracker::new(
        Limits {
            max_connections: crate::fd::lease_line::MAX_LINES,
            max_connections_per_uid: crate::fd::lease_line::MAX_LINES_PER_UID,
            admin_reserve: 0,
            ..Limits::default()
        },
    )));
    // Told when a connection is turned away at a limit: the kept connections waiting idle
    // for their next ticket in the slots it lacked close, so they never keep a process
    // out (`ticket_pressure.rs`: a uid at its own cap moves only its own).
    let pressure = Arc::new(Pressure::default());
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
                arb.metrics().ticket_refused(crate::metrics::TICKET_BUSY);
                let _ = stream.try_write(&[BUSY_REPLY]);
                pressure.turned_away(uid, cap);
                continue;
            }
        };
        let arb = arb.clone();
        let pressure = pressure.clone();
        let slots = Slots {
            channels: channel_slots.clone(),
            lines: lines.clone(),
        };
        tokio::spawn(async move {
            serve_connection(stream, cred, permit, &arb, &pressure, &slots).await;
        });
    }
}

/// Serves tickets on one connection: the first, then, for as long as each brought its
/// descriptor, the next ones the same process sends (a kept connection: no connect per
/// lease). Each ticket is checked as on a fresh connection (who wrote it, from the kernel).
/// A kept connection closes when idle for [`KEPT_IDLE`], when a connection is turned
/// away at a limit its slot counts under, or after any answer other than a descriptor.
/// `permit`: its ticket connection slot, held until it closes or becomes a channel or a
/// lease line.
async fn serve_connection(
    stream: UnixStream,
    cred: Option<tokio::net::unix::UCred>,
    permit: ConnPermit,
    arb: &Arc<Arbiter>,
    pressure: &Arc<Pressure>,
    slots: &Slots,
) {
    match serve_one(&stream, cred, arb, false).await {
        Served::Fd => {}
        Served::Nothing => return,
        Served::ChannelAsked(writers) => {
            return serve_channel(stream, cred, &writers, arb, permit, &slots.channels).await
        }
        Served::LineAsked(writers) => {
            return crate::fd::lease_line::serve(stream, cred, &writers, arb, permit, &slots.lines)
                .await
        }
    }
    let kept = pressure.keep(cred.map(|c| c.uid()));
    loop {
        let next = tokio::select! {
            r = next_ticket_comes(&stream) => r,
            _ = kept.give_way() => false,
            _ = tokio::time::sleep(KEPT_IDLE) => false,
        };
        if !next || serve_one(&stream, cred, arb, true).await != Served::Fd {
            return;
        }
    }
}

/// Waits until a kept connection has something to read (a byte, or its end): only then
/// does the ticket's read timeout start.
async fn next_ticket_comes(stream: &UnixStream) -> bool {
    loop {
        if stream.readable().await.is_err() {
            return false;
        }
        let peeked = stream.try_io(tokio::io::Interest::READABLE, || {
            let mut b = 0u8;
            // SAFETY: a one-byte peek into a local on a valid socket.
            let n = unsafe {
                libc::recv(
                    stream.as_raw_fd(),
                    (&mut b as *mut u8).cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        });
        match peeked {
            Ok(()) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return false,
        }
    }
}

/// The slots of the connections that become something else than a ticket's.
struct Slots {
    channels: Arc<ConnTracker>,
    lines: Arc<crate::fd::lease_line::Lines>,
}

/// What one ticket's turn on a connection came to.
#[derive(Debug, PartialEq, Eq)]
enum Served {
    /// Its descriptor was sent.
    Fd,
    /// Refused, or the connection ended: it closes.
    Nothing,
    /// The connection's first bytes asked for a descriptor channel; who wrote them.
    ChannelAsked(Vec<u32>),
    /// The connection's first bytes asked for a lease line (`lease_line.rs`); who wrote them.
    LineAsked(Vec<u32>),
}

/// Serves one ticket. `kept`: not the connection's first ticket (a refusal is then said
/// with [`REFUSED_REPLY`], so the client can tell it from a kept connection the broker let
/// go; an end of the stream before any byte is the client closing, not a refusal).
async fn serve_one(
    stream: &UnixStream,
    cred: Option<tokio::net::unix::UCred>,
    arb: &Arbiter,
    kept: bool,
) -> Served {
    let table = arb.tickets();
    let uid = cred.map(|c| c.uid());
    let pid = peer_pid(cred);
    let mut buf = [0u8; TICKET_LEN];
    let read = tokio::time::timeout(
        READ_TIMEOUT,
        crate::fd::ticket_read::read_exact_with_writers(stream, &mut buf),
    )
    .await;
    if kept && matches!(&read, Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof) {
        return Served::Nothing;
    }
    if !kept && (buf == CHANNEL_HELLO || buf == LINE_HELLO) {
        if let Ok(Ok(w)) = read {
            return match buf == CHANNEL_HELLO {
                true => Served::ChannelAsked(w.writers),
                false => Served::LineAsked(w.writers),
            };
        }
    }
    let (result, writers) = match (read, uid) {
        // A writer the broker's pid namespace cannot see (pid 0) beside a connecting
        // process it can: nobody it could record would hold the descriptor.
        (Ok(Ok(w)), Some(_)) if pid.is_some() && w.writers.contains(&0) => {
            (Err(Refusal::Malformed), Vec::new())
        }
        (Ok(Ok(w)), Some(uid)) => (table.redeem(&buf, uid, pid), w.writers),
        _ => (Err(Refusal::Malformed), Vec::new()),
    };
    // Writers other than the connecting process (a child on its parent's connection):
    // the descriptor may be theirs, so each is recorded as the arbiter sees fit.
    let strangers: Vec<u32> = writers
        .into_iter()
        .filter(|&w| w != 0 && Some(w) != pid)
        .collect();
    match result {
        // A recipient outside the session is recorded before the descriptor leaves, so
        // there is no moment when such a process maps memory the broker no longer counts.
        // The lease ended between the redemption and now: its rightful holder is told so.
        // The session's own process was never recorded (the arbiter's look returned at
        // once for it), so its delivery does not take the arbiter's lock: the table
        // refused its ticket if the lease already left the lease table, and a lease that
        // ends from here on is the same race as one ending while the descriptor is in flight.
        Ok(r) => match delivering(arb, &r, pid, &strangers) {
            Recipient::Added => match send_fd(stream, &r.fd).await {
                Ok(()) => {
                    arb.metrics().ticket_redeemed();
                    tracing::debug!(lease = %r.lease, ?uid, ?pid, kept, "lease fd delivered");
                    Served::Fd
                }
                Err(e) => {
                    tracing::warn!(lease = %r.lease, error = %e, "sending a lease fd failed");
                    Served::Nothing
                }
            },
            Recipient::Gone => {
                let lease = r.lease;
                arb.metrics().ticket_refused("lease_gone");
                let _ = stream.try_write(&[LEASE_ENDED_REPLY]);
                tracing::debug!(%lease, ?uid, ?pid, "ticket of a lease that just ended; closed");
                Served::Nothing
            }
            // Its record names every process that has the memory: past the bound none more.
            Recipient::Full => {
                let lease = r.lease;
                arb.metrics().ticket_refused(TOO_MANY_RECIPIENTS);
                if kept {
                    let _ = stream.try_write(&[REFUSED_REPLY]);
                }
                tracing::warn!(%lease, ?uid, ?pid, "a lease descriptor already reached as many other processes as allowed; refused");
                Served::Nothing
            }
        },
        // Only the ticket's rightful peer gets here (a foreign one is refused as unknown).
        Err(Refusal::LeaseEnded) => {
            arb.metrics().ticket_refused(Refusal::LeaseEnded.as_str());
            let _ = stream.try_write(&[LEASE_ENDED_REPLY]);
            tracing::debug!(?uid, ?pid, "ticket of an ended lease; told so and closed");
            Served::Nothing
        }
        Err(r) => {
            arb.metrics().ticket_refused(r.as_str());
            if kept {
                let _ = stream.try_write(&[REFUSED_REPLY]);
            }
            tracing::warn!(
                reason = r.as_str(),
                ?uid,
                ?pid,
                kept,
                "ticket refused; connection closed"
            );
            Served::Nothing
        }
    }
}

/// Makes `stream` the descriptor channel of the process that connected it, when that
/// process wrote the request itself (`writers`: no other process shares the channel's
/// name) and its start time is known; else closes it (as an unknown ticket's first
/// connection is). A channel takes a slot of its own (`channel_slots`) and gives back its
/// ticket connection slot (`permit`); none free: answered "busy" and closed (the process
/// keeps redeeming tickets). Then waits until the channel closes (see the module's doc).
async fn serve_channel(
    stream: UnixStream,
    cred: Option<tokio::net::unix::UCred>,
    writers: &[u32],
    arb: &Arbiter,
    permit: ConnPermit,
    channel_slots: &Arc<ConnTracker>,
) {
    let uid = cred.map(|c| c.uid());
    let pid = peer_pid(cred);
    let owner = match (pid, uid) {
        (Some(p), Some(u)) if writers == [p] => {
            crate::fd::descriptor_channels::owner_of(stream.as_raw_fd(), p, u)
        }
        _ => None,
    };
    let Some(owner) = owner else {
        arb.metrics().ticket_refused(Refusal::Foreign.as_str());
        tracing::warn!(
            ?uid,
            ?pid,
            ?writers,
            "descriptor channel refused; connection closed"
        );
        return;
    };
    let Some(slot) = slot_or_busy(
        channel_slots,
        uid,
        &stream,
        arb,
        crate::metrics::CHANNEL_BUSY,
    ) else {
        return;
    };
    drop(permit);
    let channels = arb.tickets().channels();
    // Open before the worker hears so (it asks for descriptors on it from then on), the
    // answer written before any descriptor can be.
    let Some(ch) = channels.open(owner, stream, CHANNEL_OPEN_REPLY) else {
        return;
    };
    tracing::debug!(pid = owner.pid, uid = owner.uid, "descriptor channel open");
    loop {
        let idle_until = tokio::time::Instant::from_std(ch.last_sent() + CHANNEL_IDLE);
        tokio::select! {
            _ = ch.ended() => break,
            // The worker sends nothing on a channel: a byte or its end closes it.
            _ = next_ticket_comes(ch.stream()) => break,
            _ = tokio::time::sleep_until(idle_until) => {
                if ch.last_sent().elapsed() >= CHANNEL_IDLE {
                    break;
                }
            }
        }
    }
    channels.close(&ch);
    drop(slot);
    tracing::debug!(pid = owner.pid, "descriptor channel closed");
}

/// The pid the kernel names for the connecting process (`None`: unknown, or in another pid
/// namespace, where it reads 0).
pub(crate) fn peer_pid(cred: Option<tokio::net::unix::UCred>) -> Option<u32> {
    cred.and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok())
        .filter(|&p| p != 0)
}

/// A slot of `slots` for a connection of `uid` becoming a channel or a line; none free:
/// the connection is told "busy" (counted as `reason`) and `None`.
pub(crate) fn slot_or_busy(
    slots: &Arc<ConnTracker>,
    uid: Option<u32>,
    stream: &UnixStream,
    arb: &Arbiter,
    reason: &'static str,
) -> Option<ConnPermit> {
    match slots.admit(uid) {
        Ok(slot) => Some(slot),
        Err(cap) => {
            tracing::debug!(?uid, ?cap, reason, "no slot free; told busy");
            arb.metrics().ticket_refused(reason);
            let _ = stream.try_write(&[BUSY_REPLY]);
            None
        }
    }
}

/// Sends lease `lease`'s descriptor `fd` on the descriptor channel of `to` (the lease's
/// session's own process), unless it has none or too many unread
/// (`descriptor_channels.rs`): then the grant mints a ticket instead.
pub fn push(
    channels: &DescriptorChannels,
    to: Owner,
    lease: uuid::Uuid,
    fd: BorrowedFd<'_>,
) -> Result<(), NotSent> {
    let mut msg = [0u8; PUSHED_LEN];
    msg[0] = PUSHED_FD;
    msg[1..].copy_from_slice(lease.as_bytes());
    channels.send(to, &msg, fd)
}

/// Asks the arbiter before `r`'s descriptor leaves, where it must (a recipient that may be
/// outside the session, or a writer other than the connecting process `pid`): anything
/// but [`Recipient::Added`] when it may not (the lease ended meanwhile, or too many other
/// processes have it).
fn delivering(arb: &Arbiter, r: &Redeemed, pid: Option<u32>, strangers: &[u32]) -> Recipient {
    if r.to.needs_arbiter() {
        let first = arb.fd_delivering(r.lease, pid);
        if first != Recipient::Added {
            return first;
        }
    }
    strangers
        .iter()
        .map(|&w| arb.fd_delivering(r.lease, Some(w)))
        .find(|d| *d != Recipient::Added)
        .unwrap_or(Recipient::Added)
}

/// Sends one byte with `fd` in `SCM_RIGHTS`.
async fn send_fd(stream: &UnixStream, fd: &SharedFd) -> std::io::Result<()> {
    loop {
        stream.writable().await?;
        match stream.try_io(tokio::io::Interest::WRITABLE, || {
            send_with_fd(stream.as_fd(), fd.0.as_fd())
        }) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// `sendmsg` of the byte [`FD_REPLY`] with one descriptor attached.
pub fn send_with_fd(sock: BorrowedFd<'_>, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let flags = rustix::net::SendFlags::empty();
    crate::fd::descriptor_channels::send_with_fd(sock, &[FD_REPLY], fd, flags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A forked child, killed and reaped however the test ends.
    struct Reap(libc::pid_t);
    impl Drop for Reap {
        fn drop(&mut self) {
            // SAFETY: killing and reaping our own child.
            unsafe {
                libc::kill(self.0, libc::SIGKILL);
                libc::waitpid(self.0, std::ptr::null_mut(), 0);
            }
        }
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

    /// A ticket server on a fresh socket for a host arbiter (one 64 MiB device, tenant
    /// "a" allowed all of it), and who this test process is.
    struct Serving {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
        arb: std::sync::Arc<crate::arbiter::Arbiter>,
        stop: CancellationToken,
        uid: u32,
        me: u32,
    }

    async fn serving() -> Serving {
        serving_with_channels(MAX_CHANNELS, MAX_CHANNELS_PER_UID).await
    }

    /// [`serving`], with at most `channels` descriptor channels, `per_uid` of one uid.
    async fn serving_with_channels(channels: usize, per_uid: usize) -> Serving {
        let _dir = tempfile::tempdir().unwrap();
        let path = _dir.path().join("t.sock");
        let listener = bind(&path).await.unwrap();
        let arb =
            crate::arbiter::host_arbiter(64 << 20, 1, crate::arbiter::ArbiterConfig::default());
        arb.tickets().set_socket(&path);
        arb.set_quota("a", crate::arbiter::tests::quota(64 << 20))
            .unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(serve_with_channels(
            listener,
            arb.clone(),
            stop.clone(),
            channels,
            per_uid,
        ));
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me: std::process::id(),
        }
    }

    /// The server's dispatch: the session's own process is sent its lease's descriptor
    /// without being recorded (its release then caches the block); a process outside the
    /// session is recorded before its descriptor leaves (the release then holds the block
    /// for it); a ticket minted after its lease left the table gets "lease ended" and no
    /// descriptor, whoever it was minted for.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_a_process_outside_the_session_is_recorded_and_an_ended_lease_sends_nothing() {
        use crate::arbiter::tests::req;
        use crate::fd::tickets::{Binding, Recipient};
        use crate::session::Peer;
        use gpu_broker_client::{fd::fetch, ClientError};
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        let bound = Binding { uid, pid: Some(me) };
        let fd_of = |v: &crate::lease::LeaseView| match &v.handle {
            crate::device::Handle::Fd { fd, .. } => fd.clone(),
        };
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let peer = |pid| Peer {
            pid: Some(pid),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx1) = arb.open_session("a", "own", peer(me)).unwrap();
        let (theirs, _rx2) = arb.open_session("a", "theirs", peer(other.id())).unwrap();

        // This process is `own`'s: sent, not recorded, so the release caches the block.
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let to = Recipient::SessionProcess(l.live.clone());
        let k = arb.tickets().mint(l.id, bound, fd_of(&l), to);
        fetch(&path, &k, None).await.unwrap();
        arb.release("a", l.id).unwrap();
        assert!(arb.views().quarantined().is_empty());

        // This process is outside `theirs`: recorded first, so the release holds the block.
        let l = arb.acquire(req("a", theirs, 4 << 20)).await.unwrap();
        let to = Recipient::Other(Some(l.live.clone()));
        let k = arb.tickets().mint(l.id, bound, fd_of(&l), to);
        fetch(&path, &k, None).await.unwrap();
        arb.release("a", l.id).unwrap();
        let q = arb.views().quarantined();
        assert_eq!(q.len(), 1, "{q:?}");
        assert_eq!((q[0].lease, q[0].holders.clone()), (l.id, vec![me]));

        // Minted after the end, for either: "lease ended", no descriptor.
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        arb.release("a", l.id).unwrap();
        for to in [
            Recipient::SessionProcess(l.live.clone()),
            Recipient::Other(Some(l.live.clone())),
        ] {
            let k = arb.tickets().mint(l.id, bound, fd_of(&l), to);
            let e = fetch(&path, &k, None).await.unwrap_err();
            assert!(matches!(e, ClientError::LeaseEnded(_)), "{e}");
        }
        other.kill().unwrap();
        other.wait().unwrap();
        stop.cancel();
    }

    /// A forked child that presents its parent's ticket on a connection its parent made
    /// (`SO_PEERCRED` names the parent, the session's own process) is seen as itself by
    /// the kernel's credentials of what it wrote: recorded before the descriptor leaves,
    /// so the parent's release holds the block for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_child_on_its_parents_ticket_connection_is_recorded() {
        use crate::arbiter::tests::req;
        use crate::fd::tickets::{Binding, Recipient};
        use crate::session::Peer;
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        let peer = Peer {
            pid: Some(me),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx) = arb.open_session("a", "own", peer).unwrap();
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let crate::device::Handle::Fd { fd, .. } = &l.handle;
        let bound = Binding { uid, pid: Some(me) };
        let to = Recipient::SessionProcess(l.live.clone());
        let k = arb.tickets().mint(l.id, bound, fd.clone(), to);

        // This process connects; the child writes the ticket, reads the reply, says so on
        // a pipe and waits to be killed.
        let conn = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let (mut said, told) = std::os::unix::net::UnixStream::pair().unwrap();
        // SAFETY: the child calls only write, read and _exit (async-signal-safe).
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let mut b = [0u8; 1];
            // SAFETY: plain syscalls on inherited descriptors, then _exit.
            unsafe {
                // Only the parent's end stays open: the child's wait ends with the parent.
                libc::close(said.as_raw_fd());
                libc::write(conn.as_raw_fd(), k.as_ptr().cast(), k.len());
                let n = libc::read(conn.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                b[0] = u8::from(n == 1 && b[0] == FD_REPLY);
                libc::write(told.as_raw_fd(), b.as_ptr().cast(), 1);
                libc::read(told.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        drop(conn);
        let reap = Reap(child);
        let got = tokio::task::spawn_blocking(move || {
            let mut b = [0u8; 1];
            std::io::Read::read_exact(&mut said, &mut b).unwrap();
            (said, b[0])
        })
        .await
        .unwrap();
        assert_eq!(got.1, 1, "the child got the descriptor");
        arb.release("a", l.id).unwrap();
        let q = arb.views().quarantined();
        assert_eq!(q.len(), 1, "{q:?}");
        assert_eq!(
            (q[0].lease, q[0].holders.clone()),
            (l.id, vec![child as u32])
        );
        drop(reap);
        drop(told);
        stop.cancel();
    }

    /// Sends `k` on `conn` (blocking) and reads the answer.
    fn present_on(
        conn: &std::os::unix::net::UnixStream,
        k: &[u8],
    ) -> gpu_broker_client::fd::Received {
        use std::io::Write;
        (&*conn).write_all(k).unwrap();
        gpu_broker_client::fd::recv_with_fd(conn.as_fd()).unwrap()
    }

    /// Opens this process's descriptor channel on `path` (blocking): the broker's answer
    /// byte, and the connection.
    fn open_channel(path: &std::path::Path) -> (u8, std::os::unix::net::UnixStream) {
        use std::io::{Read, Write};
        let mut conn = std::os::unix::net::UnixStream::connect(path).unwrap();
        conn.write_all(&CHANNEL_HELLO).unwrap();
        let mut b = [0u8; 1];
        let n = conn.read(&mut b).unwrap();
        (if n == 1 { b[0] } else { 0xff }, conn)
    }

    /// One message waiting on a channel, without waiting: its lease id and descriptor.
    fn pushed_on(
        conn: &std::os::unix::net::UnixStream,
    ) -> Option<(uuid::Uuid, std::os::fd::OwnedFd)> {
        use std::io::Read;
        conn.set_nonblocking(true).unwrap();
        let got = gpu_broker_client::fd::recv_with_fd(conn.as_fd()).ok()?;
        assert_eq!((got.len, got.byte), (1, PUSHED_FD));
        let mut id = [0u8; PUSHED_LEN - 1];
        conn.set_nonblocking(false).unwrap();
        (&*conn).read_exact(&mut id).unwrap();
        Some((
            uuid::Uuid::from_bytes(id),
            got.fd.expect("a message without its descriptor"),
        ))
    }

    /// The inode of a descriptor (to tell which memory it is).
    fn inode(fd: std::os::fd::RawFd) -> u64 {
        // SAFETY: fstat into a zeroed local.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
        st.st_ino
    }

    /// A grant's descriptor goes on a descriptor channel only when the caller is the
    /// lease's session's own process and the channel is that process's (pid, uid and start
    /// time): never for another process's session, another caller, another uid or a
    /// process of another start time (a reused pid), nor for a lease that ended.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_sends_its_descriptor_only_on_its_own_process_channel() {
        use crate::arbiter::tests::req;
        use crate::fd::descriptor_channels::Owner;
        use crate::fd::handles::pushed_handle;
        use crate::session::Peer;
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        let path2 = path.clone();
        let (said, conn) = tokio::task::spawn_blocking(move || open_channel(&path2))
            .await
            .unwrap();
        assert_eq!(said, CHANNEL_OPEN_REPLY);
        assert_eq!(arb.tickets().channels().len(), 1);
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let peer = |pid| Peer {
            pid: Some(pid),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx1) = arb.open_session("a", "own", peer(me)).unwrap();
        let (theirs, _rx2) = arb.open_session("a", "theirs", peer(other.id())).unwrap();
        let own_s = arb.retained().session_peer("a", own).unwrap();
        let theirs_s = arb.retained().session_peer("a", theirs).unwrap();
        let start = crate::process::start_ticks(me).unwrap();
        assert_eq!(own_s.start, Some(start));

        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        // Another caller on this process's session (a child, another process of the user).
        assert!(pushed_handle(&arb, &l, &peer(other.id()), &own_s).is_none());
        // This process calling on another process's session.
        let t = arb.acquire(req("a", theirs, 4 << 20)).await.unwrap();
        assert!(pushed_handle(&arb, &t, &peer(me), &theirs_s).is_none());
        assert!(pushed_handle(&arb, &t, &peer(other.id()), &theirs_s).is_none());
        // A session opened by a process of this pid that started at another time.
        let reused = crate::arbiter::SessionPeer {
            start: Some(start + 1),
            ..own_s
        };
        assert!(pushed_handle(&arb, &l, &peer(me), &reused).is_none());
        // Another uid (as if a process of another user had this pid).
        let foreign = Owner {
            pid: me,
            uid: uid + 1,
            start,
        };
        let crate::device::Handle::Fd { fd, .. } = &l.handle;
        assert_eq!(
            push(arb.tickets().channels(), foreign, l.id, fd.0.as_fd()),
            Err(NotSent::NoChannel)
        );
        assert!(
            pushed_on(&conn).is_none(),
            "a descriptor went to a channel not its process's"
        );

        // The session's own process, on its own channel: sent, keyed by the lease id.
        let h = pushed_handle(&arb, &l, &peer(me), &own_s).expect("not sent");
        assert!(h.pushed && h.ticket.is_empty());
        assert_eq!(
            arb.tickets().outstanding(),
            0,
            "a ticket was minted beside it"
        );
        let (id, got) = pushed_on(&conn).expect("nothing on the channel");
        assert_eq!(id, l.id);
        assert_eq!(inode(got.as_raw_fd()), inode(fd.raw()));
        // A lease that ended sends nothing.
        let ended = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        arb.release("a", ended.id).unwrap();
        assert!(pushed_handle(&arb, &ended, &peer(me), &own_s).is_none());
        assert!(pushed_on(&conn).is_none());
        other.kill().unwrap();
        other.wait().unwrap();
        stop.cancel();
    }

    /// At most `MAX_UNREAD` descriptors wait unread on a channel: past it nothing is sent
    /// (the grant mints a ticket); reading one makes room for one. A channel its process
    /// closed is forgotten, with what it left unread.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unread_descriptors_on_a_channel_are_bounded() {
        use crate::arbiter::tests::req;
        use crate::fd::descriptor_channels::{Owner, MAX_UNREAD};
        use crate::session::Peer;
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        let path2 = path.clone();
        let (said, conn) = tokio::task::spawn_blocking(move || open_channel(&path2))
            .await
            .unwrap();
        assert_eq!(said, CHANNEL_OPEN_REPLY);
        let peer = Peer {
            pid: Some(me),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx) = arb.open_session("a", "own", peer).unwrap();
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let crate::device::Handle::Fd { fd, .. } = &l.handle;
        let to = Owner {
            pid: me,
            uid,
            start: crate::process::start_ticks(me).unwrap(),
        };
        let channels = arb.tickets().channels();
        for i in 0..MAX_UNREAD {
            assert_eq!(push(channels, to, l.id, fd.0.as_fd()), Ok(()), "push {i}");
        }
        assert_eq!(push(channels, to, l.id, fd.0.as_fd()), Err(NotSent::Full));
        assert!(pushed_on(&conn).is_some());
        assert_eq!(
            push(channels, to, l.id, fd.0.as_fd()),
            Ok(()),
            "room after a read"
        );
        assert_eq!(push(channels, to, l.id, fd.0.as_fd()), Err(NotSent::Full));
        drop(conn);
        let t = std::time::Instant::now();
        while !channels.is_empty() && t.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(channels.is_empty(), "a closed channel is still open");
        assert_eq!(
            push(channels, to, l.id, fd.0.as_fd()),
            Err(NotSent::NoChannel)
        );
        stop.cancel();
    }

    /// A channel is its writer's: asked for by a process other than the one that connected
    /// (a child on its parent's connection), it is refused and the connection closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_channel_asked_for_by_another_process_on_the_connection_is_refused() {
        let Serving {
            _dir,
            path,
            arb,
            stop,
            ..
        } = serving().await;
        let conn = std::os::unix::net::UnixStream::connect(&path).unwrap();
        // SAFETY: the child calls only write and _exit (async-signal-safe).
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            // SAFETY: a plain syscall on an inherited descriptor, then _exit.
            unsafe {
                libc::write(
                    conn.as_raw_fd(),
                    CHANNEL_HELLO.as_ptr().cast(),
                    CHANNEL_HELLO.len(),
                );
                libc::_exit(0);
            }
        }
        let reap = Reap(child);
        let got = tokio::task::spawn_blocking(move || {
            conn.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            gpu_broker_client::fd::recv_with_fd(conn.as_fd()).unwrap()
        })
        .await
        .unwrap();
        assert_eq!(got.len, 0, "answered {:#x}", got.byte);
        assert!(arb.tickets().channels().is_empty());
        drop(reap);
        stop.cancel();
    }

    /// A connection that brought a descriptor serves the same process's next ticket; each
    /// ticket on it is checked as on a fresh connection: a foreign one (bound to another
    /// pid) is refused (said with a byte, then closed) and stays valid for its rightful
    /// peer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_connection_serves_the_next_ticket_and_refuses_a_foreign_one() {
        use crate::arbiter::tests::req;
        use crate::fd::tickets::{Binding, Recipient};
        use crate::session::Peer;
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let peer = Peer {
            pid: Some(me),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx) = arb.open_session("a", "own", peer).unwrap();
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let crate::device::Handle::Fd { fd, .. } = &l.handle;
        let mine = Binding { uid, pid: Some(me) };
        let theirs = Binding {
            uid,
            pid: Some(other.id()),
        };
        let to = || Recipient::SessionProcess(l.live.clone());
        let k1 = arb.tickets().mint(l.id, mine, fd.clone(), to());
        let k2 = arb.tickets().mint(l.id, mine, fd.clone(), to());
        let foreign = arb.tickets().mint(l.id, theirs, fd.clone(), to());
        let path2 = path.clone();
        let (first, second, refused, after) = tokio::task::spawn_blocking(move || {
            let conn = std::os::unix::net::UnixStream::connect(&path2).unwrap();
            let first = present_on(&conn, &k1);
            let second = present_on(&conn, &k2);
            let refused = present_on(&conn, &foreign);
            let after = gpu_broker_client::fd::recv_with_fd(conn.as_fd()).unwrap();
            (first, second, refused, after)
        })
        .await
        .unwrap();
        assert!(first.byte == FD_REPLY && first.fd.is_some());
        assert!(
            second.byte == FD_REPLY && second.fd.is_some(),
            "kept: the next ticket served"
        );
        assert_eq!((refused.len, refused.byte), (1, REFUSED_REPLY));
        assert!(
            refused.fd.is_none(),
            "a foreign ticket brought a descriptor"
        );
        assert_eq!(after.len, 0, "closed after the refusal");
        // Still valid for the process it is bound to.
        let r = arb
            .tickets()
            .redeem(&foreign, uid, Some(other.id()))
            .unwrap();
        assert_eq!(r.lease, l.id);
        other.kill().unwrap();
        other.wait().unwrap();
        stop.cancel();
    }

    /// A forked child writing a ticket on its parent's kept connection (after the parent's
    /// own ticket was served on it) is seen as itself and recorded before the descriptor
    /// leaves, as on the connection's first ticket.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_child_on_its_parents_kept_connection_is_recorded() {
        use crate::arbiter::tests::req;
        use crate::fd::tickets::{Binding, Recipient};
        use crate::session::Peer;
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        let peer = Peer {
            pid: Some(me),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx) = arb.open_session("a", "own", peer).unwrap();
        let first = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let bound = Binding { uid, pid: Some(me) };
        let fd_of = |v: &crate::lease::LeaseView| match &v.handle {
            crate::device::Handle::Fd { fd, .. } => fd.clone(),
        };
        let k1 = arb.tickets().mint(
            first.id,
            bound,
            fd_of(&first),
            Recipient::SessionProcess(first.live.clone()),
        );
        let k = arb.tickets().mint(
            l.id,
            bound,
            fd_of(&l),
            Recipient::SessionProcess(l.live.clone()),
        );
        let path2 = path.clone();
        let conn = tokio::task::spawn_blocking(move || {
            let conn = std::os::unix::net::UnixStream::connect(&path2).unwrap();
            let got = present_on(&conn, &k1);
            assert!(got.byte == FD_REPLY && got.fd.is_some());
            conn
        })
        .await
        .unwrap();
        let (mut said, told) = std::os::unix::net::UnixStream::pair().unwrap();
        // SAFETY: the child calls only write, read and _exit (async-signal-safe).
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let mut b = [0u8; 1];
            // SAFETY: plain syscalls on inherited descriptors, then _exit.
            unsafe {
                libc::close(said.as_raw_fd());
                libc::write(conn.as_raw_fd(), k.as_ptr().cast(), k.len());
                let n = libc::read(conn.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                b[0] = u8::from(n == 1 && b[0] == FD_REPLY);
                libc::write(told.as_raw_fd(), b.as_ptr().cast(), 1);
                libc::read(told.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        drop(conn);
        let reap = Reap(child);
        let got = tokio::task::spawn_blocking(move || {
            let mut b = [0u8; 1];
            std::io::Read::read_exact(&mut said, &mut b).unwrap();
            (said, b[0])
        })
        .await
        .unwrap();
        assert_eq!(
            got.1, 1,
            "the child got the descriptor on the kept connection"
        );
        arb.release("a", l.id).unwrap();
        let q = arb.views().quarantined();
        assert_eq!(q.len(), 1, "{q:?}");
        assert_eq!(
            (q[0].lease, q[0].holders.clone()),
            (l.id, vec![child as u32])
        );
        drop(reap);
        drop(told);
        stop.cancel();
    }

    /// Kept connections waiting for their next ticket do not keep a process out: when a
    /// connection is turned away at the per-uid limit, they close, and the newcomer's
    /// retry gets in (well before their idle time would have closed them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kept_connections_give_way_when_a_connection_is_turned_away() {
        use crate::arbiter::tests::req;
        use crate::fd::tickets::{Binding, Recipient};
        use crate::session::Peer;
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        let peer = Peer {
            pid: Some(me),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx) = arb.open_session("a", "own", peer).unwrap();
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let crate::device::Handle::Fd { fd, .. } = &l.handle;
        let bound = Binding { uid, pid: Some(me) };
        let (arb2, fd2, live) = (arb.clone(), fd.clone(), l.live.clone());
        let id = l.id;
        let mint = move || {
            arb2.tickets().mint(
                id,
                bound,
                fd2.clone(),
                Recipient::SessionProcess(live.clone()),
            )
        };
        // Every slot of this uid (the broker's own: the cap plus the reserve) held by a
        // connection that was served and now waits for its next ticket (each ticket minted
        // just before it is presented: a lease keeps a few unredeemed ones only).
        let cap = MAX_CONNECTIONS_PER_UID + PRIVILEGED_RESERVE;
        let path2 = path.clone();
        let mint2 = mint.clone();
        let held = tokio::task::spawn_blocking(move || {
            (0..cap)
                .map(|_| {
                    let conn = std::os::unix::net::UnixStream::connect(&path2).unwrap();
                    assert_eq!(present_on(&conn, &mint2()).byte, FD_REPLY);
                    conn
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap();
        let k = mint();
        let t = std::time::Instant::now();
        gpu_broker_client::fd::fetch(&path, &k, None).await.unwrap();
        assert!(
            t.elapsed() < KEPT_IDLE / 2,
            "the newcomer waited {:?}",
            t.elapsed()
        );
        let closed = held
            .iter()
            .filter(|c| {
                c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                matches!(gpu_broker_client::fd::recv_with_fd(c.as_fd()), Ok(r) if r.len == 0)
            })
            .count();
        assert_eq!(closed, cap, "every idle kept connection gave way");
        stop.cancel();
    }

    /// A uid turned away at its own cap closes only its own kept connections: any local
    /// user can reach its cap at will, and must not make every other worker's kept
    /// connection close (each next ticket would pay a connect). Needs root (the other
    /// uid is `nobody`'s); skipped otherwise.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_uid_at_its_cap_does_not_close_other_uids_kept_connections() {
        use crate::arbiter::tests::req;
        use crate::fd::tickets::{Binding, Recipient};
        use crate::session::Peer;
        use std::os::unix::fs::PermissionsExt;
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root to connect as another uid");
            return;
        }
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        std::fs::set_permissions(_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let peer = Peer {
            pid: Some(me),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx) = arb.open_session("a", "own", peer).unwrap();
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let crate::device::Handle::Fd { fd, .. } = &l.handle;
        let bound = Binding { uid, pid: Some(me) };
        let to = || Recipient::SessionProcess(l.live.clone());
        let k1 = arb.tickets().mint(l.id, bound, fd.clone(), to());
        let k2 = arb.tickets().mint(l.id, bound, fd.clone(), to());
        let path2 = path.clone();
        let conn = tokio::task::spawn_blocking(move || {
            let conn = std::os::unix::net::UnixStream::connect(&path2).unwrap();
            assert_eq!(present_on(&conn, &k1).byte, FD_REPLY);
            conn
        })
        .await
        .unwrap();

        // `nobody` takes every slot of its uid and one more, which is told "busy".
        // SAFETY: a zeroed sockaddr_un is valid; the path fits (a tempdir's).
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr
            .sun_path
            .iter_mut()
            .zip(path.as_os_str().as_encoded_bytes())
        {
            *d = *s as libc::c_char;
        }
        let (mut said, told) = std::os::unix::net::UnixStream::pair().unwrap();
        // SAFETY: the child calls only async-signal-safe functions, then _exit.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            // SAFETY: plain syscalls, then _exit.
            unsafe {
                let mut ok = libc::setgid(65534) == 0 && libc::setuid(65534) == 0;
                let mut last = -1;
                for _ in 0..=MAX_CONNECTIONS_PER_UID {
                    last = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                    ok &= libc::connect(last, (&addr as *const libc::sockaddr_un).cast(), len) == 0;
                }
                let mut b = [0u8; 1];
                ok &= libc::read(last, b.as_mut_ptr().cast(), 1) == 1 && b[0] == BUSY_REPLY;
                b[0] = u8::from(ok);
                libc::write(told.as_raw_fd(), b.as_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        let reap = Reap(child);
        let (said, got) = tokio::task::spawn_blocking(move || {
            let mut b = [0u8; 1];
            std::io::Read::read_exact(&mut said, &mut b).unwrap();
            (said, b[0])
        })
        .await
        .unwrap();
        assert_eq!(got, 1, "nobody's connection past its cap was told busy");
        // Well inside the kept connection's idle time: it still serves this process.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let served = tokio::task::spawn_blocking(move || {
            std::io::Write::write_all(&mut &conn, &k2).is_ok()
                && gpu_broker_client::fd::recv_with_fd(conn.as_fd())
                    .is_ok_and(|r| r.byte == FD_REPLY && r.fd.is_some())
        })
        .await
        .unwrap();
        assert!(
            served,
            "another uid at its cap closed this process's kept connection"
        );
        drop((reap, said, told));
        stop.cancel();
    }

    /// `n` forked processes of this uid, each with its descriptor channel open on `path`
    /// (asked for and answered): the answers, in the order they came, and the children
    /// (each holds its channel until killed, or until `hold` is dropped).
    struct ChannelHolders {
        answers: Vec<u8>,
        children: Vec<Reap>,
        _hold: std::os::unix::net::UnixStream,
    }

    fn fork_channel_holders(path: &std::path::Path, n: usize) -> ChannelHolders {
        use std::io::Read;
        // SAFETY: a zeroed sockaddr_un is valid; the path fits (a tempdir's).
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr
            .sun_path
            .iter_mut()
            .zip(path.as_os_str().as_encoded_bytes())
        {
            *d = *s as libc::c_char;
        }
        let (mut said, told) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut children = Vec::new();
        for _ in 0..n {
            // SAFETY: the child calls only async-signal-safe functions, then _exit.
            let child = unsafe { libc::fork() };
            assert!(child >= 0);
            if child == 0 {
                // SAFETY: plain syscalls, then _exit.
                unsafe {
                    libc::close(said.as_raw_fd());
                    let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                    let mut b = [0xffu8; 1];
                    if libc::connect(s, (&addr as *const libc::sockaddr_un).cast(), len) == 0
                        && libc::write(s, CHANNEL_HELLO.as_ptr().cast(), CHANNEL_HELLO.len())
                            == CHANNEL_HELLO.len() as isize
                        && libc::read(s, b.as_mut_ptr().cast(), 1) != 1
                    {
                        b[0] = 0xff;
                    }
                    libc::write(told.as_raw_fd(), b.as_ptr().cast(), 1);
                    // Holds the channel until the parent lets go.
                    libc::read(told.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                    libc::_exit(0);
                }
            }
            children.push(Reap(child));
        }
        drop(told);
        let mut answers = vec![0u8; n];
        said.read_exact(&mut answers).unwrap();
        ChannelHolders {
            answers,
            children,
            _hold: said,
        }
    }

    /// Waits (up to 10 s) until `arb` has `n` descriptor channels open.
    async fn channels_become(arb: &Arbiter, n: usize) -> usize {
        for _ in 0..1000 {
            if arb.tickets().channels().len() == n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        arb.tickets().channels().len()
    }

    /// Descriptor channels have their own slots: 40 worker processes of one uid keep
    /// theirs open while that uid's ticket connections take every ticket slot, and a
    /// ticket connection turned away at the uid's cap closes none of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forty_processes_channels_of_one_uid_take_no_ticket_slot_and_never_give_way() {
        use crate::arbiter::tests::req;
        use crate::fd::tickets::{Binding, Recipient};
        use crate::session::Peer;
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving().await;
        let path2 = path.clone();
        let holders = tokio::task::spawn_blocking(move || fork_channel_holders(&path2, 40))
            .await
            .unwrap();
        assert!(
            holders.answers.iter().all(|&b| b == CHANNEL_OPEN_REPLY),
            "{:?}",
            holders.answers
        );
        assert_eq!(arb.tickets().channels().len(), 40);

        let peer = Peer {
            pid: Some(me),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx) = arb.open_session("a", "own", peer).unwrap();
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let crate::device::Handle::Fd { fd, .. } = &l.handle;
        let bound = Binding { uid, pid: Some(me) };
        let (arb2, fd2, live, id) = (arb.clone(), fd.clone(), l.live.clone(), l.id);
        let mint = move || {
            arb2.tickets().mint(
                id,
                bound,
                fd2.clone(),
                Recipient::SessionProcess(live.clone()),
            )
        };
        // Every ticket slot of this uid (the cap and the reserve) served, and kept.
        let cap = MAX_CONNECTIONS_PER_UID + PRIVILEGED_RESERVE;
        let path2 = path.clone();
        let (answers, _kept, past) = tokio::task::spawn_blocking(move || {
            let kept: Vec<_> = (0..cap)
                .map(|_| std::os::unix::net::UnixStream::connect(&path2).unwrap())
                .collect();
            let answers: Vec<u8> = kept.iter().map(|c| present_on(c, &mint()).byte).collect();
            // One more: turned away at the uid's cap.
            let past = std::os::unix::net::UnixStream::connect(&path2).unwrap();
            let past = gpu_broker_client::fd::recv_with_fd(past.as_fd()).unwrap();
            (answers, kept, past.byte)
        })
        .await
        .unwrap();
        assert!(
            answers.iter().all(|&b| b == FD_REPLY),
            "ticket slots taken by channels: {answers:?}"
        );
        assert_eq!(past, BUSY_REPLY);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            arb.tickets().channels().len(),
            40,
            "channels gave way to a ticket connection"
        );
        drop(holders);
        assert_eq!(channels_become(&arb, 0).await, 0, "closed channels stayed");
        stop.cancel();
    }

    /// Past the channel budget (here 2 of one uid) a process is told "busy" and redeems
    /// its tickets as before; a channel that closes gives its slot back (nothing leaks),
    /// and the next process gets one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_process_past_the_channel_budget_is_told_busy_and_keeps_its_tickets() {
        use crate::arbiter::tests::req;
        use crate::fd::tickets::{Binding, Recipient};
        use crate::session::Peer;
        let Serving {
            _dir,
            path,
            arb,
            stop,
            uid,
            me,
        } = serving_with_channels(4, 2).await;
        let path2 = path.clone();
        let mut holders = tokio::task::spawn_blocking(move || fork_channel_holders(&path2, 2))
            .await
            .unwrap();
        assert_eq!(holders.answers, [CHANNEL_OPEN_REPLY; 2]);
        let path2 = path.clone();
        let (said, conn) = tokio::task::spawn_blocking(move || open_channel(&path2))
            .await
            .unwrap();
        assert_eq!(said, BUSY_REPLY, "a third channel of one uid");
        let mut b = [0u8; 1];
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(std::io::Read::read(&mut &conn, &mut b).unwrap(), 0);
        assert_eq!(arb.tickets().channels().len(), 2);
        // Counted as a busy channel, not as a busy ticket connection.
        let text = arb
            .views()
            .metrics_text(crate::metrics::Format::PrometheusText)
            .await;
        for line in [
            "gpu_broker_ticket_refusals_total{reason=\"channel_busy\"} 1",
            "gpu_broker_ticket_refusals_total{reason=\"busy\"} 0",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }

        // Its descriptors come with tickets.
        let peer = Peer {
            pid: Some(me),
            uid: Some(uid),
            unix: true,
        };
        let (own, _rx) = arb.open_session("a", "own", peer).unwrap();
        let l = arb.acquire(req("a", own, 4 << 20)).await.unwrap();
        let crate::device::Handle::Fd { fd, .. } = &l.handle;
        let k = arb.tickets().mint(
            l.id,
            Binding { uid, pid: Some(me) },
            fd.clone(),
            Recipient::SessionProcess(l.live.clone()),
        );
        gpu_broker_client::fd::fetch(&path, &k, None).await.unwrap();

        // One holder ends: its slot comes back, and this process gets a channel.
        drop(holders.children.pop());
        assert_eq!(channels_become(&arb, 1).await, 1);
        let path2 = path.clone();
        let (said, _mine) = tokio::task::spawn_blocking(move || open_channel(&path2))
            .await
            .unwrap();
        assert_eq!(said, CHANNEL_OPEN_REPLY);
        assert_eq!(arb.tickets().channels().len(), 2);
        stop.cancel();
    }
}
