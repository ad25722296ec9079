//! Sessions: a worker's connection to the broker. [`Session`] opens the `OpenSession`
//! stream, reads its first event (`opened`: id, tenant, keepalive timeout, peer pid)
//! and hands the rest of the stream to a background task (see [`crate::events`]).
//! Leases are acquired through a session and keep it alive; when the last clone of the
//! session (and the last lease) is dropped, or [`Session::close`] is called, the task
//! is aborted, the stream ends, and the broker ends the session and takes back every
//! lease it still held. [`SessionInfo`] is the admin service's record of a session.
//!
//! **Reconnection is opt-in** ([`SessionBuilder::reconnect`]): a session the broker
//! loses (restart, crash, shutdown, broken connection) takes all its leases with it, so
//! only an application that handles [`SessionEvent::Reconnected`] (re-acquiring what it
//! needs) should ask for it. Without it, such a session ends with
//! [`SessionEvent::Closed`], as [`Client::session`] always did. With it, the session
//! object stays usable across broker restarts: [`Session::id`] follows the current
//! broker session, and [`Lease`]s of a lost session are dead (see
//! [`crate::reconnect`]).

use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::runtime::Handle;
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

use gpu_broker_proto::v1 as pb;
use pb::session_event::Event;

use crate::client::Client;
use crate::error::ClientError;
use crate::events::{EventHub, ReclaimRequest, SessionEvent, SessionEvents};
use crate::lease::{Lease, LeaseInfo, LeaseRequest};
use crate::reconnect::{self, Backoff, ReconnectPolicy, DEFAULT_IDLE_TIMEOUT};
use crate::tenant::Usage;

/// An open session. Cheap to clone; all clones share one broker session (with
/// reconnection: the current one).
#[derive(Clone)]
pub struct Session {
    inner: Arc<SessionInner>,
}

struct SessionInner {
    name: String,
    client: Client,
    hub: Arc<EventHub>,
    shared: Arc<Shared>,
    reconnect: Option<ReconnectPolicy>,
    task: AbortHandle,
    runtime: Handle,
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        self.task.abort();
        self.hub.close(Some("session dropped by the client".into()));
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id())
            .field("tenant", &self.tenant())
            .field("name", &self.inner.name)
            .field("reconnect", &self.inner.reconnect.map(|p| p.backoff))
            .finish_non_exhaustive()
    }
}

/// What one `opened` event said: one broker session behind a [`Session`].
#[derive(Debug)]
pub(crate) struct Opened {
    pub(crate) id: String,
    tenant: String,
    broker_version: String,
    keepalive_timeout: Option<Duration>,
    peer_pid: u32,
}

/// Opens one `OpenSession` stream and reads its `opened` event.
pub(crate) async fn open_stream(
    client: &Client,
    name: &str,
) -> Result<(tonic::Streaming<pb::SessionEvent>, Opened), ClientError> {
    let mut stream = client
        .raw()
        .open_session(pb::OpenSessionRequest {
            name: name.to_string(),
        })
        .await?
        .into_inner();
    let opened = loop {
        match stream.message().await? {
            None => {
                return Err(ClientError::Protocol(
                    "session stream ended before its `opened` event".into(),
                ))
            }
            Some(pb::SessionEvent {
                event: Some(Event::Opened(opened)),
            }) => break opened,
            Some(pb::SessionEvent {
                event: Some(Event::Heartbeat(_)),
            }) => continue,
            Some(other) => {
                return Err(ClientError::Protocol(format!(
                    "first session event is {other:?}, expected `opened`"
                )))
            }
        }
    };
    if opened.session_id.is_empty() {
        return Err(ClientError::Protocol(
            "`opened` event carries no session id".into(),
        ));
    }
    tracing::debug!(
        session_id = opened.session_id,
        tenant = opened.tenant,
        "session opened"
    );
    let opened = Opened {
        keepalive_timeout: (opened.keepalive_timeout_ms > 0)
            .then(|| Duration::from_millis(opened.keepalive_timeout_ms)),
        id: opened.session_id,
        tenant: opened.tenant,
        broker_version: opened.broker_version,
        peer_pid: opened.peer_pid,
    };
    Ok((stream, opened))
}

/// State shared by a session's clones, its leases and its background task: every
/// broker session it has had (append-only, so `&str` accessors stay valid), which one
/// is current, whether it is connected, and the leases held on it.
pub(crate) struct Shared {
    generations: AppendOnly<Opened>,
    live: Mutex<Live>,
}

