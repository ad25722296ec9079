//! Connection limits: what a peer can make the broker hold open before it has proved
//! anything. Every accepted connection is admitted against a total cap and a per-peer-uid
//! cap (Unix socket), with a reserve only root and the broker's own user may use so an
//! operator can always connect; a connection must send its HTTP/2 preface within the
//! handshake deadline or it is closed; accept errors (EMFILE) back off instead of spinning;
//! and the unauthenticated services (health, reflection) have a bounded number of open
//! streams on each listener. Counters are in [`ListenerStats`]. `server.rs` wires this in with
//! [`incoming_unix`], [`incoming_tcp`] and [`UnauthStreamsLayer`]. Every Unix socket the
//! broker serves (main, operators', tickets) is bound by [`bind_unix`].

use futures::Stream;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::codegen::http;
use tonic::transport::server::Connected;

/// Why [`bind_unix`] bound nothing.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// A live process still serves on the socket file.
    #[error("a live process already serves on {0}")]
    InUse(std::path::PathBuf),
    /// Something that is not a socket (a mistyped path naming a file) is there: never
    /// removed.
    #[error("{0} exists and is not a socket: not replaced")]
    NotASocket(std::path::PathBuf),
    #[error("socket {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Binds the Unix socket at `path` with file mode `mode`: creates its directory and
/// replaces a stale socket file (one whose connect is refused: nobody listens), but
/// refuses one that a live process still serves (or may: a full backlog, no permission)
/// and never removes anything that is not a socket.
///
/// The socket never sits at `path` with another mode: it is bound inside a fresh
/// directory of its own next to `path` (mode 0700: nobody else can reach the socket while
/// its mode is still the umask's), given `mode` there, then linked into place (a name
/// taken meanwhile is refused, never replaced); the directory is removed. The path bound
/// first is `DIR/.bind-<12 hex digits>/s`, 21 bytes after the directory (a socket's path
/// has at most 107).
pub async fn bind_unix(path: &std::path::Path, mode: u32) -> Result<UnixListener, BindError> {
    bind_unix_observed(path, mode, |_| {}).await
}

/// A directory only its owner can enter, removed with what is in it when dropped.
struct HiddenDir(std::path::PathBuf);

impl HiddenDir {
    /// Makes `.bind-<random>` in `dir`, mode 0700 from its creation.
    async fn create(dir: &std::path::Path) -> io::Result<HiddenDir> {
        let name = uuid::Uuid::new_v4().simple().to_string();
        let p = dir.join(format!(".bind-{}", &name[..12]));
        tokio::fs::DirBuilder::new().mode(0o700).create(&p).await?;
        Ok(HiddenDir(p))
    }
    fn socket(&self) -> std::path::PathBuf {
        self.0.join("s")
    }
}

impl Drop for HiddenDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.socket());
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// [`bind_unix`], calling `just_bound` with where the socket is the moment it is bound
/// (before its mode is set; tests look at what is reachable then).
async fn bind_unix_observed(
    path: &std::path::Path,
    mode: u32,
    just_bound: impl FnOnce(&std::path::Path),
) -> Result<UnixListener, BindError> {
    // The file system is asked off the runtime (tokio::fs): a slow or hung directory
    // holds no runtime thread.
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |source| BindError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir).await.map_err(err)?;
    }
    match tokio::fs::symlink_metadata(path).await {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(BindError::NotASocket(path.to_path_buf()));
        }
        Ok(_) => match UnixStream::connect(path).await {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!(path = %path.display(), "removing stale socket file");
                tokio::fs::remove_file(path).await.map_err(err)?;
            }
            _ => return Err(BindError::InUse(path.to_path_buf())),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let hidden = HiddenDir::create(dir).await.map_err(err)?;
    let bound = hidden.socket();
    let l = UnixListener::bind(&bound).map_err(err)?;
    just_bound(&bound);
    tokio::fs::set_permissions(&bound, std::fs::Permissions::from_mode(mode))
        .await
        .map_err(err)?;
    // A link, not a rename: a name taken since the look above is not replaced.
    match tokio::fs::hard_link(&bound, path).await {
        Ok(()) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            match tokio::fs::symlink_metadata(path).await {
                Ok(m) if !m.file_type().is_socket() => {
                    Err(BindError::NotASocket(path.to_path_buf()))
                }
                _ => Err(BindError::InUse(path.to_path_buf())),
            }
        }
        Err(e) => Err(err(e)),
    }
}

