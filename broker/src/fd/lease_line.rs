//! Lease lines: a connection to the ticket socket on which a session's own process leases
//! and releases the blocks it retained (`arbiter/retained.rs`) without a gRPC call. A
//! retained block's lease needs no queue, no device and no descriptor, so over gRPC it is
//! the HTTP/2 round trip alone, which costs more than the driver's own allocation and map
//! of a small block; a line is one framed request and answer on a kept Unix connection.
//!
//! - Opened by `LINE_HELLO` and the session's id as a connection's first bytes
//!   (`gpu_broker_proto::ticket`), written by the process that connected, which must be
//!   the session's own (pid, uid and start time, as the kernel names it: `SO_PEERCRED`,
//!   `SO_PEERPIDFD`); a session opened with a claim's token has none (its leases are the
//!   claim's, checked on every gRPC acquire).
//! - It serves only what the retained path of `AcquireLease` and `ReleaseLease` would do,
//!   with the same checks under the same lock (`Retained::acquire`, `Retained::release`),
//!   the tenant's call rate and the token's expiry. Anything else is answered
//!   `LINE_NOT_HERE`: nothing was done, the client asks over gRPC, which answers whatever
//!   it is (a refusal included). So the line never refuses and never waits.
//! - A frame that is not one (an unknown kind, a payload too long or not the message it
//!   should be), a frame begun and not finished within [`FRAME_TIMEOUT`], an answer not
//!   taken within it, or [`LINE_IDLE`] without a request closes the line; the client opens
//!   another. One line per session (a newer one closes the older). Lines have their own
//!   slots ([`MAX_LINES`], [`MAX_LINES_PER_UID`]), beside the ticket connections' and the
//!   descriptor channels'.
//! - Who wrote the hello is checked; later frames are not (a descriptor of the line passed
//!   to another process, or a forked child, speaks as the session's process, as on the
//!   session's own gRPC connection). The token's expiry is as known when the line opened
//!   (a revoked token ends its sessions at once, an expired one at the next sweep).

