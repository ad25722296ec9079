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