/// The HTTP/2 client preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`) is 24 bytes.
const PREFACE_BYTES: usize = 24;

/// The limits, from the command line (`--max-connections` and friends).
#[derive(Clone, Debug, clap::Args)]
pub struct LimitFlags {
    /// Most open connections in all (gRPC listeners together); 0: derive from the
    /// descriptor limit (half of `RLIMIT_NOFILE`, at most 4096).
    #[arg(long, env = "GPU_BROKER_MAX_CONNECTIONS", default_value_t = crate::defaults::MAX_CONNECTIONS)]
    pub max_connections: usize,

    /// Most open connections of one peer uid on the Unix socket.
    #[arg(
        long,
        env = "GPU_BROKER_MAX_CONNECTIONS_PER_UID",
        default_value_t = crate::defaults::MAX_CONNECTIONS_PER_UID
    )]
    pub max_connections_per_uid: usize,

    /// Connections kept for root and the broker's own user (operators) beyond what
    /// everyone else may open.
    #[arg(
        long,
        env = "GPU_BROKER_ADMIN_CONNECTION_RESERVE",
        default_value_t = crate::defaults::ADMIN_CONNECTION_RESERVE
    )]
    pub admin_connection_reserve: usize,

    /// A new connection must send its HTTP/2 preface within this, or it is closed.
    #[arg(long, env = "GPU_BROKER_HANDSHAKE_TIMEOUT", default_value = crate::defaults::text(crate::defaults::HANDSHAKE_TIMEOUT), value_parser = crate::units::parse_duration)]
    pub handshake_timeout: Duration,

    /// Most concurrent HTTP/2 streams (calls) on one connection.
    #[arg(
        long,
        env = "GPU_BROKER_MAX_STREAMS_PER_CONNECTION",
        default_value_t = crate::defaults::MAX_STREAMS_PER_CONNECTION
    )]
    pub max_streams_per_connection: u32,

    /// Most open calls to the services that need no token (health, reflection), on each
    /// listener (main socket, TCP, operators' socket).
    #[arg(
        long,
        env = "GPU_BROKER_MAX_UNAUTHENTICATED_STREAMS",
        default_value_t = crate::defaults::MAX_UNAUTHENTICATED_STREAMS
    )]
    pub max_unauthenticated_streams: usize,
}

impl LimitFlags {
    /// The limits these flags give on this machine.
    pub fn limits(&self) -> Limits {
        let max_connections = if self.max_connections == 0 {
            crate::fd_budget::default_max_connections()
        } else {
            self.max_connections
        };
        Limits {
            max_connections,
            max_connections_per_uid: self.max_connections_per_uid.max(1),
            admin_reserve: self.admin_connection_reserve.min(max_connections),
            handshake_timeout: self.handshake_timeout,
            max_streams_per_connection: self.max_streams_per_connection.max(1),
            max_unauthenticated_streams: self.max_unauthenticated_streams,
        }
    }
}

/// The connection limits in force.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub max_connections_per_uid: usize,
    pub admin_reserve: usize,
    pub handshake_timeout: Duration,
    pub max_streams_per_connection: u32,
    pub max_unauthenticated_streams: usize,
}

/// Most open connections of the HTTP (metrics, status) listener.
pub const MAX_HTTP_CONNECTIONS: usize = 64;