struct Live {
    /// Index of the current generation in `generations`.
    current: usize,
    /// False between losing a session and re-opening one.
    connected: bool,
    /// Ids of the leases of the current generation held through `Lease` objects.
    leases: Vec<String>,
}

impl Shared {
    fn new(first: Opened) -> Arc<Shared> {
        let generations = AppendOnly::new();
        let current = generations.push(first);
        Arc::new(Shared {
            generations,
            live: Mutex::new(Live {
                current,
                connected: true,
                leases: Vec::new(),
            }),
        })
    }

    fn current(&self) -> &Opened {
        let index = self.live.lock().current;
        self.generation(index)
    }

    fn generation(&self, index: usize) -> &Opened {
        match self.generations.get(index) {
            Some(g) => g,
            // Indexes only come from `push`, and entries are never removed.
            None => unreachable!("session generation {index} missing"),
        }
    }

    pub(crate) fn current_id_and_keepalive(&self) -> (String, Option<Duration>) {
        let g = self.current();
        (g.id.clone(), g.keepalive_timeout)
    }

    /// The current generation, its session id, and whether it is connected.
    pub(crate) fn snapshot(&self) -> (usize, &str, bool) {
        let (index, connected) = {
            let live = self.live.lock();
            (live.current, live.connected)
        };
        (index, &self.generation(index).id, connected)
    }

    /// The session id of a generation.
    pub(crate) fn id_of(&self, generation: usize) -> &str {
        &self.generation(generation).id
    }

    /// Records a lease acquired on `generation`; false (nothing recorded) when that
    /// session is no longer the live one.
    pub(crate) fn track(&self, generation: usize, lease_id: &str) -> bool {
        let mut live = self.live.lock();
        if live.current != generation || !live.connected {
            return false;
        }
        live.leases.push(lease_id.to_string());
        true
    }

    /// Forgets a lease of `generation` (released, detached or dropped); true when that
    /// session is still the live one, i.e. the lease may still exist on the broker.
    pub(crate) fn untrack(&self, generation: usize, lease_id: &str) -> bool {
        let mut live = self.live.lock();
        if live.current != generation || !live.connected {
            return false;
        }
        if let Some(pos) = live.leases.iter().position(|l| l == lease_id) {
            live.leases.remove(pos);
        }
        true
    }

    /// Whether a lease of `generation` may still exist on the broker.
    pub(crate) fn is_live(&self, generation: usize) -> bool {
        let live = self.live.lock();
        live.current == generation && live.connected
    }

    /// The current session is lost: returns the ids of its leases.
    pub(crate) fn disconnect(&self) -> Vec<String> {
        let mut live = self.live.lock();
        live.connected = false;
        std::mem::take(&mut live.leases)
    }

    /// A new session replaces the lost one.
    pub(crate) fn connected(&self, opened: Opened) {
        let index = self.generations.push(opened);
        let mut live = self.live.lock();
        live.current = index;
        live.connected = true;
        live.leases.clear();
    }
}

/// An append-only list whose entries never move, so `&T` lives as long as the list.
/// Entries sit in segments of doubling size (1, 2, 4, ...), allocated on demand.
struct AppendOnly<T> {
    segments: [OnceLock<Box<[OnceLock<T>]>>; SEGMENTS],
    len: AtomicUsize,
    push: Mutex<()>,
}

const SEGMENTS: usize = usize::BITS as usize;

impl<T> AppendOnly<T> {
    fn new() -> Self {
        AppendOnly {
            segments: std::array::from_fn(|_| OnceLock::new()),
            len: AtomicUsize::new(0),
            push: Mutex::new(()),
        }
    }

    /// (segment, offset) of entry `index`: segment `s` holds entries `2^s - 1 ..`.
    fn locate(index: usize) -> (usize, usize) {
        let n = index + 1;
        let segment = (usize::BITS - 1 - n.leading_zeros()) as usize;
        (segment, n - (1 << segment))
    }

    fn push(&self, value: T) -> usize {
        let _one_writer = self.push.lock();
        let index = self.len.load(Ordering::Acquire);
        let (segment, offset) = Self::locate(index);
        let slots = self.segments[segment]
            .get_or_init(|| (0..1usize << segment).map(|_| OnceLock::new()).collect());
        let _ = slots[offset].set(value);
        self.len.store(index + 1, Ordering::Release);
        index
    }