use crate::arbiter::{Arbiter, LineSession, Retaining};
use crate::listener::{ConnPermit, ConnTracker};
use crate::service::convert;
use gpu_broker_proto::ticket::{
    line_frame, line_payload_len, LINE_ACQUIRE, LINE_FRAME_HEAD, LINE_GRANTED, LINE_MAX_PAYLOAD,
    LINE_NOT_HERE, LINE_OPEN_REPLY, LINE_RELEASE, LINE_RELEASED,
};
use gpu_broker_proto::v1 as pb;
use parking_lot::Mutex;
use prost::Message;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Most lease lines open at once (one per session that retains blocks; past it sessions
/// lease over gRPC). Their descriptors are part of the broker's reserve (`fd_budget.rs`).
pub const MAX_LINES: usize = 256;
/// Most lease lines of one peer uid: half, so one user cannot take every line.
pub const MAX_LINES_PER_UID: usize = 128;
/// How long a line stays open with no request: a process leasing now and then keeps it.
pub const LINE_IDLE: Duration = Duration::from_secs(30);
/// How long the rest of the hello, or of a frame begun, may take.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(5);

/// The open lines' slots, and each session's line (a newer one ends the older).
pub(crate) struct Lines {
    slots: Arc<ConnTracker>,
    by_session: Mutex<HashMap<Uuid, (u64, CancellationToken)>>,
    next: std::sync::atomic::AtomicU64,
}

impl Lines {
    pub(crate) fn new(slots: Arc<ConnTracker>) -> Lines {
        Lines {
            slots,
            by_session: Mutex::default(),
            next: Default::default(),
        }
    }

    /// Registers a line of `session`, ending the one it had; its key and end.
    fn register(&self, session: Uuid) -> (u64, CancellationToken) {
        let key = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let end = CancellationToken::new();
        if let Some((_, older)) = self.by_session.lock().insert(session, (key, end.clone())) {
            older.cancel();
        }
        (key, end)
    }

    /// Forgets line `key` of `session` (unless a newer one took its place).
    fn forget(&self, session: Uuid, key: u64) {
        let mut lines = self.by_session.lock();
        if lines.get(&session).is_some_and(|(k, _)| *k == key) {
            lines.remove(&session);
        }
    }
}

/// The line's session and its process, as checked when it opened.
struct Line {
    session: Uuid,
    tenant: String,
    pid: u32,
    uid: u32,
    /// When the session's token stops authenticating (ms since the epoch; `None`: never).
    token_expires: Option<i64>,
    /// The token's hash, to mark it used (`None`: a broker without tokens).
    token_hash: Option<[u8; 32]>,
}

/// Makes `stream` (whose first 32 bytes were `LINE_HELLO`, written by `writers`) the lease
/// line of the session its next 16 bytes name, when the process that connected is that
/// session's own; else closes it. A line takes a slot of `lines` and gives back its ticket
/// connection slot (`permit`); none free: answered "busy" and closed. Then serves it until
/// it closes.
pub(crate) async fn serve(
    mut stream: UnixStream,
    cred: Option<tokio::net::unix::UCred>,
    writers: &[u32],
    arb: &Arc<Arbiter>,
    permit: ConnPermit,
    lines: &Lines,
) {
    let uid = cred.map(|c| c.uid());
    let pid = crate::fd::ticket_server::peer_pid(cred);
    let mut id = [0u8; 16];
    let rest = tokio::time::timeout(
        FRAME_TIMEOUT,
        crate::fd::ticket_read::read_exact_with_writers(&stream, &mut id),
    )
    .await;
    let rest_writers = match rest {
        Ok(Ok(w)) => w.writers,
        _ => return,
    };
    let line = match (pid, uid) {
        (Some(p), Some(u)) if writers == [p] && rest_writers == [p] => {
            line_for(arb, &stream, Uuid::from_bytes(id), p, u)
        }
        _ => None,
    };
    let Some(line) = line else {
        arb.metrics()
            .ticket_refused(crate::fd::tickets::Refusal::Foreign.as_str());
        // Also what a session's process in another pid namespace meets every minute.
        tracing::debug!(
            ?uid,
            ?pid,
            ?writers,
            "lease line refused; connection closed"
        );
        return;
    };
    let slot = crate::fd::ticket_server::slot_or_busy(
        &lines.slots,
        uid,
        &stream,
        arb,
        crate::metrics::LINE_BUSY,
    );
    let Some(slot) = slot else { return };
    drop(permit);
    let (key, end) = lines.register(line.session);
    if stream.write_all(&[LINE_OPEN_REPLY]).await.is_ok() {
        tracing::debug!(session = %line.session, pid = line.pid, "lease line open");
        // Buffered: a request's head and body come in one read, as a rule.
        let mut stream = BufReader::with_capacity(LINE_FRAME_HEAD + LINE_MAX_PAYLOAD, stream);
        serve_requests(&mut stream, arb, &line, &end).await;
    }
    lines.forget(line.session, key);
    drop(slot);
    tracing::debug!(session = %line.session, "lease line closed");
}

/// Answers the line's requests until it closes, or `end` (a newer line of the session)
/// comes between two requests: a request read is always answered, so a line that closes
/// before an answer did not serve its request.
async fn serve_requests(
    stream: &mut BufReader<UnixStream>,
    arb: &Arc<Arbiter>,
    line: &Line,
    end: &CancellationToken,
) {
    loop {
        let next = tokio::select! {
            next = next_frame(stream) => next,
            _ = end.cancelled() => return,
        };
        let Some((kind, payload)) = next else { return };
        let Some((kind, body)) = answer(arb, line, kind, &payload) else {
            tracing::warn!(session = %line.session, kind, "malformed frame on a lease line; closed");
            return;
        };
        // Answers are bounded by the requests' own bounds (a label, ids); a client
        // that does not take one in time loses the line.
        debug_assert!(body.len() <= LINE_MAX_PAYLOAD);
        let mut frame = &line_frame(kind, &body)[..];
        if arb.crash_point().names("mid", "line-answer") {
            // The crash-point test of an answer that broke off: its first part, then death.
            let _ = stream.write_all(&frame[..LINE_FRAME_HEAD]).await;
            frame = &frame[LINE_FRAME_HEAD..];
            arb.crash_point().pass("mid", "line-answer");
        }
        let sent = tokio::time::timeout(FRAME_TIMEOUT, stream.write_all(frame)).await;
        if !matches!(sent, Ok(Ok(()))) {
            // Its process stopped reading (gone, or it gave up on the call): as a gRPC
            // answer nobody reads, what was done stays done.
            return;
        }
    }
}

/// The line of `session` for the process that connected `stream` (`pid`, `uid`), when it
/// is that session's own and its token still authenticates.
fn line_for(
    arb: &Arc<Arbiter>,
    stream: &UnixStream,
    session: Uuid,
    pid: u32,
    uid: u32,
) -> Option<Line> {
    let owner = crate::fd::descriptor_channels::owner_of(stream.as_raw_fd(), pid, uid)?;
    let LineSession {
        tenant,
        peer,
        start,
        token_id,
    } = arb.retained().line_session(session)?;
    let own = peer.unix
        && peer.pid == Some(owner.pid)
        && peer.uid == Some(owner.uid)
        && start == Some(owner.start);
    if !own {
        return None;
    }
    let token = match token_id {
        Some(id) => {
            let t = arb.authenticator().live_by_id(&id)?;
            if crate::arbiter::claims::claim_of_token_name(&t.name).is_some() {
                return None;
            }
            Some(t)
        }
        None => None,
    };
    Some(Line {
        session,
        tenant,
        pid,
        uid,
        token_expires: token.as_ref().and_then(|t| t.expires_unix_ms),
        token_hash: token.map(|t| t.hash),
    })
}

/// The next frame's kind and payload; `None` when the line closes (its end, an error, a
/// payload too long, [`LINE_IDLE`] before a frame or [`FRAME_TIMEOUT`] within one).
async fn next_frame(stream: &mut BufReader<UnixStream>) -> Option<(u8, Vec<u8>)> {
    let mut head = [0u8; LINE_FRAME_HEAD];
    // The first byte may be long in coming; the rest of the frame may not.
    tokio::time::timeout(LINE_IDLE, stream.read_exact(&mut head[..1]))
        .await
        .ok()?
        .ok()?;
    let rest = async {
        stream.read_exact(&mut head[1..]).await?;
        let len = line_payload_len(&head).ok_or(std::io::ErrorKind::InvalidData)?;
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).await?;
        Ok::<_, std::io::Error>(payload)
    };
    let payload = tokio::time::timeout(FRAME_TIMEOUT, rest).await.ok()?.ok()?;
    Some((head[0], payload))
}

