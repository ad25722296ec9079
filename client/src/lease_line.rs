//! A session's lease line: a connection to the broker's ticket socket on which this
//! process leases again, and releases, the blocks it retained
//! ([`crate::Session::retain_mappings`]) without a gRPC call: one small framed request and
//! answer on a kept Unix connection instead of an HTTP/2 round trip, the whole cost of a
//! retained lease (protocol: `gpu_broker_proto::ticket`, `docs/protocol.md`).
//!
//! The broker serves on it only what the gRPC call would do for a retained block; for
//! anything else it answers "not here" and the caller makes the gRPC call, as it does when
//! there is no line (an older broker, one at its limit, `GPU_BROKER_CLIENT_LEASE_LINE=off`)
//! or the line failed. A request goes on the line only when the answer can be awaited
//! alone: one request at a time (a second caller meanwhile takes gRPC). A line belongs to
//! the process that opened it (a forked child opens its own) and to one broker session (a
//! resumed session after a restart opens another).

use gpu_broker_proto::ticket::{
    BUSY_REPLY, LINE_ACQUIRE, LINE_FRAME_HEAD, LINE_GRANTED, LINE_HELLO, LINE_HELLO_LEN,
    LINE_MAX_PAYLOAD, LINE_NOT_HERE, LINE_OPEN_REPLY, LINE_RELEASE, LINE_RELEASED,
};
use gpu_broker_proto::v1 as pb;
use parking_lot::Mutex;
use prost::Message;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// A broker that refused a line (an older one, or it did not take this process as the
/// session's) is asked again after this long.
pub const REFUSED_FOR: Duration = Duration::from_secs(60);
/// A broker at its line limit is asked again after this long.
pub const BUSY_FOR: Duration = Duration::from_secs(1);
/// How long opening a line may take before it is given up (the request then goes over
/// gRPC).
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// The variable that turns lines off (`off`), for a side-by-side measurement.
pub const LINE_ENV: &str = "GPU_BROKER_CLIENT_LEASE_LINE";

/// Lines are on unless [`LINE_ENV`] says `off` (read once).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(LINE_ENV).map_or(true, |v| v != "off"))
}

/// One session's line, and what is known of the broker's ticket socket.
#[derive(Default)]
pub(crate) struct LeaseLine {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The line, when open and not in use.
    conn: Option<Conn>,
    /// A request is on the line (its caller holds the connection).
    busy: bool,
    /// Where the broker's ticket socket is (from a lease's handle).
    places: Vec<PathBuf>,
    /// Not asked again before then.
    refused_until: Option<Instant>,
}

struct Conn {
    stream: UnixStream,
    /// The process that opened it.
    owner: u32,
    /// The broker session it serves.
    session: String,
}

impl LeaseLine {
    /// Notes where the broker's ticket socket is (the candidates for a lease's
    /// `socket_path`, `crate::fd::candidates`).
    pub fn remember(&self, places: Vec<PathBuf>) {
        if !places.is_empty() {
            self.state.lock().places = places;
        }
    }

    /// `AcquireLease` on the line of session `session`: the grant of a retained block, or
    /// `None` (not here, no line, or it failed): ask over gRPC.
    pub async fn acquire(
        &self,
        session: &str,
        req: &pb::AcquireLeaseRequest,
    ) -> Option<pb::AcquireLeaseResponse> {
        let (kind, body) = self.ask(session, LINE_ACQUIRE, req.encode_to_vec()).await?;
        match kind {
            LINE_GRANTED => pb::AcquireLeaseResponse::decode(body.as_slice()).ok(),
            _ => None,
        }
    }

    /// `ReleaseLease` (retaining, may decline) on the line of session `session`; `None`:
    /// ask over gRPC.
    pub async fn release(
        &self,
        session: &str,
        req: &pb::ReleaseLeaseRequest,
    ) -> Option<pb::ReleaseLeaseResponse> {
        let (kind, body) = self.ask(session, LINE_RELEASE, req.encode_to_vec()).await?;
        match kind {
            LINE_RELEASED => pb::ReleaseLeaseResponse::decode(body.as_slice()).ok(),
            _ => None,
        }
    }

    /// One request on the line (opened first if need be); its answer's kind and payload.
    async fn ask(&self, session: &str, kind: u8, body: Vec<u8>) -> Option<(u8, Vec<u8>)> {
        if !enabled() || body.len() > LINE_MAX_PAYLOAD {
            return None;
        }
        let mut conn = self.take(session).await?;
        let answer = exchange(&mut conn.stream, kind, &body).await;
        let mut st = self.state.lock();
        st.busy = false;
        // A broken line is dropped (closed); the next request opens another.
        let answer = answer.ok()?;
        st.conn = Some(conn);
        Some(answer)
    }

    /// The line for `session`, marked in use; opened when there is none (and the broker
    /// was not asked lately). `None`: another request is on it, or there is none.
    async fn take(&self, session: &str) -> Option<Conn> {
        let me = std::process::id();
        let place = {
            let mut st = self.state.lock();
            if st.busy {
                return None;
            }
            let conn = st.conn.take();
            if let Some(c) = conn.filter(|c| c.owner == me && c.session == session) {
                st.busy = true;
                return Some(c);
            }
            if st.refused_until.is_some_and(|t| Instant::now() < t) {
                return None;
            }
            // Known once a block was retained.
            let place = st.places.first().cloned()?;
            st.busy = true;
            place
        };
        let opened = tokio::time::timeout(OPEN_TIMEOUT, open(&place, session)).await;
        let mut st = self.state.lock();
        match opened {
            Ok(Ok(stream)) => Some(Conn {
                stream,
                owner: me,
                session: session.to_string(),
            }),
            Ok(Err(until)) => {
                st.busy = false;
                st.refused_until = Some(until);
                None
            }
            Err(_) => {
                st.busy = false;
                st.refused_until = Some(Instant::now() + BUSY_FOR);
                None
            }
        }
    }
}

