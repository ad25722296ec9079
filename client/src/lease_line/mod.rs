//! A session's lease line: a connection to the broker's ticket socket on which this
//! process leases again, and releases, the blocks it retained
//! ([`crate::Session::retain_mappings`]) without a gRPC call: one small framed request and
//! answer on a kept Unix connection instead of an HTTP/2 round trip, the whole cost of a
//! retained lease (protocol: `gpu_broker_proto::ticket`, `docs/protocol.md`).
//!
//! The broker serves on it only what the gRPC call would do for a retained block; for
//! anything else it answers "not here" and the caller makes the gRPC call, as it does when
//! there is no line (an older broker, one at its limit, `GPU_BROKER_CLIENT_LEASE_LINE=off`)
//! or the line ended before answering. An answer that began and broke off is an error,
//! not a reason to ask again: the broker may have done it. One request at a time (a
//! second caller meanwhile takes gRPC). A line belongs to the process that opened it (a
//! forked child opens its own) and to one broker session (a resumed session after a
//! restart opens another). A caller outside any task (a thread in `block_on`, as
//! Python's) waits for the answer on its own thread (`exchange.rs`).

mod exchange;

use crate::error::ClientError;
use exchange::Asked;
use gpu_broker_proto::ticket::{
    BUSY_REPLY, LINE_ACQUIRE, LINE_GRANTED, LINE_HELLO, LINE_HELLO_LEN, LINE_MAX_PAYLOAD,
    LINE_OPEN_REPLY, LINE_RELEASE, LINE_RELEASED,
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
/// A broker at its line limit, or whose socket did not answer, is asked again after this
/// long.
pub const BUSY_FOR: Duration = Duration::from_secs(1);
/// A line unused this long is opened anew rather than used: the broker closes one idle
/// for 30 s, and a request on a closed line is a round trip lost.
pub const MAX_IDLE_AGE: Duration = Duration::from_secs(25);
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
    /// Where the broker's ticket socket may be, in order (from a lease's handle).
    places: Vec<PathBuf>,
    /// Not asked again before then.
    refused_until: Option<Instant>,
}

struct Conn {
    wire: Wire,
    /// The process that opened it.
    owner: u32,
    /// The broker session it serves.
    session: String,
    /// When its last answer came.
    used: Instant,
}

/// A line's connection, non-blocking either way.
enum Wire {
    /// Registered with the runtime: a caller inside a task awaits the answer.
    Runtime(UnixStream),
    /// Not registered: a caller outside any task waits on its own thread, woken by the
    /// kernel and not by a runtime thread (which registration would also wake).
    Thread(std::os::unix::net::UnixStream),
}

impl Wire {
    /// Sends one request and reads its answer, the way the caller can wait.
    async fn exchange(self, kind: u8, body: &[u8]) -> (Option<Wire>, Result<Asked, ClientError>) {
        let Ok(wire) = self.for_caller() else {
            return (None, Ok(Asked::NotSent));
        };
        match wire {
            Wire::Runtime(mut s) => {
                let asked = exchange::on_runtime(&mut s, kind, body).await;
                (Some(Wire::Runtime(s)), asked)
            }
            Wire::Thread(mut s) => {
                match exchange::on_thread(&mut s, kind, body, exchange::THREAD_WAIT) {
                    exchange::OnThread::Done(asked) => (Some(Wire::Thread(s)), asked),
                    // Slow: the rest is awaited on the runtime, as a task's caller would.
                    exchange::OnThread::Waiting(part) => match UnixStream::from_std(s) {
                        Ok(mut s) => {
                            let asked = exchange::awaited(&mut s, part).await;
                            (Some(Wire::Runtime(s)), asked)
                        }
                        Err(e) => (
                            None,
                            Err(ClientError::Protocol(format!(
                                "a lease line's answer could not be awaited: {e}"
                            ))),
                        ),
                    },
                }
            }
        }
    }