/// The answer to one request (its kind and payload); `None`: not a request, the line closes.
fn answer(arb: &Arc<Arbiter>, line: &Line, kind: u8, payload: &[u8]) -> Option<(u8, Vec<u8>)> {
    match kind {
        LINE_ACQUIRE => {
            let r = pb::AcquireLeaseRequest::decode(payload).ok()?;
            Some(match acquire(arb, line, r) {
                Some(reply) => {
                    arb.metrics().line_request("acquire", "granted");
                    (LINE_GRANTED, reply.encode_to_vec())
                }
                None => {
                    arb.metrics().line_request("acquire", "not_here");
                    (LINE_NOT_HERE, Vec::new())
                }
            })
        }
        LINE_RELEASE => {
            let r = pb::ReleaseLeaseRequest::decode(payload).ok()?;
            Some(match release(arb, line, &r) {
                Some(reply) => {
                    arb.metrics().line_request("release", "released");
                    (LINE_RELEASED, reply.encode_to_vec())
                }
                None => {
                    arb.metrics().line_request("release", "not_here");
                    (LINE_NOT_HERE, Vec::new())
                }
            })
        }
        _ => None,
    }
}

/// Has the session's token expired since the line opened?
fn token_expired(line: &Line) -> bool {
    let now = crate::units::unix_ms(std::time::SystemTime::now());
    line.token_expires.is_some_and(|exp| now >= exp)
}