    fn get(&self, index: usize) -> Option<&T> {
        if index >= self.len.load(Ordering::Acquire) {
            return None;
        }
        let (segment, offset) = Self::locate(index);
        self.segments[segment].get()?.get(offset)?.get()
    }
}

/// Options for opening a [`Session`]: `client.session_builder("worker-1")
/// .reconnect(Backoff::default()).open().await` (or just `.await`).
#[must_use = "a session builder does nothing until opened"]
#[derive(Debug, Clone)]
pub struct SessionBuilder {
    client: Client,
    name: String,
    backoff: Option<Backoff>,
    give_up_after: Option<Duration>,
    idle_timeout: Option<Duration>,
}

impl SessionBuilder {
    pub(crate) fn new(client: Client, name: String) -> Self {
        SessionBuilder {
            client,
            name,
            backoff: None,
            give_up_after: None,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
        }
    }

    /// Re-open the session automatically, waiting `backoff` between attempts, when the
    /// broker loses it (see [`crate::reconnect`]). Off by default. The first open is not
    /// retried: its error is returned by [`SessionBuilder::open`].
    pub fn reconnect(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// With [`SessionBuilder::reconnect`]: stop (with [`SessionEvent::Closed`]) when no
    /// attempt succeeded for `limit` (default: try forever).
    pub fn give_up_after(mut self, limit: Duration) -> Self {
        self.give_up_after = Some(limit);
        self
    }

    /// With [`SessionBuilder::reconnect`]: treat a stream that brings nothing (the
    /// broker sends a heartbeat every 5 s) for `timeout` as broken, which detects a hung
    /// broker or a dead TCP peer; `None` disables it. Default 30 s.
    pub fn idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Opens the session.
    pub async fn open(self) -> Result<Session, ClientError> {
        let policy = self.backoff.map(|backoff| ReconnectPolicy {
            backoff,
            give_up_after: self.give_up_after,
            idle_timeout: self.idle_timeout,
        });
        Session::open_with(self.client, self.name, policy).await
    }
}

impl IntoFuture for SessionBuilder {
    type Output = Result<Session, ClientError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.open())
    }
}

impl Session {
    /// Opens a session named `name` without reconnection (see [`Client::session`]).
    pub(crate) async fn open(client: Client, name: String) -> Result<Session, ClientError> {
        Session::open_with(client, name, None).await
    }

    async fn open_with(
        client: Client,
        name: String,
        reconnect: Option<ReconnectPolicy>,
    ) -> Result<Session, ClientError> {
        let runtime = Handle::try_current()
            .map_err(|_| ClientError::Transport("no tokio runtime to run the session on".into()))?;
        let (stream, opened) = open_stream(&client, &name).await?;
        let hub = EventHub::new();
        let shared = Shared::new(opened);
        let task = runtime.spawn(reconnect::supervise(
            stream,
            hub.clone(),
            client.clone(),
            name.clone(),
            shared.clone(),
            reconnect,
        ));
        Ok(Session {
            inner: Arc::new(SessionInner {
                name,
                client,
                hub,
                shared,
                reconnect,
                task: task.abort_handle(),
                runtime,
            }),
        })
    }

    /// Session id assigned by the broker. With reconnection, the id of the current
    /// broker session (it changes on [`SessionEvent::Reconnected`]).
    pub fn id(&self) -> &str {
        &self.inner.shared.current().id
    }

    /// Tenant the token belongs to.
    pub fn tenant(&self) -> &str {
        &self.inner.shared.current().tenant
    }

    /// Name given at open time.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Version string the broker reported (the current broker, with reconnection).
    pub fn broker_version(&self) -> &str {
        &self.inner.shared.current().broker_version
    }

    /// How long the broker keeps a quiet session (None: no timeout). Keepalives are sent
    /// automatically every third of it.
    pub fn keepalive_timeout(&self) -> Option<Duration> {
        self.inner.shared.current().keepalive_timeout
    }

    /// This process's pid as the broker saw it on the Unix socket (0 over TCP).
    pub fn peer_pid(&self) -> u32 {
        self.inner.shared.current().peer_pid
    }

    /// The client this session was opened with.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// True when the session reconnects automatically ([`SessionBuilder::reconnect`]).
    pub fn reconnects(&self) -> bool {
        self.inner.reconnect.is_some()
    }