    /// This wire as the current caller waits: on its thread when it runs outside any task
    /// of a multi-thread runtime (its thread is its own; a current-thread runtime's
    /// `block_on` also drives the runtime's other tasks), on the runtime otherwise.
    fn for_caller(self) -> std::io::Result<Wire> {
        let own_thread = tokio::task::try_id().is_none()
            && tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        Ok(match (self, own_thread) {
            (Wire::Runtime(s), true) => Wire::Thread(s.into_std()?),
            (Wire::Thread(s), false) => Wire::Runtime(UnixStream::from_std(s)?),
            (wire, _) => wire,
        })
    }
}

/// The line held by one request; let go (for the next) however the request ends, a
/// cancelled one included.
struct InUse<'a>(&'a LeaseLine);

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        self.0.state.lock().busy = false;
    }
}

impl LeaseLine {
    /// Notes where the broker's ticket socket may be (the candidates for a lease's
    /// `socket_path`, `crate::fd::candidates`).
    pub fn remember(&self, places: Vec<PathBuf>) {
        if !places.is_empty() {
            self.state.lock().places = places;
        }
    }

    /// `AcquireLease` on the line of session `session`: the grant of a retained block;
    /// `Ok(None)`: not served here, ask over gRPC.
    pub async fn acquire(
        &self,
        session: &str,
        req: &pb::AcquireLeaseRequest,
    ) -> Result<Option<pb::AcquireLeaseResponse>, ClientError> {
        match self.ask(session, LINE_ACQUIRE, req.encode_to_vec()).await? {
            Asked::Answered(LINE_GRANTED, body) => Ok(Some(decode(&body)?)),
            _ => Ok(None),
        }
    }

    /// `ReleaseLease` (retaining, may decline) on the line of session `session`;
    /// `Ok(None)`: not served here, ask over gRPC.
    pub async fn release(
        &self,
        session: &str,
        req: &pb::ReleaseLeaseRequest,
    ) -> Result<Option<pb::ReleaseLeaseResponse>, ClientError> {
        match self.ask(session, LINE_RELEASE, req.encode_to_vec()).await? {
            Asked::Answered(LINE_RELEASED, body) => Ok(Some(decode(&body)?)),
            _ => Ok(None),
        }
    }

    /// One request on the line (opened first if need be). An answer that began and broke
    /// off, or is not one, is an error: the broker may have done what was asked, so it is
    /// not asked again over gRPC.
    async fn ask(&self, session: &str, kind: u8, body: Vec<u8>) -> Result<Asked, ClientError> {
        if !enabled() || body.len() > LINE_MAX_PAYLOAD {
            return Ok(Asked::NotSent);
        }
        let Some((in_use, kept)) = self.claim(session) else {
            return Ok(Asked::NotSent);
        };
        let mut conn = match kept {
            Some(c) => c,
            None => match self.open_line(session).await {
                Some(c) => c,
                None => return Ok(Asked::NotSent),
            },
        };
        let (wire, asked) = conn.wire.exchange(kind, &body).await;
        if let (Some(wire), Ok(Asked::Answered(..))) = (wire, &asked) {
            conn.wire = wire;
            conn.used = Instant::now();
            self.state.lock().conn = Some(conn);
        }
        drop(in_use);
        asked
    }

    /// Marks the line in use for `session`, with its open connection when there is one
    /// (of this process and session, not idle too long); `None`: another request is on
    /// it, or the broker is not to be asked now.
    fn claim(&self, session: &str) -> Option<(InUse<'_>, Option<Conn>)> {
        let mut st = self.state.lock();
        if st.busy {
            return None;
        }
        let me = std::process::id();
        let kept = st
            .conn
            .take()
            .filter(|c| c.owner == me && c.session == session && c.used.elapsed() < MAX_IDLE_AGE);
        if kept.is_none() {
            let refused = st.refused_until.is_some_and(|t| Instant::now() < t);
            // Known once a block was retained.
            if refused || st.places.is_empty() {
                return None;
            }
        }
        st.busy = true;
        Some((InUse(self), kept))
    }