/// Runs `serve` as one call of the line's tenant: `None` when its token expired or its
/// call rate is spent (gRPC then refuses it), or when `serve` leaves it to gRPC, which
/// takes its own call (this one is given back).
fn as_a_call<T>(arb: &Arbiter, line: &Line, serve: impl FnOnce() -> Option<T>) -> Option<T> {
    if token_expired(line) {
        return None;
    }
    if let Some(h) = &line.token_hash {
        let now = crate::units::unix_ms(std::time::SystemTime::now());
        arb.authenticator().mark_used(h, now);
    }
    let limits = arb.rate_limits();
    if limits.is_some_and(|l| l.take(&line.tenant, Instant::now()).is_err()) {
        return None;
    }
    let served = serve();
    if served.is_none() {
        if let Some(l) = limits {
            l.give_back(&line.tenant);
        }
    }
    served
}

/// `AcquireLease` of a block the line's process retained; `None`: not served here.
fn acquire(
    arb: &Arc<Arbiter>,
    line: &Line,
    mut r: pb::AcquireLeaseRequest,
) -> Option<pb::AcquireLeaseResponse> {
    if r.session_id != line.session.to_string() || r.host_tier {
        return None;
    }
    let caller = crate::session::Peer {
        pid: Some(line.pid),
        uid: Some(line.uid),
        unix: true,
    };
    let accept = crate::fd::handles::parse_accept(&std::mem::take(&mut r.accept_handles)).ok()?;
    crate::fd::handles::check_servable(arb, accept, &caller).ok()?;
    let asked = convert::acquire_request(line.tenant.clone(), line.session, r).ok()?;
    let valid = arb.validate(asked).ok()?;
    let view = as_a_call(arb, line, || arb.retained().acquire(&valid, Some(line.pid)))?;
    let mut lease = convert::lease_on(&view, arb);
    lease.handle = Some(pb::lease::Handle::Fd(crate::fd::handles::retained_handle(
        arb, &view,
    )));
    Some(pb::AcquireLeaseResponse { lease: Some(lease) })
}

