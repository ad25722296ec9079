//! Sessions: a worker's connection to the broker. This module is the handle
//! ([`Session`]) and its builder ([`SessionBuilder`], reached through
//! [`Client::session`] and [`Client::session_builder`]). Opening one runs the handshake
//! (`handshake.rs`: `OpenSession` and its `opened` event) and hands the stream to the
//! session's background task, the reconnect supervisor (`reconnect.rs`), which runs the
//! stream pump (`pump.rs`) and publishes to the session's events ([`crate::events`]);
//! which broker session is current, and the leases held on it, live in
//! `generation.rs`. Leases ([`crate::lease`]) and compute turns ([`crate::turn`]) are
//! requested through a session and keep it alive; when the last clone of the session
//! (and the last lease) is dropped, or [`Session::close`] is called, the task is
//! aborted, the stream ends, and the broker ends the session and takes back every
//! lease it still held.
//!
//! **Reconnection is opt-in** ([`SessionBuilder::reconnect`]): a session the broker
//! loses (restart, crash, shutdown, broken connection) takes all its leases with it, so
//! only an application that handles [`SessionEvent::Reconnected`] (re-acquiring what it
//! needs) should ask for it. Without it, such a session ends with
//! [`SessionEvent::Closed`], as [`Client::session`] always did. With it, the session
//! object stays usable across broker restarts: [`Session::id`] follows the current
//! broker session, and leases of a lost session are dead (see [`crate::reconnect`]).

use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::runtime::Handle;
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

use crate::client::Client;
use crate::error::ClientError;
use crate::events::{EventHub, ReclaimRequest, SessionEvent, SessionEvents};
use crate::generation::Generations;
use crate::handshake::open_stream;
use crate::lease_info::LeaseInfo;
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
    generations: Arc<Generations>,
    reconnect: Option<ReconnectPolicy>,
    task: AbortHandle,
    runtime: Handle,
    /// Blocks this process retained mapped (`retained.rs`; off unless asked).
    retained: Arc<crate::retained::RetainedCache>,
    /// Where those blocks are leased again without a gRPC call (`lease_line.rs`).
    line: crate::lease_line::LeaseLine,
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

/// How long a call of a reconnecting session waits out a broker outage, unless the
/// reconnect policy gives up sooner or later.
pub const OUTAGE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Did the call fail because the broker was away (down, restarting, its connection cut
/// mid-call: tonic reports that as `UNKNOWN` "transport error")?
fn is_outage(e: &ClientError) -> bool {
    use crate::error::Code;
    match e.code() {
        Code::Unavailable => true,
        Code::Unknown => e.message().contains("transport error"),
        _ => false,
    }
}

/// Between two tries of a call during an outage.
const OUTAGE_RETRY: std::time::Duration = std::time::Duration::from_millis(50);

impl IntoFuture for SessionBuilder {
    type Output = Result<Session, ClientError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.open())
    }
}

impl Session {
    async fn open_with(
        client: Client,
        name: String,
        reconnect: Option<ReconnectPolicy>,
    ) -> Result<Session, ClientError> {
        let runtime = Handle::try_current()
            .map_err(|_| ClientError::Transport("no tokio runtime to run the session on".into()))?;
        let (stream, opened, _) = open_stream(&client, &name, None).await?;
        let hub = EventHub::new();
        let generations = Generations::new(opened);
        let task = runtime.spawn(reconnect::supervise(
            stream,
            hub.clone(),
            client.clone(),
            name.clone(),
            generations.clone(),
            reconnect,
        ));
        Ok(Session {
            inner: Arc::new(SessionInner {
                name,
                client,
                hub,
                generations,
                reconnect,
                task: task.abort_handle(),
                runtime,
                retained: Arc::default(),
                line: Default::default(),
            }),
        })
    }

    /// Session id assigned by the broker. With reconnection, the id of the current
    /// broker session (it changes on [`SessionEvent::Reconnected`]); an id returned
    /// earlier is the caller's and keeps its value.
    pub fn id(&self) -> String {
        self.inner.generations.current().id().to_string()
    }