    /// False while a reconnecting session is between losing its broker session and
    /// re-opening one (and once closed).
    pub fn is_connected(&self) -> bool {
        !self.is_closed() && self.inner.shared.snapshot().2
    }

    /// Events from the broker, ending with [`SessionEvent::Closed`]. The first call also
    /// yields events that arrived before it; later calls start from now.
    pub fn events(&self) -> SessionEvents {
        self.inner.hub.subscribe()
    }

    /// Calls `callback` for every event (the last one is `Closed`) on a background task.
    pub fn on_event<F>(&self, mut callback: F) -> JoinHandle<()>
    where
        F: FnMut(SessionEvent) + Send + 'static,
    {
        let mut events = self.events();
        self.inner.runtime.spawn(async move {
            while let Some(event) = events.next().await {
                callback(event);
            }
        })
    }

    /// Runs `handler` for every [`SessionEvent::ReclaimRequested`] from now on, each
    /// call on its own task (a slow handler does not hold up the next request). The
    /// handler is expected to stop using the lease, close its mappings and
    /// [`Lease::release`] it before [`ReclaimRequest::deadline`]; an `Err` it returns is
    /// logged. The returned task ends once the session is closed and every handler call
    /// has finished. Across reconnections the handler stays registered.
    ///
    /// ```no_run
    /// # use std::{collections::HashMap, sync::Arc};
    /// # use gpu_broker_client::{ClientError, Lease, Session};
    /// # fn demo(session: &Session, held: Arc<parking_lot::Mutex<HashMap<String, Lease>>>) {
    /// session.on_reclaim(move |req| {
    ///     let held = held.clone();
    ///     async move {
    ///         let lease = held.lock().remove(&req.lease_id);
    ///         match lease {
    ///             Some(lease) => lease.release().await,
    ///             None => Ok::<(), ClientError>(()), // already gone
    ///         }
    ///     }
    /// });
    /// # }
    /// ```
    pub fn on_reclaim<F, Fut, E>(&self, handler: F) -> JoinHandle<()>
    where
        F: Fn(ReclaimRequest) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let mut events = self.events();
        self.inner.runtime.spawn(async move {
            let mut calls = JoinSet::new();
            while let Some(event) = events.next().await {
                // Reap finished calls as we go.
                while calls.try_join_next().is_some() {}
                let Some(request) = event.reclaim_request() else {
                    continue;
                };
                let lease_id = request.lease_id.clone();
                let call = handler(request);
                calls.spawn(async move {
                    if let Err(e) = call.await {
                        tracing::warn!(lease_id, error = %e, "reclaim handler failed");
                    }
                });
            }
            while calls.join_next().await.is_some() {}
        })
    }

    /// True once the session is over: the stream ended (for good, with reconnection)
    /// or [`Session::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.inner.hub.is_closed()
    }

    /// Ends the session now, for every clone: the stream is dropped (or reconnecting
    /// stops), subscribers get `Closed`, and the broker takes back the session's leases
    /// (dropping a [`Lease`] afterwards only logs the failed release).
    pub fn close(&self) {
        self.inner.task.abort();
        self.inner
            .hub
            .close(Some("session closed by the client".into()));
    }

    /// Acquires `bytes` with default options (any device, no wait, device memory only).
    pub async fn lease(&self, bytes: u64) -> Result<Lease, ClientError> {
        self.lease_request(bytes).send().await
    }

    /// A lease request to refine: `.device(1).wait(d).label("kv").reclaimable(true)
    /// .fallback_host(true).send().await`.
    pub fn lease_request(&self, bytes: u64) -> LeaseRequest<'_> {
        LeaseRequest::new(self, bytes)
    }

    /// A compute-turn request on `device`: `.wait(d).await` gives a [`crate::Turn`].
    pub fn turn(&self, device: u32) -> crate::turn::TurnRequest<'_> {
        crate::turn::TurnRequest::new(self, device)
    }

    /// Every lease of this session's tenant (`ListLeases`).
    pub async fn list_leases(&self) -> Result<Vec<LeaseInfo>, ClientError> {
        self.inner.client.list_leases().await
    }

    /// The tenant's quota and live usage (`GetUsage`).
    pub async fn usage(&self) -> Result<Usage, ClientError> {
        self.inner.client.usage().await
    }

    /// Sends one `Keepalive` now (the background task already sends them on schedule).
    pub async fn keepalive(&self) -> Result<(), ClientError> {
        let id = self.id().to_string();
        self.inner.client.keepalive(&id).await
    }

    /// State shared with leases and the background task.
    pub(crate) fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    /// Runs `future` on the runtime the session was opened on.
    pub(crate) fn spawn<F>(&self, future: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        drop(self.inner.runtime.spawn(future));
    }
}

