//! Which handle kind a lease reply carries, and the tickets of fd handles. A request names
//! the kinds it accepts (`accept_handles`; empty means any: older workers). The broker
//! serves one kind, **fd**: CUDA VMM memory or a memfd, delivered by the ticket server to
//! the calling process only. It needs a Unix-socket caller (its uid and pid come from the
//! kernel) and a running ticket server; a TCP caller cannot receive `SCM_RIGHTS` and gets
//! `FAILED_PRECONDITION`.
//!
//! `cuda_ipc` (legacy CUDA IPC handles) is no longer served: any process on the node can
//! forge them (`docs/security.md`). A request that accepts it but not fd gets
//! [`BrokerError::LegacyHandlesRemoved`]. `host_shm` is accepted in requests (old workers
//! name it) but never served.

use crate::arbiter::Arbiter;
use crate::error::BrokerError;
use crate::fd::tickets::{Binding, Recipient};
use crate::lease::{LeaseView, LiveMark};
use crate::session::Peer;
use gpu_broker_proto::v1 as pb;

/// The kinds a request accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accept {
    pub fd: bool,
    /// Names the removed legacy kind (only to say so when it names no kind served).
    pub cuda_ipc: bool,
}

/// Reads `accept_handles`: empty means any kind (the broker serves fd); unknown values are
/// `INVALID_ARGUMENT`.
// Names the deprecated legacy kind on purpose: to answer it with LEGACY_HANDLES_REMOVED.
#[allow(deprecated)]
pub fn parse_accept(kinds: &[i32]) -> Result<Accept, BrokerError> {
    if kinds.is_empty() {
        return Ok(Accept {
            fd: true,
            cuda_ipc: false,
        });
    }
    let mut a = Accept {
        fd: false,
        cuda_ipc: false,
    };
    for &k in kinds.iter().take(16) {
        match pb::HandleKind::try_from(k) {
            Ok(pb::HandleKind::Fd) => a.fd = true,
            Ok(pb::HandleKind::CudaIpc) => a.cuda_ipc = true,
            Ok(pb::HandleKind::HostShm) | Ok(pb::HandleKind::Unspecified) => {}
            Err(_) => {
                return Err(BrokerError::InvalidArgument(format!(
                    "unknown handle kind {k} in accept_handles"
                )))
            }
        }
    }
    Ok(a)
}

/// The ticket binding of `caller`, when it can receive an fd at all.
fn binding(arb: &Arbiter, caller: &Peer) -> Result<Binding, BrokerError> {
    if arb.tickets().socket().is_none() {
        return Err(BrokerError::NoTicketServer);
    }
    match (caller.unix, caller.uid) {
        (true, Some(uid)) => Ok(Binding {
            uid,
            pid: caller.pid.filter(|&p| p != 0),
        }),
        _ => Err(BrokerError::FdNeedsUnixSocket),
    }
}

/// Checks before a grant that the caller can use what leases carry (fd handles).
pub fn check_servable(arb: &Arbiter, accept: Accept, caller: &Peer) -> Result<(), BrokerError> {
    if !accept.fd {
        if accept.cuda_ipc {
            return Err(BrokerError::LegacyHandlesRemoved);
        }
        return Err(BrokerError::FdHandlesNotAccepted);
    }
    binding(arb, caller).map(|_| ())
}

/// The session a lease or request names must belong to the caller's uid when both are
/// known: a ticket goes to the session's user only.
pub fn check_same_user(session: &Peer, caller: &Peer) -> Result<(), BrokerError> {
    match (session.uid, caller.uid) {
        (Some(s), Some(c)) if s != c => Err(BrokerError::SessionOfAnotherUser),
        _ => Ok(()),
    }
}

/// The reply's `FdHandle` with a fresh ticket bound to `caller`; `session` is the peer of
/// the lease's session (a caller with its pid is the session's own process, which the
/// ticket server then need not ask the arbiter about).
pub fn fd_handle(
    arb: &Arbiter,
    view: &LeaseView,
    caller: &Peer,
    session: &Peer,
) -> Result<pb::FdHandle, BrokerError> {
    let crate::device::Handle::Fd {
        kind,
        fd,
        block_id,
        size,
    } = &view.handle;
    let mem = Memory {
        id: view.id,
        kind: *kind,
        fd,
        block_id: *block_id,
        size: *size,
    };
    fd_handle_to(arb, &mem, caller, recipient(caller, session, &view.live))
}

/// Whom a lease's descriptor for `caller` goes to: the session's own process when the
/// kernel showed both pids and they are one; either way with the lease's mark. A session's
/// peer is fixed when the session opens, so the ticket server's own look would find the
/// same.
fn recipient(caller: &Peer, session: &Peer, live: &LiveMark) -> Recipient {
    match (caller.pid.filter(|&p| p != 0), session.pid) {
        (Some(c), Some(s)) if c == s => Recipient::SessionProcess(live.clone()),
        _ => Recipient::Other(Some(live.clone())),
    }
}