    /// Tenant the token belongs to.
    pub fn tenant(&self) -> String {
        self.inner.generations.current().opened().tenant.clone()
    }

    /// Name given at open time.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Version string the broker reported (the current broker, with reconnection).
    pub fn broker_version(&self) -> String {
        self.inner
            .generations
            .current()
            .opened()
            .broker_version
            .clone()
    }

    /// How long the broker keeps a quiet session (None: no timeout). Keepalives are sent
    /// automatically every third of it.
    pub fn keepalive_timeout(&self) -> Option<Duration> {
        self.inner.generations.current().opened().keepalive_timeout
    }

    /// This process's pid as the broker saw it on the Unix socket (0 over TCP).
    pub fn peer_pid(&self) -> u32 {
        self.inner.generations.current().opened().peer_pid
    }

    /// True when a broker restart can keep this session: the broker runs with a keeper
    /// (or systemd's fd store) and gave it a resume secret, so a reconnecting session is
    /// resumed with its leases ([`SessionEvent::Resumed`]) rather than opened anew.
    pub fn resumable(&self) -> bool {
        !self
            .inner
            .generations
            .current()
            .opened()
            .resume_secret
            .is_empty()
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
        !self.is_closed() && self.inner.generations.snapshot().1
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
    /// [`Lease::release`](crate::Lease::release) it before [`ReclaimRequest::deadline`]; an `Err` it returns is
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
    /// (dropping a [`crate::Lease`] afterwards only logs the failed release).
    pub fn close(&self) {
        self.inner.task.abort();
        self.inner
            .hub
            .close(Some("session closed by the client".into()));
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
        let id = self.id();
        self.inner.client.keepalive(&id).await
    }

    /// Which broker session is current, and the leases held on it.
    /// How long a call of a reconnecting session waits out a broker outage (retrying)
    /// before it fails: the reconnect give-up limit, else [`OUTAGE_WAIT`]; zero for a
    /// session that does not reconnect.
    pub(crate) fn outage_wait(&self) -> std::time::Duration {
        match &self.inner.reconnect {
            Some(p) => p.give_up_after.unwrap_or(OUTAGE_WAIT),
            None => std::time::Duration::ZERO,
        }
    }

    /// Runs `call` until it succeeds, fails with something other than `UNAVAILABLE`
    /// (the broker is down or restarting), the session's generation `on` is no longer
    /// live, or [`Session::outage_wait`] has passed; a broker restart with a keeper keeps
    /// the session, so the call goes through once the broker is back.
    pub(crate) async fn through_outage<T, F, Fut>(
        &self,
        on: &crate::generation::Generation,
        mut call: F,
    ) -> Result<T, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let limit = self.outage_wait();
        let t0 = tokio::time::Instant::now();
        loop {
            match call().await {
                Err(e)
                    if is_outage(&e) && t0.elapsed() < limit && self.generations().is_live(on) =>
                {
                    tracing::debug!(error = %e, "broker unavailable; retrying");
                    tokio::time::sleep(OUTAGE_RETRY).await;
                    // Once the session is being resumed, the retry waits for it: a call
                    // that overtook the resume could not be named in it.
                    if self.generations().resuming() {
                        let left = limit.saturating_sub(t0.elapsed());
                        self.generations().settled(left).await;
                    }
                }
                r => return r,
            }
        }
    }

    pub(crate) fn generations(&self) -> &Generations {
        &self.inner.generations
    }

    /// Runs `future` on the runtime the session was opened on, returning its handle.
    pub(crate) fn spawn_task<F>(&self, future: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.inner.runtime.spawn(future)
    }

