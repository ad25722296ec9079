//! Opening one broker session: the `OpenSession` call and its first event (`opened`:
//! session id, tenant, broker version, keepalive timeout, peer pid), checked and turned
//! into [`Opened`]. The session handle calls it once, the reconnect supervisor once per
//! re-open; what follows `opened` on the stream belongs to the pump.

use std::time::Duration;

use gpu_broker_proto::v1 as pb;
use pb::session_event::Event;

use crate::client::Client;
use crate::error::ClientError;

/// What one `opened` event said: one broker session behind a session handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Opened {
    /// Session id the broker assigned.
    pub(crate) id: String,
    /// Tenant of the token.
    pub(crate) tenant: String,
    /// The broker's version string.
    pub(crate) broker_version: String,
    /// How long the broker keeps a quiet session (None: no timeout).
    pub(crate) keepalive_timeout: Option<Duration>,
    /// The caller's pid as the broker saw it (0 over TCP).
    pub(crate) peer_pid: u32,
}

/// Opens one `OpenSession` stream named `name` and reads its `opened` event
/// (heartbeats before it are skipped; anything else first is a protocol error).
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