/// A session as the admin service reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SessionInfo {
    /// Session id.
    pub session_id: String,
    /// Tenant of the session.
    pub tenant: String,
    /// Name the worker gave.
    pub name: String,
    /// Peer process id (0 when unknown, e.g. over TCP).
    pub peer_pid: u32,
    /// Peer user id (0 when unknown).
    pub peer_uid: u32,
    /// When it opened, milliseconds since the Unix epoch.
    pub opened_unix_ms: i64,
    /// Live leases of the session.
    pub lease_count: u32,
    /// Bytes those leases hold.
    pub held_bytes: u64,
    /// `"unix"` or `"tcp"`.
    pub transport: String,
    /// GPU memory the peer process uses (NVML; 0 when unknown).
    pub gpu_used_bytes: u64,
    /// Of that, memory beyond its leases (own allocations and CUDA context).
    pub own_alloc_bytes: u64,
    /// The worker allocates more GPU memory behind the broker's back than allowed.
    pub over_allowance: bool,
}

impl From<pb::SessionInfo> for SessionInfo {
    fn from(s: pb::SessionInfo) -> Self {
        SessionInfo {
            session_id: s.session_id,
            tenant: s.tenant,
            name: s.name,
            peer_pid: s.peer_pid,
            peer_uid: s.peer_uid,
            opened_unix_ms: s.opened_unix_ms,
            lease_count: s.lease_count,
            held_bytes: s.held_bytes,
            transport: s.transport,
            gpu_used_bytes: s.gpu_used_bytes,
            own_alloc_bytes: s.own_alloc_bytes,
            over_allowance: s.over_allowance,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_only_keeps_references_valid() {
        let list = AppendOnly::new();
        assert!(list.get(0).is_none());
        let first = list.push("s-0".to_string());
        let kept: &String = list.get(first).unwrap();
        for i in 1..1000 {
            assert_eq!(list.push(format!("s-{i}")), i);
        }
        assert_eq!(kept, "s-0");
        for i in [0, 1, 2, 3, 6, 7, 8, 511, 999] {
            assert_eq!(list.get(i).unwrap(), &format!("s-{i}"));
        }
        assert!(list.get(1000).is_none());
        assert_eq!(AppendOnly::<()>::locate(0), (0, 0));
        assert_eq!(AppendOnly::<()>::locate(1), (1, 0));
        assert_eq!(AppendOnly::<()>::locate(2), (1, 1));
        assert_eq!(AppendOnly::<()>::locate(3), (2, 0));
        assert_eq!(
            AppendOnly::<()>::locate(usize::MAX - 1),
            (63, (1 << 63) - 1)
        );
    }

    fn opened(id: &str) -> Opened {
        Opened {
            id: id.into(),
            tenant: "t".into(),
            broker_version: "v".into(),
            keepalive_timeout: None,
            peer_pid: 1,
        }
    }

    #[test]
    fn leases_die_with_their_generation() {
        let shared = Shared::new(opened("s-1"));
        let (g1, id, connected) = shared.snapshot();
        assert_eq!((id, connected), ("s-1", true));
        assert!(shared.track(g1, "a"));
        assert!(shared.track(g1, "b"));
        assert!(shared.track(g1, "c"));
        assert!(shared.untrack(g1, "b"));
        assert!(shared.is_live(g1));
        assert_eq!(shared.disconnect(), ["a", "c"]);
        // Between sessions: nothing is live, nothing can be recorded.
        assert!(!shared.is_live(g1));
        assert!(!shared.track(g1, "d"));
        assert!(!shared.untrack(g1, "a"));
        shared.connected(opened("s-2"));
        let (g2, id, connected) = shared.snapshot();
        assert_eq!((id, connected), ("s-2", true));
        assert_ne!(g1, g2);
        assert_eq!(shared.id_of(g1), "s-1");
        assert!(!shared.is_live(g1));
        assert!(!shared.untrack(g1, "c"));
        assert!(!shared.track(g1, "e"), "a late reply of the old session");
        assert!(shared.track(g2, "f"));
        assert_eq!(shared.disconnect(), ["f"]);
    }
}