/// Opens the line of `session` on the ticket socket at `path`; `Err(until)`: refused or
/// busy, not to be asked again before `until`.
async fn open(path: &std::path::Path, session: &str) -> Result<UnixStream, Instant> {
    let refused = Instant::now() + REFUSED_FOR;
    let id = uuid::Uuid::parse_str(session).map_err(|_| refused)?;
    let mut stream = UnixStream::connect(path).await.map_err(|_| refused)?;
    let mut hello = [0u8; LINE_HELLO_LEN];
    hello[..LINE_HELLO.len()].copy_from_slice(&LINE_HELLO);
    hello[LINE_HELLO.len()..].copy_from_slice(id.as_bytes());
    stream.write_all(&hello).await.map_err(|_| refused)?;
    let mut reply = [0u8; 1];
    match stream.read(&mut reply).await {
        Ok(1) if reply[0] == LINE_OPEN_REPLY => Ok(stream),
        Ok(1) if reply[0] == BUSY_REPLY => Err(Instant::now() + BUSY_FOR),
        _ => Err(refused),
    }
}

/// Sends one request and reads its answer. No deadline, as a gRPC call has none: the
/// broker answers at once (it never queues or waits on a line) or closes the line, which
/// it does only before reading a request or on a malformed one, so a line that breaks
/// did not serve it (but where the broker itself died).
async fn exchange(
    stream: &mut UnixStream,
    kind: u8,
    body: &[u8],
) -> std::io::Result<(u8, Vec<u8>)> {
    let mut frame = Vec::with_capacity(LINE_FRAME_HEAD + body.len());
    frame.push(kind);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame).await?;
    let mut head = [0u8; LINE_FRAME_HEAD];
    stream.read_exact(&mut head).await?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > LINE_MAX_PAYLOAD || !matches!(head[0], LINE_GRANTED | LINE_RELEASED | LINE_NOT_HERE) {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).await?;
    Ok((head[0], payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    const SESSION: &str = "0190a7a4-0000-7000-8000-000000000001";

    /// A stand-in ticket socket: each connection is counted and handed to `serve`.
    fn fake_broker<F, Fut>(serve: F) -> (tempfile::TempDir, PathBuf, Arc<AtomicUsize>)
    where
        F: Fn(UnixStream) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(s));
            }
        });
        (dir, path, accepted)
    }

    fn request() -> pb::AcquireLeaseRequest {
        pb::AcquireLeaseRequest {
            session_id: SESSION.into(),
            bytes: 1 << 20,
            ..Default::default()
        }
    }

    /// A broker that does not know lines (it closes the connection at the hello) is not
    /// asked again for a while: every lease meanwhile goes to gRPC with no connect.
    #[tokio::test]
    async fn a_broker_without_lines_is_not_asked_at_every_lease() {
        let (_dir, path, accepted) = fake_broker(|s| async move { drop(s) });
        let line = LeaseLine::default();
        assert!(
            line.acquire(SESSION, &request()).await.is_none(),
            "no place known"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 0);
        line.remember(vec![path]);
        for _ in 0..3 {
            assert!(line.acquire(SESSION, &request()).await.is_none());
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    /// A line the broker closed (idle) fails its next request, which then goes to gRPC;
    /// the request after opens another line and is answered on it.
    #[tokio::test]
    async fn a_line_closed_under_the_client_is_opened_again() {
        let served = Arc::new(AtomicUsize::new(0));
        let count = served.clone();
        let (_dir, path, accepted) = fake_broker(move |mut s| {
            let count = count.clone();
            async move {
                let mut hello = [0u8; LINE_HELLO_LEN];
                s.read_exact(&mut hello).await.unwrap();
                s.write_all(&[LINE_OPEN_REPLY]).await.unwrap();
                // The first line closes before any request; the others answer one.
                if count.fetch_add(1, Ordering::SeqCst) == 0 {
                    return;
                }
                let mut head = [0u8; LINE_FRAME_HEAD];
                s.read_exact(&mut head).await.unwrap();
                let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
                let mut body = vec![0u8; len];
                s.read_exact(&mut body).await.unwrap();
                let reply = pb::AcquireLeaseResponse {
                    lease: Some(pb::Lease {
                        lease_id: "l".into(),
                        ..Default::default()
                    }),
                }
                .encode_to_vec();
                let mut frame = vec![LINE_GRANTED];
                frame.extend_from_slice(&(reply.len() as u32).to_le_bytes());
                frame.extend_from_slice(&reply);
                s.write_all(&frame).await.unwrap();
                let _ = s.read(&mut [0u8; 1]).await;
            }
        });
        let line = LeaseLine::default();
        line.remember(vec![path]);
        assert!(line.acquire(SESSION, &request()).await.is_none(), "closed");
        let granted = line.acquire(SESSION, &request()).await.unwrap();
        assert_eq!(granted.lease.unwrap().lease_id, "l");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        // A line is one session's: another session's request opens its own.
        let other = "0190a7a4-0000-7000-8000-000000000002";
        let mut req = request();
        req.session_id = other.into();
        assert!(line.acquire(other, &req).await.is_some());
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }
}