    /// Opens the line of `session` at the first place that answers; else notes when to
    /// ask again.
    async fn open_line(&self, session: &str) -> Option<Conn> {
        let places = self.state.lock().places.clone();
        let opened = tokio::time::timeout(OPEN_TIMEOUT, open(&places, session))
            .await
            .unwrap_or(Err(Instant::now() + BUSY_FOR));
        match opened {
            Ok(stream) => Some(Conn {
                wire: Wire::Runtime(stream),
                owner: std::process::id(),
                session: session.to_string(),
                used: Instant::now(),
            }),
            Err(until) => {
                self.state.lock().refused_until = Some(until);
                None
            }
        }
    }
}

fn decode<M: Message + Default>(body: &[u8]) -> Result<M, ClientError> {
    M::decode(body).map_err(|e| ClientError::Protocol(format!("a lease line's answer: {e}")))
}

/// Opens the line of `session` at the first of `places` that takes it; `Err(until)`:
/// none did, not to be asked again before `until` (soon when one was busy or none
/// answered, a broker restarting; later when refused).
async fn open(places: &[PathBuf], session: &str) -> Result<UnixStream, Instant> {
    let id = uuid::Uuid::parse_str(session).map_err(|_| Instant::now() + REFUSED_FOR)?;
    let mut hello = [0u8; LINE_HELLO_LEN];
    hello[..LINE_HELLO.len()].copy_from_slice(&LINE_HELLO);
    hello[LINE_HELLO.len()..].copy_from_slice(id.as_bytes());
    let mut again = Instant::now() + BUSY_FOR;
    for place in places {
        let Ok(mut stream) = UnixStream::connect(place).await else {
            continue;
        };
        if stream.write_all(&hello).await.is_err() {
            continue;
        }
        let mut reply = [0u8; 1];
        match stream.read(&mut reply).await {
            Ok(1) if reply[0] == LINE_OPEN_REPLY => return Ok(stream),
            Ok(1) if reply[0] == BUSY_REPLY => {}
            _ => again = Instant::now() + REFUSED_FOR,
        }
    }
    Err(again)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_broker_proto::ticket::{line_frame, line_payload_len, LINE_FRAME_HEAD, LINE_NOT_HERE};
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

    /// Takes a hello and opens the line.
    async fn take_hello(s: &mut UnixStream) {
        let mut hello = [0u8; LINE_HELLO_LEN];
        s.read_exact(&mut hello).await.unwrap();
        s.write_all(&[LINE_OPEN_REPLY]).await.unwrap();
    }

    /// Reads one request frame whole.
    async fn read_request(s: &mut UnixStream) {
        let mut head = [0u8; LINE_FRAME_HEAD];
        s.read_exact(&mut head).await.unwrap();
        let mut body = vec![0u8; line_payload_len(&head).unwrap()];
        s.read_exact(&mut body).await.unwrap();
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
            line.acquire(SESSION, &request()).await.unwrap().is_none(),
            "no place known"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 0);
        line.remember(vec![path]);
        for _ in 0..3 {
            assert!(line.acquire(SESSION, &request()).await.unwrap().is_none());
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
                take_hello(&mut s).await;
                // The first line closes before any request; the others answer one.
                if count.fetch_add(1, Ordering::SeqCst) == 0 {
                    return;
                }
                read_request(&mut s).await;
                let reply = pb::AcquireLeaseResponse {
                    lease: Some(pb::Lease {
                        lease_id: "l".into(),
                        ..Default::default()
                    }),
                }
                .encode_to_vec();
                s.write_all(&line_frame(LINE_GRANTED, &reply))
                    .await
                    .unwrap();
                let _ = s.read(&mut [0u8; 1]).await;
            }
        });
        let line = LeaseLine::default();
        line.remember(vec![path]);
        assert!(
            line.acquire(SESSION, &request()).await.unwrap().is_none(),
            "closed"
        );
        let granted = line.acquire(SESSION, &request()).await.unwrap().unwrap();
        assert_eq!(granted.lease.unwrap().lease_id, "l");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        // A line is one session's: another session's request opens its own.
        let other = "0190a7a4-0000-7000-8000-000000000002";
        let mut req = request();
        req.session_id = other.into();
        assert!(line.acquire(other, &req).await.unwrap().is_some());
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    /// A request whose caller gave up (its future dropped mid-answer) leaves the line free
    /// for the next, which opens another line; an answer that begins and breaks off is an
    /// error, not a reason to ask gRPC (the broker may have granted it).
    #[tokio::test]
    async fn a_cancelled_request_frees_the_line_and_a_broken_answer_is_an_error() {
        let n = Arc::new(AtomicUsize::new(0));
        let count = n.clone();
        let (read, mut reads) = tokio::sync::mpsc::unbounded_channel();
        let (_dir, path, _accepted) = fake_broker(move |mut s| {
            let (count, read) = (count.clone(), read.clone());
            async move {
                take_hello(&mut s).await;
                read_request(&mut s).await;
                let _ = read.send(());
                match count.fetch_add(1, Ordering::SeqCst) {
                    // Never answers.
                    0 => tokio::time::sleep(Duration::from_secs(60)).await,
                    // Begins an answer and closes.
                    1 => s.write_all(&[LINE_GRANTED, 9]).await.unwrap(),
                    _ => s.write_all(&line_frame(LINE_NOT_HERE, b"")).await.unwrap(),
                }
            }
        });
        let line = LeaseLine::default();
        line.remember(vec![path]);
        // Given up once the broker has the request.
        let first = request();
        tokio::select! {
            answer = line.acquire(SESSION, &first) => {
                panic!("the broker never answers: {:?}", answer.map(|r| r.is_some()))
            }
            _ = reads.recv() => {}
        }
        let broken = line.acquire(SESSION, &request()).await;
        assert!(
            matches!(broken, Err(ClientError::Protocol(_))),
            "{:?}",
            broken.map(|r| r.is_some())
        );
        assert!(
            line.acquire(SESSION, &request()).await.unwrap().is_none(),
            "not here"
        );
        assert_eq!(n.load(Ordering::SeqCst), 3, "each on a line of its own");
    }

    /// The line opens at the first place that takes it: a place that refuses (a socket of
    /// another broker, an older one) or does not answer is passed over.
    #[tokio::test]
    async fn every_place_is_tried_in_turn() {
        let (_a, refusing, _) = fake_broker(|s| async move { drop(s) });
        let (_b, taking, accepted) = fake_broker(|mut s| async move {
            take_hello(&mut s).await;
            read_request(&mut s).await;
            s.write_all(&line_frame(LINE_GRANTED, b"")).await.unwrap();
        });
        let line = LeaseLine::default();
        let nowhere = refusing.with_file_name("nothing.sock");
        line.remember(vec![nowhere, refusing, taking]);
        assert!(line.acquire(SESSION, &request()).await.unwrap().is_some());
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "answered on the third place"
        );
    }

    /// A caller outside any task of a multi-thread runtime (a thread in `block_on`, as
    /// Python's) waits on its own thread, one inside a task on the runtime; the same line
    /// serves both in turn, one connection throughout.
    #[test]
    fn one_line_serves_callers_in_and_out_of_tasks() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let line = Arc::new(LeaseLine::default());
        let (_dir, accepted) = rt.block_on(async {
            let (dir, path, accepted) = fake_broker(|mut s| async move {
                take_hello(&mut s).await;
                for _ in 0..4 {
                    read_request(&mut s).await;
                    s.write_all(&line_frame(LINE_GRANTED, b"")).await.unwrap();
                }
            });
            line.remember(vec![path]);
            (dir, accepted)
        });
        let on_thread = |line: &LeaseLine| {
            let st = line.state.lock();
            matches!(st.conn.as_ref().map(|c| &c.wire), Some(Wire::Thread(_)))
        };
        let from_block_on = || rt.block_on(line.acquire(SESSION, &request()));
        assert!(from_block_on().unwrap().is_some());
        assert!(on_thread(&line), "block_on's caller waits on its thread");
        let in_task = line.clone();
        let answered = rt
            .block_on(rt.spawn(async move { in_task.acquire(SESSION, &request()).await }))
            .unwrap();
        assert!(answered.unwrap().is_some());
        assert!(!on_thread(&line), "a task awaits on the runtime");
        assert!(from_block_on().unwrap().is_some());
        assert!(on_thread(&line));
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one line throughout");
    }
}