/// The memory a ticket delivers: lease or import `id`'s descriptor and what the
/// `FdHandle` says of it.
struct Memory<'a> {
    id: uuid::Uuid,
    kind: crate::device::MemoryKind,
    fd: &'a crate::device::SharedFd,
    block_id: u64,
    size: u64,
}

/// Can `caller` receive descriptors at all (a Unix-socket peer, a ticket server running)?
pub fn check_fd_receivable(arb: &Arbiter, caller: &Peer) -> Result<(), BrokerError> {
    binding(arb, caller).map(|_| ())
}

/// An `FdHandle` for the memory `fd` of lease or import `id`, with a fresh ticket bound
/// to `caller`. An import's descriptor is always delivered through the arbiter's check (a
/// lingering import delivers nothing more, even to its session's process).
pub fn fd_handle_of(
    arb: &Arbiter,
    id: uuid::Uuid,
    kind: crate::device::MemoryKind,
    fd: &crate::device::SharedFd,
    block_id: u64,
    size: u64,
    caller: &Peer,
) -> Result<pb::FdHandle, BrokerError> {
    let mem = Memory {
        id,
        kind,
        fd,
        block_id,
        size,
    };
    fd_handle_to(arb, &mem, caller, Recipient::Other(None))
}

fn fd_handle_to(
    arb: &Arbiter,
    mem: &Memory<'_>,
    caller: &Peer,
    to: Recipient,
) -> Result<pb::FdHandle, BrokerError> {
    let bind = binding(arb, caller)?;
    let tickets = arb.tickets();
    let socket = tickets.socket().unwrap_or_default();
    let ticket = tickets.mint(mem.id, bind, mem.fd.clone(), to);
    Ok(pb::FdHandle {
        socket_path: socket.to_string_lossy().into_owned(),
        ticket: ticket.to_vec(),
        memory_kind: crate::service::convert::memory_kind(mem.kind) as i32,
        block_id: mem.block_id,
        size: mem.size,
        ticket_ttl_ms: u64::try_from(tickets.ttl().as_millis()).unwrap_or(u64::MAX),
        retained: false,
        pushed: false,
    })
}

/// The reply's `FdHandle` for a lease whose descriptor was just sent on its process's
/// descriptor channel (`descriptor_channels.rs`): only when `caller` is the lease's
/// session's own process (its pid) and that process's channel is open (pid, uid and
/// start time all the session's). No ticket is minted. `None`: nothing was sent (no such
/// channel, too many unread on it, the lease already ended): mint a ticket as before.
pub fn pushed_handle(
    arb: &Arbiter,
    view: &LeaseView,
    caller: &Peer,
    session: &crate::arbiter::SessionPeer,
) -> Option<pb::FdHandle> {
    let socket = arb.tickets().socket()?;
    let pid = caller.pid.filter(|&p| p != 0 && caller.unix)?;
    let uid = caller.uid?;
    if session.peer.pid != Some(pid) || session.peer.uid != Some(uid) {
        return None;
    }
    let to = crate::fd::descriptor_channels::Owner {
        pid,
        uid,
        start: session.start?,
    };
    // An ended lease's descriptor goes nowhere (a ticket for it would be a tombstone).
    if !view.live.is_live() {
        return None;
    }
    let crate::device::Handle::Fd {
        kind,
        fd,
        block_id,
        size,
    } = &view.handle;
    let sent = std::os::fd::AsFd::as_fd(&*fd.0);
    crate::fd::ticket_server::push(arb.tickets().channels(), to, view.id, sent).ok()?;
    arb.metrics().descriptor_pushed();
    Some(pb::FdHandle {
        socket_path: socket.to_string_lossy().into_owned(),
        ticket: Vec::new(),
        memory_kind: crate::service::convert::memory_kind(*kind) as i32,
        block_id: *block_id,
        size: *size,
        ticket_ttl_ms: 0,
        retained: false,
        pushed: true,
    })
}

