//! Sessions: a worker's connection to the broker. [`Session`] opens the `OpenSession`
//! stream, reads its first event (`opened`: id, tenant, keepalive timeout, peer pid)
//! and hands the rest of the stream to a background task (see [`crate::events`]).
//! Leases are acquired through a session and keep it alive; when the last clone of the
//! session (and the last lease) is dropped, or [`Session::close`] is called, the task
//! is aborted, the stream ends, and the broker ends the session and takes back every
//! lease it still held. [`SessionInfo`] is the admin service's record of a session.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use tokio::runtime::Handle;
use tokio::task::{AbortHandle, JoinHandle};

use gpu_broker_proto::v1 as pb;
use pb::session_event::Event;

use crate::client::Client;
use crate::error::ClientError;
use crate::events::{self, EventHub, SessionEvent, SessionEvents};
use crate::lease::{Lease, LeaseInfo, LeaseRequest};
use crate::tenant::Usage;

/// An open session. Cheap to clone; all clones share one broker session.
#[derive(Clone)]
pub struct Session {
    inner: Arc<SessionInner>,
}

struct SessionInner {
    id: String,
    tenant: String,
    name: String,
    broker_version: String,
    keepalive_timeout: Option<Duration>,
    peer_pid: u32,
    client: Client,
    hub: Arc<EventHub>,
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
            .field("id", &self.inner.id)
            .field("tenant", &self.inner.tenant)
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Opens a session named `name` (see [`Client::session`]).
    pub(crate) async fn open(client: Client, name: String) -> Result<Session, ClientError> {
        let runtime = Handle::try_current()
            .map_err(|_| ClientError::Transport("no tokio runtime to run the session on".into()))?;
        let mut stream = client
            .raw()
            .open_session(pb::OpenSessionRequest { name: name.clone() })
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
        let keepalive_timeout = (opened.keepalive_timeout_ms > 0)
            .then(|| Duration::from_millis(opened.keepalive_timeout_ms));
        let hub = EventHub::new();
        let task = runtime.spawn(events::run(
            stream,
            hub.clone(),
            client.clone(),
            opened.session_id.clone(),
            keepalive_timeout.map(|t| t / 3),
        ));
        tracing::debug!(
            session_id = opened.session_id,
            tenant = opened.tenant,
            "session opened"
        );
        Ok(Session {
            inner: Arc::new(SessionInner {
                id: opened.session_id,
                tenant: opened.tenant,
                name,
                broker_version: opened.broker_version,
                keepalive_timeout,
                peer_pid: opened.peer_pid,
                client,
                hub,
                task: task.abort_handle(),
                runtime,
            }),
        })
    }

    /// Session id assigned by the broker.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// Tenant the token belongs to.
    pub fn tenant(&self) -> &str {
        &self.inner.tenant
    }

    /// Name given at open time.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Version string the broker reported.
    pub fn broker_version(&self) -> &str {
        &self.inner.broker_version
    }

    /// How long the broker keeps a quiet session (None: no timeout). Keepalives are sent
    /// automatically every third of it.
    pub fn keepalive_timeout(&self) -> Option<Duration> {
        self.inner.keepalive_timeout
    }

    /// This process's pid as the broker saw it on the Unix socket (0 over TCP).
    pub fn peer_pid(&self) -> u32 {
        self.inner.peer_pid
    }

    /// The client this session was opened with.
    pub fn client(&self) -> &Client {
        &self.inner.client
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

    /// True once the stream has ended (or [`Session::close`] was called).
    pub fn is_closed(&self) -> bool {
        self.inner.hub.is_closed()
    }

    /// Ends the session now, for every clone: the stream is dropped, subscribers get
    /// `Closed`, and the broker takes back the session's leases (dropping a [`Lease`]
    /// afterwards only logs the failed release).
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
        self.inner.client.keepalive(&self.inner.id).await
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
        }
    }
}