/// `ReleaseLease` retaining the block (`retain_mapping` and `may_decline`, as the client
/// asks) of a lease of the line's tenant; `None`: not served here.
fn release(
    arb: &Arc<Arbiter>,
    line: &Line,
    r: &pb::ReleaseLeaseRequest,
) -> Option<pb::ReleaseLeaseResponse> {
    if !(r.retain_mapping && r.may_decline) {
        return None;
    }
    let id = convert::parse_id("lease_id", &r.lease_id).ok()?;
    let answer = as_a_call(arb, line, || {
        arb.retained().release_on_line(line.session, id, line.pid)
    })?;
    Some(pb::ReleaseLeaseResponse {
        retained: answer == Retaining::Retained,
        declined: answer == Retaining::Declined,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arbiter::tests::{quota, req};
    use crate::session::Peer;
    use gpu_broker_proto::ticket::LINE_HELLO;
    use std::os::unix::net::UnixStream as StdStream;
    use tokio_util::sync::CancellationToken;

    /// A ticket server for a host arbiter (one 64 MiB device, tenant "a" allowed all of
    /// it, `cfg` its settings), with a session of this process that retained one 4 MiB
    /// block.
    struct Retainer {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
        arb: Arc<Arbiter>,
        stop: CancellationToken,
        session: Uuid,
        /// The retained block's ended lease and block id.
        ended: Uuid,
        block: u64,
        _rx: tokio::sync::mpsc::UnboundedReceiver<crate::session::SessionEvent>,
    }

    fn me() -> Peer {
        Peer {
            pid: Some(std::process::id()),
            // SAFETY: getuid cannot fail.
            uid: Some(unsafe { libc::getuid() }),
            unix: true,
        }
    }

    fn block_of(v: &crate::lease::LeaseView) -> u64 {
        let crate::device::Handle::Fd { block_id, .. } = &v.handle;
        *block_id
    }

    async fn retaining(cfg: crate::arbiter::ArbiterConfig) -> Retainer {
        let _dir = tempfile::tempdir().unwrap();
        let path = _dir.path().join("t.sock");
        let listener = crate::fd::ticket_server::bind(&path).await.unwrap();
        let arb = crate::arbiter::host_arbiter(64 << 20, 1, cfg);
        arb.tickets().set_socket(&path);
        arb.set_quota("a", quota(64 << 20)).unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(crate::fd::ticket_server::serve(
            listener,
            arb.clone(),
            stop.clone(),
        ));
        let (session, _rx) = arb.open_session("a", "w", me()).unwrap();
        let l = arb.acquire(req("a", session, 4 << 20)).await.unwrap();
        let kept = arb
            .retained()
            .release("a", l.id, Some(std::process::id()), true)
            .unwrap();
        assert_eq!(kept, Retaining::Retained);
        Retainer {
            _dir,
            path,
            arb,
            stop,
            session,
            ended: l.id,
            block: block_of(&l),
            _rx,
        }
    }

    /// Opens a line of `session` on `path`: its first answer byte (`None`: closed).
    fn open(path: &std::path::Path, session: Uuid) -> (Option<u8>, StdStream) {
        use std::io::{Read, Write};
        let mut s = StdStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut hello = LINE_HELLO.to_vec();
        hello.extend_from_slice(session.as_bytes());
        s.write_all(&hello).unwrap();
        let mut b = [0u8; 1];
        let got = match s.read(&mut b) {
            Ok(1) => Some(b[0]),
            _ => None,
        };
        (got, s)
    }

    /// One request on a line: the answer's kind and payload (`None`: the line closed).
    fn ask(s: &mut StdStream, kind: u8, body: &[u8]) -> Option<(u8, Vec<u8>)> {
        use std::io::{Read, Write};
        s.write_all(&line_frame(kind, body)).ok()?;
        let mut head = [0u8; LINE_FRAME_HEAD];
        s.read_exact(&mut head).ok()?;
        let mut payload = vec![0u8; line_payload_len(&head)?];
        s.read_exact(&mut payload).ok()?;
        Some((head[0], payload))
    }

    fn acquire_req(session: Uuid, bytes: u64) -> Vec<u8> {
        pb::AcquireLeaseRequest {
            session_id: session.to_string(),
            bytes,
            ..Default::default()
        }
        .encode_to_vec()
    }

    /// Whether `session`'s retained 4 MiB block is leased again on line `s`.
    fn leased_again(s: &mut StdStream, session: Uuid) -> bool {
        matches!(
            ask(s, LINE_ACQUIRE, &acquire_req(session, 4 << 20)),
            Some((LINE_GRANTED, _))
        )
    }

    fn release_req(lease: &str) -> Vec<u8> {
        pb::ReleaseLeaseRequest {
            lease_id: lease.into(),
            retain_mapping: true,
            may_decline: true,
        }
        .encode_to_vec()
    }

    async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        tokio::task::spawn_blocking(f).await.unwrap()
    }

    /// The session's own process leases its retained block again on the line (the same
    /// block, answered as the gRPC call would be: a retained fd handle, no ticket), releases
    /// it retained again, and is told "not here" for what only gRPC serves (another size);
    /// each counted. A frame that is not one closes the line, and the broker opens the next.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retained_block_is_leased_and_released_again_on_its_sessions_line() {
        let r = retaining(Default::default()).await;
        let (path, session, block) = (r.path.clone(), r.session, r.block);
        let (granted, released, other) = blocking(move || {
            let (first, mut s) = open(&path, session);
            assert_eq!(first, Some(LINE_OPEN_REPLY));
            let granted = ask(&mut s, LINE_ACQUIRE, &acquire_req(session, 4 << 20)).unwrap();
            let lease = match granted {
                (LINE_GRANTED, body) => pb::AcquireLeaseResponse::decode(body.as_slice())
                    .unwrap()
                    .lease
                    .unwrap(),
                (k, _) => panic!("answered {k:#x}"),
            };
            let released = ask(&mut s, LINE_RELEASE, &release_req(&lease.lease_id)).unwrap();
            let other = ask(&mut s, LINE_ACQUIRE, &acquire_req(session, 8 << 20)).unwrap();
            // An unknown kind: closed, nothing answered.
            assert!(ask(&mut s, 0x7f, b"").is_none());
            (lease, released, other)
        })
        .await;
        let Some(pb::lease::Handle::Fd(h)) = &granted.handle else {
            panic!("{granted:?}")
        };
        assert!(h.retained && h.ticket.is_empty() && !h.pushed, "{h:?}");
        assert_eq!(h.block_id, block);
        assert_eq!(granted.bytes, 4 << 20);
        assert_eq!(released.0, LINE_RELEASED);
        let released = pb::ReleaseLeaseResponse::decode(released.1.as_slice()).unwrap();
        assert!(released.retained && !released.declined);
        assert_eq!(other, (LINE_NOT_HERE, Vec::new()));
        // Retained again: counted as quarantined, not held.
        let t = r.arb.views().tenant("a").unwrap();
        assert_eq!(
            (t.usage.held_bytes, t.usage.quarantined_bytes),
            (0, 4 << 20)
        );
        let text = r
            .arb
            .views()
            .metrics_text(crate::metrics::Format::PrometheusText)
            .await;
        for (op, answer, n) in [
            ("acquire", "granted", 1),
            ("release", "released", 1),
            ("acquire", "not_here", 1),
        ] {
            let line = format!("lease_line_requests_total{{op=\"{op}\",answer=\"{answer}\"}} {n}");
            assert!(text.contains(&line), "{line} not in\n{text}");
        }
        // A payload longer than a line carries closes it too; the next line opens.
        let path = r.path.clone();
        blocking(move || {
            use std::io::{Read, Write};
            let (first, mut s) = open(&path, session);
            assert_eq!(first, Some(LINE_OPEN_REPLY));
            let mut head = vec![LINE_ACQUIRE];
            head.extend_from_slice(&((LINE_MAX_PAYLOAD as u32) + 1).to_le_bytes());
            s.write_all(&head).unwrap();
            let mut b = [0u8; 1];
            assert_eq!(s.read(&mut b).unwrap(), 0, "closed");
            let (first, mut s) = open(&path, session);
            assert_eq!(first, Some(LINE_OPEN_REPLY));
            assert!(leased_again(&mut s, session));
        })
        .await;
        r.stop.cancel();
    }

    /// A line is its session's own process's: a session of another process, or none, gets
    /// the connection closed and no answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_line_opens_only_for_its_sessions_own_process() {
        let r = retaining(Default::default()).await;
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let theirs_peer = Peer {
            pid: Some(other.id()),
            ..me()
        };
        let (theirs, _rx) = r.arb.open_session("a", "theirs", theirs_peer).unwrap();
        let path = r.path.clone();
        let (theirs_answer, unknown_answer) =
            blocking(move || (open(&path, theirs).0, open(&path, Uuid::new_v4()).0)).await;
        assert_eq!(theirs_answer, None, "another process's session");
        assert_eq!(unknown_answer, None, "no such session");
        other.kill().unwrap();
        other.wait().unwrap();
        r.stop.cancel();
    }

    /// The hello is its connecting process's alone: a session id written by another
    /// process on the connection (a child on its parent's socket) gets it closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hello_finished_by_another_process_is_refused() {
        let r = retaining(Default::default()).await;
        let (path, session) = (r.path.clone(), r.session);
        let answer = blocking(move || {
            use std::io::{Read, Write};
            use std::os::fd::AsRawFd;
            let mut s = StdStream::connect(&path).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(&LINE_HELLO).unwrap();
            let id = *session.as_bytes();
            // SAFETY: the child calls only write and _exit (async-signal-safe).
            let child = unsafe { libc::fork() };
            assert!(child >= 0);
            if child == 0 {
                // SAFETY: a plain syscall on an inherited descriptor, then _exit.
                unsafe {
                    libc::write(s.as_raw_fd(), id.as_ptr().cast(), id.len());
                    libc::_exit(0);
                }
            }
            // SAFETY: reaping our own child.
            unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
            let mut b = [0u8; 1];
            s.read(&mut b).unwrap()
        })
        .await;
        assert_eq!(answer, 0, "closed, nothing answered");
        r.stop.cancel();
    }

    /// A session's newer line closes its older one: one line per session.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sessions_newer_line_closes_its_older() {
        let r = retaining(Default::default()).await;
        let (path, session) = (r.path.clone(), r.session);
        blocking(move || {
            use std::io::Read;
            let (first, mut older) = open(&path, session);
            assert_eq!(first, Some(LINE_OPEN_REPLY));
            let (first, mut newer) = open(&path, session);
            assert_eq!(first, Some(LINE_OPEN_REPLY));
            assert_eq!(older.read(&mut [0u8; 1]).unwrap(), 0, "closed");
            assert!(leased_again(&mut newer, session));
        })
        .await;
        r.stop.cancel();
    }

    /// A line opens for a session whose token authenticates, never for one whose token is
    /// gone (revoked, expired) or a claim's; its requests mark the token used.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_line_opens_only_while_its_sessions_token_authenticates_and_never_for_a_claim() {
        let r = retaining(Default::default()).await;
        let now = crate::units::unix_ms(std::time::SystemTime::now());
        let token = |id: &str, name: String, expires: Option<i64>, hash: u8| {
            r.arb.authenticator().add(crate::auth::TokenEntry {
                token_id: id.into(),
                tenant: "a".into(),
                hash: [hash; 32],
                description: String::new(),
                created_unix_ms: now,
                name,
                scope: crate::auth::Scope::Worker,
                expires_unix_ms: expires,
            })
        };
        token("live", "w".into(), Some(now + 600_000), 1);
        token(
            "claim",
            crate::arbiter::claims::claim_token_name("u1"),
            None,
            2,
        );
        token("expired", "w".into(), Some(now - 1), 3);
        let mut answers = Vec::new();
        for id in ["live", "claim", "expired", "unknown"] {
            let (session, _rx, _) = r
                .arb
                .sessions()
                .open("a", id, me(), Some(id.into()))
                .unwrap();
            let path = r.path.clone();
            answers.push(blocking(move || open(&path, session).0).await);
        }
        assert_eq!(answers, [Some(LINE_OPEN_REPLY), None, None, None]);
        // A request on the line marks its token used, as a call does.
        assert_eq!(r.arb.authenticator().last_used(&[1; 32]), None);
        let (session, _rx, _) = r
            .arb
            .sessions()
            .open("a", "again", me(), Some("live".into()))
            .unwrap();
        let path = r.path.clone();
        blocking(move || {
            let (_, mut s) = open(&path, session);
            ask(&mut s, LINE_ACQUIRE, &acquire_req(session, 8 << 20))
        })
        .await;
        assert!(r.arb.authenticator().last_used(&[1; 32]).is_some());
        r.stop.cancel();
    }

    /// Where gRPC would refuse or must answer, the line does nothing and says "not here",
    /// taking none of the tenant's calls: a quota lowered under the retained block (it
    /// stays retained), a release of a lease the tenant has not (a block let go), host
    /// memory; and once the tenant's call rate is spent, what it would serve; a session
    /// ended.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_line_leaves_to_grpc_what_grpc_would_refuse() {
        let cfg = crate::arbiter::ArbiterConfig {
            rate: crate::rate::RateConfig {
                rate: 0.001,
                burst: 1.0,
            },
            ..Default::default()
        };
        let r = retaining(cfg).await;
        r.arb.set_quota("a", quota(2 << 20)).unwrap();
        let (path, session, ended, arb) = (r.path.clone(), r.session, r.ended, r.arb.clone());
        let (answers, granted) = blocking(move || {
            let (first, mut s) = open(&path, session);
            assert_eq!(first, Some(LINE_OPEN_REPLY));
            let mut answers = vec![
                // Over the lowered quota.
                ask(&mut s, LINE_ACQUIRE, &acquire_req(session, 4 << 20))
                    .unwrap()
                    .0,
                // The ended lease's id names a retained block, let go only over gRPC.
                ask(&mut s, LINE_RELEASE, &release_req(&ended.to_string()))
                    .unwrap()
                    .0,
            ];
            let host = pb::AcquireLeaseRequest {
                session_id: session.to_string(),
                bytes: 4 << 20,
                host_tier: true,
                ..Default::default()
            };
            answers.push(ask(&mut s, LINE_ACQUIRE, &host.encode_to_vec()).unwrap().0);
            // None of those took the burst of one call: this does.
            arb.set_quota("a", quota(64 << 20)).unwrap();
            let (kind, body) = ask(&mut s, LINE_ACQUIRE, &acquire_req(session, 4 << 20)).unwrap();
            assert_eq!(kind, LINE_GRANTED);
            let granted = pb::AcquireLeaseResponse::decode(body.as_slice())
                .unwrap()
                .lease
                .unwrap();
            // The rate is spent: its release is gRPC's to refuse.
            answers.push(
                ask(&mut s, LINE_RELEASE, &release_req(&granted.lease_id))
                    .unwrap()
                    .0,
            );
            (answers, granted)
        })
        .await;
        assert_eq!(answers, [LINE_NOT_HERE; 4]);
        let t = r.arb.views().tenant("a").unwrap();
        assert_eq!(
            (t.usage.held_bytes, t.usage.quarantined_bytes),
            (4 << 20, 0),
            "still leased: {granted:?}"
        );

        let r = retaining(Default::default()).await;
        let (path, session) = (r.path.clone(), r.session);
        let (first, mut s) = blocking(move || open(&path, session)).await;
        assert_eq!(first, Some(LINE_OPEN_REPLY));
        r.arb.end_session(session, "test");
        let answer =
            blocking(move || ask(&mut s, LINE_ACQUIRE, &acquire_req(session, 4 << 20))).await;
        assert_eq!(answer.map(|a| a.0), Some(LINE_NOT_HERE));
        r.stop.cancel();
    }

    /// A token past its expiry takes no call on a line it opened before: nothing is served.
    #[test]
    fn a_token_past_its_expiry_takes_no_call() {
        let arb = crate::arbiter::host_arbiter(16 << 20, 1, Default::default());
        let now = crate::units::unix_ms(std::time::SystemTime::now());
        let line = |token_expires| Line {
            session: Uuid::new_v4(),
            tenant: "a".into(),
            pid: 1,
            uid: 0,
            token_expires,
            token_hash: None,
        };
        let served = |l: &Line| as_a_call(&arb, l, || Some(())).is_some();
        assert!(served(&line(None)));
        assert!(served(&line(Some(now + 60_000))));
        assert!(!served(&line(Some(now - 1))));
    }
}