/// The reply's `FdHandle` for a lease made of a block its caller retained mapped
/// (`arbiter/retained.rs`): the caller is the process that has the descriptor, so no
/// ticket is minted; it reuses its import and mapping of `block_id`.
pub fn retained_handle(arb: &Arbiter, view: &LeaseView) -> pb::FdHandle {
    let crate::device::Handle::Fd {
        kind,
        block_id,
        size,
        ..
    } = &view.handle;
    let socket = arb.tickets().socket().unwrap_or_default();
    pb::FdHandle {
        socket_path: socket.to_string_lossy().into_owned(),
        ticket: Vec::new(),
        memory_kind: crate::service::convert::memory_kind(*kind) as i32,
        block_id: *block_id,
        size: *size,
        ticket_ttl_ms: 0,
        retained: true,
        pushed: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(pid: Option<u32>) -> Peer {
        Peer {
            pid,
            uid: Some(1000),
            unix: true,
        }
    }

    #[test]
    fn only_a_caller_whose_pid_is_the_sessions_is_its_process() {
        let mark = LiveMark::default();
        let of = |c, s| recipient(&peer(c), &peer(s), &mark);
        assert_eq!(
            of(Some(7), Some(7)),
            Recipient::SessionProcess(mark.clone())
        );
        // A forked child or another process of the user: tracked before delivery.
        let other = Recipient::Other(Some(mark.clone()));
        assert_eq!(of(Some(8), Some(7)), other);
        // Without both pids from the kernel nothing is known.
        assert_eq!(of(None, Some(7)), other);
        assert_eq!(of(Some(7), None), other);
        assert_eq!(of(None, None), other);
        assert_eq!(of(Some(0), Some(0)), other);
    }

    /// The service mints a lease's ticket outside the arbiter's lock: a ticket for the
    /// session's own process minted from a grant's view after the lease ended is refused
    /// by the table (the ticket server would not ask the arbiter), while one minted before
    /// is redeemed as the session process's and one for another process is left to the
    /// arbiter's look (what the server then does: `ticket_server.rs`'s tests).
    #[tokio::test]
    async fn an_own_process_ticket_minted_after_the_end_delivers_nothing() {
        use crate::arbiter::{host_arbiter, ArbiterConfig};
        let arb = host_arbiter(64 << 20, 1, ArbiterConfig::default());
        arb.tickets()
            .set_socket(std::path::Path::new("/nonexistent/t.sock"));
        let q = crate::arbiter::tests::quota(64 << 20);
        arb.set_quota("a", q).unwrap();
        let me = Peer {
            pid: Some(std::process::id()),
            uid: Some(1000),
            unix: true,
        };
        let (s, _rx) = arb.open_session("a", "t", me).unwrap();
        let session = arb.sessions().peer("a", s).unwrap();
        let req = crate::arbiter::tests::req("a", s, 4 << 20);
        let (uid, pid) = (1000, me.pid);

        let live = arb.acquire(req.clone()).await.unwrap();
        let h = fd_handle(&arb, &live, &me, &session).unwrap();
        let got = arb.tickets().redeem(&h.ticket, uid, pid).unwrap();
        assert!(matches!(got.to, Recipient::SessionProcess(_)));
        assert_eq!(got.lease, live.id);

        let ended = arb.acquire(req).await.unwrap();
        arb.release("a", ended.id).unwrap();
        let late = fd_handle(&arb, &ended, &me, &session).unwrap();
        assert_eq!(
            arb.tickets().redeem(&late.ticket, uid, pid).unwrap_err(),
            crate::fd::tickets::Refusal::LeaseEnded
        );
        // Another process of the user goes through the arbiter's look.
        let child = Peer { pid: Some(1), ..me };
        let other = fd_handle(&arb, &live, &child, &session).unwrap();
        let got = arb.tickets().redeem(&other.ticket, uid, Some(1)).unwrap();
        assert!(got.to.needs_arbiter());
    }

    #[test]
    #[allow(deprecated)] // the legacy kind, still parsed
    fn empty_accepts_fd_and_unknown_kinds_are_refused() {
        assert_eq!(
            parse_accept(&[]).unwrap(),
            Accept {
                fd: true,
                cuda_ipc: false
            }
        );
        let only_fd = parse_accept(&[pb::HandleKind::Fd as i32]).unwrap();
        assert!(only_fd.fd && !only_fd.cuda_ipc);
        let shm = parse_accept(&[pb::HandleKind::HostShm as i32]).unwrap();
        assert!(!shm.fd && !shm.cuda_ipc);
        let legacy = parse_accept(&[pb::HandleKind::CudaIpc as i32]).unwrap();
        assert!(!legacy.fd && legacy.cuda_ipc);
        assert!(matches!(
            parse_accept(&[99]),
            Err(BrokerError::InvalidArgument(_))
        ));
    }

    #[test]
    fn another_users_session_is_refused() {
        let p = |uid| Peer {
            uid,
            pid: None,
            unix: true,
        };
        assert!(check_same_user(&p(Some(1)), &p(Some(1))).is_ok());
        assert!(check_same_user(&p(None), &p(Some(1))).is_ok());
        assert!(matches!(
            check_same_user(&p(Some(1)), &p(Some(2))),
            Err(BrokerError::SessionOfAnotherUser)
        ));
    }
}