impl Limits {
    /// The limits of the HTTP listener: few connections (scrapers), no reserve, the same
    /// deadline for a request's headers.
    pub fn for_http(&self) -> Limits {
        Limits {
            max_connections: MAX_HTTP_CONNECTIONS.min(self.max_connections),
            admin_reserve: 0,
            ..self.clone()
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        LimitFlags {
            max_connections: crate::defaults::MAX_CONNECTIONS,
            max_connections_per_uid: crate::defaults::MAX_CONNECTIONS_PER_UID,
            admin_connection_reserve: crate::defaults::ADMIN_CONNECTION_RESERVE,
            handshake_timeout: crate::defaults::HANDSHAKE_TIMEOUT,
            max_streams_per_connection: crate::defaults::MAX_STREAMS_PER_CONNECTION,
            max_unauthenticated_streams: crate::defaults::MAX_UNAUTHENTICATED_STREAMS,
        }
        .limits()
    }
}

/// What the listeners did (exported as metrics).
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Connections admitted.
    pub accepted: AtomicU64,
    /// Connections closed at once because a cap was reached.
    pub refused: AtomicU64,
    /// Connections closed because they sent no HTTP/2 preface in time (with TLS: or did
    /// not finish the TLS handshake in time).
    pub handshake_timeouts: AtomicU64,
    /// TLS handshakes that failed (bad or missing client certificate, not TLS, ...).
    pub tls_handshake_failures: AtomicU64,
    /// `accept` failures (EMFILE and the like), each followed by a back-off.
    pub accept_errors: AtomicU64,
    /// Unauthenticated calls refused because their cap was reached.
    pub unauthenticated_refused: AtomicU64,
}

/// Counts open connections per uid and in total, and admits new ones.
#[derive(Debug)]
pub struct ConnTracker {
    limits: Limits,
    counts: Mutex<Counts>,
    stats: Arc<ListenerStats>,
    own_uid: u32,
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    per_uid: HashMap<u32, usize>,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Total,
    PerUid,
}