    /// Keeps the descriptors and mappings of released leases in this process, up to
    /// `bytes` in all (0, the default: off): a lease released after this asks the broker
    /// to hold its block for the tenant, and the next lease of that size is that block,
    /// granted with no ticket and mapped already ([`crate::Lease::mapped`]). Retained
    /// blocks stay counted to the tenant until let go: past the bound (oldest first),
    /// when the broker asks ([`SessionEvent::DropRetained`], answered by a listener this
    /// starts), or when the process exits. A lowered bound lets go at once.
    pub fn retain_mappings(&self, bytes: u64) {
        let (over, start) = self.inner.retained.set_bound(bytes);
        self.let_go(over);
        if !start {
            return;
        }
        let (cache, client) = (self.inner.retained.clone(), self.inner.client.clone());
        let mut events = self.events();
        self.spawn(async move {
            while let Some(event) = events.next().await {
                let gone = match &event {
                    SessionEvent::DropRetained { lease_id } => {
                        cache.take_ended(lease_id).into_iter().collect()
                    }
                    // The broker session is gone, or restarted (a restart keeps leases, not
                    // retained blocks), or this one ends.
                    SessionEvent::Reconnected { .. }
                    | SessionEvent::Resumed { .. }
                    | SessionEvent::Closed { .. } => cache.take_all(),
                    _ => continue,
                };
                for e in gone {
                    confirm_let_go(&client, e).await;
                }
            }
        });
    }

    /// Bytes of blocks this process retains now ([`Session::retain_mappings`]).
    pub fn retained_bytes(&self) -> u64 {
        self.inner.retained.held()
    }

    /// Lets go of every block this process retains (each confirmed to the broker).
    pub async fn drop_retained(&self) {
        for e in self.inner.retained.take_all() {
            confirm_let_go(&self.inner.client, e).await;
        }
    }

    pub(crate) fn retained(&self) -> &crate::retained::RetainedCache {
        &self.inner.retained
    }

    /// The lease line of this session's retained blocks (`lease_line.rs`).
    pub(crate) fn lease_line(&self) -> &crate::lease_line::LeaseLine {
        &self.inner.line
    }

    /// Unmaps and closes `entries` and confirms each to the broker, before returning.
    pub(crate) async fn let_go_now(&self, entries: Vec<crate::retained::Entry>) {
        if entries.is_empty() {
            return;
        }
        // On a task of its own: a caller that stops waiting (a timeout, a `select!`) does
        // not stop the confirmations, which the broker needs to give the memory to others.
        let client = self.inner.client.clone();
        let confirming = self.inner.runtime.spawn(async move {
            for e in entries {
                confirm_let_go(&client, e).await;
            }
        });
        let _ = confirming.await;
    }

    /// Unmaps and closes `entries`, then confirms each to the broker in the background.
    pub(crate) fn let_go(&self, entries: Vec<crate::retained::Entry>) {
        if entries.is_empty() {
            return;
        }
        let client = self.inner.client.clone();
        self.spawn(async move {
            for e in entries {
                confirm_let_go(&client, e).await;
            }
        });
    }

    /// Runs `future` on the runtime the session was opened on.
    pub(crate) fn spawn<F>(&self, future: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        drop(self.inner.runtime.spawn(future));
    }
}

/// Opening sessions is the client's job to the caller; the code lives here so that the
/// connection (`client.rs`) does not depend on the session built on it.
impl Client {
    /// Opens a session named `name` (shown to operators), without reconnection: when
    /// the broker loses it, it ends with [`SessionEvent::Closed`].
    pub async fn session(&self, name: impl Into<String>) -> Result<Session, ClientError> {
        Session::open_with(self.clone(), name.into(), None).await
    }

    /// A session named `name` to configure before opening, e.g. with automatic
    /// reconnection: `client.session_builder("w").reconnect(Backoff::default()).await`.
    pub fn session_builder(&self, name: impl Into<String>) -> SessionBuilder {
        SessionBuilder::new(self.clone(), name.into())
    }
}

/// Unmaps and closes a retained block, then tells the broker (a release of its ended
/// lease id), after which the broker may hand the memory on.
async fn confirm_let_go(client: &Client, e: crate::retained::Entry) {
    let ended = e.ended.clone();
    drop(e);
    if let Err(err) = client.release_lease(&ended).await {
        tracing::debug!(lease_id = ended, error = %err, "letting go of a retained block failed");
    }
}