impl ConnTracker {
    pub fn new(limits: Limits) -> Arc<ConnTracker> {
        Arc::new(ConnTracker {
            limits,
            counts: Mutex::default(),
            stats: Arc::default(),
            // SAFETY: geteuid cannot fail.
            own_uid: unsafe { libc::geteuid() },
        })
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn stats(&self) -> &Arc<ListenerStats> {
        &self.stats
    }

    /// Root and the broker's own user may use the admin reserve.
    fn privileged(&self, uid: Option<u32>) -> bool {
        matches!(uid, Some(u) if u == 0 || u == self.own_uid)
    }

    /// Admits a connection from `uid` (None: TCP), or says which cap it hit.
    pub fn admit(self: &Arc<Self>, uid: Option<u32>) -> Result<ConnPermit, Refusal> {
        let l = &self.limits;
        let privileged = self.privileged(uid);
        let mut c = self.counts.lock();
        let total_cap = if privileged {
            l.max_connections
        } else {
            l.max_connections - l.admin_reserve
        };
        if c.total >= total_cap {
            return Err(Refusal::Total);
        }
        if let Some(u) = uid {
            let uid_cap = if privileged {
                l.max_connections_per_uid + l.admin_reserve
            } else {
                l.max_connections_per_uid
            };
            let n = c.per_uid.entry(u).or_default();
            if *n >= uid_cap {
                return Err(Refusal::PerUid);
            }
            *n += 1;
        }
        c.total += 1;
        drop(c);
        self.stats.open.fetch_add(1, Ordering::Relaxed);
        self.stats.accepted.fetch_add(1, Ordering::Relaxed);
        Ok(ConnPermit {
            tracker: self.clone(),
            uid,
        })
    }

    fn release(&self, uid: Option<u32>) {
        let mut c = self.counts.lock();
        c.total -= 1;
        if let Some(u) = uid {
            if let Some(n) = c.per_uid.get_mut(&u) {
                *n -= 1;
                if *n == 0 {
                    c.per_uid.remove(&u);
                }
            }
        }
        drop(c);
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// Open connections now (total).
    pub fn open(&self) -> usize {
        self.counts.lock().total
    }
}

/// A connection's place under the caps; given back when the connection closes.
#[derive(Debug)]
pub struct ConnPermit {
    tracker: Arc<ConnTracker>,
    uid: Option<u32>,
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.tracker.release(self.uid);
    }
}

/// An admitted connection: holds its permit, and fails its reads once the handshake
/// deadline passes before the HTTP/2 preface arrived (the server then closes it).
pub struct Conn<IO> {
    io: IO,
    preface_left: usize,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    stats: Arc<ListenerStats>,
    _permit: ConnPermit,
}

impl<IO> Conn<IO> {
    fn new(io: IO, permit: ConnPermit, handshake: Duration) -> Conn<IO> {
        Conn {
            io,
            preface_left: PREFACE_BYTES,
            deadline: Some(Box::pin(tokio::time::sleep(handshake))),
            stats: permit.tracker.stats.clone(),
            _permit: permit,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Conn<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(d) = this.deadline.as_mut() {
            if d.as_mut().poll(cx).is_ready() {
                this.deadline = None;
                this.preface_left = 0;
                this.stats
                    .handshake_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!("closing a connection that sent no HTTP/2 preface in time");
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no HTTP/2 preface within the handshake timeout",
                )));
            }
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if this.preface_left > 0 {
            let n = buf.filled().len() - before;
            this.preface_left = this.preface_left.saturating_sub(n);
            if this.preface_left == 0 {
                this.deadline = None;
            }
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Conn<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: Connected> Connected for Conn<IO> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

use std::future::Future;

/// Accept back-off: starts at 10 ms, doubles to 1 s, resets after a success.
#[derive(Debug)]
struct Backoff(Duration);

impl Backoff {
    const MIN: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);
    fn next(&mut self) -> Duration {
        let d = self.0;
        self.0 = (self.0 * 2).min(Self::MAX);
        d
    }
    fn reset(&mut self) {
        self.0 = Self::MIN;
    }
}

/// One accept with admission: returns the next admitted connection. Refused connections
/// are closed at once; accept errors are counted, logged (once per streak) and followed by
/// a growing pause, so a full descriptor table never makes the loop spin.
async fn accept_admitted<L: Acceptor>(
    l: &L,
    tracker: &Arc<ConnTracker>,
    backoff: &mut Backoff,
) -> Conn<L::Io> {
    let (io, permit) = accept_admitted_raw(l, tracker, backoff).await;
    Conn::new(io, permit, tracker.limits.handshake_timeout)
}

/// [`accept_admitted`] without the preface deadline: the connection and its permit.
async fn accept_admitted_raw<L: Acceptor>(
    l: &L,
    tracker: &Arc<ConnTracker>,
    backoff: &mut Backoff,
) -> (L::Io, ConnPermit) {
    let mut streak = 0u32;
    loop {
        match l.accept_one().await {
            Ok(io) => {
                backoff.reset();
                streak = 0;
                let uid = L::uid(&io);
                match tracker.admit(uid) {
                    Ok(permit) => return (io, permit),
                    Err(why) => {
                        let n = tracker.stats.refused.fetch_add(1, Ordering::Relaxed);
                        // Log the first refusal and then one in a thousand.
                        if n.is_multiple_of(1000) {
                            tracing::warn!(
                                ?uid,
                                cap = ?why,
                                open = tracker.open(),
                                limits = ?tracker.limits,
                                refused_so_far = n + 1,
                                "connection refused: a connection cap is reached"
                            );
                        }
                        drop(io);
                    }
                }
            }
            Err(e) => {
                tracker.stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                let pause = backoff.next();
                if streak == 0 {
                    tracing::error!(error = %e, pause = ?pause, "accept failed; backing off");
                }
                streak += 1;
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// A listener the admission loop can accept from.
trait Acceptor {
    type Io;
    fn accept_one(&self) -> impl Future<Output = io::Result<Self::Io>> + Send;
    fn uid(io: &Self::Io) -> Option<u32>;
}

impl Acceptor for UnixListener {
    type Io = UnixStream;
    async fn accept_one(&self) -> io::Result<UnixStream> {
        self.accept().await.map(|(s, _)| s)
    }
    fn uid(io: &UnixStream) -> Option<u32> {
        io.peer_cred().ok().map(|c| c.uid())
    }
}

impl Acceptor for TcpListener {
    type Io = TcpStream;
    async fn accept_one(&self) -> io::Result<TcpStream> {
        let (s, _) = self.accept().await?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }
    fn uid(_: &TcpStream) -> Option<u32> {
        None
    }
}

/// The admitted connections of a Unix listener, for `serve_with_incoming_shutdown`.
pub fn incoming_unix(
    l: UnixListener,
    tracker: Arc<ConnTracker>,
) -> impl Stream<Item = io::Result<Conn<UnixStream>>> {
    incoming(l, tracker)
}

/// The admitted connections of a TCP listener (counted in the total; no uid).
pub fn incoming_tcp(
    l: TcpListener,
    tracker: Arc<ConnTracker>,
) -> impl Stream<Item = io::Result<Conn<TcpStream>>> {
    incoming(l, tracker)
}

/// The admitted connections of a TCP listener served with TLS. Each handshake runs in a
/// task of its own (a slow one holds up no other) and must finish within the handshake
/// timeout counted from accept; the connection then has what is left of that timeout to
/// send its HTTP/2 preface, read through the TLS layer: a client that completes the
/// handshake and then sends nothing is closed like a silent plain connection, and its
/// permit (its place under the connection caps) goes with it.
pub fn incoming_tls(
    l: TcpListener,
    tracker: Arc<ConnTracker>,
    tls: Arc<crate::tls::TlsServer>,
) -> impl Stream<Item = io::Result<Conn<tokio_rustls::server::TlsStream<TcpStream>>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let mut backoff = Backoff(Backoff::MIN);
        loop {
            let (io, permit) = tokio::select! {
                _ = tx.closed() => return,
                a = accept_admitted_raw(&l, &tracker, &mut backoff) => a,
            };
            let accepted = std::time::Instant::now();
            let timeout = tracker.limits.handshake_timeout;
            let (tx, acceptor, stats) = (tx.clone(), tls.acceptor(), tracker.stats.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(timeout, acceptor.accept(io)).await {
                    Ok(Ok(stream)) => {
                        let left = timeout.saturating_sub(accepted.elapsed());
                        let _ = tx.send(Ok(Conn::new(stream, permit, left))).await;
                    }
                    Ok(Err(e)) => {
                        stats.tls_handshake_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(error = %e, "TLS handshake failed");
                    }
                    Err(_) => {
                        stats.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(
                            "closing a connection whose TLS handshake did not finish in time"
                        );
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

fn incoming<L: Acceptor + Send + 'static>(
    l: L,
    tracker: Arc<ConnTracker>,
) -> impl Stream<Item = io::Result<Conn<L::Io>>>
where
    L::Io: Send,
{
    futures::stream::unfold(
        (l, tracker, Backoff(Backoff::MIN)),
        |(l, tracker, mut backoff)| async move {
            let c = accept_admitted(&l, &tracker, &mut backoff).await;
            Some((Ok(c), (l, tracker, backoff)))
        },
    )
}

/// Paths of the services that need no token.
fn unauthenticated(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/") || path.starts_with("/grpc.reflection.")
}

/// A tower layer that bounds the open calls to the unauthenticated services (a
/// `Health/Watch` stream lives until its client leaves): past the cap they are answered
/// `RESOURCE_EXHAUSTED` at once. A call's slot is held until its response body ends.
/// `server.rs` makes one per listener (its clones share the slots), so the listeners'
/// caps are apart.
#[derive(Clone)]
pub struct UnauthStreamsLayer {
    slots: Arc<Semaphore>,
    max: usize,
    stats: Arc<ListenerStats>,
}

impl UnauthStreamsLayer {
    pub fn new(tracker: &ConnTracker) -> UnauthStreamsLayer {
        let max = tracker.limits.max_unauthenticated_streams;
        UnauthStreamsLayer {
            slots: Arc::new(Semaphore::new(max)),
            max,
            stats: tracker.stats.clone(),
        }
    }
}

impl<S> tower::Layer<S> for UnauthStreamsLayer {
    type Service = UnauthStreams<S>;
    fn layer(&self, inner: S) -> UnauthStreams<S> {
        UnauthStreams {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service of [`UnauthStreamsLayer`].
#[derive(Clone)]
pub struct UnauthStreams<S> {
    inner: S,
    layer: UnauthStreamsLayer,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, RB> tower::Service<http::Request<B>> for UnauthStreams<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = http::Response<Held<RB>>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let permit = if unauthenticated(req.uri().path()) {
            match self.layer.slots.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    self.layer
                        .stats
                        .unauthenticated_refused
                        .fetch_add(1, Ordering::Relaxed);
                    let max = self.layer.max;
                    let status = crate::grpc_status::status_with_reason(
                        tonic::Code::ResourceExhausted,
                        format!(
                            "{max} calls to the unauthenticated services are open on this listener, the most allowed (--max-unauthenticated-streams)"
                        ),
                        Some(crate::grpc_status::Reason::StreamLimit),
                        vec![("open_streams", max.to_string())],
                    );
                    let resp = status.into_http::<RB>();
                    return Box::pin(async move { Ok(resp.map(|b| Held::new(b, None))) });
                }
            }
        } else {
            None
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|b| Held::new(b, permit)))
        })
    }
}

/// A response body that holds a slot until it is dropped.
pub struct Held<B> {
    inner: B,
    _permit: Option<OwnedSemaphorePermit>,
}

impl<B> Held<B> {
    fn new(inner: B, permit: Option<OwnedSemaphorePermit>) -> Held<B> {
        Held {
            inner,
            _permit: permit,
        }
    }
}

impl<B: Default> Default for Held<B> {
    fn default() -> Self {
        Held::new(B::default(), None)
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for Held<B> {
    type Data = B::Data;
    type Error = B::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_uid: usize, reserve: usize) -> Limits {
        Limits {
            max_connections: total,
            max_connections_per_uid: per_uid,
            admin_reserve: reserve,
            ..Limits::default()
        }
    }

    #[tokio::test]
    async fn a_unix_socket_is_bound_with_its_mode_over_a_stale_file_never_over_a_live_one() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/dir/s.sock");
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        // The directory is made; the mode is the one asked for.
        let live = bind_unix(&path, 0o660).await.unwrap();
        assert_eq!(mode(&path), 0o660);
        // A socket a live process serves is refused, and left in place.
        match bind_unix(&path, 0o666).await {
            Err(BindError::InUse(p)) => assert_eq!(p, path),
            other => panic!("bound over a live socket: {other:?}"),
        }
        assert!(
            UnixStream::connect(&path).await.is_ok(),
            "the live socket still serves"
        );
        // Once nobody serves it the file is stale: replaced, with the new mode.
        drop(live);
        let _again = bind_unix(&path, 0o666).await.unwrap();
        assert_eq!(mode(&path), 0o666);
        assert!(UnixStream::connect(&path).await.is_ok());
        // A file that is not a socket (a mistyped path) is refused and left as it was.
        let file = dir.path().join("plain");
        std::fs::write(&file, b"state").unwrap();
        match bind_unix(&file, 0o660).await {
            Err(BindError::NotASocket(p)) => assert_eq!(p, file),
            other => panic!("bound over a plain file: {other:?}"),
        }
        assert_eq!(
            std::fs::read(&file).unwrap(),
            b"state",
            "the file is untouched"
        );
        // What cannot be made is an I/O error naming the path.
        let under_a_file = file.join("s.sock");
        match bind_unix(&under_a_file, 0o660).await {
            Err(BindError::Io { path, .. }) => assert_eq!(path, under_a_file),
            other => panic!("bound under a plain file: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_unix_socket_is_never_reachable_at_its_path_before_its_mode_is_set() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let mut seen = None;
        let l = bind_unix_observed(&path, 0o666, |bound| {
            // Just bound, its mode still the umask's: not at the path, and inside a
            // directory only the broker's user can enter.
            assert!(
                std::fs::symlink_metadata(&path).is_err(),
                "a socket is at the path before its mode is set"
            );
            let hidden = bound.parent().unwrap();
            assert_eq!(hidden.parent().unwrap(), dir.path(), "next to the path");
            let meta = std::fs::metadata(hidden).unwrap();
            assert_eq!(meta.permissions().mode() & 0o777, 0o700);
            // SAFETY: plain syscall.
            assert_eq!(meta.uid(), unsafe { libc::geteuid() });
            seen = Some(hidden.to_path_buf());
        })
        .await
        .unwrap();
        // At the path with the mode asked for, serving; the directory is gone.
        assert_eq!(mode(&path), 0o666);
        assert!(UnixStream::connect(&path).await.is_ok());
        assert!(!seen.unwrap().exists(), "the hidden directory is removed");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["s.sock"], "nothing else is left next to it");
        // Accepted connections come through the linked path.
        let (accepted, _) = tokio::join!(l.accept(), UnixStream::connect(&path));
        accepted.unwrap();
        // A name taken after the look (here: a plain file made in the window) is never
        // replaced, and nothing is left behind.
        let raced = dir.path().join("raced.sock");
        let r = bind_unix_observed(&raced, 0o660, |_| std::fs::write(&raced, b"x").unwrap()).await;
        assert!(matches!(r, Err(BindError::NotASocket(_))), "{r:?}");
        assert_eq!(std::fs::read(&raced).unwrap(), b"x");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn caps_per_uid_and_in_total_keep_a_reserve_for_operators() {
        let t = ConnTracker::new(limits(10, 4, 2));
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(t.admit(Some(1000)).unwrap());
        }
        assert_eq!(t.admit(Some(1000)).unwrap_err(), Refusal::PerUid);
        for _ in 0..4 {
            held.push(t.admit(Some(1001)).unwrap());
        }
        // 8 of 10 open; the last 2 are the operators' reserve.
        assert_eq!(t.admit(Some(1002)).unwrap_err(), Refusal::Total);
        assert_eq!(t.admit(None).unwrap_err(), Refusal::Total);
        let a = t.admit(Some(0)).expect("root uses the reserve");
        let _b = t.admit(Some(0)).expect("root uses the reserve");
        assert_eq!(t.admit(Some(0)).unwrap_err(), Refusal::Total);
        drop(a);
        assert!(t.admit(Some(0)).is_ok());
        // Closing connections gives their places back.
        held.clear();
        assert_eq!(t.open(), 1);
        assert!(t.admit(Some(1000)).is_ok());
    }

    #[test]
    fn backoff_grows_to_a_second_and_resets() {
        let mut b = Backoff(Backoff::MIN);
        let steps: Vec<_> = (0..10).map(|_| b.next()).collect();
        assert_eq!(steps[0], Duration::from_millis(10));
        assert_eq!(*steps.last().unwrap(), Duration::from_secs(1));
        b.reset();
        assert_eq!(b.next(), Duration::from_millis(10));
    }

    #[tokio::test]
    async fn a_silent_connection_fails_its_reads_after_the_deadline() {
        use tokio::io::AsyncReadExt;
        let t = ConnTracker::new(limits(4, 4, 0));
        let (a, _b) = tokio::io::duplex(64);
        let mut c = Conn::new(a, t.admit(None).unwrap(), Duration::from_millis(50));
        let mut buf = [0u8; 8];
        let e = c.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(t.stats().handshake_timeouts.load(Ordering::Relaxed), 1);
        drop(c);
        assert_eq!(t.open(), 0);
    }

    #[tokio::test]
    async fn a_connection_that_sent_its_preface_has_no_deadline() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let t = ConnTracker::new(limits(4, 4, 0));
        let (a, mut b) = tokio::io::duplex(64);
        let mut c = Conn::new(a, t.admit(None).unwrap(), Duration::from_millis(50));
        b.write_all(&[0u8; PREFACE_BYTES]).await.unwrap();
        let mut buf = [0u8; PREFACE_BYTES];
        c.read_exact(&mut buf).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        c.read_exact(&mut one)
            .await
            .expect("no deadline after the preface");
    }
}
